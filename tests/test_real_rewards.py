"""A reward of four parts on the real stack, in both actor modes: builtin:math, a format pattern every
completion matches, the task's own reward and a reward model on its own Ray actor.

math-verify times itself with signal.alarm, which fails off a main thread: called on the in-flight
actor's event loop it failed on every sample. In the reward workers it works in both modes. The
reward model, a tiny random-init Qwen2ForSequenceClassification, scores every completion. The
weighted sum and the per-part metrics are checked on real trajectories, and each logged sample's
reward is recomputed offline to the 1e-4: the task's function and the model's logit from a plain
transformers forward pass, plus 0.5 for the format, leave 0 or 1, the math part. One run per mode
covers all four parts: each run is mostly start-up.
"""

from __future__ import annotations

import json

import pytest

from actors.tasks import successor_reward
from tests.runs import DEMO, read_metrics, run_dir, train
from tests.test_reward_model import build_tiny_reward_model

pytestmark = pytest.mark.slow

PARTS = (
    "reward.functions=[{function: 'builtin:math'}, {function: 'builtin:format', weight: 0.5}, "
    "{function: 'builtin:successor', weight: 0.25, name: task}, {function: model, weight: 0.5}]"
)


@pytest.mark.parametrize(("k", "weight_update"), [(1, "between_requests"), (2, "inflight")])
def test_math_format_task_and_reward_model_parts_score_every_completion(
    k, weight_update, tiny_model_dir, tmp_path, capsys
):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = build_tiny_reward_model(tmp_path / "rm")
    out = tmp_path / "runs"
    code = train(
        DEMO,
        tiny_model_dir,
        out,
        "run.steps=3",
        f"run.max_staleness={k}",
        f"rollout.weight_update={weight_update}",
        "rollout.prompts_per_step=8",
        "run.log_samples=8",
        "reward.function=null",
        PARTS,
        "reward.format_pattern=.*",
        "reward.workers=1",
        f"reward.model.path={rm}",
        "reward.model.batch_size=16",
    )
    assert code == 0, capsys.readouterr().out
    metrics = read_metrics(out)
    assert len(metrics) == 3
    for m in metrics:
        assert m["reward_errors"] == 0  # math-verify ran in every call, the model answered every batch
        assert 0.0 <= m["reward/math"] <= 1.0 and m["reward/format"] == 1.0
        assert m["reward/model"] != 0.0  # real logits, not the 0 of a failed call
        # reward = 1 x math + 0.5 x format + 0.25 x task + 0.5 x model, averaged over the step's completions
        expected = m["reward/math"] + 0.5 + 0.25 * m["reward/task"] + 0.5 * m["reward/model"]
        assert m["reward_mean"] == pytest.approx(expected, abs=1e-6)
    root = run_dir(out)
    assert "reward-model-0" in json.loads((root / "processes.json").read_text())  # placed like any process

    model = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm)
    samples = [json.loads(line) for line in (root / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 8
    for s in samples:
        with torch.no_grad():
            logit = model(**tokenizer(s["prompt"] + s["completion"], return_tensors="pt")).logits[0, 0].item()
        math = s["reward"] - 0.5 - 0.25 * successor_reward(s["prompt"], s["completion"]) - 0.5 * logit
        assert min(abs(math), abs(math - 1)) < 1e-4, s
