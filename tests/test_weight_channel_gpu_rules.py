"""The weight channel under NCCL's rules, without a GPU (issue 37, items 1, 4 and 5).

NCCL refuses two ranks of one communicator on one device, and sends only tensors on the group's
device. Here the first rule is checked against the placement the plan builds for every schedule,
and the second with tensors on a device other than the host, as
tests/test_collectives.py checks the learner's own collective (the ``meta`` device stands in for
the GPU where a fake ``cuda`` tensor cannot ``copy_`` on a CPU-only torch). A group whose broadcast reads its
buffer only when waited on (the latest an asynchronous send may read it) checks that the
publisher's bounded ring of pack buffers never overwrites a bucket still on the wire.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import cluster.dist_channel as dist_channel
from cluster.buckets import PushHeader, plan_buckets, unpack
from cluster.dist_channel import PACK_RING, DistPublisher
from cluster.weights import LocalWeightChannel
from launch.config import load_config
from launch.plan import build_plan
from learner.worker import LearnerWorker

REQUIRED = ["model.path=m", "data.prompts=builtin:successor", "reward.function=builtin:successor"]
ON_GPUS = ["resources.learner.num_gpus=1", "resources.actors.num_gpus=1", "learner.zero_stage=1"]
NCCL = ["weights.backend=distributed", "weights.process_group=nccl"]


@pytest.mark.parametrize("schedule", ["overlapped", "colocated"])
def test_a_schedule_that_puts_an_actor_on_learner_rank_0s_gpu_refuses_the_nccl_weight_group(schedule):
    base = REQUIRED + ON_GPUS + [f"run.schedule={schedule}"]
    plan = build_plan(load_config(None, base + ["weights.backend=distributed", "weights.process_group=gloo"]))
    shares_rank_0s_gpu = plan.actors.shares == plan.learner.prefix  # actor 0 lives in rank 0's bundle
    assert shares_rank_0s_gpu == (schedule == "colocated")
    if shares_rank_0s_gpu:  # NCCL: "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device"
        with pytest.raises(ValueError, match="NCCL refuses .*set weights.backend=ray or weights.process_group=gloo"):
            load_config(None, base + NCCL)
    else:
        assert load_config(None, base + NCCL).weights.process_group == "nccl"


def test_an_nccl_weight_group_is_refused_for_tensor_parallel_engines():
    tp = ["resources.actors.tensor_parallel=2", "resources.actors.num_gpus=2"]
    with pytest.raises(ValueError, match="tensor_parallel = 2 receives the whole model on each engine's first GPU"):
        load_config(None, REQUIRED + NCCL + tp)
    assert load_config(None, REQUIRED + tp + ["weights.backend=distributed"]).weights.process_group == "gloo"


class LateSendGroup:
    """A process group whose broadcast reads the buffer only when its work is waited on, and then
    acknowledges the push for receiver 1 (the publisher's transport, minus the network)."""

    def __init__(self, publisher: DistPublisher):
        self.publisher, self.sent, self.aborted, self.ended = publisher, [], False, None

    def broadcast(self, buffers, opts):
        (buf,) = buffers
        group = self

        class Work:
            def wait(self, timeout):
                group.sent.append(buf.clone())
                group.publisher._store.set(f"push/{group.publisher._seq}/ack/1", "1")
                return True

        return Work()

    def abort(self):
        self.aborted = True
        self.ended = "abort"

    def shutdown(self):
        self.ended = "shutdown"


def weights(version: int) -> list:
    g = torch.Generator().manual_seed(version)
    return [(f"layer.{i}.weight", torch.randn(40 + i, 100, generator=g)) for i in range(12)]  # 16-20 KB each


def test_the_publisher_holds_two_buckets_and_never_overwrites_one_on_the_wire(monkeypatch):
    monkeypatch.setattr(dist_channel, "build_group", lambda *args: LateSendGroup(publisher))
    bucket = 40 << 10  # two tensors per bucket: six buckets a push
    publisher = DistPublisher("127.0.0.1", 0, 2, 10.0, connect_timeout_s=10.0, bucket_bytes=bucket)
    # receiver 1 joins through a connection of its own (the publisher's waits on its own store client)
    dist.TCPStore("127.0.0.1", publisher.port, None, False, timedelta(seconds=5)).set("join/1", "actor-0")
    try:
        for version in (1, 2):
            named = weights(version)
            sizes, slots = plan_buckets(named, bucket)
            assert len(sizes) == 6
            publisher.publish(version, named)
            group = publisher._group
            received, group.sent = unpack(PushHeader(version, sizes, slots), group.sent), []
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(received, named, strict=True))
        held = sum(b.numel() for b in publisher._pack_buffers.values())
        assert len(publisher._pack_buffers) == PACK_RING and held <= PACK_RING * bucket  # not 6 buckets' bytes
    finally:
        publisher.close(timeout=0.1)


@pytest.mark.parametrize("bye", [True, False])
def test_closing_shuts_the_group_down_only_when_every_receiver_said_bye(monkeypatch, bye):
    """NCCL's shutdown finalizes the communicator with every rank: with a receiver gone it would hang at
    exit, so the group is aborted instead."""
    monkeypatch.setattr(dist_channel, "build_group", lambda *args: LateSendGroup(publisher))
    publisher = DistPublisher("127.0.0.1", 0, 2, 10.0, connect_timeout_s=10.0)
    receiver = dist.TCPStore("127.0.0.1", publisher.port, None, False, timedelta(seconds=5))
    receiver.set("join/1", "actor-0")
    publisher.wait_connected()
    if bye:
        receiver.set("bye/1", "1")
    publisher.close(timeout=0.2)
    assert publisher._group.ended == ("shutdown" if bye else "abort")


