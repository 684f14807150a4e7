"""``tandem check-data`` and the checks it shares with preflight: the prompts exactly as the sampler
gets them (rendered by the chat template, token ids decoded back), each shown row's own answer and a
wrong one scored by the reward's real parts, one line per problem, exit 1 on a problem, 2 when nothing
loads; it starts neither Ray nor vLLM. Preflight fails before start-up when builtin:math meets rows
without an answer, and says once when data.chat_template=auto falls back to raw text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actors.tiny_model import build_tiny_model, build_tokenizer
from launch.check_data import check_data
from launch.config import load_config
from launch.preflight import PreflightError, preflight
from queues.templates import PromptRenderer

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "Put the final answer in \\boxed{}."
ROWS = [  # GSM8K's answer form, a plain number, LaTeX, and a prompt the demo tokenizer mangles
    {
        "question": 'Tom said "Hi!" and has 3 + 4 apples. How many?',
        "answer": "3 + 4 = 7\n#### 7",
        "data_source": "gsm8k",
    },
    {"question": "What is 12 × 4?", "answer": "48", "data_source": "gsm8k"},
    {"question": "Halve 1.", "answer": "\\frac{1}{2}", "data_source": "math"},
    {"question": "What is 10 - 3?", "answer": "7", "data_source": "gsm8k"},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat", chat=True)


def write_config(tmp_path: Path, model: Path | str, rows: list[dict], **extra: str) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [
        f"model: {{path: {model}}}",
        f"data: {{prompts: {data}, prompt_field: question, system_prompt: {json.dumps(SYSTEM)}}}",
        "reward: {function: builtin:math}",
        f"run: {{output_dir: {tmp_path / 'runs'}}}",
    ]
    path = tmp_path / "config.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_check(capsys, config: Path, *overrides: str, n: int = 3) -> tuple[int, str, str]:
    code = check_data(str(config), list(overrides), n)
    out, err = capsys.readouterr()
    return code, out, err


def test_prompts_are_shown_as_the_sampler_gets_them_and_own_answers_score_1(tmp_path, chat_model, capsys):
    from transformers import AutoTokenizer

    code, out, _ = run_check(capsys, write_config(tmp_path, chat_model, ROWS), n=3)
    assert code == 0, out
    assert f"template: the chat template of the tokenizer of {chat_model}" in out
    # Row 0 rendered by the ChatML template, every character kept, with its token count.
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ROWS[0]["question"]}]
    tok = AutoTokenizer.from_pretrained(chat_model)
    n_ids = len(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert f"sent to the sampler: {n_ids} tokens (limit 496), decoded:" in out  # 496 = 512 - 16
    assert "    | <|im_start|>system\n    | Put the final answer in \\boxed{}.<|im_end|>\n" in out
    assert '    | Tom said "Hi!" and has 3 + 4 apples. How many?<|im_end|>\n    | <|im_start|>assistant\n' in out
    assert "row 0 (data_source: gsm8k)" in out and 'answer: "3 + 4 = 7\\n#### 7"' in out
    # GSM8K's "#### 7" is boxed as the 7 math-verify compares; the next row's answer is the wrong one.
    assert 'reward of gold "\\boxed{7}": 1 (expect ~1)' in out
    assert 'reward of wrong "\\boxed{48}" (row 1\'s answer): 0 (expect 0)' in out
    assert 'reward of gold "\\boxed{\\frac{1}{2}}": 1 (expect ~1)' in out
    assert "\nrow 2 (data_source: math)\n" in out and "\nrow 3" not in out  # n=3 rows shown
    assert "verdict: OK" in out and "warnings:" not in out


def test_rows_without_an_answer_fail_naming_the_field_and_the_columns(tmp_path, chat_model, capsys):
    rows = [{"question": r["question"], "solution": r["answer"]} for r in ROWS]
    code, out, _ = run_check(capsys, write_config(tmp_path, chat_model, rows), n=1)
    assert code == 1
    assert "no answer in this row: its gold answer cannot be scored" in out
    problem = next(line for line in out.splitlines() if line.startswith("  - reward builtin:math"))
    assert (
        "4 of 4 rows of data.prompts have none" in problem and "its columns are: question, solution, prompt" in problem
    )
    assert problem.endswith(
        "set data.answer_field to the column holding the reference answer (e.g. data.answer_field=solution)"
    )
    # The held-out rows are checked too (a run scores them with the same reward).
    code, out, _ = run_check(capsys, write_config(tmp_path, chat_model, rows), "eval.fraction=0.25", n=0)
    assert code == 1 and "1 of 1 rows of the held-out set have none" in out and "3 of 3 rows of data.prompts" in out
    # The same rows with the answer mapped pass.
    assert run_check(capsys, write_config(tmp_path, chat_model, rows), "data.answer_field=solution", n=1)[0] == 0


def test_answers_the_reward_cannot_read_fail_the_verdict(tmp_path, chat_model, capsys):
    # builtin:format wants a <think> block: a bare answer scores 0 for every row checked.
    code, out, _ = run_check(capsys, write_config(tmp_path, chat_model, ROWS), "reward.function=builtin:format", n=2)
    assert code == 1
    # The format reward gets the answer text as it is (no box: only builtin:math reads one).
    assert 'reward of gold "3 + 4 = 7\\n#### 7": 0 (expect ~1)' in out
    assert "the row's own answer scored 0 or less for 2 of 2 rows checked" in out


def test_prompts_longer_than_the_budget_fail_unless_skipped(tmp_path, chat_model, capsys):
    config = write_config(tmp_path, chat_model, ROWS)
    # Row 0 is the longest prompt; limit = 128 - 40 = 88 tokens, and every ChatML prompt here is 70+.
    code, out, _ = run_check(capsys, config, "engine.max_model_len=128", "rollout.max_tokens=40", n=0)
    assert code == 1 and "limit 88 = engine.max_model_len 128 - rollout.max_tokens 40" in out
    assert "prompts of data.prompts are longer than 88 tokens (first: row 0)" in out
    code, out, _ = run_check(
        capsys, config, "engine.max_model_len=128", "rollout.max_tokens=40", "data.skip_long_prompts=true", n=0
    )
    assert code == 0 and "data.skip_long_prompts=true drops them" in out


def test_a_tokenizer_that_loses_characters_and_has_no_template_is_said(tmp_path, tiny_model_dir, capsys):
    # The demo's tiny model: no capitals, no quotes, no chat template (raw text).
    code, out, _ = run_check(capsys, write_config(tmp_path, tiny_model_dir, ROWS), n=1)
    assert code == 0  # warnings, not problems: the run would work, on text the user may not expect
    assert "template: raw text, no chat template (the tokenizer has none)" in out
    assert "    | om said i! and has 3 + 4 apples. ow many?\n" in out  # T, quotes, H lost
    assert "the tokenizer loses text of 1 of 1 prompts shown" in out and "tandem tiny-model --chat DIR" in out
    assert "data.chat_template=auto: the tokenizer of" in out and "has no chat template" in out


def test_a_config_or_data_that_does_not_load_is_exit_2_in_one_line(tmp_path, chat_model, capsys):
    code, out, err = run_check(capsys, write_config(tmp_path, chat_model, ROWS), "data.prompt_field=nope")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tandem: error: ") and "data.prompt_field" in err


def test_the_cli_starts_neither_ray_nor_vllm_and_exits_1_on_a_problem(tmp_path, chat_model):
    good = write_config(tmp_path, chat_model, ROWS)
    script = (
        "import sys\nfrom launch.cli import main\n"
        f"code = main(['check-data', '--config', {str(good)!r}, '-n', '1'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm', 'deepspeed'))\n"
        "print('RESULT', code, heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "RESULT 0 []", done.stdout + done.stderr
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = write_config(bad_dir, chat_model, [{"question": "What is 2+2?"}, {"question": "And 3+3?"}])
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "check-data", "--config", str(bad), "-n", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "  - reward builtin:math needs each row's answer, but 2 of 2 rows" in done.stdout


def test_preflight_fails_before_start_when_math_rows_have_no_answer(tmp_path, tiny_model_dir):
    base = ["model.path=m", "data.prompts=p.jsonl", f"run.output_dir={tmp_path / 'runs'}"]
    rows = [{"prompt": "1+1", "reward_model": {"ground_truth": "2"}, "data_source": "a"}, {"prompt": "2+2"}]
    cfg = load_config(None, [*base, "reward.function=builtin:math"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg, tiny_model_dir, rows)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("reward builtin:math needs each row's answer, but 2 of 2 rows of data.prompts have none")
    assert "its columns are: prompt, reward_model, data_source" in message
    assert "(e.g. data.answer_field=reward_model.ground_truth)" in message  # verl's nested column
    # A reward that does not read the answer starts as before.
    ok = load_config(None, [*base, "reward.function=builtin:successor"])
    assert preflight(ok, tiny_model_dir, rows) == rows


def test_preflight_checks_answers_only_where_by_source_chooses_math(tmp_path, tiny_model_dir):
    base = ["model.path=m", "data.prompts=p.jsonl", f"run.output_dir={tmp_path / 'runs'}"]
    cfg = load_config(None, [*base, "reward.function=builtin:successor", "reward.by_source={gsm8k: builtin:math}"])
    rows = [{"prompt": "next 1:", "data_source": "other"}, {"prompt": "3+4", "answer": "7", "data_source": "gsm8k"}]
    assert preflight(cfg, tiny_model_dir, rows) == rows
    rows.append({"prompt": "5+5", "data_source": "gsm8k"})
    with pytest.raises(PreflightError, match=r"but 1 of 3 rows .*\(first: row 2, .* or drop the rows without one$"):
        preflight(cfg, tiny_model_dir, rows)


def test_auto_without_a_template_is_said_once_at_start_up(tmp_path, tiny_model_dir, capsys):
    cfg = load_config(None, ["model.path=m", "data.prompts=p.jsonl", "reward.function=builtin:successor",
                             f"run.output_dir={tmp_path / 'runs'}"])  # fmt: skip
    preflight(cfg, tiny_model_dir, [{"prompt": "next 1:", "answer": "2"}])
    err = capsys.readouterr().err
    assert err == (
        f"tandem: data.chat_template=auto: the tokenizer of {tiny_model_dir} has no chat template; prompts are "
        "sent as raw text (set data.chat_template to a .jinja file to use one)\n"
    )


def test_the_renderer_names_the_template_it_uses(tmp_path):
    bare = PromptRenderer(build_tokenizer(), "auto")
    assert bare.template == "none" and bare.fallback_note() is not None
    assert PromptRenderer(build_tokenizer(), "none").template == "none"
    assert PromptRenderer(build_tokenizer(), "none").fallback_note() is None  # asked for raw text: nothing to say
    assert (
        PromptRenderer(build_tokenizer(), "none").describe() == "raw text, no chat template (data.chat_template=none)"
    )
    own = build_tokenizer()
    own.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert PromptRenderer(own, "auto").template == "tokenizer" and PromptRenderer(own, "auto").fallback_note() is None
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    from_file = PromptRenderer(build_tokenizer(), str(jinja))
    assert from_file.template == "file" and from_file.describe() == f"the chat template of {jinja} (data.chat_template)"
    assert from_file.text({"prompt": "q"}) == "<q>"


def test_answers_longer_than_max_tokens_and_the_config_warnings_are_said(tmp_path, chat_model, capsys):
    # A GSM8K answer is a worked solution: at the default rollout.max_tokens (16) a completion that works
    # like it is cut before its "#### n", and a run learns nothing while the gold answers score 1.
    worked = [dict(r, answer="First 3 + 4 = <<3+4=7>>7 apples, then nothing else happens.\n#### 7") for r in ROWS]
    config = write_config(tmp_path, chat_model, worked)
    code, out, _ = run_check(capsys, config, "algorithm.kl.placement=loss", "algorithm.kl.estimator=k1", n=1)
    assert code == 0, out  # a warning, not a problem: the data is right, the budget is small
    assert "more than rollout.max_tokens = 16: a completion that works like them is cut" in out
    assert "algorithm.kl.placement=loss with estimator=k1" in out  # what `tandem train` would warn about
    code, out, _ = run_check(capsys, config, "rollout.max_tokens=128", n=1)
    assert "rollout.max_tokens = 128" not in out and "warnings:" not in out
