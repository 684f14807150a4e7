"""The torch.distributed weight channel: learner rank 0 broadcasts versioned weights to the actors.

The same interface as ``cluster/weights.py`` (``publish`` / ``latest_version`` / ``is_closed`` /
``fetch`` / ``close``), but the bytes go over a standalone process group (gloo on CPU, NCCL on
GPU) instead of Ray's object store. The group lives beside DeepSpeed's default group: it is
built directly from a ``TCPStore`` (``ray.util.collective`` cannot be used when a learner rank
is a member, see /work/shared/CPU-STACK.md).

    rank 0  DistPublisher   (learner rank 0; owns the TCPStore server on host:port)
    rank i  DistReceiver    (generation actor i; a background thread receives every push and
                             keeps the newest, so generation never blocks the publisher)

One push, all keys in the publisher's TCPStore:
    push/<seq>               header (JSON ``PushHeader``): version, bucket sizes, and each tensor's
                             name, dtype, shape, bucket and byte offset; or ``closed``
    broadcast                each bucket from rank 0, in order, every one with a deadline
    push/<seq>/ack/<rank>    the receiver has all buckets
Receivers also register once (``join/<rank>`` = their name) and beat (``hb/<rank>`` += 1 every
``heartbeat_s``, from their own thread), so a push that fails or misses its deadline names
the receivers that never acknowledged and says which of them stopped beating (dead or
stalled). The bytes of a push, its buckets and header, are laid out by ``cluster/buckets.py``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.buckets import DEFAULT_BUCKET_BYTES, PushHeader, lone_tensor, pack_bucket, plan_buckets, unpack
from cluster.weights import NamedTensors, NewestWeights, WeightsTimeout

_POLL_S = 0.005  # how often an idle receiver looks for the next push (a store round trip)


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
        return DistReceiverHandle(self, rank, name)


# --- the group -----------------------------------------------------------------------------
def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _build_group(backend: str, store, rank: int, world_size: int, timeout_s: float, publisher_host: str):
    """A process group of its own over ``store`` (not the default group DeepSpeed uses)."""
    prefixed = dist.PrefixStore("group", store)
    if backend == "gloo":
        # Bind gloo to the interface that reaches the publisher (GLOO_SOCKET_IFNAME overrides), not
        # to whatever this host's name resolves to, which may be a loopback address on another node.
        interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
        options = dist.ProcessGroupGloo._Options()
        options._devices = [
            dist.ProcessGroupGloo.create_device(interface=interface)
            if interface
            else dist.ProcessGroupGloo.create_device(hostname=_address_towards(publisher_host))
        ]
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("weights backend 'nccl' needs a CUDA build of torch; use 'gloo' on CPU")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"unknown process-group backend {backend!r}; use 'gloo' or 'nccl'")


def _device(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def _broadcast_all(group, buffers: Iterable[torch.Tensor], deadline: float) -> None:
    """Broadcast every buffer from rank 0 (queued together, so packing overlaps sending); each
    operation and each wait is bounded by ``deadline``."""
    works = []
    for buf in buffers:
        if buf.numel() == 0:
            continue
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, _left(deadline)
        works.append(group.broadcast([buf], opts))
    for work in works:
        if not work.wait(_left(deadline)):
            raise TimeoutError("broadcast did not finish before the deadline")


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _abort(group) -> None:
    """Drop a group after a failure so no half-finished operation lingers."""
    for method in ("abort", "shutdown"):
        try:
            getattr(group, method)()
            return
        except Exception:
            continue


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


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
        self._store = dist.TCPStore(
            host, port, None, True, timedelta(seconds=connect_timeout_s), wait_for_workers=False
        )
        self.host, self.port = host, self._store.port
        self._names = {r: f"rank {r}" for r in range(1, world_size)}  # rank -> receiver name, once joined
        self._group = None
        self._error: str | None = None  # why the channel is unusable
        self._seq, self._version, self._closed = 0, 0, False
        self._pack_buffers: dict[int, torch.Tensor] = {}  # bucket index -> its pack buffer, kept between pushes
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
        missing = list(ranks)
        while missing and time.monotonic() < self._connect_deadline and not self._stop.is_set():
            missing = [r for r in missing if not self._store.check([f"join/{r}"])]
            time.sleep(0.01)
        for r in ranks:
            if r not in missing:
                self._names[r] = self._store.get(f"join/{r}").decode()
        if missing:
            self._error = (
                f"weight channel at {self.host}:{self.port}: receiver(s) {', '.join(map(str, missing))} did not join "
                f"within {self.connect_timeout_s:g}s; did those generation actors start? check their logs"
            )
            return
        try:
            left = max(1.0, self._connect_deadline - time.monotonic())
            self._group = _build_group(self.backend, self._store, 0, self.world_size, left, self.host)
        except Exception as exc:
            self._error = f"weight channel at {self.host}:{self.port}: forming the group failed: {_short(exc)}"

    def wait_connected(self) -> None:
        """Block until every receiver has joined (bounded by ``connect_timeout_s``)."""
        self._connecting.join(max(0.0, self._connect_deadline - time.monotonic()) + 5.0)
        if self._group is None and self._error is None:
            self._error = f"weight channel at {self.host}:{self.port}: the group did not form in time"
        if self._error:
            raise WeightPushError(self._error, [self._names[r] for r in range(1, self.world_size)])

    def latest_version(self) -> int:
        return self._version

    def is_closed(self) -> bool:
        return self._closed

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
            self._store.set(f"push/{seq}", header.to_json())
            _broadcast_all(self._group, self._pack(weights, header), deadline)
            self._store.wait([f"push/{seq}/ack/{r}" for r in range(1, self.world_size)], _left(deadline))
        except Exception as exc:
            self._fail(version, seq, _short(exc), time.monotonic() - start)
        for key in [f"push/{seq}"] + [f"push/{seq}/ack/{r}" for r in range(1, self.world_size)]:
            self._store.delete_key(key)
        self._version = version

    def _pack(self, weights: NamedTensors, header: PushHeader) -> Iterator[torch.Tensor]:
        """Buckets one at a time (bucket b+1 is packed while bucket b is on the wire), into the
        previous push's pack buffers: fresh ones would page-fault on every push."""
        device = _device(self.backend)
        for b in range(len(header.bucket_bytes)):
            lone = lone_tensor(weights, header, b, device)
            if lone is not None:
                yield lone
                continue
            self._pack_buffers[b] = pack_bucket(weights, header, b, device, out=self._pack_buffers.get(b))
            yield self._pack_buffers[b]

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
            _abort(self._group)
        raise WeightPushError(self._error, [self._names[r] for r in (silent or beating)])

    def close(self, timeout: float = 2.0) -> None:
        """Tell receivers there will be no more pushes (they report ``is_closed()``) and wait up to
        ``timeout`` for them to notice. The store stays up while this object lives."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._group is None or self._error:
            return
        self._seq += 1
        self._store.set(f"push/{self._seq}", PushHeader(self._version, [], [], closed=True).to_json())
        byes = [f"bye/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + timeout
        while not self._store.check(byes) and time.monotonic() < deadline:
            time.sleep(0.01)


# --- ranks 1..N -----------------------------------------------------------------------------
class DistReceiver:
    """Rank ``rank`` (1..world_size-1): joins the publisher's group and receives every push in a
    background thread, keeping the newest (version, weights) for ``fetch``.

    ``fetch`` never touches the network, so it always returns or raises within its timeout; if
    the publisher dies or a push fails, it raises ``WeightsTimeout`` with the reason. The tensors
    it returns are views into this push's receive buffers, never written again. Memory: the
    newest weights plus (CPU) a pre-faulted spare set for the next push, about 2x the model.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        name: str,
        timeout_s: float,
        *,
        connect_timeout_s: float = 300.0,
        backend: str = "gloo",
        heartbeat_s: float = 0.25,
    ):
        if not 1 <= rank < world_size:
            raise ValueError(f"receiver {name}: rank {rank} outside 1..{world_size - 1} (rank 0 is the publisher)")
        self.host, self.port, self.rank, self.world_size, self.name = host, port, rank, world_size, name
        self.timeout_s, self.connect_timeout_s, self.backend = timeout_s, connect_timeout_s, backend
        self.heartbeat_s = heartbeat_s
        self._newest = NewestWeights()  # the newest push; closed / error: no more will arrive
        self._spare: list[torch.Tensor] | None = None  # pre-faulted buffers for the next push (CPU)
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weight-receiver-{name}", daemon=True)
        self._thread.start()

    # --- the interface the actors use ----------------------------------------------------
    def latest_version(self) -> int:
        return self._newest.version

    def is_closed(self) -> bool:
        return self._newest.closed

    def fetch(self, min_version: int, timeout: float) -> tuple[int, NamedTensors | None]:
        """Newest (version, weights) once version >= ``min_version``; version 0 means the initial weights."""
        got = self._newest.wait(min_version, timeout)
        if got is not None:
            return got
        why = self._newest.error or (
            "the publisher closed the channel"
            if self._newest.closed
            else "is the learner alive? (raise run.weights_timeout_s for very slow steps)"
        )
        raise WeightsTimeout(
            f"{self.name}: waited up to {timeout:.0f}s for policy version {min_version}, newest received is "
            f"{self._newest.version} (publisher {self.host}:{self.port}); {why}"
        )

    def wait_connected(self, timeout: float) -> bool:
        """True once this receiver is in the group (for tests and start-up checks)."""
        return self._connected.wait(timeout)

    def close(self) -> None:
        """Stop receiving (the publisher's next push will name this receiver as gone)."""
        self._stop.set()
        self._thread.join(timeout=1.0)

    # --- the background thread -----------------------------------------------------------
    def _run(self) -> None:
        where = f"publisher {self.host}:{self.port}"
        try:
            store = dist.TCPStore(self.host, self.port, None, False, timedelta(seconds=self.connect_timeout_s))
        except Exception as exc:
            return self._set_error(
                f"could not reach the weight {where} within {self.connect_timeout_s:.0f}s: {_short(exc)}"
            )
        group, phase = None, f"joining the weight channel at {where}"
        try:
            threading.Thread(target=self._beat, name=f"weight-heartbeat-{self.name}", daemon=True).start()
            store.set(f"join/{self.rank}", self.name)
            group = _build_group(self.backend, store, self.rank, self.world_size, self.connect_timeout_s, self.host)
            self._connected.set()
            seq = 1
            while not self._stop.is_set():
                phase = f"waiting for the next push from the {where} (is the learner alive?)"
                if not store.check([f"push/{seq}"]):
                    time.sleep(_POLL_S)
                    continue
                header = PushHeader.from_json(store.get(f"push/{seq}"))
                if header.closed:
                    store.set(f"bye/{self.rank}", "1")
                    # Tear the group down in this thread before is_closed() lets the process exit:
                    # its threads destroyed mid-teardown at exit abort the process.
                    group = None
                    self._newest.end()
                    return
                phase = f"receiving weight push v{header.version} from the {where}"
                buffers = self._buffers(header.bucket_bytes)
                _broadcast_all(group, buffers, time.monotonic() + self.timeout_s)
                weights = unpack(header, buffers)
                store.set(f"push/{seq}/ack/{self.rank}", "1")
                self._newest.offer(header.version, weights)
                seq += 1
                if self.backend == "gloo":
                    # Fresh CPU memory page-faults while the bytes arrive (measured: half the push
                    # rate at 64 MiB buckets); fault the next push's buffers in now, while idle.
                    self._spare = [torch.empty(n, dtype=torch.uint8).fill_(0) for n in header.bucket_bytes]
        except Exception as exc:
            if group is not None:
                _abort(group)
            self._set_error(f"failed while {phase}: {_short(exc)}; see the learner's log")

    def _buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        """Receive buffers: the spare set when the layout repeats (never memory handed out to ``fetch``)."""
        spare, self._spare = self._spare, None
        if spare is not None and [b.numel() for b in spare] == sizes:
            return spare
        return [torch.empty(n, dtype=torch.uint8, device=_device(self.backend)) for n in sizes]

    def _beat(self) -> None:
        """Heartbeats from their own thread and store connection: they continue while a push is received."""
        try:
            store = dist.TCPStore(self.host, self.port, None, False, timedelta(seconds=self.connect_timeout_s))
            while not self._stop.is_set() and not self._newest.closed:  # beats on after a failed push: alive
                store.add(f"hb/{self.rank}", 1)
                self._stop.wait(self.heartbeat_s)
        except Exception:
            return  # the receive thread reports what went wrong

    def _set_error(self, message: str) -> None:
        self._newest.end(error=message)


class DistReceiverHandle:
    """What the driver passes to an actor: picklable; builds its ``DistReceiver`` on first use in
    the actor's process (so actors need no change beyond receiving a handle as their channel)."""

    def __init__(self, spec: DistChannelSpec, rank: int, name: str):
        self.spec, self.rank, self.name = spec, rank, name
        self._receiver: DistReceiver | None = None
        self._opening = threading.Lock()  # one receiver per handle, even if two threads call at once

    def __reduce__(self):
        return DistReceiverHandle, (self.spec, self.rank, self.name)

    def _open(self) -> DistReceiver:
        with self._opening:
            if self._receiver is None:
                self._receiver = self.spec.receiver(self.rank, self.name)
            return self._receiver

    def latest_version(self) -> int:
        return self._open().latest_version()

    def is_closed(self) -> bool:
        return self._open().is_closed()

    def fetch(self, min_version: int, timeout: float) -> tuple[int, NamedTensors | None]:
        return self._open().fetch(min_version, timeout)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
