"""Multi-turn episodes without an engine: tool calls, chat-template deltas, the environment workers'
deadlines, and the rollout's masks, log-probs and versions (a scripted engine plays the model)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from actors.config import EpisodeConfig, RewardConfig, RolloutConfig
from actors.env_pool import EnvironmentPool, EnvironmentSpecError, EpisodeEnded, load_environment_class
from actors.environments import StepResult, tool_schema
from actors.episode import MultiTurn, TurnRenderer
from actors.lookup_task import TOOLS_CHAT_TEMPLATE, LookupEnvironment, lookup_rows, tool_call_text
from actors.rollout import Completion
from actors.tiny_model import build_chat_tokenizer
from actors.tool_calls import parse_hermes
from queues.messages import PromptRequest


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_chat_tokenizer()
    tok.chat_template = TOOLS_CHAT_TEMPLATE
    return tok


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


def test_deltas_append_turns_without_rerendering_the_history(tokenizer):
    """prompt + sampled turn + delta + ... is the template's own rendering of the conversation when the
    sampled text re-tokenizes to itself; each delta is tokenized alone."""
    row = lookup_rows(1)[0]
    tools = [tool_schema(LookupEnvironment.lookup)]
    renderer = TurnRenderer(tokenizer, tools)
    messages = [{"role": "user", "content": row["prompt"]}]
    call = tool_call_text("lookup", {"key": row["key"]})
    turn1 = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    delta = renderer.delta(turn1, [{"role": "tool", "content": row["answer"]}])
    turn2 = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = renderer.prompt(messages) + turn1 + delta + turn2
    conversation = messages + [
        {"role": "assistant", "content": call},
        {"role": "tool", "content": row["answer"]},
        {"role": "assistant", "content": row["answer"]},
    ]
    whole = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert (
        tokenizer.decode(delta)
        == f"\n<|im_start|>user\n<tool_response>{row['answer']}</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"][: len(ids)]
    # a turn cut before its stop token: the template's whole closing follows it
    cut = tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(renderer.delta(cut, [])).startswith("<|im_end|>\n<|im_start|>assistant")


def test_rerendering_a_sampled_turn_gives_other_ids_than_the_sampler_produced(tokenizer):
    """Why history is never re-rendered: a model can sample ids that do not survive decode -> encode
    (here half of a two-byte character, and a special token inside its text)."""
    renderer = TurnRenderer(tokenizer, [])
    sampled = tokenizer("caf", add_special_tokens=False)["input_ids"] + [
        0xC3,
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    sampled += [tokenizer.eos_token_id]
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    prompt = renderer.prompt([{"role": "user", "content": "hi"}])
    ours = prompt + sampled
    again = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}], tokenize=False
    )
    rerendered = tokenizer(again, add_special_tokens=False)["input_ids"][: len(ours)]
    assert rerendered != ours


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


class ScriptedEngine:
    """Plays the model: each turn's text, sampled at version ``version`` with log-prob -0.5 per token."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.calls, self.version = tokenizer, turns, [], 0

    async def sample(self, prompt_ids, request, max_tokens, salt):
        text = self.turns[len(self.calls) % len(self.turns)]
        self.calls.append(list(prompt_ids))
        ids = (self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])[:max_tokens]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        version, self.version = self.version, self.version + 1  # a new policy every turn
        return Completion(ids, [-0.5] * len(ids), [version] * len(ids), finish)


class _Spec:
    def __init__(self, rollout, system_prompt=None):
        from actors.config import EngineConfig

        self.rollout, self.engine = rollout, EngineConfig(max_model_len=1024)
        self.chat_template, self.system_prompt = None, system_prompt


def _episode(tokenizer, turns, max_tokens=200, **episode):
    rollout = RolloutConfig(
        kind="multi_turn",
        group_size=2,
        max_tokens=max_tokens,
        episode=EpisodeConfig(environment="builtin:lookup", workers=1, **episode),
    )
    rollout_fn = MultiTurn(_Spec(rollout))
    rollout_fn.start(tokenizer)
    row = lookup_rows(1, seed=5)[0]
    engine = ScriptedEngine(tokenizer, [t.format(**row) for t in turns])
    try:
        sample = asyncio.run(rollout_fn.episode(PromptRequest(1, row, 0), engine, 0))
    finally:
        rollout_fn.close()
    return row, engine, sample