def test_an_nccl_push_packs_and_sends_on_the_gpu_and_a_lone_tensor_from_its_own_memory(monkeypatch):
    # the meta device stands in for the GPU here (fake cuda tensors cannot copy_ on a CPU-only torch)
    monkeypatch.setattr(dist_channel, "device_of", lambda backend: "meta" if backend == "nccl" else "cpu")
    publisher = DistPublisher("127.0.0.1", 0, 2, 10.0, connect_timeout_s=0.5, bucket_bytes=1 << 20, backend="nccl")
    try:
        assert publisher.device == "meta" and LocalWeightChannel.device == "cpu"
        big = torch.empty(600, 1024, device="meta")  # 2.4 MB: a bucket of its own
        named = [("embed", big), ("a", torch.empty(10, 10, device="meta")), ("b", torch.empty(5, device="meta"))]
        sizes, slots = plan_buckets(named, 1 << 20)
        sent = list(publisher._pack(named, PushHeader(1, sizes, slots)))
        assert [t.device.type for t in sent] == ["meta", "meta"]  # NCCL sends only the group's device
        assert sent[0].numel() == big.numel() * 4 and len(publisher._pack_buffers) == 1  # sent from its own memory
        host = [("embed", torch.zeros(600, 1024)), *named[1:]]  # what the old export handed over: host tensors
        list(publisher._pack(host, PushHeader(1, sizes, slots)))
        assert publisher._pack_buffers[0].numel() == big.numel() * 4  # copied into a device buffer of its size
    finally:
        publisher.close(timeout=0.1)


def test_rank_0_exports_the_live_parameters_where_the_channel_sends_them():
    worker = object.__new__(LearnerWorker)
    worker.zero_stage, worker.rank = 1, 0
    worker.policy = SimpleNamespace(module=torch.nn.Linear(4, 3, device="meta"))  # meta: the GPU's stand-in
    assert {t.device.type for _, t in worker.export_weights(copy=False, device="meta")} == {"meta"}  # no host trip
    host = torch.nn.Linear(4, 3)
    worker.policy = SimpleNamespace(module=host)
    live = dict(worker.export_weights(copy=False))
    assert live["weight"].data_ptr() == host.weight.data_ptr()  # views of the parameters, not copies


def test_publishing_asks_for_the_tensors_where_the_channel_sends_them(monkeypatch):
    asked = []

    class Publisher:
        device = "cuda"

        def publish(self, version, named):
            asked.append(("publish", version))

    worker = object.__new__(LearnerWorker)
    worker.rank, worker.publisher, worker._published = 1, Publisher(), True
    worker.spans = SimpleNamespace(span=lambda kind: _nothing(), take=lambda: [])
    monkeypatch.setattr(LearnerWorker, "export_weights", lambda self, copy=True, device="cpu": asked.append(device))
    worker.publish_weights(3)
    assert asked == ["cuda"]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_broadcast_window_waits_for_the_oldest_operation_before_taking_the_next_buffer():
    from cluster.dist_group import broadcast_all

    log = []

    class Group:
        def broadcast(self, buffers, opts):
            index = int(buffers[0][0])
            log.append(f"send {index}")
            return SimpleNamespace(wait=lambda timeout: log.append(f"done {index}") or True)

    def buffers():
        for i in range(4):
            log.append(f"pack {i}")
            yield torch.tensor([i], dtype=torch.uint8)

    broadcast_all(Group(), buffers(), time.monotonic() + 5, in_flight=1)
    assert log == ["pack 0", "send 0", "pack 1", "send 1", "done 0", "pack 2", "send 2", "done 1", "pack 3",
                   "send 3", "done 2", "done 3"]  # fmt: skip


def test_the_weight_group_alone_raises_on_a_missed_nccl_deadline_instead_of_being_torn_down(monkeypatch):
    """torch's NCCL watchdog ends the process when an operation misses its timeout (the default error
    mode, 3); the weight group is built in mode 2 (abort the communicator, raise), read by
    ProcessGroupNCCL's constructor, so DeepSpeed's group in the same process keeps the default."""
    import cluster.dist_group as dist_group

    built = []

    class ProcessGroupNCCL:  # the constructor's signature and its Options, as torch's CUDA build has them
        class Options:
            pass

        def __init__(self, store, rank, world_size, options):
            built.append((os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), rank, world_size, options._timeout))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", ProcessGroupNCCL, raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    dist_group.build_group("nccl", dist.HashStore(), 1, 3, 7.0, "127.0.0.1")
    assert built == [("2", 1, 3, timedelta(seconds=7))]
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # not the rest of the process's groups


def test_a_transport_failure_is_named_in_one_short_line_without_the_librarys_location_and_advice():
    from cluster.dist_group import short

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:46258: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
        "Check the logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
    )
    assert short(gloo) == "RuntimeError: Read error [127.0.0.1]:46258: Connection reset by peer."
    assert short(TimeoutError("Operation timed out!\nmore")) == "TimeoutError: Operation timed out!"
