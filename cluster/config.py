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

    def check_placement(self, shares_devices: bool, receiver_devices: int) -> None:
        """NCCL's rules for the distributed weight group, before anything starts: one device per rank of
        a communicator (``shares_devices``: the colocated schedule puts actor 0 on learner rank 0's GPU),
        and a receiver's buffers on the one device its thread sees (``receiver_devices``: an engine's
        tensor-parallel GPUs; the whole model would land on the first, outside vLLM's memory budget)."""
        if self.backend != "distributed" or self.process_group != "nccl":
            return
        fix = "set weights.backend=ray or weights.process_group=gloo"
        if shares_devices:
            raise ValueError(
                "weights.process_group = nccl with run.schedule = colocated puts learner rank 0 and actor 0 on one "
                f"GPU, which NCCL refuses ('Duplicate GPU detected'): {fix}"
            )
        if receiver_devices > 1:
            raise ValueError(
                f"weights.process_group = nccl with resources.actors.tensor_parallel = {receiver_devices} receives "
                f"the whole model on each engine's first GPU, outside vLLM's memory budget: {fix}"
            )