def test_an_episode_masks_the_environment_and_keeps_the_samplers_ids_logprobs_and_versions(tokenizer):
    call = tool_call_text("lookup", {"key": "KEY"}).replace("KEY", "{key}").replace("{", "{{").replace("}", "}}")
    call = call.replace("{{key}}", "{key}")
    row, engine, sample = _episode(tokenizer, [call, "{answer}"])
    ep = sample.episode
    assert ep["end"] == "done" and ep["model_turns"] == 2 and ep["tool_calls"] == 1 and ep["tool_errors"] == 0
    assert ep["environment_reward"] == 1.0 and ep["turn_rewards"] == [0.0, 1.0]
    assert [t["role"] for t in ep["turns"]] == ["model", "environment", "model"]
    turn1 = tokenizer(tool_call_text("lookup", {"key": row["key"]}), add_special_tokens=False)["input_ids"]
    turn1 += [tokenizer.eos_token_id]
    turn2 = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n_env = len(sample.token_ids) - len(turn1) - len(turn2)
    assert sample.token_ids[: len(turn1)] == turn1 and sample.token_ids[-len(turn2) :] == turn2
    assert sample.mask == [1] * len(turn1) + [0] * n_env + [1] * len(turn2)
    assert sample.logprobs == [-0.5] * len(turn1) + [0.0] * n_env + [-0.5] * len(turn2)
    assert sample.versions == [0] * len(turn1) + [0] * n_env + [1] * len(turn2)  # swap between the turns
    assert ep["turn_ends"] == [len(turn1) - 1, len(sample.token_ids) - 1]
    # the second turn was sampled from exactly the ids so far: token in, token out
    assert engine.calls[1] == sample.prompt_token_ids + sample.token_ids[: len(turn1) + n_env]
    assert row["answer"] in sample.text and "<tool_response>" in sample.text


def test_an_episode_ends_at_max_turns_and_at_its_token_budget(tokenizer):
    _, engine, sample = _episode(
        tokenizer, ['<tool_call>{{"name": "lookup", "arguments": {{}}}}</tool_call>'], max_tokens=600, max_turns=3
    )
    assert sample.episode["end"] == "max_turns" and sample.episode["model_turns"] == 3
    # the last turn is still stepped (its reward counts); its observation is not appended
    assert sample.episode["tool_errors"] == 3 and len(engine.calls) == 3
    assert [t["role"] for t in sample.episode["turns"]][-2:] == ["environment", "model"]
    _, _, short = _episode(tokenizer, ["a long turn " * 5], max_tokens=40, max_turns=5)
    assert short.episode["end"] == "length" and short.finish_reason == "length" and len(short.token_ids) <= 40


def test_episode_rewards_reach_the_reward_parts():
    from actors.reward_scorer import RewardScorer, Scored

    cfg = RewardConfig(
        functions=[{"function": "environment", "weight": 2.0}, {"function": "builtin:format", "weight": 1.0}]
    )
    scorer = RewardScorer(cfg, pool=object())  # the pool is not called here
    scored = scorer.with_environment(
        Scored(0.5, {"environment": 0.0, "format": 0.5}, None, None),
        {"environment_reward": 1.0, "turn_rewards": [0.0, 1.0]},
    )
    assert scored.reward == 2.5 and scored.parts == {"environment": 1.0, "format": 0.5} and scored.steps == [0.0, 2.0]
    assert json.dumps(scored.parts)


def test_episode_settings_are_checked_across_sections(tmp_path):
    from launch.config import load_config

    base = [
        "model.path=m",
        "data.prompts=builtin:lookup",
        "rollout.max_tokens=100",
    ]
    with pytest.raises(Exception, match="rollout.kind is single_turn"):
        load_config(None, [*base, "reward.function=environment"])
    with pytest.raises(Exception, match="set reward.function=environment"):
        load_config(
            None,
            [
                *base,
                "reward.function=builtin:lookup",
                "rollout.kind=multi_turn",
                "rollout.episode.environment=builtin:lookup",
                "algorithm.name=grpo_process",
            ],
        )
    cfg = load_config(
        None,
        [*base, "reward.function=environment", "rollout.kind=multi_turn", "rollout.episode.environment=builtin:lookup"],
    )
    assert cfg.reward.uses_environment and cfg.reward.function_parts == []


