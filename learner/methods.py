"""The policy-gradient methods Tandem carries, chosen once by ``algorithm.name``.

A ``Method`` carries its behaviour, not names: the advantage estimator it builds
(``learner/estimators.py``), the per-token policy loss the ranks minimise
(``learner/algorithms/policy_losses.py``), how token losses are averaged, its default clip
range, and what it needs (a critic, per-step rewards). Adding a method is one entry here.

| method        | advantages                         | loss      | aggregation  |
| ------------- | ---------------------------------- | --------- | ------------ |
| reinforce     | reward-to-go - batch-mean baseline | vanilla   | token_mean   |
| rloo          | leave-one-out group baseline       | ppo_clip  | token_mean   |
| grpo          | (r - mean) / (std + eps) per group | ppo_clip  | token_mean   |
| grpo_process  | per-step rewards, group-normalised | ppo_clip  | token_mean   |
| dr_grpo       | r - group mean (no std)            | ppo_clip  | fixed_length |
| gspo          | as grpo                            | gspo      | seq_mean     |
| cispo         | as grpo                            | cispo     | token_mean   |
| ppo           | GAE(gamma, lambda) with a critic   | ppo_clip  | token_mean   |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from learner.algorithms import dr_grpo_advantages, grpo_advantages, rloo_advantages
from learner.algorithms.policy_losses import PolicyLoss, cispo_loss, gspo_loss, ppo_clip_loss, vanilla_pg_loss
from learner.estimators import (
    AdvantageEstimator,
    GeneralizedAdvantage,
    GroupOutcome,
    ProcessSteps,
    ReinforceBaseline,
)

if TYPE_CHECKING:
    from learner.config import AlgorithmConfig

EstimatorFactory = Callable[["AlgorithmConfig"], AdvantageEstimator]


@dataclass(frozen=True)
class Method:
    estimator: EstimatorFactory  # builds the advantage estimator from the algorithm section
    loss: PolicyLoss  # l_t(logprobs, old_logprobs, advantages, mask, weights, **clip)
    aggregation: str  # token_mean | seq_mean | fixed_length
    clip: tuple[float, float] | None = (0.2, 0.2)  # default (eps_low, eps_high); None: the loss has no ratio clip
    dual_clip: bool = False  # the loss takes algorithm.loss.dual_clip (PPO's clipped surrogate)
    needs_critic: bool = False  # trains a value model (V_old for GAE)
    per_step_rewards: bool = False  # the reward function scores each reasoning step (process supervision)

    @property
    def kl_in_reward(self) -> bool:
        """Whether a per-token KL can be placed in the reward: per-step rewards have no last-token slot."""
        return not self.per_step_rewards


def _grpo(a: AlgorithmConfig) -> AdvantageEstimator:
    eps = a.estimator.advantage_eps
    return GroupOutcome(lambda rewards, group_size: grpo_advantages(rewards, group_size, eps))


METHODS: dict[str, Method] = {
    "reinforce": Method(
        lambda a: ReinforceBaseline(a.estimator.gamma, a.estimator.discount == "turn"),
        vanilla_pg_loss,
        "token_mean",
        clip=None,
    ),
    "rloo": Method(lambda a: GroupOutcome(rloo_advantages), ppo_clip_loss, "token_mean", dual_clip=True),
    "grpo": Method(_grpo, ppo_clip_loss, "token_mean", dual_clip=True),
    "grpo_process": Method(
        lambda a: ProcessSteps(a.estimator.advantage_eps),
        ppo_clip_loss,
        "token_mean",
        dual_clip=True,
        per_step_rewards=True,
    ),
    "dr_grpo": Method(lambda a: GroupOutcome(dr_grpo_advantages), ppo_clip_loss, "fixed_length", dual_clip=True),
    "gspo": Method(_grpo, gspo_loss, "seq_mean", clip=(3e-4, 4e-4)),
    "cispo": Method(_grpo, cispo_loss, "token_mean", clip=(1.0, 0.2)),
    "ppo": Method(
        lambda a: GeneralizedAdvantage(a.estimator.gamma, a.estimator.lam, a.estimator.discount == "turn"),
        ppo_clip_loss,
        "token_mean",
        dual_clip=True,
        needs_critic=True,
    ),
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(METHODS)}")
    return METHODS[name]
