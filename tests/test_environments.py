"""Environments without an engine: tool calls and their schemas, the tool environment's answers, and the
environment workers' deadlines and checks (a hang, a crash, a bad answer, a file that cannot load)."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.config import EpisodeConfig, RolloutConfig
from actors.env_pool import EnvironmentPool, EnvironmentSpecError, EpisodeEnded, load_environment_class
from actors.environments import StepResult, tool_schema
from actors.lookup_task import LookupEnvironment, lookup_rows, tool_call_text
from actors.tool_calls import parse_hermes


def test_hermes_calls_are_parsed_and_a_malformed_one_is_an_error_not_a_crash():
    text = 'first <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
    text += '<tool_call>\n{"name": "mul", "arguments": "{\\"a\\": 3}"}\n</tool_call>'
    assert parse_hermes(text) == ([("add", {"a": 1, "b": 2}), ("mul", {"a": 3})], None)
    assert parse_hermes("the answer is 5") == ([], None)
    calls, error = parse_hermes('<tool_call>{"name": add}</tool_call>')
    assert calls == [] and "is not JSON" in error
    assert 'no "name"' in parse_hermes('<tool_call>{"arguments": {}}</tool_call>')[1]
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}') == ([("f", {"x": 1})], None)  # unclosed


def test_tool_schema_from_a_plain_function_and_from_a_method():
    def add(a: int, b: float = 1.0, note: str = ""):
        """Add two numbers.

        More text."""

    schema = tool_schema(add)["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two numbers."
    assert schema["parameters"]["properties"] == {
        "a": {"type": "integer"},
        "b": {"type": "number"},
        "note": {"type": "string"},
    }
    assert schema["parameters"]["required"] == ["a"]
    assert tool_schema(LookupEnvironment.lookup)["function"]["parameters"]["required"] == ["key"]  # no self


def test_a_tool_environment_answers_calls_errors_and_the_final_answer():
    env, row = LookupEnvironment(), lookup_rows(1, seed=3)[0]
    assert env.reset(row) == [{"role": "user", "content": row["prompt"]}]
    ok = env.step(tool_call_text("lookup", {"key": row["key"]}))
    assert (ok.observation, ok.done, ok.info) == (row["answer"], False, {"tool_calls": 1, "tool_errors": 0})
    wrong = env.step(tool_call_text("lookup", {"key": "nope"}))
    assert wrong.observation.startswith("Error: lookup raised KeyError") and wrong.info["tool_errors"] == 1
    unknown = env.step(tool_call_text("search", {}))
    assert "no tool named 'search'" in unknown.observation
    assert env.step(row["answer"]) == StepResult(reward=1.0, done=True, info={"tool_calls": 0})


HANGING_ENV = '''
import os, time
from actors.environments import StepResult, ToolEnvironment

def wait(seconds: float):
    """Sleep."""
    time.sleep(seconds)
    return "woke"

class Slow(ToolEnvironment):
    tools = [wait]

class Crashing(ToolEnvironment):
    def step(self, action_text):
        os._exit(3)

class Garbage(ToolEnvironment):
    def step(self, action_text):
        print("garbage \\x00\\x01 on stdout", flush=True)
        return {"not": "a StepResult"}
'''


def _pool(tmp_path, name: str, **kw) -> EnvironmentPool:
    path = tmp_path / "envs.py"
    path.write_text(HANGING_ENV)
    pool = EnvironmentPool(EpisodeConfig(environment=f"{path}:{name}", workers=1, **kw))
    pool.wait_ready()
    return pool


def test_a_hanging_tool_ends_its_episode_and_the_next_episode_runs(tmp_path):
    pool = _pool(tmp_path, "Slow", step_timeout_s=1.0)
    try:

        async def go():
            first, _, _ = await pool.reset({"prompt": "p"})
            second, _, tools = await pool.reset({"prompt": "p"})  # on the same (only) worker
            assert tools[0]["function"]["name"] == "wait"
            started = time.monotonic()
            with pytest.raises(EpisodeEnded) as ended:
                await pool.step(first, tool_call_text("wait", {"seconds": 60}))
            assert ended.value.reason == "timeout" and time.monotonic() - started < 10
            with pytest.raises(EpisodeEnded) as lost:  # its worker was replaced with the episodes it held
                await pool.step(second, "answer")
            assert lost.value.reason == "lost"
            third, _, _ = await pool.reset({"prompt": "p"})
            return await pool.step(third, tool_call_text("wait", {"seconds": 0.01}))

        result = asyncio.run(go())
        assert result.observation == "woke" and pool.replaced == 1
    finally:
        pool.close()


@pytest.mark.parametrize("name, detail", [("Crashing", "died"), ("Garbage", "not a StepResult")])
def test_a_crashing_or_garbage_environment_ends_its_episode_with_the_reason(tmp_path, name, detail):
    pool = _pool(tmp_path, name, step_timeout_s=5.0)
    try:

        async def go():
            episode, _, _ = await pool.reset({"prompt": "p"})
            with pytest.raises(EpisodeEnded) as ended:
                await pool.step(episode, "x")
            return ended.value

        ended = asyncio.run(go())
        assert ended.reason == "error" and detail in ended.detail
    finally:
        pool.close()


def test_an_environment_that_cannot_load_is_named(tmp_path):
    with pytest.raises(EnvironmentSpecError, match="does not exist"):
        load_environment_class(str(tmp_path / "missing.py") + ":Env")
    (tmp_path / "e.py").write_text("class NotAnEnv: pass\n")
    with pytest.raises(EnvironmentSpecError, match="no class 'NotAnEnv' with reset"):
        load_environment_class(str(tmp_path / "e.py") + ":NotAnEnv")
    with pytest.raises(EnvironmentSpecError, match="no built-in environment"):
        load_environment_class("builtin:nope")
    with pytest.raises(ValueError, match="needs an environment"):
        RolloutConfig(kind="multi_turn")


def test_an_environment_is_checked_before_the_run_in_a_child_process(tmp_path):
    from actors.env_pool import check_environment

    check_environment(EpisodeConfig(environment="builtin:lookup"))
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(EnvironmentSpecError, match="exited while being imported"):
        check_environment(EpisodeConfig(environment=f"{tmp_path / 'exits.py'}:Env"))
    (tmp_path / "hangs.py").write_text("import time\ntime.sleep(600)\n")
    started = time.monotonic()
    with pytest.raises(EnvironmentSpecError, match="did not finish importing within 2 s"):
        check_environment(EpisodeConfig(environment=f"{tmp_path / 'hangs.py'}:Env", import_timeout_s=2))
    assert time.monotonic() - started < 10
    (tmp_path / "broken.py").write_text("raise RuntimeError('no database')\n")
    with pytest.raises(EnvironmentSpecError, match="failed to import: RuntimeError: no database"):
        check_environment(EpisodeConfig(environment=f"{tmp_path / 'broken.py'}:Env"))


def test_the_startup_check_gives_the_tools_and_the_resets_of_the_rows_it_is_given(tmp_path):
    from actors.env_pool import check_environment

    row = lookup_rows(1, seed=4)[0]
    check = check_environment(EpisodeConfig(environment="builtin:lookup"), [row])
    assert check.tools == [tool_schema(LookupEnvironment.lookup)]
    assert check.resets == [([{"role": "user", "content": row["prompt"]}], None)]
    (tmp_path / "bad.py").write_text(BAD_ENV)  # TextReset's reset returns a string, not messages
    check = check_environment(EpisodeConfig(environment=f"{tmp_path / 'bad.py'}:TextReset"), [{}, {}])
    assert check.tools == [] and len(check.resets) == 2
    assert check.resets[0] == (
        None,
        "TypeError: reset() must give a list of {'role': str, 'content': str} messages, not 'not messages'",
    )
    (tmp_path / "dies.py").write_text(
        "import os\nfrom actors.environments import Environment\n\n"
        "class Env(Environment):\n    def reset(self, row):\n        os._exit(3)\n"
    )
    check = check_environment(EpisodeConfig(environment=f"{tmp_path / 'dies.py'}:Env"), [{}, {}])
    assert check.resets == [(None, "the environment's process died during reset() (exit code 3)")]  # no 2nd try


# A template shaped like Qwen3's: the last assistant turn gets an empty <think> block unless it has one, so
# appending a turn re-renders the one before it when that holds no reasoning.
BAD_ENV = """
from actors.environments import Environment, StepResult

class NoReward(Environment):
    def reset(self, row):
        return [{"role": "user", "content": "p"}]

    def step(self, action_text):
        return StepResult("x", reward=None)

class TextReset(Environment):
    def reset(self, row):
        return "not messages"

class Raising(Environment):
    def reset(self, row):
        return [{"role": "user", "content": "p"}]

    def step(self, action_text):
        raise RuntimeError("the sandbox is gone")
"""


def test_bad_answers_from_an_environment_end_the_episode_and_free_its_slot(tmp_path):
    (tmp_path / "bad.py").write_text(BAD_ENV)

    async def go(name):
        pool = EnvironmentPool(EpisodeConfig(environment=f"{tmp_path / 'bad.py'}:{name}", workers=1))
        pool.wait_ready()
        try:
            try:
                episode, _, _ = await pool.reset({})
                await pool.step(episode, "x")
            except EpisodeEnded as ended:
                return ended, pool.workers[0].episodes
        finally:
            pool.close()

    ended, _ = asyncio.run(go("NoReward"))
    assert ended.reason == "error" and "not a number" in ended.detail
    ended, held = asyncio.run(go("TextReset"))
    assert "list of {'role': str, 'content': str} messages" in ended.detail and held == set()
