"""The weight channel: learner rank 0 publishes versioned weights, every generation actor receives them.

One small interface, a transport behind each backend, one factory:

    publisher = open_weight_publisher(weights_config, receivers=n, ...)   # on learner rank 0
    handles = publisher.receivers(["actor-0", ...])                       # picklable, one per actor
    publisher.publish(version, named_tensors)  ...  publisher.close()
    handle.fetch(min_version, timeout) -> (version, named_tensors)        # inside the actor

- ``ray``: the weights are a Ray object put by rank 0; a small async store actor holds the
  newest version's reference and wakes waiting actors (``cluster/weights.py``).
- ``distributed``: rank 0 broadcasts over its own torch.distributed group in buckets, with a
  deadline per push that names a dead or stalled receiver (``cluster/dist_channel.py``).
- in-process (``cluster.weights.LocalWeightChannel``): both sides in one process, for tests.

Every wait has a deadline: ``fetch`` returns the newest weights once their version reaches
``min_version``, raises ``WeightsTimeout`` when the deadline passes first, ``ChannelClosed``
when the publisher closed the channel first, and ``ChannelFailed`` at once when the channel
has broken (both are ``WeightsTimeout``s, so a caller that only waits need not tell them apart).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cluster.config import WeightsConfig

NamedTensors = list  # [(hf_parameter_name, tensor), ...]


class WeightsTimeout(TimeoutError):
    """No weights of the required version arrived within the deadline."""


class ChannelClosed(WeightsTimeout):
    """The publisher closed the channel before the required version arrived."""


class ChannelFailed(WeightsTimeout):
    """The channel broke (a failed push, a lost publisher): no version will arrive; the message says why."""


class WeightReceiver(Protocol):
    """An actor's end of the channel."""

    def latest_version(self) -> int:
        """The newest version published so far (0: the initial weights)."""

    def fetch(self, min_version: int, timeout: float) -> tuple[int, NamedTensors | None]:
        """The newest (version, weights) once version >= ``min_version`` (weights None at version 0)."""

    def is_closed(self) -> bool: ...

    def close(self) -> None: ...


class WeightPublisher(Protocol):
    """Learner rank 0's end of the channel."""

    device: str  # where ``publish`` wants the tensors: "cpu", or "cuda" (an NCCL group sends from the GPU)

    def publish(self, version: int, weights: NamedTensors) -> None:
        """Send ``weights`` as ``version`` (an older or equal version is ignored); raises on a missed deadline."""

    def receivers(self, names: list[str]) -> list[WeightReceiver]:
        """One picklable receiver per actor, in order, to hand to the actors."""

    def close(self) -> None:
        """No more versions: waiting receivers wake with ``ChannelClosed``."""


def _open_ray(config: WeightsConfig, receivers: int, connect_timeout_s: float) -> WeightPublisher:
    from cluster.placement import on_this_node
    from cluster.weights import RayWeightChannel

    return RayWeightChannel(on_this_node())  # on learner rank 0's node: it goes only with its publisher


def _open_distributed(config: WeightsConfig, receivers: int, connect_timeout_s: float) -> WeightPublisher:
    from cluster.dist_channel import DistPublisher, node_address

    return DistPublisher(
        node_address(),
        0,
        receivers + 1,
        config.push_timeout_s,
        connect_timeout_s=connect_timeout_s,
        bucket_bytes=config.bucket_mb << 20,
        backend=config.process_group,
    )


_OPENERS = {"ray": _open_ray, "distributed": _open_distributed}
WEIGHT_BACKENDS = tuple(_OPENERS)  # the choices of weights.backend
# Why a backend cannot take a new receiver once open (a replacement for a dead actor), by backend
_FIXED_MEMBERS = {"distributed": "the distributed weight channel is one process group and cannot take a new actor"}


def replacement_refused(config: WeightsConfig) -> str | None:
    """Why a dead actor cannot be replaced on this weight channel, or None when it can."""
    return _FIXED_MEMBERS.get(config.backend)


def open_weight_publisher(config: WeightsConfig, receivers: int, connect_timeout_s: float) -> WeightPublisher:
    """The publisher of ``config.backend`` for ``receivers`` actors, opened in the calling process
    (learner rank 0: the distributed backend binds its store there)."""
    return _OPENERS[config.backend](config, receivers, connect_timeout_s)
