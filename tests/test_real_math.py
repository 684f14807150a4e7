"""End to end on the real stack, the long-reasoning job in miniature (issue 11, item 9): a tiny chat model
warm-started with supervised steps on worked additions that end in ``\\boxed{}``, then GRPO with
``builtin:math`` (math-verify in the reward workers), dynamic sampling and held-out evaluation; the
eval pass@1 must rise, and the saved model, loaded in vLLM by ``tandem eval``, must score what the
run's last evaluation scored (every round samples each row with the same seed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.cli import main
from launch.run import run_training
from launch.tools.example import MATH_CONFIG, prepare_math_model

pytestmark = pytest.mark.slow

# The eval pass@1 of the five rounds (steps 0, 20, ..., 80), fitted by a least-squares line: its rise
# over the run must reach this. One round is 256 samples (sd of pass@1 about 0.023 at 0.83); the
# fitted rise over 80 steps has sd about 1.26 x that of one round's noise and uses every round.
# A run that does not learn fits about 0 +- 0.013. From the old fixed 600-step warm-start (on the sums'
# turn) the rises were 0.042, 0.036 and 0.027, against a margin of 0.01. From the warm-start to a target on
# partly careless solutions (launch/tools/example.py) they are 0.162 (pass@1 0.785 -> 0.953) and, with
# torch's non-vectorised kernels (ATEN_CPU_CAPABILITY=default), 0.253 (0.715 -> 0.969) on 2026-12-07:
# half the smaller one is 6 sd of a run that does not learn.
MARGIN = 0.08


def fitted_rise(steps: list[int], values: list[float]) -> float:
    """Least-squares slope of ``values`` over ``steps``, times the span of ``steps``."""
    mean_x, mean_y = sum(steps) / len(steps), sum(values) / len(values)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values)) / sum((x - mean_x) ** 2 for x in steps)
    return slope * (steps[-1] - steps[0])


def test_fitted_rise_is_the_slope_over_the_span():
    assert fitted_rise([0, 20, 40, 60, 80], [0.80, 0.81, 0.82, 0.83, 0.84]) == pytest.approx(0.04)
    # the CI run of 2026-12-04: 0.8166, 0.824, 0.828, 0.836, 0.8437 -> 0.0265 (hand: sum(x y) / 10 x 4)
    assert fitted_rise([0, 20, 40, 60, 80], [0.8166, 0.824, 0.828, 0.836, 0.8437]) == pytest.approx(0.02648)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return prepare_math_model(tmp_path_factory.mktemp("models"))


SAMPLER_CHECK = """
import asyncio, json, sys
from actors.generation import GenerationActor
from queues.messages import PromptRequest
from queues.templates import PromptRenderer
from tests.runs import actor_spec

model, log, out = sys.argv[1], sys.argv[2], sys.argv[3]
renderer = PromptRenderer.load(model)
row = {"prompt": "7+4+3+4+4+3", "answer": "25"}
ids = renderer.token_ids(row)
actor = GenerationActor(actor_spec(model, log, "builtin:math", group_size=2, max_tokens=96))
async def sample():
    await actor.ready()
    return await actor.generate([PromptRequest(0, row, min_version=0, prompt_token_ids=ids)])
(group,) = asyncio.run(sample())
actor.builder.close()
seen = {"rendered": ids, "text": renderer.text(row), "rewards": [t.reward for t in group.trajectories],
        "sampled": [t.prompt_token_ids.tolist() for t in group.trajectories],
        "decoded": renderer.tokenizer.decode(group.trajectories[0].prompt_token_ids)}
open(out, "w").write(json.dumps(seen))  # a file: the actor sends stdout to its log
"""


def test_the_sampler_gets_exactly_the_rendered_chat_prompt(model, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", SAMPLER_CHECK, str(model), str(tmp_path / "actor.log"), str(tmp_path / "seen.json")],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(root), "VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:] + (tmp_path / "actor.log").read_text()[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["text"] == "<u>7+4+3+4+4+3\n<a>" and seen["decoded"] == seen["text"]
    assert seen["sampled"] == [seen["rendered"]] * 2  # what the learner trains on is what was rendered
    assert len(seen["rewards"]) == 2


def test_math_example_learns_and_its_saved_model_scores_the_same(model, tmp_path, capsys):
    result: dict = {}
    code = run_training(
        MATH_CONFIG,
        [f"model.path={model}", f"run.output_dir={tmp_path / 'runs'}"],
        result=result,
    )
    assert code == 0
    run_dir = Path(result["run_dir"])
    rounds = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rounds] == [0, 20, 40, 60, 80]
    last = rounds[-1]
    assert all(r["eval/prompts"] == 64 and r["eval/samples"] == 4 and r["eval/reward_errors"] == 0 for r in rounds)
    assert fitted_rise([r["step"] for r in rounds], [r["eval/pass@1"] for r in rounds]) >= MARGIN, rounds
    assert last["eval/pass@4"] >= last["eval/pass@1"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "reward/math" in metrics[0] and all(m["reward_errors"] == 0 for m in metrics)
    assert sum(m["filtered_groups"] for m in metrics) > 0  # dynamic sampling left zero-variance groups out
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert any("\\boxed{" in s["completion"] for s in samples)
    capsys.readouterr()

    out_dir = tmp_path / "eval-runs"
    assert main(["eval", "--model", str(run_dir / "model"), "--config", str(run_dir / "config.yaml"),
                 f"run.output_dir={out_dir}"]) == 0  # fmt: skip
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["eval/prompts"] == 64
    assert scored["eval/pass@1"] == pytest.approx(last["eval/pass@1"], abs=2 / (64 * 4)), (scored, last)