def test_the_tools_examples_demonstrations_are_what_the_rollout_builds(tokenizer):
    from launch.tools.example_tools import demonstration_pairs

    row = lookup_rows(1, seed=9)[0]
    (p1, call), (p2, answer) = demonstration_pairs(tokenizer, [row])
    renderer = TurnRenderer(tokenizer, [tool_schema(LookupEnvironment.lookup)])
    eos = tokenizer.eos_token_id
    assert p1 == renderer.prompt([{"role": "user", "content": row["prompt"]}])
    assert tokenizer.decode(call) == tool_call_text("lookup", {"key": row["key"]})
    assert p2 == p1 + call + [eos] + renderer.delta(call + [eos], [{"role": "tool", "content": row["answer"]}])
    assert tokenizer.decode(answer) == row["answer"]


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


# A template shaped like Qwen3's: the last assistant turn gets an empty <think> block unless it has one, so
# appending a turn re-renders the one before it when that holds no reasoning.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' and loop.last and '<think>' not in m.content %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_adds_empty_reasoning_to_the_last_turn_still_appends_turns():
    tok = build_chat_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    renderer = TurnRenderer(tok, [])
    delta = renderer.delta([tok.eos_token_id], [{"role": "tool", "content": "42"}])
    assert tok.decode(delta) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ messages | length }}"  # rewrites
    with pytest.raises(Exception, match="renders earlier turns differently"):
        TurnRenderer(tok, []).delta([tok.eos_token_id], [{"role": "tool", "content": "42"}])


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


def test_an_episode_the_environment_failed_trains_no_token_but_stays_in_its_group(tmp_path, tokenizer):
    (tmp_path / "bad.py").write_text(BAD_ENV)
    rollout = RolloutConfig(
        kind="multi_turn",
        group_size=2,
        max_tokens=200,
        episode={"environment": f"{tmp_path / 'bad.py'}:Raising", "workers": 1},
    )
    fn = MultiTurn(_Spec(rollout, system_prompt="be brief"))
    fn.start(tokenizer)
    engine = ScriptedEngine(tokenizer, ["hello"])
    try:
        sample = asyncio.run(fn.episode(PromptRequest(1, {"prompt": "p"}, 3), engine, 0))
    finally:
        fn.close()
    assert sample.episode["end"] == "error" and "the sandbox is gone" in sample.episode["detail"]
    assert sample.mask == [0] * len(sample.token_ids) and sample.model_mask == [1] * len(sample.token_ids)
    assert tokenizer.decode(sample.prompt_token_ids).startswith("<|im_start|>system\nbe brief")  # data.system_prompt


def test_an_episode_never_outgrows_the_engines_context(tokenizer):
    rollout = RolloutConfig(
        kind="multi_turn", group_size=2, max_tokens=500, episode={"environment": "builtin:lookup", "workers": 1}
    )
    spec = _Spec(rollout)
    spec.engine = spec.engine.model_copy(update={"max_model_len": 120})
    fn = MultiTurn(spec)
    fn.start(tokenizer)
    engine = ScriptedEngine(tokenizer, ['<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'])
    try:
        sample = asyncio.run(fn.episode(PromptRequest(1, lookup_rows(1)[0], 0), engine, 0))
    finally:
        fn.close()
    assert sample.episode["end"] == "length" and len(sample.prompt_token_ids) + len(sample.token_ids) <= 120


def test_a_per_turn_discount_on_single_turn_completions_is_a_warning():
    from launch.config import load_config

    base = [
        "model.path=m",
        "data.prompts=builtin:echo",
        "reward.function=builtin:echo",
        "algorithm.name=reinforce",
        "algorithm.estimator.gamma=0.9",
    ]
    assert any(
        "discounts nothing" in w for w in load_config(None, [*base, "algorithm.estimator.discount=turn"]).warnings
    )
    assert not any("discounts nothing" in w for w in load_config(None, base).warnings)
