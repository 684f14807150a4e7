"""Evaluation: the unbiased pass@k estimator against hand-computed numbers, a round's metrics, and the
evaluator's rounds (sent in pieces, completed by their groups, never mixed into a training batch)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from launch.config import EvalConfig, load_config
from queues.bounded import LocalQueue
from queues.messages import Trajectory, TrajectoryGroup
from runtime.collector import BatchCollector
from runtime.evaluation import Evaluator, eval_metrics, ks_for, pass_at_k
from tests.fakes import RecordingAdmission, make_group


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # n - c < k: always a correct one
    assert pass_at_k(8, 3, 8) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]


def group(prompt_id: int, rewards: list[float], purpose: str = "eval", lengths=None, version: int = 3):
    lengths = lengths or [2] * len(rewards)
    trajs = [
        Trajectory(
            prompt_token_ids=np.zeros(2, np.int32),
            completion_token_ids=np.zeros(n, np.int32),
            completion_mask=np.ones(n, np.uint8),
            sampler_logprobs=np.zeros(n, np.float32),
            policy_versions=np.full(n, version, np.int32),
            reward=r,
            finish_reason="length" if n >= 4 else "stop",
            completion_text="",
        )
        for r, n in zip(rewards, lengths)
    ]
    return TrajectoryGroup(prompt_id=prompt_id, row={}, trajectories=trajs, actor_name="a", purpose=purpose)


def test_round_metrics_by_hand():
    groups = [group(-1, [1, 0, 0, 0], lengths=[2, 2, 4, 4]), group(-2, [1, 1, 0.5, 0])]
    m = eval_metrics(groups, correct_reward=1.0)
    # prompt 1: c=1 of 4; prompt 2: c=2 of 4 (0.5 is below eval.correct_reward)
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["eval/pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert m["eval/pass@4"] == 1.0
    assert m["eval/reward_mean"] == pytest.approx(3.5 / 8)
    assert m["eval/completion_len_mean"] == pytest.approx(20 / 8) and m["eval/truncated_frac"] == 0.25
    assert m["eval/prompts"] == 2 and m["eval/samples"] == 4 and m["eval/policy_version"] == 3
    assert eval_metrics(groups, correct_reward=0.5)["eval/pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)


def test_rounds_are_sent_in_pieces_and_recorded_when_complete():
    sent, recorded = [], []

    async def put(requests):
        sent.append(requests)

    rows = [{"prompt": f"q{i}", "answer": "1"} for i in range(5)]
    cfg = EvalConfig(prompts="x", every=10, samples=3, temperature=0.0)
    ev = Evaluator(rows, cfg, put, render=lambda row: [len(row["prompt"])], record=lambda s, m: recorded.append((s, m)))
    ev.chunk = 2

    async def scenario():
        assert ev.due(0, 30) and ev.due(10, 30) and ev.due(30, 30) and not ev.due(5, 30)
        ev.start(0, version=0)
        ev.start(10, version=10)
        await asyncio.sleep(0)
        await asyncio.gather(*ev.sending)
        ev.check_sending()

    asyncio.run(scenario())
    assert [len(p) for p in sent] == [2, 2, 1, 2, 2, 1]
    first, second = [r for p in sent[:3] for r in p], [r for p in sent[3:] for r in p]
    assert [r.prompt_id for r in first] == [-1, -2, -3, -4, -5] and [r.prompt_id for r in second][0] == -6
    assert all(r.purpose == "eval" and r.samples == 3 and r.temperature == 0.0 for r in first)
    assert first[0].prompt_token_ids == [2] and second[0].min_version == 10
    for r in second:  # the later round may finish first
        ev.add(group(r.prompt_id, [1, 1, 1]))
    ev.add(group(-6, [1, 1, 1]))  # a duplicate is ignored
    assert [s for s, _ in recorded] == [10] and recorded[0][1]["eval/pass@1"] == 1.0
    for r in first[:4]:
        ev.add(group(r.prompt_id, [0, 0, 1]))
    assert ev.pending and len(recorded) == 1
    ev.give_up()  # the run ends before the last group: what arrived is recorded, the gap counted
    assert recorded[1][0] == 0 and recorded[1][1]["eval/missing_prompts"] == 1
    assert recorded[1][1]["eval/pass@1"] == pytest.approx(1 / 3) and not ev.pending


def test_the_collector_routes_eval_groups_out_of_the_batch():
    results, seen = LocalQueue("results", 16), []
    results.put_many([group(-1, [1, 0]), group(0, [1, 0], "train", version=0), group(1, [0, 1], "train", version=0)], 1)

    evaluator = SimpleNamespace(add=seen.append)

    async def scenario():
        admission = RecordingAdmission(stale_ok=False)  # nothing is stale
        collector = BatchCollector(results, {}, None, 5, admission=admission, evaluator=evaluator)
        batch = await collector.collect(2, step=0, max_staleness=0)
        results.put_many([group(-2, [1, 1])], 1)
        await collector.drain_eval(lambda: len(seen) < 2, timeout=5)
        return batch

    batch = asyncio.run(scenario())
    assert [g.prompt_id for g in batch.groups] == [0, 1] and [g.prompt_id for g in seen] == [-1, -2]


def test_eval_every_needs_a_held_out_set():
    with pytest.raises(Exception, match="eval.every = 5 but there is nothing to evaluate on"):
        load_config(None, ["model.path=m", "data.prompts=p", "reward.function=f", "eval.every=5"])
    with pytest.raises(Exception, match="eval.prompts or eval.fraction, not both"):
        load_config(
            None, ["model.path=m", "data.prompts=p", "reward.function=f", "eval.prompts=e", "eval.fraction=0.1"]
        )


def test_an_eval_round_says_how_many_of_its_episodes_their_environment_ended():
    from runtime.evaluation import eval_line

    group = make_group(-1, [0.0, 0.0, 1.0])
    for traj, end in zip(group.trajectories, ["error", "done", "done"]):
        traj.episode = {"end": end, "detail": "RuntimeError: the sandbox is gone" if end == "error" else None}
    m = eval_metrics([group], correct_reward=1.0)
    assert m["eval/episode_failed"] == 1 and m["eval/episode_failure"] == "error: RuntimeError: the sandbox is gone"
    assert eval_line(0, {**m, "eval/seconds": 1.0}).endswith(
        "| 1 episodes ended by their environment (first: error: RuntimeError: the sandbox is gone)"
    )
    assert "episode_failed" not in eval_metrics([make_group(-1, [0.0, 1.0])], correct_reward=1.0)
