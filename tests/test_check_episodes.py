"""Episodes before a run: ``tandem check-data`` on a multi-turn config shows the prompt the sampler gets
(reset(row)'s messages, the system prompt, the tools rendered by the template) and says what it did not
check; a run whose environment offers tools that the chat template does not render stops before start, in
one line. The environments are the built-in ``lookup`` and user files written here (one whose reset raises
or hangs for some rows, one that hangs at import)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from actors.tiny_model import build_tiny_model
from launch.check_data import check_data
from launch.cli import main
from launch.config import load_config
from launch.preflight import PreflightError, preflight

# The tiny chat model's template before it rendered tools: plain ChatML, as many base models' templates are.
PLAIN_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALCULATOR = '''
import time
from actors.environments import ToolEnvironment


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Calculator(ToolEnvironment):
    tools = [multiply]

    def reset(self, row):
        if row["prompt"] == "boom":
            raise RuntimeError("no such table")
        if row["prompt"] == "hang":
            time.sleep(600)
        self.row = row
        return [{"role": "user", "content": row["prompt"] + " Use the tool."}]
'''


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat", chat=True)


def lookup_config(tmp_path: Path, model: Path, *extra: str) -> list[str]:
    """The tools example's settings (configs/examples/tools.yaml) on the tiny chat model, as overrides."""
    return [
        f"model.path={model}",
        "data.prompts=builtin:lookup",
        "data.num_rows=16",
        "reward.function=environment",
        "rollout.kind=multi_turn",
        "rollout.episode.environment=builtin:lookup",
        "rollout.max_tokens=200",
        "engine.max_model_len=512",
        f"run.output_dir={tmp_path / 'runs'}",
        *extra,
    ]


def run_check(capsys, overrides: list[str], n: int = 2) -> tuple[int, str, str]:
    code = check_data(None, overrides, n)
    out, err = capsys.readouterr()
    return code, out, err


def test_check_data_shows_the_episode_prompt_with_the_tools_and_says_what_it_did_not_check(
    tmp_path, chat_model, capsys
):
    code, out, err = run_check(capsys, lookup_config(tmp_path, chat_model))
    assert code == 0, out + err
    assert "environment: builtin:lookup (rollout.episode.environment); tools: lookup;" in out
    assert "reward: the environment's (scored in episodes by the actors, not checked here)" in out
    assert "gold completion" not in out  # nothing is scored that could not be
    assert "  reset(row): 1 message(s) (user)" in out
    # the prompt as the sampler gets it: the tools' schemas in the system turn, then reset's message
    assert '    | {"name": "lookup", "description": "The code of a key.", "parameters":' in out
    assert "    | <|im_start|>user\n    | code of k" in out
    assert "sent to the sampler: 300 tokens (the episode's prompt; engine.max_model_len 512 leaves 212" in out
    assert out.rstrip().endswith(
        "verdict: OK for what was checked: the rows load, reset() works for 2 rows, prompts fit; not checked: the "
        "environment's step() and rewards"
    )


def test_a_template_that_ignores_tools_fails_check_data_and_stops_train_before_start(tmp_path, chat_model, capsys):
    template = tmp_path / "chatml.jinja"
    template.write_text(PLAIN_CHATML)
    overrides = lookup_config(tmp_path, chat_model, f"data.chat_template={template}")
    problem = (
        f"rollout.episode.environment 'builtin:lookup' offers the tools lookup, but the chat template {template} "
        "(data.chat_template) ignores tools (a prompt renders the same with and without them), so the model would "
        "never see them; use a chat template with a tools branch (data.chat_template=path.jinja, e.g. the model "
        "family's own), or a model built by `tandem tiny-model --chat DIR`"
    )
    code, out, _ = run_check(capsys, overrides, n=1)
    assert code == 1 and f"  - {problem}\n" in out
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, overrides), str(chat_model), [{"prompt": "code of k1?", "key": "k1"}])
    assert str(err.value) == problem
    # `tandem train` says it in one line and starts nothing (no run directory)
    config = tmp_path / "train.yaml"
    config.write_text("run: {name: tools}\n")
    assert main(["train", "--config", str(config), *overrides]) == 2
    assert capsys.readouterr().err == f"tandem: error: {problem}\n"
    assert not any((tmp_path / "runs").iterdir())
    # the tiny chat model's own template renders them: the same run passes
    rows = [{"prompt": "code of k1?", "key": "k1"}]
    assert preflight(load_config(None, lookup_config(tmp_path, chat_model)), str(chat_model), rows) == rows


