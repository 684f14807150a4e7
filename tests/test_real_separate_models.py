"""PPO's critic and the KL reference on their own processes train exactly like colocated ones.

Placement must not change the numbers: with the critic on separate ranks (training beside
the policy) and the reference model in its own actor, two PPO steps with a KL loss give the
same loss, KL, value loss and updated policy weights as the same steps with both models on
the learner rank.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from launch.build import build_learner_group
from launch.config import load_config
from launch.run_dir import RunLog
from tests.fakes import make_group

pytestmark = pytest.mark.slow


def _train(ray, cfg, model_path, run, batches):
    async def go():
        group = await build_learner_group(cfg, model_path, run)
        kinds = (len(group.workers), len(group.critics), len(group.references))
        metrics = [await group.train_step(b) for b in batches]
        weights = ray.get(await group.export_weights()).tensors()
        for w in group.workers + group.critics + group.references:
            ray.kill(w)
        return kinds, metrics, dict(weights)

    return asyncio.run(go())


def test_separate_critic_and_reference_match_colocated(ray_session, tiny_model_dir, tmp_path):
    ray = ray_session
    rng = random.Random(1)
    batches = [
        [make_group(p, [rng.random() for _ in range(4)], completion_len=rng.randint(2, 9), seed=s) for p in range(4)]
        for s in range(2)
    ]
    base = [
        "model.path=x",
        "data.prompts=x",
        "reward.function=x",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "learner.lr=0.01",
        "algorithm.name=ppo",
        "algorithm.kl.placement=loss",
        "algorithm.kl.beta=0.5",
    ]
    separate = ["resources.critic.placement=separate", "resources.reference.placement=separate"]
    run = RunLog.create(str(tmp_path), "placement", {}, 2)
    kinds_c, colocated, w_c = _train(ray, load_config(None, base), tiny_model_dir, run, batches)
    kinds_s, apart, w_s = _train(ray, load_config(None, base + separate), tiny_model_dir, run, batches)

    assert kinds_c == (1, 0, 0) and kinds_s == (1, 1, 1)
    for mc, ms in zip(colocated, apart):
        assert mc["tokens"] == ms["tokens"]
        for key in ("loss", "kl_ref_mean", "value_loss_share", "critic_value_mean", "advantage_abs_mean"):
            assert ms[key] == pytest.approx(mc[key], abs=1e-6), key
    assert "critic_seconds" in apart[0]
    # step 2's policy moved away from the reference: the KL term is live, not trivially zero
    assert apart[1]["kl_ref_mean"] > 0
    assert max(float((w_c[k] - w_s[k]).abs().max()) for k in w_c) < 1e-6


def test_a_run_with_every_model_on_its_own_process(tmp_path, tiny_model_dir, capsys):
    """``tandem train``: PPO with a KL reward, the critic and the reference placed separately,
    and an in-flight actor whose engine is tensor parallel over two cores."""
    import json
    from pathlib import Path

    from launch.cli import main

    config = Path(__file__).resolve().parents[1] / "configs" / "ppo.yaml"
    code = main(
        [
            "train",
            "--config",
            str(config),
            f"model.path={tiny_model_dir}",
            "model.build_tiny=false",
            "run.steps=3",
            "rollout.prompts_per_step=8",
            "rollout.weight_update=inflight",
            "resources.actors.tensor_parallel=2",
            "resources.critic.placement=separate",
            "resources.reference.placement=separate",
            f"run.output_dir={tmp_path}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    root = next(tmp_path.iterdir())
    summary = json.loads(root.joinpath("summary.json").read_text())
    assert summary["steps"] == 3
    assert {"actor-0", "learner-0", "critic-0", "reference-0"} <= set(summary["placement"])
    metrics = [json.loads(line) for line in root.joinpath("metrics.jsonl").read_text().splitlines()]
    assert all("learner/critic_value_mean" in m and "learner/kl_ref_mean" in m for m in metrics), metrics[0].keys()
    assert "tensor parallel 2" in root.joinpath("logs", "actor-0.log").read_text()
