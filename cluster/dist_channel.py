"""The torch.distributed weight channel: learner rank 0 broadcasts versioned weights to the actors.

The interface of ``cluster/channel.py``, but the bytes go over a standalone process group (gloo
on CPU, NCCL on GPU; ``cluster/dist_group.py``) instead of Ray's object store.

    rank 0  DistPublisher   (learner rank 0; owns the TCPStore server on host:port)
    rank i  DistReceiver    (generation actor i, ``cluster/dist_receiver.py``; a background thread
                             receives every push and keeps the newest, so generation never blocks)

One push, all keys in the publisher's TCPStore:
    push/<seq>               header (JSON ``PushHeader``): version, bucket sizes, and each tensor's
                             name, dtype, shape, bucket and byte offset; or ``closed``
    push/<seq>/go/<rank>     set after the header: receiver <rank> waits on it (the store wakes it;
                             nothing polls), and sets it itself to ``stop`` to end its own wait
    broadcast                each bucket from rank 0, in order, every one with a deadline
    push/<seq>/ack/<rank>    the receiver has all buckets
Receivers also register once (``join/<rank>`` = their name) and beat (``hb/<rank>`` += 1 every
``heartbeat_s``, from their own thread), so a push that fails or misses its deadline names
the receivers that never acknowledged and says which of them stopped beating (dead or
stalled). The bytes of a push, its buckets and header, are laid out by ``cluster/buckets.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from cluster.buckets import DEFAULT_BUCKET_BYTES, PushHeader, lone_tensor, pack_bucket, plan_buckets
from cluster.channel import NamedTensors
from cluster.dist_group import (
    abort,
    bound_store,
    broadcast_all,
    build_group,
    device_of,
    left,
    listening_socket,
    release,
    short,
    wait_keys,
)

if TYPE_CHECKING:
    from cluster.dist_receiver import DistReceiver, DistReceiverHandle


def node_address() -> str:
    """This node's address as Ray knows it: where receivers on other nodes reach the publisher."""
    import ray

    return ray.util.get_node_ip_address()


PACK_RING = 2  # the publisher's pack buffers, reused in turn


class WeightPushError(RuntimeError):
    """A push failed or missed its deadline; ``receivers`` names the receivers to blame."""

    def __init__(self, message: str, receivers: list[str] | None = None):
        super().__init__(message)
        self.receivers = receivers or []


@dataclass(frozen=True)
class DistChannelSpec:
    """All a receiver needs to join; the publisher makes it, the driver hands it to the actors."""

    host: str  # the publisher's address, reachable from every actor
    port: int  # the publisher's TCPStore port
    world_size: int  # 1 publisher + number of receivers
    timeout_s: float  # deadline of one push, header to last acknowledgement
    connect_timeout_s: float  # deadline for every receiver to join the group
    backend: str  # "gloo" (CPU tensors) or "nccl" (CUDA tensors)

    def receiver(self, rank: int, name: str) -> DistReceiver:
        """Join now (in a background thread) as ``rank`` (1..world_size-1)."""
        from cluster.dist_receiver import DistReceiver

        return DistReceiver(
            self.host,
            self.port,
            rank,
            self.world_size,
            name,
            self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            backend=self.backend,
        )

    def handle(self, rank: int, name: str) -> DistReceiverHandle:
        """A picklable stand-in for the receiver that joins on first use inside the actor."""
        from cluster.dist_receiver import DistReceiverHandle

        return DistReceiverHandle(self, rank, name)


