"""The weight channel's config section (``weights``): how weights travel from the learner to the actors.

The placement of each role (``resources.actors``, ``resources.learner``, ...) lives with its role
(``actors/config.py``, ``learner/config.py``) and ``launch/config.py`` composes ``resources``: the
cluster code knows no roles, in its imports or its values."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cluster.channel import WEIGHT_BACKENDS
from schema import Section


class WeightsConfig(Section):
    backend: Literal[WEIGHT_BACKENDS] = Field(  # type: ignore[valid-type]
        "ray",
        description="How weights reach the actors: Ray's object store, or a torch.distributed broadcast from "
        "learner rank 0 (gloo on CPU, NCCL on GPU) in buckets, with per-actor deadlines.",
    )
    process_group: Literal["gloo", "nccl"] = Field("gloo", description="Backend of the distributed weight group.")
    push_timeout_s: float = Field(60, gt=0, description="Deadline of one distributed push; a stalled actor is named.")
    bucket_mb: int = Field(64, gt=0, description="Bucket size of a distributed push, in MiB.")
