"""The cluster's config sections: where every process runs (``resources``) and how weights travel
(``weights``). Placement is separate from every algorithm parameter."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.channel import WEIGHT_BACKENDS
from queues.config import Section


class WeightsConfig(Section):
    backend: Literal[WEIGHT_BACKENDS] = Field(  # type: ignore[valid-type]
        "ray",
        description="How weights reach the actors: Ray's object store, or a torch.distributed broadcast from "
        "learner rank 0 (gloo on CPU, NCCL on GPU) in buckets, with per-actor deadlines.",
    )
    process_group: Literal["gloo", "nccl"] = Field("gloo", description="Backend of the distributed weight group.")
    push_timeout_s: float = Field(60, gt=0, description="Deadline of one distributed push; a stalled actor is named.")
    bucket_mb: int = Field(64, gt=0, description="Bucket size of a distributed push, in MiB.")


class ActorPlacement(Section):
    count: int = Field(1, gt=0, description="Number of generation actors (one vLLM engine each).")
    num_cpus: float = Field(1, ge=0, description="Ray CPUs reserved per generation actor.")
    num_gpus: float = Field(
        0, ge=0, description="Ray GPUs per generation actor; on GPU it must equal tensor_parallel (vLLM uses them all)."
    )
    tensor_parallel: int = Field(
        1, gt=0, description="vLLM tensor parallel size: the engine shards the model over this many GPUs (CPU: cores)."
    )
    custom: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per actor, e.g. {rollout_node: 1}, to pin them to nodes.",
    )
    max_restarts: int = Field(
        3, ge=0, description="Times each dead generation actor is replaced; past that the run checkpoints and stops."
    )


class LearnerPlacement(Section):
    ranks: int = Field(1, gt=0, description="Data-parallel learner ranks (one DeepSpeed process each).")
    num_cpus: float = Field(1, ge=0, description="Ray CPUs reserved per learner rank.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs per learner rank.")
    custom: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per rank, e.g. {train_node: 1}, to pin them to nodes."
    )


class CriticPlacement(Section):
    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="PPO's critic: on the learner ranks (colocated) or on its own ranks, as many as the learner's, "
        "training beside the policy (separate).",
    )
    num_cpus: float = Field(1, ge=0, description="Ray CPUs per separate critic rank.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs per separate critic rank.")
    custom: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per separate critic rank.")


class ReferencePlacement(Section):
    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="The frozen KL reference model: on every learner rank (colocated) or in its own actors (separate).",
    )
    count: int = Field(1, gt=0, description="Separate reference actors; the learner's shards are spread over them.")
    num_cpus: float = Field(1, ge=0, description="Ray CPUs per separate reference actor.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs per separate reference actor.")
    custom: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per reference actor.")


class RewardModelPlacement(Section):
    count: int = Field(1, gt=0, description="Reward model actors (used only with reward.model); calls alternate.")
    num_cpus: float = Field(1, ge=0, description="Ray CPUs per reward model actor.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs per reward model actor.")
    custom: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per reward model actor.")


class ResourcesConfig(Section):
    address: str | None = Field(None, description="Ray cluster address to join; empty starts a local Ray.")
    local_num_cpus: int | None = Field(
        None, gt=0, description="CPUs a local Ray advertises (default: this machine's cores, or what the plan needs)."
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for all actors and ranks (one bundle each)."
    )
    placement_timeout_s: float = Field(60, gt=0, description="Longest wait for the placement group to be placed.")
    actors: ActorPlacement = Field(default_factory=ActorPlacement)
    learner: LearnerPlacement = Field(default_factory=LearnerPlacement)
    critic: CriticPlacement = Field(default_factory=CriticPlacement)
    reference: ReferencePlacement = Field(default_factory=ReferencePlacement)
    reward_model: RewardModelPlacement = Field(default_factory=RewardModelPlacement)

    @model_validator(mode="after")
    def _gpus_match_tensor_parallel(self) -> ResourcesConfig:
        a = self.actors
        if a.num_gpus and a.num_gpus != a.tensor_parallel:
            raise ValueError(
                f"resources.actors.num_gpus = {a.num_gpus:g} but resources.actors.tensor_parallel = "
                f"{a.tensor_parallel}: each vLLM engine shards over all its GPUs; set them equal"
            )
        if not a.num_gpus and a.num_cpus < a.tensor_parallel:
            raise ValueError(
                f"resources.actors.tensor_parallel = {a.tensor_parallel} on CPU runs one shard per core, but "
                f"resources.actors.num_cpus = {a.num_cpus:g} reserves fewer; set num_cpus={a.tensor_parallel}"
            )
        return self
