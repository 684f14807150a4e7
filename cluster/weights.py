"""The Ray and in-process weight channels (the interface is ``cluster/channel.py``).

- ``RayWeightChannel``: learner rank 0 puts the weights into Ray's object store as
  ``FlatWeights``; a small async store actor holds the newest version and its reference and
  wakes every actor waiting for a version (no polling), so any actor on any node can fetch.
- ``LocalWeightChannel``: the same over an in-process variable, for tests.
``NewestWeights`` is the receiving side every in-process channel shares.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from cluster.channel import ChannelClosed, NamedTensors, WeightsTimeout
from schema.process import ignore_sigterm


class FlatWeights:
    """Named tensors as raw bytes (one numpy ``uint8`` array each), the form the Ray path stores.

    Ray keeps numpy buffers out of band: storing this costs one copy into the object store,
    and an actor on the same node gets views of that shared memory, no copy at all. Pickled
    torch tensors go through ``torch.save`` bytes instead, two more copies each way. bfloat16
    has no numpy dtype, hence bytes plus (dtype, shape).
    """

    def __init__(self, named: NamedTensors):
        import torch

        self.entries = [
            (
                name,
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                t.detach().reshape(-1).view(torch.uint8).numpy(),
            )
            for name, t in ((n, t.detach().cpu().contiguous()) for n, t in named)
        ]

    @property
    def nbytes(self) -> int:
        return sum(raw.nbytes for *_, raw in self.entries)

    def tensors(self) -> NamedTensors:
        """``(name, tensor)`` pairs viewing the stored bytes (read-only memory on the Ray path: the
        consumer copies them into its own parameters, as every weight load does)."""
        import warnings

        import torch

        with warnings.catch_warnings():  # "non-writable array": views of Ray's shared memory, never written
            warnings.simplefilter("ignore", UserWarning)
            return [
                (name, torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape))
                for name, dtype, shape, raw in self.entries
            ]


class NewestWeights:
    """The receiving side of every in-process channel: the newest (version, weights) seen, whether
    the channel has ended (closed, or failed with a reason), and a wait for a minimum version
    that returns within its deadline whatever happens."""

    def __init__(self):
        self.version, self.weights = 0, None
        self.closed = False
        self.error: str | None = None  # why no more versions will arrive
        self._changed = threading.Condition()

    def offer(self, version: int, weights: Any) -> None:
        """Keep ``weights`` if ``version`` is newer than what is held (an older one never replaces it)."""
        with self._changed:
            if version > self.version:
                self.version, self.weights = version, weights
                self._changed.notify_all()

    def end(self, error: str | None = None) -> None:
        """No more versions: closed by the publisher, or (``error``) failed."""
        with self._changed:
            self.closed = self.closed or error is None
            self.error = self.error or error
            self._changed.notify_all()

    def wait(self, min_version: int, timeout: float) -> tuple[int, Any] | None:
        """(version, weights) once version >= ``min_version``; None if the deadline passes or the
        channel ends first (the caller explains which, from ``closed`` / ``error``)."""
        with self._changed:
            self._changed.wait_for(lambda: self.version >= min_version or self.closed or self.error, timeout)
            return (self.version, self.weights) if self.version >= min_version else None


class NewestReceiver:
    """What every in-process receiving end answers from its ``NewestWeights`` (``self._newest``)."""

    _newest: NewestWeights

    def latest_version(self) -> int:
        return self._newest.version

    def is_closed(self) -> bool:
        return self._newest.closed


class _WeightStore:
    """Ray actor state (an async actor, so waiting calls do not block each other): the newest
    version and a reference to its weights."""

    def __init__(self):
        ignore_sigterm()  # a SIGTERM to every process of a job is the driver's to act on
        self.version = 0
        self.ref_box: list = []  # [ObjectRef] (boxed so Ray passes the reference, not the value)
        self.closed = False
        self.changed = asyncio.Condition()

    async def publish(self, version: int, ref_box: list) -> None:
        async with self.changed:
            if version > self.version:
                self.version, self.ref_box = version, ref_box
                self.changed.notify_all()

    async def wait(self, min_version: int, timeout: float) -> tuple[int, list, bool]:
        """(version, [ref], closed) once version >= ``min_version`` or the channel closed, or at the deadline."""
        async with self.changed:
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: self.version >= min_version or self.closed), timeout
                )
            except asyncio.TimeoutError:
                pass
            return self.version, self.ref_box, self.closed

    def latest(self) -> tuple[int, bool]:
        return self.version, self.closed

    async def close(self) -> None:
        async with self.changed:
            self.closed = True
            self.changed.notify_all()


def _missed(min_version: int, newest: int, timeout: float, closed: bool) -> WeightsTimeout:
    if closed:
        return ChannelClosed(f"the weight channel closed before policy version {min_version} (newest {newest})")
    return WeightsTimeout(
        f"waited {timeout:.0f}s for policy version {min_version}, newest published is {newest}; "
        "is the learner alive? (raise run.weights_timeout_s for very slow steps)"
    )


class RayWeightChannel:
    """Handle to the store actor; picklable, so it is both the publisher (on learner rank 0) and
    every actor's receiver."""

    device = "cpu"  # publish takes host tensors: they go into Ray's object store

    def __init__(self, actor_options: dict | None = None):
        import ray

        options = {"num_cpus": 0, "max_concurrency": 1000, **(actor_options or {})}
        self._store = ray.remote(_WeightStore).options(**options).remote()

    # --- publisher ---------------------------------------------------------------------------
    def publish(self, version: int, weights: NamedTensors) -> None:
        """Put ``weights`` into the object store here (one copy; same-node actors read it in place)."""
        import ray

        ray.get(self._store.publish.remote(version, [ray.put(FlatWeights(weights))]))

    def receivers(self, names: list[str]) -> list[RayWeightChannel]:
        return [self] * len(names)

    def close(self) -> None:
        import ray

        ray.get(self._store.close.remote())

    # --- receiver ----------------------------------------------------------------------------
    def latest_version(self) -> int:
        import ray

        return ray.get(self._store.latest.remote())[0]

    def is_closed(self) -> bool:
        import ray

        return ray.get(self._store.latest.remote())[1]

    def fetch(self, min_version: int, timeout: float) -> tuple[int, NamedTensors | None]:
        """Newest (version, weights) once version >= ``min_version``; version 0 means the initial weights."""
        import ray

        version, box, closed = ray.get(self._store.wait.remote(min_version, timeout), timeout=timeout + 30)
        if version < min_version:
            raise _missed(min_version, version, timeout, closed)
        if not box:
            return version, None
        return version, ray.get(box[0], timeout=max(timeout, 30.0)).tensors()


class LocalWeightChannel(NewestReceiver):
    """The same channel inside one process: publisher and receiver at once."""

    device = "cpu"

    def __init__(self):
        self._newest = NewestWeights()

    def publish(self, version: int, weights: NamedTensors) -> None:
        self._newest.offer(version, weights)

    def receivers(self, names: list[str]) -> list[LocalWeightChannel]:
        return [self] * len(names)

    def fetch(self, min_version: int, timeout: float) -> tuple[int, NamedTensors | None]:
        got = self._newest.wait(min_version, timeout)
        if got is None:
            raise _missed(min_version, self._newest.version, timeout, self._newest.closed)
        return got

    def close(self) -> None:
        self._newest.end()