# --- rank 0 --------------------------------------------------------------------------------
class DistPublisher:
    """Rank 0: owns the store on ``host:port`` (port 0 picks a free one; see ``spec``) and pushes.

    Construction returns at once; the group forms in a background thread as receivers join.
    ``publish`` waits for it (up to ``connect_timeout_s`` from construction) and then pushes
    within ``timeout_s``, or raises ``WeightPushError`` naming the receivers at fault. After a
    failed push the group is unusable and every later ``publish`` raises.
    """

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        *,
        connect_timeout_s: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        backend: str = "gloo",
        heartbeat_s: float = 0.25,
    ):
        if world_size < 2:
            raise ValueError(f"weight channel world_size {world_size}: need the publisher and at least one receiver")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.bucket_bytes, self.backend, self.heartbeat_s = bucket_bytes, backend, heartbeat_s
        self.world_size = world_size
        self._store = bound_store(
            listening_socket(host, port), None, timedelta(seconds=connect_timeout_s), wait_for_workers=False
        )
        self.host, self.port = host, self._store.port
        self._names = {r: f"rank {r}" for r in range(1, world_size)}  # rank -> receiver name, once joined
        self._group = None
        self._error: str | None = None  # why the channel is unusable
        self._seq, self._version, self._closed = 0, 0, False
        self.device = device_of(backend)  # where publish wants the tensors: NCCL sends from the GPU
        self._pack_buffers: dict[int, torch.Tensor] = {}  # ring slot -> its pack buffer, kept between pushes
        self._stop = threading.Event()
        self._connecting = threading.Thread(target=self._connect, name="weight-publisher-connect", daemon=True)
        self._connect_deadline = time.monotonic() + connect_timeout_s
        self._connecting.start()

    @property
    def spec(self) -> DistChannelSpec:
        return DistChannelSpec(
            self.host, self.port, self.world_size, self.timeout_s, self.connect_timeout_s, self.backend
        )

    def _connect(self) -> None:
        ranks = range(1, self.world_size)
        joined = wait_keys(self._store, [f"join/{r}" for r in ranks], self._connect_deadline - time.monotonic())
        missing = [] if joined else [r for r in ranks if not self._store.check([f"join/{r}"])]
        for r in ranks:
            if r not in missing:
                self._names[r] = self._store.get(f"join/{r}").decode()
        if missing:
            self._error = (
                f"weight channel at {self.host}:{self.port}: receiver(s) {', '.join(map(str, missing))} did not join "
                f"within {self.connect_timeout_s:g}s; did those generation actors start? check their logs"
            )
            return
        if self._stop.is_set():
            return  # closed while receivers were joining
        try:
            remaining = max(1.0, self._connect_deadline - time.monotonic())
            self._group = build_group(self.backend, self._store, 0, self.world_size, remaining, self.host)
        except Exception as exc:
            self._error = f"weight channel at {self.host}:{self.port}: forming the group failed: {short(exc)}"

    def wait_connected(self) -> None:
        """Block until every receiver has joined (bounded by ``connect_timeout_s``)."""
        self._connecting.join(max(0.0, self._connect_deadline - time.monotonic()) + 5.0)
        if self._group is None and self._error is None:
            self._error = f"weight channel at {self.host}:{self.port}: the group did not form in time"
        if self._error:
            raise WeightPushError(self._error, [self._names[r] for r in range(1, self.world_size)])

    def receivers(self, names: list[str]) -> list[DistReceiverHandle]:
        """One handle per receiver rank 1..n, in order; each joins on first use inside its actor."""
        if len(names) != self.world_size - 1:
            raise ValueError(f"weight channel for {self.world_size - 1} receivers got {len(names)} names")
        return [self.spec.handle(rank, name) for rank, name in enumerate(names, start=1)]

    def latest_version(self) -> int:
        return self._version

    def is_closed(self) -> bool:
        return self._closed

    def _announce(self, seq: int, header: PushHeader) -> None:
        """The header, then each receiver's wake-up key."""
        self._store.set(f"push/{seq}", header.to_json())
        for r in range(1, self.world_size):
            self._store.set(f"push/{seq}/go/{r}", "go")

    def publish(self, version: int, weights: NamedTensors) -> None:
        """Push ``weights`` as ``version`` to every receiver; an older or equal version is ignored."""
        if self._closed:
            raise WeightPushError(f"weight push v{version}: the channel is closed")
        if self._error:
            raise WeightPushError(f"weight push v{version}: the channel is unusable: {self._error}")
        if version <= self._version:
            return
        self.wait_connected()
        start = time.monotonic()
        deadline = start + self.timeout_s
        sizes, slots = plan_buckets(weights, self.bucket_bytes)
        header = PushHeader(version, sizes, slots)
        self._seq += 1
        seq = self._seq
        try:
            self._announce(seq, header)
            broadcast_all(self._group, self._pack(weights, header), deadline, in_flight=PACK_RING - 1)
            self._store.wait([f"push/{seq}/ack/{r}" for r in range(1, self.world_size)], left(deadline))
        except Exception as exc:
            self._fail(version, seq, short(exc), time.monotonic() - start)
        for r in range(1, self.world_size):
            self._store.delete_key(f"push/{seq}/ack/{r}")
            self._store.delete_key(f"push/{seq}/go/{r}")
        self._store.delete_key(f"push/{seq}")
        self._version = version

    def _pack(self, weights: NamedTensors, header: PushHeader) -> Iterator[torch.Tensor]:
        """Buckets one at a time, bucket b+1 packed while bucket b is on the wire, into a ring of
        ``PACK_RING`` buffers kept between pushes (fresh memory would page-fault on every push):
        the channel holds at most ``PACK_RING`` buckets' bytes on ``self.device``, not a copy of the
        model (``broadcast_all`` lets a slot be packed again only once its broadcast is done). A
        bucket of one tensor already on the device is sent from its own memory."""
        for b in range(len(header.bucket_bytes)):
            lone = lone_tensor(weights, header, b, self.device)
            if lone is not None:
                yield lone
                continue
            size, held = header.bucket_bytes[b], self._pack_buffers.get(b % PACK_RING)
            if held is None or held.numel() < size:  # a slot holds any bucket of up to bucket_bytes
                held = torch.empty(max(size, min(self.bucket_bytes, max(header.bucket_bytes))), dtype=torch.uint8,
                                   device=self.device)  # fmt: skip
                self._pack_buffers[b % PACK_RING] = held
            yield pack_bucket(weights, header, b, self.device, out=held)

    def _beats(self) -> dict[int, int]:
        return {r: self._store.add(f"hb/{r}", 0) for r in range(1, self.world_size)}

    def _fail(self, version: int, seq: int, cause: str, elapsed: float) -> None:
        """Name the receivers that never acknowledged, telling dead or stalled ones (no heartbeat
        for a few periods) from live ones; then mark the channel unusable and raise."""
        window = max(1.0, 4 * self.heartbeat_s)
        before = self._beats()
        time.sleep(window)
        after = self._beats()
        missing = [r for r in range(1, self.world_size) if not self._store.check([f"push/{seq}/ack/{r}"])]
        silent = [r for r in missing if after[r] == before[r]]
        beating = [r for r in missing if r not in silent]
        parts = [f"weight push v{version} failed after {elapsed:.1f}s (deadline {self.timeout_s:.0f}s):"]
        # well before the deadline, the transport itself failed: a peer's connection closed
        timed_out = elapsed + 0.1 >= self.timeout_s
        how = f"did not acknowledge within {self.timeout_s:.0f}s" if timed_out else "dropped out"
        for r in silent:
            parts.append(
                f"receiver {self._names[r]} (rank {r}) {how} "
                f"and sent no heartbeat for {window:.1f}s (dead or stalled); check its log."
            )
        if beating:
            who = ", ".join(f"{self._names[r]} (rank {r})" for r in beating)
            parts.append(
                f"Alive but not acknowledged: {who}"
                + (" (held up by the failed receiver)." if silent else "; too slow? raise the push timeout.")
            )
        parts.append(f"Cause: {cause}")
        self._error = " ".join(parts)
        if self._group is not None:
            abort(self._group)
        raise WeightPushError(self._error, [self._names[r] for r in (silent or beating)])

    def close(self, timeout: float = 2.0) -> None:
        """Tell receivers there will be no more pushes (they report ``is_closed()``) and wait up to
        ``timeout`` for them to notice. The store stays up while this object lives."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # a group still forming is not built now
        try:  # also after a failed push or before the group formed: receivers waiting for a push wake
            self._seq += 1
            self._announce(self._seq, PushHeader(self._version, [], [], closed=True))
        except Exception:
            return  # the store itself is gone: receivers find out from their own connections
        if self._group is not None and not self._error:
            said_bye = wait_keys(self._store, [f"bye/{r}" for r in range(1, self.world_size)], timeout)
            # NCCL's shutdown is a collective finalize: with a receiver gone it would hang, so abort then
            (release if said_bye else abort)(self._group)  # a failed push aborted it already
