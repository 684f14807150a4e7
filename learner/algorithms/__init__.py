"""The RL math of the learner: aggregation weights, advantages, KL, policy losses, shaping.

Pure functions over torch tensors; this package imports nothing heavier than torch, so it
can be used and tested without Ray, vLLM or DeepSpeed installed.
"""

from learner.algorithms.advantages import (
    accumulate_step_rewards,
    broadcast_to_tokens,
    dr_grpo_advantages,
    gae,
    group_mean_std,
    grpo_advantages,
    grpo_process_advantages,
    masked_mean,
    masked_moments,
    normalise_rewards,
    normalise_step_rewards,
    reinforce_baseline_advantages,
    reward_to_go,
    rloo_advantages,
    step_moments,
    turn_discounts,
    update_running_moments,
    whiten,
)
from learner.algorithms.aggregation import AGGREGATIONS, check_aggregation, token_weights
from learner.algorithms.importance import tis_weights
from learner.algorithms.kl import (
    KL_ESTIMATORS,
    adaptive_kl_beta,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_reward_shaping,
)
from learner.algorithms.policy_losses import (
    POLICY_LOSSES,
    cispo_loss,
    entropy_from_logits,
    get_policy_loss,
    gspo_loss,
    ppo_clip_loss,
    value_loss,
    vanilla_pg_loss,
)
from learner.algorithms.shaping import soft_overlong_penalty, truncation_penalty

__all__ = [
    "tis_weights",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "accumulate_step_rewards",
    "adaptive_kl_beta",
    "broadcast_to_tokens",
    "check_aggregation",
    "cispo_loss",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "gae",
    "get_kl_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "group_mean_std",
    "grpo_process_advantages",
    "gspo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_reward_shaping",
    "masked_mean",
    "masked_moments",
    "normalise_rewards",
    "normalise_step_rewards",
    "ppo_clip_loss",
    "reinforce_baseline_advantages",
    "reward_to_go",
    "rloo_advantages",
    "soft_overlong_penalty",
    "step_moments",
    "turn_discounts",
    "token_weights",
    "truncation_penalty",
    "update_running_moments",
    "value_loss",
    "vanilla_pg_loss",
    "whiten",
]
