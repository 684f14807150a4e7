"""The run's processes as placement sees them: one ``ProcessKind`` per kind of process.

The actors and the learner ranks always; PPO's critic and the KL reference model only when
the run has them and they are placed on processes of their own (colocated, they live on the
learner ranks and add no process). Each kind carries the environment its role needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from actors.environment import actor_env, reward_model_env
from cluster.placement import ProcessKind
from launch.config import TandemConfig
from learner.environment import rank_env


@dataclass(frozen=True)
class Plan:
    actors: ProcessKind
    learner: ProcessKind
    critic: ProcessKind | None  # separate critic ranks, one per learner rank
    reference: ProcessKind | None  # separate reference actors
    reward_model: ProcessKind | None = None  # the reward model's actors (reward.model)

    @property
    def kinds(self) -> list[ProcessKind]:
        kinds = (self.actors, self.learner, self.critic, self.reference, self.reward_model)
        return [k for k in kinds if k is not None]


def _kind(prefix: str, label: str, count: int, section, key: str, **extra) -> ProcessKind:
    """A kind of process whose resources are the ``resources.<key>`` section ``section``."""
    return ProcessKind(
        prefix, label, count, section.num_cpus, section.num_gpus, dict(section.custom), f"resources.{key}", **extra
    )


def build_plan(cfg: TandemConfig) -> Plan:
    res = cfg.resources
    tp = res.actors.tensor_parallel
    actors = _kind("actor", "actor", res.actors.count, res.actors, "actors", count_key="resources.actors.count",
                   note=f"vLLM tensor parallel {tp}" if tp > 1 else "")  # fmt: skip
    learner = _kind("learner", "learner rank", res.learner.ranks, res.learner, "learner",
                    count_key="resources.learner.ranks")  # fmt: skip
    separate_critic = cfg.has_critic and res.critic.placement == "separate"
    separate_reference = cfg.has_reference and res.reference.placement == "separate"
    both = separate_critic and separate_reference  # one hint names both: resources.critic/reference.placement
    critic = reference = None
    if separate_critic:  # as many critic ranks as learner ranks: they train on the same shards
        hint = "resources.critic/reference.placement" if both else "resources.critic.placement"
        critic = _kind("critic", "critic rank", res.learner.ranks, res.critic, "critic", colocate_hint=hint)
    if separate_reference:
        reference = _kind("reference", "reference actor", res.reference.count, res.reference, "reference",
                          count_key="resources.reference.count",
                          colocate_hint=None if both else "resources.reference.placement")  # fmt: skip
    reward_model = None
    if cfg.reward.model is not None:
        reward_model = _kind("reward-model", "reward model actor", res.reward_model.count, res.reward_model,
                             "reward_model", count_key="resources.reward_model.count")  # fmt: skip
    if cfg.run.schedule == "colocated":
        actors, learner = colocate(actors, learner)
    return Plan(actors, learner, critic, reference, reward_model)


def colocate(actors: ProcessKind, learner: ProcessKind) -> tuple[ProcessKind, ProcessKind]:
    """The colocated schedule: the actors go into the learner ranks' bundles (actor i into rank i's modulo
    the ranks), and every process of a shared bundle asks Ray for an equal fraction of what it uses, so
    the bundle's CPUs and GPUs are counted once: the phases take turns on them."""
    per_bundle = math.ceil(actors.count / learner.count)
    share = 1.0 / (1 + per_bundle)
    note = "shares the learner's devices, generating while the learner waits"
    return (
        replace(actors, shares=learner.prefix, share=share, note=", ".join(filter(None, [actors.note, note]))),
        replace(learner, share=share),
    )


def actor_environment(cfg: TandemConfig, index: int) -> dict[str, str]:
    return actor_env(cfg.resources.actors, index, cfg.engine)


def reward_model_environment(kind: ProcessKind) -> dict[str, str]:
    return reward_model_env(kind.num_cpus)


def rank_environment(kind: ProcessKind) -> dict[str, str]:
    return rank_env(kind.num_cpus, kind.num_gpus)
