"""The torch.distributed weight channel: the bucket layout in-process, then real processes
(forked from a fork server), a real gloo group and real deadlines: a dead or stalled receiver,
a dead publisher.

Every wait in these tests is bounded, so a regression fails instead of hanging. The tests with
real processes check deadlines on the clock, so they are ``slow`` (never run in the fast suite,
where a loaded machine could miss them).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import signal
import time

import pytest
import torch

from cluster.buckets import PushHeader, pack_bucket, plan_buckets, unpack
from cluster.channel import ChannelClosed, WeightsTimeout
from cluster.dist_channel import DistPublisher, WeightPushError
from cluster.dist_receiver import DistReceiver

# Children fork from a server that imported torch once (~2 s here), not from this process (which
# runs threads): each starts in ~0.1 s instead of re-importing torch.
PROCS = mp.get_context("forkserver")
PROCS.set_forkserver_preload(["torch", "cluster.dist_receiver", __name__])
HOST = "127.0.0.1"
SMALL_BUCKET = 64 << 10  # 64 KiB: the ~1.3 MB of weights below travel in several buckets


def make_weights(version: int) -> list:
    """~1.3 MB of fp32 and bf16 tensors that differ per version, with odd sizes, a 0-d tensor,
    an empty one, and NaN / inf / -0.0 bit patterns that only a bit-exact copy preserves."""
    g = torch.Generator().manual_seed(version)
    embed = torch.randn(512, 512, generator=g)  # fp32, 1 MiB: bigger than a bucket, sent alone
    embed[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")])
    return [
        ("model.embed_tokens.weight", embed),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(128, 128, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(128, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(256, 128, generator=g)),
        ("model.norm.weight", torch.randn(7, generator=g)),  # 28 bytes: the next offset must realign
        ("model.layers.0.input_layernorm.weight", torch.randn(128, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(512, 128, generator=g).to(torch.bfloat16)),
        ("step", torch.tensor(float(version))),
        ("empty", torch.empty(0, 3, dtype=torch.bfloat16)),
    ]


def same_bits(got: list, want: list) -> bool:
    """Names, dtypes, shapes and every byte equal (NaN == NaN, -0.0 != 0.0)."""
    return [n for n, _ in got] == [n for n, _ in want] and all(
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        for (_, a), (_, b) in zip(got, want, strict=True)
    )


# --- in-process: the layout ------------------------------------------------------------------
def test_bucket_plan_and_round_trip_in_process():
    named = [
        ("a", torch.arange(2048, dtype=torch.float32)),  # 8192 B > 4096: a bucket of its own
        ("b", torch.ones(32, 32, dtype=torch.bfloat16)),  # 2048 B: bucket 1 @ 0
        ("c", torch.ones(32, dtype=torch.bfloat16)),  # 64 B: bucket 1 @ 2048
        ("d", torch.ones(7)),  # 28 B: bucket 1 @ 2112 -> bucket 1 holds 2140 B
        ("e", torch.ones(64, 64, dtype=torch.int8)),  # 4096 B: align(2140) = 2176, 2176 + 4096 > 4096 -> bucket 2
        ("f", torch.tensor(3.0)),  # 4 B: 4096 + 4 > 4096 -> bucket 3
    ]
    sizes, slots = plan_buckets(named, bucket_bytes=4096)
    assert sizes == [8192, 2140, 4096, 4]
    assert [(s.bucket, s.offset) for s in slots] == [(0, 0), (1, 0), (1, 2048), (1, 2112), (2, 0), (3, 0)]
    header = PushHeader.from_json(PushHeader(7, sizes, slots).to_json())  # what receivers parse
    assert header.slots[1].dtype == "bfloat16" and header.slots[5].shape == []
    buckets = [pack_bucket(named, header, b) for b in range(len(sizes))]
    assert buckets[0].data_ptr() == named[0][1].data_ptr()  # a lone contiguous tensor is not copied
    received = [b.clone() for b in buckets]  # what a receiver holds after the broadcasts
    assert same_bits(unpack(header, received), named)
    weights = make_weights(3)
    sizes, slots = plan_buckets(weights, SMALL_BUCKET)
    header = PushHeader(3, sizes, slots)
    assert len(sizes) >= 4
    assert same_bits(unpack(header, [pack_bucket(weights, header, b).clone() for b in range(len(sizes))]), weights)


@pytest.mark.slow
def test_publisher_names_receivers_that_never_join():
    pub = DistPublisher(HOST, 0, 3, timeout_s=1, connect_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(WeightPushError, match=r"receiver\(s\) 1, 2 did not join within 0.5s"):
        pub.publish(1, make_weights(1))
    assert time.monotonic() - start < 3
    pub.close()


# --- real processes ---------------------------------------------------------------------------
def _checking_receiver(port: int, rank: int, name: str, results) -> None:
    """Receive until v3, compare bit for bit, check the deadlines, wait for the close; report."""
    torch.set_num_threads(1)
    rx = DistReceiver(HOST, port, rank, 3, name, timeout_s=20, connect_timeout_s=60)
    try:
        version, named = rx.fetch(3, timeout=60)
        start = time.monotonic()
        try:
            rx.fetch(4, timeout=0.3)
            late = None
        except WeightsTimeout:
            late = time.monotonic() - start
        try:  # the publisher's close wakes a waiting fetch at once
            rx.fetch(4, timeout=20)
            closed_wakes = False
        except ChannelClosed:
            closed_wakes = True
        results.put(
            {
                "name": name,
                "version": version,
                "exact": same_bits(named, make_weights(3)),
                "late_s": late,
                "closed": rx.is_closed() and closed_wakes,
            }
        )
    except Exception as exc:
        results.put({"name": name, "error": repr(exc)})


def _idle_receiver(port: int, rank: int, world_size: int, name: str) -> None:
    """Receive in the background until killed (or for at most a minute)."""
    torch.set_num_threads(1)
    DistReceiver(HOST, port, rank, world_size, name, timeout_s=20, connect_timeout_s=60)
    time.sleep(60)


def _publisher_then_idle(results) -> None:
    """Publish v1 to one receiver, then wait to be killed."""
    torch.set_num_threads(1)
    pub = DistPublisher(HOST, 0, 2, timeout_s=20, connect_timeout_s=60, bucket_bytes=SMALL_BUCKET)
    results.put(pub.spec)  # what learner rank 0 hands the driver
    pub.publish(1, make_weights(1))
    time.sleep(60)


def _stop_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL also ends a stopped process
        p.join(5)


@pytest.mark.slow
def test_three_versions_reach_two_receivers_bit_exact():
    pub = DistPublisher(HOST, 0, 3, timeout_s=20, connect_timeout_s=60, bucket_bytes=SMALL_BUCKET)
    results = PROCS.Queue()
    procs = [
        PROCS.Process(target=_checking_receiver, args=(pub.port, r, f"actor-{r}", results), daemon=True) for r in (1, 2)
    ]
    for p in procs:
        p.start()
    try:
        for version in (1, 2, 3):
            pub.publish(version, make_weights(version))
        pub.publish(2, make_weights(2))  # older than the newest: ignored, like the other backends
        assert pub.latest_version() == 3
        pub.close()
        reports = sorted((results.get(timeout=60) for _ in procs), key=lambda r: r["name"])
    finally:
        _stop_all(procs)
    for report in reports:
        assert "error" not in report, report
        assert report["version"] == 3 and report["exact"], report
        assert report["late_s"] is not None and report["late_s"] < 1.5, report  # fetch(4) raised, promptly
        assert report["closed"], report


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "stalled"])
def test_push_to_a_dead_or_stalled_receiver_fails_within_the_deadline_naming_it(sig):
    deadline_s = 2.0
    pub = DistPublisher(HOST, 0, 3, timeout_s=deadline_s, connect_timeout_s=60, bucket_bytes=SMALL_BUCKET)
    procs = [PROCS.Process(target=_idle_receiver, args=(pub.port, r, 3, f"actor-{r}"), daemon=True) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        pub.publish(1, make_weights(1))  # the group works
        os.kill(procs[0].pid, sig)
        start = time.monotonic()
        with pytest.raises(WeightPushError) as failure:
            pub.publish(2, make_weights(2))
        elapsed = time.monotonic() - start
        message = str(failure.value)
        print(f"{elapsed:.2f}s: {message}")
        assert elapsed < deadline_s + 3  # the deadline, plus a 1 s look at the heartbeats
        assert failure.value.receivers == ["actor-1"]
        assert "weight push v2 failed" in message
        # stalled: the deadline passes; dead: its closed connection may end the push sooner
        how = "did not acknowledge within 2s"
        how = how if sig == signal.SIGSTOP else f"({how}|dropped out)"
        assert re.search(rf"receiver actor-1 \(rank 1\) {how} and sent no heartbeat", message), message
        assert "dead or stalled" in message
        assert "actor-2 (rank 2) did not" not in message  # alive: never blamed
        start = time.monotonic()
        with pytest.raises(WeightPushError, match="unusable"):  # later pushes fail at once, no hang
            pub.publish(3, make_weights(3))
        assert time.monotonic() - start < 0.5
    finally:
        _stop_all(procs)
        pub.close()


@pytest.mark.slow
def test_fetch_raises_within_its_deadline_when_the_publisher_dies():
    results = PROCS.Queue()
    publisher = PROCS.Process(target=_publisher_then_idle, args=(results,), daemon=True)
    publisher.start()
    rx = None
    try:
        spec = results.get(timeout=60)
        rx = pickle.loads(pickle.dumps(spec.handle(1, "actor-1")))  # as the driver passes it to an actor
        version, named = rx.fetch(1, timeout=60)
        assert version == 1 and same_bits(named, make_weights(1))
        publisher.kill()
        publisher.join(5)
        start = time.monotonic()
        with pytest.raises(WeightsTimeout, match="actor-1: waited up to 2s for policy version 2, newest received is 1"):
            rx.fetch(2, timeout=2)
        assert time.monotonic() - start < 2.5
        with pytest.raises(WeightsTimeout, match="waiting for the next push from the publisher 127.0.0.1"):
            rx.fetch(2, timeout=0)  # by now the receiver knows why: the connection to the publisher is gone
        assert rx.fetch(1, timeout=0)[0] == 1  # the newest weights stay available
    finally:
        if rx is not None:
            rx.close()
        _stop_all([publisher])
