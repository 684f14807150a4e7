"""A reward model on its own Ray actor as a part of the reward, on the real stack, in both actor modes.

A tiny random-init Qwen2ForSequenceClassification scores every completion beside the task's reward:
reward = task + 0.5 x model. Each logged sample's reward is recomputed offline (the task's function,
and the model's logit from a plain transformers forward pass) to the 1e-4."""

from __future__ import annotations

import json

import pytest

from actors.tasks import successor_reward
from tests.runs import DEMO, read_metrics, run_dir, train
from tests.test_reward_model import build_tiny_reward_model

pytestmark = pytest.mark.slow

PARTS = "reward.functions=[{function: 'builtin:successor', name: task}, {function: model, weight: 0.5}]"


@pytest.mark.parametrize(("k", "weight_update"), [(1, "between_requests"), (2, "inflight")])
def test_a_reward_model_actor_scores_every_completion(k, weight_update, tiny_model_dir, tmp_path, capsys):
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
        f"reward.model.path={rm}",
        "reward.model.batch_size=16",
    )
    assert code == 0, capsys.readouterr().out
    metrics = read_metrics(out)
    assert len(metrics) == 3 and all(m["reward_errors"] == 0 for m in metrics)
    for m in metrics:
        assert m["reward_mean"] == pytest.approx(m["reward/task"] + 0.5 * m["reward/model"], abs=1e-6)
        assert m["reward/model"] != 0.0  # real logits, not the 0 of a failed call
    root = run_dir(out)
    assert "reward-model-0" in json.loads((root / "processes.json").read_text())  # placed like any process

    model = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm)
    samples = [json.loads(line) for line in (root / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 8
    for s in samples:
        with torch.no_grad():
            logit = model(**tokenizer(s["prompt"] + s["completion"], return_tensors="pt")).logits[0, 0].item()
        task = successor_reward(s["prompt"], s["completion"], None)
        assert s["reward"] == pytest.approx(task + 0.5 * logit, abs=1e-4)
