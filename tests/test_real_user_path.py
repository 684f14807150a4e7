"""A user's first hour on the real stack (Ray, vLLM, DeepSpeed; CPU): their own word problems in the
layouts the field uses, an instruct-style chat model, the default settings plus field names.

Each run here is what a user types, with data the test makes: a GSM8K-layout parquet
({question, answer "... #### 72"}) and a verl/DAPO-layout parquet (a chat message list as the prompt,
the answer nested in reward_model.ground_truth, a data_source, a malformed row), a tiny chat model
whose byte-level tokenizer round-trips any text, ``builtin:math`` plus a format reward, a held-out
set scored as pass@k, ``rollout.temperature`` 0.7, and ``tandem check-data`` first. The default
``rollout.prompts_per_request`` of 8 prompts x 8 samples of ~230 prompt tokens puts about 15K
prompt tokens into one generate call: past the 4K a CPU engine step held when a seeded request's
split prefill crashed the actor ("CPU Generator does not use offset").

What each run must show: it exits 0; every reward call succeeded; and on the first step, trained on
the weights that sampled it, the sampler's log-probs equal the learner's to float precision
(``learner/tis_mismatch_kl``), which holds at T = 0.7 only when both score softmax(z / T).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import read_metrics, read_summary, run_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["Tom", "Ana", "O'Neil", "Zoë", "Mr. Okafor", "Priya"]
THINGS = ["apples", "marbles", "stickers", "books"]


def word_problem(rng: random.Random) -> tuple[str, int, str]:
    """A GSM8K-style problem of ~200 characters (capitals, quotes and accents included), its answer,
    and a GSM8K-style worked solution ending in '#### n'."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 9)
    answer = (a + b) * c
    question = (
        f'{name} has {a} {thing} and is given {b} more by a friend who says "keep them". '
        f"Then {name} buys {c - 1} more boxes holding the same number as {name} now has, so there are {c} "
        f"boxes in all. How many {thing} are there in total?"
    )
    worked = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n{c} boxes: {a + b} x {c} = {answer}."
    solution = f"{worked}\n#### {answer}"
    return question, answer, solution


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    from actors.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat", chat=True))


def write_parquet(folder: Path, name: str, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / name
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


@pytest.fixture(scope="module")
def gsm8k_parquet(tmp_path_factory) -> str:
    rng = random.Random(0)
    rows = []
    for _ in range(72):
        question, _, solution = word_problem(rng)
        rows.append({"question": question, "answer": solution})
    return write_parquet(tmp_path_factory.mktemp("data"), "gsm8k-train.parquet", rows)


@pytest.fixture(scope="module")
def verl_parquet(tmp_path_factory) -> str:
    rng = random.Random(1)
    rows = []
    for i in range(72):
        question, answer, _ = word_problem(rng)
        instruction = " Let's think step by step and output the final answer after '####'."
        rows.append(
            {
                "data_source": "openai/gsm8k" if i % 2 else "math_dapo",
                "prompt": [{"role": "user", "content": question + instruction}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    rows[5]["prompt"] = [{"role": "system", "content": "no user message: a malformed row"}]
    return write_parquet(tmp_path_factory.mktemp("data"), "verl-train.parquet", rows)


def user_config(path: Path, model: str, prompts: str, out: Path, **data_fields: str) -> str:
    """The config a user writes: the model, the data and its field names, the reward, a few steps,
    T = 0.7, a held-out tenth scored as pass@k. Everything else is the default."""
    import yaml

    config = {
        "model": {"path": model},
        "data": {"prompts": prompts, **data_fields},
        "reward": {"functions": [{"function": "builtin:math"}, {"function": "builtin:format", "weight": 0.5}]},
        "rollout": {"temperature": 0.7},
        "eval": {"fraction": 0.1, "every": 2},
        "run": {"steps": 2, "output_dir": str(out)},
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def check_data(config: str) -> subprocess.CompletedProcess:
    """``tandem check-data`` as a user runs it: its own process, before any training."""
    cmd = [sys.executable, "-m", "launch.cli", "check-data", "--config", config, "-n", "2"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def assert_first_run_right(out: Path, capsys) -> None:
    metrics = read_metrics(out)
    assert len(metrics) == 2
    for m in metrics:
        assert m["reward_errors"] == 0, m  # math-verify and the format reward answered every call
    # step 1 trains on the weights that sampled it: sampler and learner score the same tempered softmax
    assert metrics[0]["learner/tis_mismatch_kl"] < 1e-4, metrics[0]
    summary = read_summary(out)
    assert summary["status"] == "completed"
    evals = [json.loads(line) for line in (run_dir(out) / "eval.jsonl").read_text().splitlines()]
    assert evals and "eval/pass@1" in evals[-1] and "eval/pass@4" in evals[-1]
    assert summary["learned"] is False  # a random model never answers: the run says so instead of a quiet exit 0
    assert (run_dir(out) / "logs" / "driver.log").is_file()


def test_gsm8k_parquet_with_the_defaults_and_the_prompt_field(chat_model, gsm8k_parquet, tmp_path, capsys):
    from launch.cli import main

    out = tmp_path / "runs"
    config = user_config(tmp_path / "my.yaml", chat_model, gsm8k_parquet, out, prompt_field="question")
    checked = check_data(config)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "template: the chat template of the tokenizer" in checked.stdout
    assert 'reward of gold "\\boxed{' in checked.stdout and ": 1 [math 1, format 0] (expect ~1)" in checked.stdout
    code = main(["train", "--config", config])
    assert code == 0, capsys.readouterr().out
    assert_first_run_right(out, capsys)


def test_verl_parquet_with_the_defaults_and_a_nested_answer_field(chat_model, verl_parquet, tmp_path, capsys):
    from launch.cli import main

    out = tmp_path / "runs"
    config = user_config(tmp_path / "my.yaml", chat_model, verl_parquet, out, answer_field="reward_model.ground_truth")
    checked = check_data(config)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    code = main(["train", "--config", config])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "skipped 1 of 72 rows" in captured.err  # the malformed row, named at load
    assert_first_run_right(out, capsys)