def user_env_config(tmp_path: Path, model: Path, prompts: list[str], *extra: str) -> list[str]:
    (tmp_path / "calc.py").write_text(CALCULATOR)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "42"}) + "\n" for p in prompts))
    return [
        f"model.path={model}",
        f"data.prompts={data}",
        'data.system_prompt="Answer with a number."',
        "reward.function=environment",
        "rollout.kind=multi_turn",
        f"rollout.episode.environment={tmp_path / 'calc.py'}:Calculator",
        "rollout.episode.step_timeout_s=1",
        "rollout.max_tokens=100",
        "engine.max_model_len=512",
        f"run.output_dir={tmp_path / 'runs'}",
        *extra,
    ]


def test_a_reset_that_raises_or_hangs_is_a_problem_naming_the_row(tmp_path, chat_model, capsys):
    overrides = user_env_config(tmp_path, chat_model, ["What is 6 times 7?", "boom", "hang", "What is 2 times 3?"])
    started = time.monotonic()
    code, out, err = run_check(capsys, overrides, n=4)
    assert code == 1, out + err
    assert time.monotonic() - started < 60  # the hanging reset is given up after step_timeout_s
    env = f"{tmp_path / 'calc.py'}:Calculator"
    # row 0 as the sampler gets it: data.system_prompt (reset gave none) with the tools, then reset's message
    assert f"environment: {env} (rollout.episode.environment); tools: multiply;" in out
    assert "    | <|im_start|>system\n    | Answer with a number.\n    | \n    | Tools you may call:" in out
    assert '"name": "multiply", "description": "Multiply two integers."' in out
    assert "    | What is 6 times 7? Use the tool.<|im_end|>" in out
    problems = out[out.index("verdict: ") :]
    assert problems.startswith("verdict: 2 problem(s); a run would fail or not learn:\n")
    assert (
        f"  - row 1: reset(row) of {env} failed: RuntimeError: no such table; an episode of this row ends at once "
        "(end: error, or timeout when reset hangs) and trains nothing: fix the environment's reset\n"
    ) in problems
    assert (
        f"  - row 2: reset(row) of {env} failed: reset() did not return within rollout.episode.step_timeout_s = 1 s"
    ) in problems
    assert "  reset(row): not tried (the check's environment process was lost above)" in out  # row 3


def test_an_environment_that_hangs_at_import_ends_check_data_in_one_line(tmp_path, chat_model, capsys):
    overrides = user_env_config(tmp_path, chat_model, ["What is 6 times 7?"], "rollout.episode.import_timeout_s=2")
    (tmp_path / "calc.py").write_text("import time\ntime.sleep(600)\n")
    started = time.monotonic()
    code, out, err = run_check(capsys, overrides, n=1)
    assert code == 2 and out == "" and time.monotonic() - started < 60
    assert err == (
        f"tandem: error: rollout.episode.environment '{tmp_path / 'calc.py'}:Calculator' did not finish importing "
        "within 2 s (rollout.episode.import_timeout_s); move slow work out of the file's top level\n"
    )


def test_episode_prompts_that_leave_less_than_one_turn_are_a_problem_and_stop_train(tmp_path, chat_model, capsys):
    """The tools example's context (384) with the tiny chat model's hermes tools (300-token prompts): 84 tokens
    are left, less than one model turn (96): every episode would end by length before it answers."""
    overrides = lookup_config(tmp_path, chat_model, "engine.max_model_len=384", "rollout.episode.turn_max_tokens=96")
    code, out, _ = run_check(capsys, overrides, n=1)
    assert code == 1
    assert (
        "row 0: the episode's prompt (tools included) is 300 tokens: engine.max_model_len = 384 leaves 84, less than "
        "one model turn (rollout.episode.turn_max_tokens = 96)" in out
    )
    with pytest.raises(PreflightError, match=r"^16 of 16 episode prompts \(the row's prompt and the environment's "
                       r"tools, \d+ tokens\) leave less than one model turn"):  # fmt: skip
        preflight(load_config(None, overrides), str(chat_model), _lookup_rows())
    assert preflight(load_config(None, lookup_config(tmp_path, chat_model)), str(chat_model), _lookup_rows())


def _lookup_rows() -> list[dict]:
    from actors.lookup_task import lookup_rows

    return lookup_rows(16)
