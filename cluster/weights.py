"""The weight channel: learner rank 0 publishes versioned weights, actors pull them.

One small interface with swappable backends, picked by ``build_weight_channel``:
- ``"ray"``: weights are a Ray object (put by learner rank 0 as ``FlatWeights``); a tiny
  store actor holds the newest version and its reference, so any actor on any node can pull.
- ``"local"``: the same methods over an in-process variable, for tests.
Actors pull between generate calls; ``fetch`` waits for a minimum version with a
deadline and raises ``WeightsTimeout`` naming the versions instead of hanging.
"""

from __future__ import annotations

import threading
import time
from typing import Any

NamedTensors = list  # [(hf_parameter_name, tensor), ...]


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


class WeightsTimeout(TimeoutError):
    """No weights of the required version arrived within the deadline."""


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


class _WeightStore:
    """Ray actor state: the newest version and a reference to its weights."""

    def __init__(self):
        self.version = 0
        self.ref_box: list = []  # [ObjectRef] (boxed so Ray passes the reference, not the value)
        self.closed = False

    def publish(self, version: int, ref_box: list) -> None:
        if version > self.version:
            self.version, self.ref_box = version, ref_box

    def latest(self) -> tuple[int, list, bool]:
        return self.version, self.ref_box, self.closed

    def close(self) -> None:
        self.closed = True


class RayWeightChannel:
    """Handle to the store actor; picklable, so actors receive it as an argument."""

    def __init__(self, actor_options: dict | None = None):
        import ray

        options = {"num_cpus": 0, **(actor_options or {})}
        self._store = ray.remote(_WeightStore).options(**options).remote()

    def publish(self, version: int, weights: Any) -> None:
        """``weights``: an ObjectRef to ``FlatWeights`` (preferred: put where the weights are) or
        the NamedTensors themselves."""
        import ray

        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(FlatWeights(weights))
        ray.get(self._store.publish.remote(version, [ref]))

    def latest_version(self) -> int:
        import ray

        return ray.get(self._store.latest.remote())[0]

    def is_closed(self) -> bool:
        import ray

        return ray.get(self._store.latest.remote())[2]

    def fetch(self, min_version: int, timeout: float) -> tuple[int, NamedTensors | None]:
        """Newest (version, weights) once version >= ``min_version``; version 0 means the initial weights."""
        import ray

        deadline = time.monotonic() + timeout
        while True:
            version, box, closed = ray.get(self._store.latest.remote())
            if version >= min_version:
                if not box:
                    return version, None
                return version, ray.get(box[0], timeout=max(1.0, deadline - time.monotonic())).tensors()
            if closed or time.monotonic() > deadline:
                raise WeightsTimeout(
                    f"waited {timeout:.0f}s for policy version {min_version}, newest published is {version}; "
                    "is the learner alive? (raise run.weights_timeout_s for very slow steps)"
                )
            time.sleep(0.02)

    def close(self) -> None:
        import ray

        ray.get(self._store.close.remote())


class LocalWeightChannel:
    """The same channel inside one process."""

    def __init__(self):
        self._newest = NewestWeights()

    def publish(self, version: int, weights: NamedTensors) -> None:
        self._newest.offer(version, weights)

    def latest_version(self) -> int:
        return self._newest.version

    def is_closed(self) -> bool:
        return self._newest.closed

    def fetch(self, min_version: int, timeout: float) -> tuple[int, NamedTensors | None]:
        got = self._newest.wait(min_version, timeout)
        if got is None:
            raise WeightsTimeout(
                f"waited {timeout:.0f}s for policy version {min_version}, newest published is {self._newest.version}"
            )
        return got

    def close(self) -> None:
        self._newest.end()


def build_weight_channel(backend: str) -> Any:
    """``"ray"`` or ``"local"``."""
    if backend == "ray":
        return RayWeightChannel()
    if backend == "local":
        return LocalWeightChannel()
    raise ValueError(f"unknown weight channel backend {backend!r}; use 'ray' or 'local'")
