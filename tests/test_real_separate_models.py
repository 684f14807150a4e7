"""PPO's critic and the KL reference on their own processes train exactly like colocated ones.

Placement must not change the numbers: with the critic on separate ranks (training beside
the policy) and the reference model in its own actor, two PPO steps with a KL loss give the
same loss, KL, value loss and updated policy weights as the same steps with both models on
the learner rank.
"""

from __future__ import annotations

import json

import pytest

from launch.config import load_config
from observe.run_dir import RunLog
from tests.runs import CONFIGS, GROUP_BASE, read_metrics, read_summary, run_dir, train, train_group, varied_batches

pytestmark = pytest.mark.slow


def test_separate_critic_and_reference_match_colocated(ray_session, tiny_model_dir, tmp_path):
    ray = ray_session
    batches = varied_batches(seed=1)
    base = GROUP_BASE + ["algorithm.name=ppo", "algorithm.kl.placement=loss", "algorithm.kl.beta=0.5"]
    separate = ["resources.critic.placement=separate", "resources.reference.placement=separate"]
    run = RunLog.create(str(tmp_path), "placement", {}, 2)
    kinds_c, colocated, w_c = train_group(ray, load_config(None, base), tiny_model_dir, run, batches)
    kinds_s, apart, w_s = train_group(ray, load_config(None, base + separate), tiny_model_dir, run, batches)

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
    import ray

    if ray.is_initialized():  # the module's 4-CPU Ray: this run starts its own, sized for 5 processes' CPUs
        ray.shutdown()
    code = train(
        CONFIGS / "ppo.yaml",
        tiny_model_dir,
        tmp_path,
        "run.steps=3",
        "rollout.prompts_per_step=8",
        "rollout.weight_update=inflight",
        "resources.actors.tensor_parallel=2",
        "resources.actors.num_cpus=2",
        "resources.critic.placement=separate",
        "resources.reference.placement=separate",
    )
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    summary = read_summary(tmp_path)
    assert summary["steps"] == 3
    assert {"actor-0", "learner-0", "critic-0", "reference-0"} <= set(summary["placement"])
    metrics = read_metrics(tmp_path)
    assert all("learner/critic_value_mean" in m and "learner/kl_ref_mean" in m for m in metrics), metrics[0].keys()
    assert "tensor parallel 2" in (run_dir(tmp_path) / "logs" / "actor-0.log").read_text()
    # every process has its lane on the timeline, the separate ones too, each span on its step's version
    spans = [json.loads(line) for line in (run_dir(tmp_path) / "timeline.jsonl").read_text().splitlines()]
    lanes = {(s["process"], s["kind"]) for s in spans}
    assert {("critic-0", "score"), ("critic-0", "train"), ("reference-0", "score"), ("learner-0", "train")} <= lanes
    assert {s["version"] for s in spans if s["process"] in ("critic-0", "reference-0")} == {1, 2, 3}
