"""The pieces between actors and learner, each alone with in-process neighbours."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from cluster.channel import ChannelClosed, WeightsTimeout
from cluster.weights import FlatWeights, LocalWeightChannel
from learner.group import merge_rank_metrics
from learner.step_plan import plan_step
from queues.bounded import LocalQueue, QueueClosed, QueueTimeout
from runtime.admission import Pace
from runtime.collector import BatchCollector
from runtime.step_metrics import step_metrics
from tests.fakes import RecordingAdmission, make_group, make_sequence, make_trajectory
from tests.reference_batch import completion_logprobs, pad_sequences
from tests.tolerance import PACKED_LOGPROB_ATOL


def test_queue_backpressure_and_deadlines():
    q = LocalQueue("results", maxsize=2)
    q.put_many([1, 2], timeout=0.1)
    with pytest.raises(QueueTimeout, match="results queue stayed full"):
        q.put_many([3], timeout=0.05)
    assert q.get_batch(5, timeout=0.1) == [1, 2]
    assert q.get_batch(5, timeout=0.05) == []  # empty: returns after the deadline, does not hang


def test_closing_a_queue_wakes_its_waiters_at_once():
    import threading
    import time

    q = LocalQueue("prompt", maxsize=1)
    woke = []

    def consumer():
        start = time.monotonic()
        try:
            q.get_batch(1, timeout=30)
        except QueueClosed:
            woke.append(time.monotonic() - start)

    t = threading.Thread(target=consumer)
    t.start()
    q.put_many(["a"], timeout=1)  # taken by the waiting consumer? then it returns normally
    t.join(5)
    t = threading.Thread(target=consumer)
    t.start()
    q.close_now()
    t.join(5)
    assert not t.is_alive() and len(woke) == 1  # the second consumer was woken by the close, not the deadline
    with pytest.raises(QueueClosed):
        q.put_many(["b"], timeout=1)


def test_weight_channel_waits_with_a_deadline():
    ch = LocalWeightChannel()
    with pytest.raises(WeightsTimeout, match="policy version 1, newest published is 0"):
        ch.fetch(1, timeout=0.05)
    ch.publish(2, [("w", torch.ones(1))])
    ch.publish(1, [("w", torch.zeros(1))])  # an older version never replaces a newer one
    version, named = ch.fetch(1, timeout=0.05)
    assert version == 2 and float(named[0][1]) == 1.0
    ch.close()
    with pytest.raises(ChannelClosed):  # a closed channel answers a wait for a newer version at once
        ch.fetch(3, timeout=30)


def test_flat_weights_round_trip_every_dtype_and_shape():
    import pickle

    named = [
        ("embed", torch.randn(5, 3, dtype=torch.bfloat16)),
        ("bias", torch.randn(3)),
        ("scalar", torch.tensor(2.5, dtype=torch.float16)),
        ("empty", torch.empty(0, 4)),
        ("strided", torch.arange(12.0).reshape(3, 4).t()),  # not contiguous
    ]
    flat = FlatWeights(named)
    assert flat.nbytes == 30 + 12 + 2 + 0 + 48
    # pickle protocol 5 with out-of-band buffers, as Ray stores it: the bytes travel as buffers
    buffers = []
    data = pickle.dumps(flat, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(named) and len(data) < 2000
    back = pickle.loads(data, buffers=buffers).tensors()
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_policy_clock_fetches_only_when_needed_and_reports_waits_once():
    from actors.policy_clock import PolicyClock

    clock = PolicyClock()
    assert not clock.wants(latest=0, min_version=0)  # nothing new, nothing needed
    assert clock.wants(latest=1, min_version=0) and clock.wants(latest=0, min_version=1)
    clock.loaded(2)
    clock.waited(0.5)
    clock.waited(0.25)
    assert not clock.wants(latest=2, min_version=1)
    assert clock.take_wait() == 0.75 and clock.take_wait() == 0.0  # rides on one group only
    assert clock.stats() == {"version": 2, "weight_loads": 1, "weight_wait_s": 0.75}


def test_pace_admits_within_the_staleness_bound():
    async def go():
        pace = Pace(prompts_per_step=4, max_staleness=1)
        assert pace.allowance() == 8  # steps 0 and 1 may be generated with version 0
        waiter = asyncio.create_task(pace.admit(8))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # prompt 8 belongs to step 2: needs version 1
        await pace.advance(1)
        await asyncio.wait_for(waiter, 1)
        await pace.drop()  # a dropped prompt is replaced by one more admission
        assert pace.allowance() == 13

    asyncio.run(go())


def test_synchronous_pace_alternates():
    pace = Pace(prompts_per_step=4, max_staleness=0)
    assert pace.allowance() == 4  # only step 0's prompts before the first update


def test_collector_drops_too_stale_groups_and_counts_them():
    async def go():
        q = LocalQueue("results", maxsize=10)
        q.put_many(
            [
                make_group(0, [0.0, 1.0], version=0),
                make_group(1, [1.0, 1.0], version=2),
                make_group(2, [0.5, 0.0], version=1),
            ],
            timeout=1,
        )
        admission = RecordingAdmission()
        collector = BatchCollector(q, {}, None, 5, admission=admission)
        batch = await collector.collect(2, step=2, max_staleness=1)
        return batch, admission.stale

    batch, dropped = asyncio.run(go())
    assert [g.prompt_id for g in batch.groups] == [1, 2]  # version 0 at step 2 is staleness 2 > 1
    assert batch.dropped == 1 and dropped == [0]
    assert batch.staleness == {0: 6, 1: 6}  # per token: 2 sequences x 3 tokens each


def test_the_step_plan_balances_ranks_with_global_normalisers_and_maps_both_ways():
    rng = random.Random(0)
    trajs = [make_trajectory([4, 5, 6], [7] * rng.randint(1, 6), reward=float(i)) for i in range(10)]
    rewards = torch.arange(10.0)
    trained = torch.tensor([float(len(t.completion_token_ids)) for t in trajs])  # every token trained
    plan = plan_step(trajs, rewards, trained, ranks=2, token_budget=12)
    sizes = [s.micro_sizes[0] for s in plan.shards]
    assert len(sizes[0]) == len(sizes[1])  # collectives must match
    assert sorted(i for order in plan.order for i in order.tolist()) == list(range(10))
    tokens = [int(s.tokens.prompt_offsets[-1] + s.tokens.completion_offsets[-1]) for s in plan.shards]
    assert abs(tokens[0] - tokens[1]) <= 9  # within the longest sequence (3 + 6)
    for shard, order in zip(plan.shards, plan.order):
        assert shard.tokens.rewards.tolist() == [float(i) for i in order]  # rewards follow the rank's order
        assert shard.tokens.completion_lengths.tolist() == [len(trajs[i].completion_token_ids) for i in order]
        start = 0
        for size in shard.micro_sizes[0]:  # micro-batches are contiguous runs within the budget
            lens = shard.tokens.completion_lengths[start : start + size] + 3
            assert size <= 1 or lens.sum() <= 12
            start += size
    total = sum(len(t.completion_token_ids) for t in trajs)
    assert all(s.normalisers[0].num_tokens == total and s.normalisers[0].num_sequences == 10 for s in plan.shards)
    # per-sequence values round-trip: rank-local -> global -> rank-local
    local = [{"x": s.tokens.rewards * 2} for s in plan.shards]
    assert plan.gather(local)["x"].tolist() == (rewards * 2).tolist()
    back = plan.scatter({"x": rewards})
    assert [b["x"].tolist() for b in back] == [s.tokens.rewards.tolist() for s in plan.shards]
    # two minibatches: each optimizer step has its own global normaliser over its 5 sequences
    two = plan_step(trajs, rewards, trained, ranks=1, token_budget=64, minibatches=2).shards[0]
    assert [n.num_tokens for n in two.normalisers] == [
        float(sum(len(t.completion_token_ids) for t in trajs[:5])),
        float(sum(len(t.completion_token_ids) for t in trajs[5:])),
    ]


def test_merged_metrics_sum_loss_and_weight_by_tokens():
    merged = merge_rank_metrics(
        [
            {"loss": 0.25, "tokens": 10, "seconds": 1.0, "ratio_mean": 1.0, "ratio_max": 1.5, "grad_norm": 2.0},
            {"loss": 0.50, "tokens": 30, "seconds": 2.0, "ratio_mean": 2.0, "ratio_max": 1.2, "grad_norm": 2.0},
        ]
    )
    assert merged["loss"] == 0.75 and merged["tokens"] == 40 and merged["learner_seconds"] == 2.0
    # the phases are the slowest rank's, each: a fast rank's optimizer phase holds its wait for the slow one
    phases = merge_rank_metrics(
        [
            {"loss": 0.0, "tokens": 1, "seconds": 3.2, "time_backward_s": 2.0, "time_optimizer_s": 0.2},
            {"loss": 0.0, "tokens": 1, "seconds": 3.2 - 1e-3, "time_backward_s": 1.0, "time_optimizer_s": 1.7},
        ]
    )
    assert (phases["time_backward_s"], phases["time_optimizer_s"]) == (2.0, 0.2)
    assert merged["loss"] == 0.75 and merged["tokens"] == 40 and merged["learner_seconds"] == 2.0
    assert merged["ratio_mean"] == pytest.approx((1.0 * 10 + 2.0 * 30) / 40)  # = 1.75
    assert merged["ratio_max"] == 1.5 and merged["grad_norm"] == 2.0


def test_padded_logprobs_equal_each_sequence_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = random.Random(1)
    seqs = [make_sequence(rng, rng.randint(1, 6), rng.randint(1, 7)) for _ in range(5)]
    batch = pad_sequences(seqs, pad_id=0)
    with torch.no_grad():
        padded = completion_logprobs(
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch
        )
        for i, s in enumerate(seqs):
            ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            p = len(s.prompt_token_ids)
            alone = torch.stack([logp[p - 1 + t, tok] for t, tok in enumerate(s.completion_token_ids)])
            c = len(s.completion_token_ids)
            torch.testing.assert_close(padded[i, :c], alone, atol=PACKED_LOGPROB_ATOL, rtol=0)
            assert torch.all(padded[i, c:] == 0) and torch.all(batch.completion_mask[i, c:] == 0)


def test_dynamic_sampling_leaves_out_zero_variance_groups_up_to_its_limit():
    async def go(max_filtered):
        q = LocalQueue("results", maxsize=10)
        rewards = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.5], [1.0, 0.0], [0.0, 0.0]]
        q.put_many([make_group(i, r) for i, r in enumerate(rewards)], timeout=1)
        admission = RecordingAdmission(stale_ok=False)  # nothing is stale here
        collector = BatchCollector(q, {}, None, 5, admission=admission, max_filtered=max_filtered)
        return await collector.collect(2, step=0, max_staleness=0), admission.left_out

    batch, left_out = asyncio.run(go(max_filtered=2))
    assert [g.prompt_id for g in batch.groups] == [1, 3] and left_out == [0, 2] == batch.filtered_ids
    assert batch.zero_variance == 3 and batch.oversample_reached  # group 3 came past the limit: kept
    batch, left_out = asyncio.run(go(max_filtered=1))
    assert [g.prompt_id for g in batch.groups] == [1, 2] and left_out == [0]
    batch, left_out = asyncio.run(go(max_filtered=None))  # filtering off: only counted
    assert [g.prompt_id for g in batch.groups] == [0, 1] and batch.zero_variance == 1 and not left_out
    metrics = step_metrics(batch, {}, 1.0)
    assert metrics["zero_variance_frac"] == 0.5 and metrics["filtered_groups"] == 0


def test_a_group_with_a_penalised_cut_completion_carries_a_signal():
    # {cut r=1, finished r=1} with truncation_penalty -1 trains on [-1, 1]: not a zero-variance group,
    # though its raw rewards are equal (dynamic sampling dropped it, and zero_variance_frac counted it)
    from launch.config import load_config
    from learner.group import outcome_rewards

    algo = load_config(
        None, ["model.path=m", "data.prompts=p", "reward.function=r", "algorithm.shaping.truncation_penalty=-1"]
    )
    group = make_group(0, [1.0, 1.0])
    group.trajectories[0].finish_reason = "length"
    assert outcome_rewards(group.trajectories, algo.algorithm, 16) == [-1.0, 1.0]

    async def go():
        q = LocalQueue("results", maxsize=10)
        q.put_many([group, make_group(1, [1.0, 0.0])], timeout=1)

        collector = BatchCollector(
            q,
            {},
            None,
            5,
            admission=RecordingAdmission(stale_ok=False, no_signal_ok=False),  # nothing is stale or filtered
            max_filtered=2,
            outcomes=lambda g: outcome_rewards(g.trajectories, algo.algorithm, 16),
        )
        return await collector.collect(2, step=0, max_staleness=0)

    batch = asyncio.run(go())
    assert [g.prompt_id for g in batch.groups] == [0, 1] and batch.zero_variance == 0


def test_a_long_wait_for_the_batch_is_said_naming_the_quiet_actors_only(monkeypatch):
    # a frozen actor stalled a run for a minute without a word (issue 26, item 9); the review found the
    # first notice named every actor, the busy ones too
    from types import SimpleNamespace

    import runtime.collector as collecting
    from runtime.collector import DataTimeout

    monkeypatch.setattr(collecting, "WAIT_NOTICE_S", 0.4)
    said: list[str] = []
    run = SimpleNamespace(say=said.append, log_path=lambda name: f"/run/logs/{name}.log", logs="/run/logs")

    async def go():
        q = LocalQueue("results", maxsize=20)
        loops = {asyncio.get_running_loop().create_future(): name for name in ("actor-0", "actor-1")}
        collector = BatchCollector(q, loops, run, timeout=1.3, admission=RecordingAdmission())

        async def busy_actor_0():  # a group every 0.15 s from actor-0; actor-1 is frozen
            for i in range(8):
                group = make_group(i, [0.0, 1.0])
                group.actor_name = "actor-0"
                q.put_many([group], timeout=1)
                await asyncio.sleep(0.15)

        feeding = asyncio.ensure_future(busy_actor_0())
        with pytest.raises(DataTimeout):
            await collector.collect(20, step=0, max_staleness=1)
        await feeding

    asyncio.run(go())
    assert said, "nothing said during a 1.3 s wait with a silent actor"
    assert said[0].startswith("step 1: waiting 0s for prompt groups (")
    assert "; the run stops after run.data_timeout_s = 1s); nothing for that long from actor-1 (" in said[0]
    assert all("actor-0" not in line for line in said)  # it kept sending: not named
    assert "its log: /run/logs/actor-1.log" in said[0]


def test_an_abandoned_get_that_fails_as_its_queue_closes_is_not_reported_but_other_errors_are_said():
    # Ctrl-C while a step waited for its batch printed "Task exception was never retrieved ... QueueClosed"
    from runtime.collector import settled

    said: list[str] = []

    async def go():
        loop = asyncio.get_running_loop()
        closed, broken = loop.create_future(), loop.create_future()
        settled(closed, said.append, "a get")
        settled(broken, said.append, "the rollout loop")
        closed.set_exception(QueueClosed("the results queue is closed"))
        broken.set_exception(RuntimeError("prompt row 7 is not a dict"))
        await asyncio.sleep(0)  # the callbacks run
        return closed, broken

    closed, broken = asyncio.run(go())
    assert not closed._log_traceback and not broken._log_traceback  # seen: asyncio prints nothing at exit
    assert said == ["the rollout loop failed: RuntimeError: prompt row 7 is not a dict"]
