"""Ranks 1..N of the distributed weight channel: a generation actor's receiving end.

The protocol (keys, header, acknowledgements, heartbeats) is described in ``cluster/dist_channel.py``.
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.buckets import PushHeader, unpack
from cluster.channel import ChannelClosed, ChannelFailed, NamedTensors, WeightsTimeout
from cluster.dist_channel import DistChannelSpec
from cluster.dist_group import abort, broadcast_all, build_group, device_of, release, short, wait_keys
from cluster.weights import NewestReceiver, NewestWeights

IDLE_WAIT_S = 60.0  # a receiver's wait for the next push is renewed this often (the store wakes it sooner)


class DistReceiver(NewestReceiver):
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
        self._seq = 1  # the push this receiver waits for next
        self.heartbeat_error: str | None = None  # why the heartbeat thread stopped, if it failed
        self._spare: list[torch.Tensor] | None = None  # pre-faulted buffers for the next push (CPU)
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weight-receiver-{name}", daemon=True)
        self._thread.start()

    # --- the interface the actors use (latest_version, is_closed: NewestReceiver) ---------
    def fetch(self, min_version: int, timeout: float) -> tuple[int, NamedTensors | None]:
        """Newest (version, weights) once version >= ``min_version``; version 0 means the initial weights."""
        got = self._newest.wait(min_version, timeout)
        if got is not None:
            return got
        where = f"{self.name}: waited up to {timeout:.0f}s for policy version {min_version}, newest received is "
        where += f"{self._newest.version} (publisher {self.host}:{self.port})"
        if self._newest.closed and not self._newest.error:
            raise ChannelClosed(f"{where}; the publisher closed the channel")
        beats = f"; heartbeats stopped: {self.heartbeat_error}" if self.heartbeat_error else ""
        if self._newest.error:
            raise ChannelFailed(f"{where}; {self._newest.error}{beats}")
        raise WeightsTimeout(f"{where}; is the learner alive? (raise run.weights_timeout_s for very slow steps){beats}")

    def wait_connected(self, timeout: float) -> bool:
        """True once this receiver is in the group (for tests and start-up checks)."""
        return self._connected.wait(timeout)

    def close(self) -> None:
        """Stop receiving (the publisher's next push will name this receiver as gone): the receive
        thread's wait for the next push is ended by setting its wake-up key to ``stop``."""
        self._stop.set()
        try:
            store = dist.TCPStore(self.host, self.port, None, False, timedelta(seconds=2))
            store.set(f"push/{self._seq}/go/{self.rank}", "stop")
        except Exception:
            pass  # the publisher is gone: the thread's wait fails on its own
        self._thread.join(timeout=1.0)

    # --- the background thread -----------------------------------------------------------
    def _run(self) -> None:
        where = f"publisher {self.host}:{self.port}"
        try:
            store = dist.TCPStore(self.host, self.port, None, False, timedelta(seconds=self.connect_timeout_s))
        except Exception as exc:
            return self._set_error(
                f"could not reach the weight {where} within {self.connect_timeout_s:.0f}s: {short(exc)}"
            )
        group, phase = None, f"joining the weight channel at {where}"
        try:
            threading.Thread(target=self._beat, name=f"weight-heartbeat-{self.name}", daemon=True).start()
            store.set(f"join/{self.rank}", self.name)
            group = build_group(self.backend, store, self.rank, self.world_size, self.connect_timeout_s, self.host)
            self._connected.set()
            while not self._stop.is_set():
                phase = f"waiting for the next push from the {where} (is the learner alive?)"
                go = f"push/{self._seq}/go/{self.rank}"
                if not wait_keys(store, [go], IDLE_WAIT_S) or store.get(go) == b"stop":
                    continue  # no push yet (renew the wait), or close() woke us: the loop ends
                header = PushHeader.from_json(store.get(f"push/{self._seq}"))
                if header.closed:
                    store.set(f"bye/{self.rank}", "1")
                    # Tear the group down in this thread before is_closed() lets the process exit:
                    # its threads destroyed mid-teardown at exit abort the process.
                    release(group)
                    group = None
                    self._newest.end()
                    return
                phase = f"receiving weight push v{header.version} from the {where}"
                buffers = self._buffers(header.bucket_bytes)
                broadcast_all(group, buffers, time.monotonic() + self.timeout_s)
                weights = unpack(header, buffers)
                store.set(f"push/{self._seq}/ack/{self.rank}", "1")
                self._newest.offer(header.version, weights)
                self._seq += 1
                if self.backend == "gloo":
                    # Fresh CPU memory page-faults while the bytes arrive (measured: half the push
                    # rate at 64 MiB buckets); fault the next push's buffers in now, while idle.
                    self._spare = [torch.empty(n, dtype=torch.uint8).fill_(0) for n in header.bucket_bytes]
        except Exception as exc:
            if group is not None:
                abort(group)
            self._set_error(f"failed while {phase}: {short(exc)}; see the learner's log")

    def _buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        """Receive buffers: the spare set when the layout repeats (never memory handed out to ``fetch``)."""
        spare, self._spare = self._spare, None
        if spare is not None and [b.numel() for b in spare] == sizes:
            return spare
        return [torch.empty(n, dtype=torch.uint8, device=device_of(self.backend)) for n in sizes]

    def _beat(self) -> None:
        """Heartbeats from their own thread and store connection: they continue while a push is received.
        If they fail, the reason is kept (``heartbeat_error``), printed to this process's log, and named
        when a ``fetch`` fails: the publisher would otherwise blame a silent receiver without a cause."""
        try:
            store = dist.TCPStore(self.host, self.port, None, False, timedelta(seconds=self.connect_timeout_s))
            while not self._stop.is_set() and not self._newest.closed:  # beats on after a failed push: alive
                store.add(f"hb/{self.rank}", 1)
                self._stop.wait(self.heartbeat_s)
        except Exception as exc:
            if self._stop.is_set() or self._newest.closed:
                return
            self.heartbeat_error = short(exc)
            print(
                f"[{self.name}] weight-channel heartbeats stopped: {self.heartbeat_error}", file=sys.stderr, flush=True
            )

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
