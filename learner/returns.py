"""From scored trajectories to advantages: the batch-level step the learner group runs.

Order of operations (each optional step is a config switch in ``algorithm``):
  1. sequence rewards: truncation penalty (EOS trick) or its soft ramp, running
     normalisation, batch whitening (optionally keeping the mean);
  2. per-token rewards: the sequence reward on the last token, ``- beta * KL_t`` on every
     token when the KL is placed in the reward;
  3. advantages by the method's estimator (GAE, reward-to-go with a baseline, group
     baselines, process supervision), broadcast over the completion;
  4. optional advantage whitening.
Inputs are ``[N]`` or ``[N, T]`` tensors over completion tokens with their mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from learner.algorithms import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    grpo_process_advantages,
    kl_reward_shaping,
    normalise_rewards,
    reward_to_go,
    rloo_advantages,
    soft_overlong_penalty,
    truncation_penalty,
    update_running_moments,
    whiten,
)


@dataclass
class RewardStats:
    """Running moments of the task reward, for ``normalise_rewards``."""

    count: torch.Tensor = field(default_factory=lambda: torch.tensor(0.0))
    mean: torch.Tensor = field(default_factory=lambda: torch.tensor(0.0))
    var: torch.Tensor = field(default_factory=lambda: torch.tensor(1.0))


@dataclass
class ScoredBatch:
    """What the advantage step needs, as tensors over the batch's N sequences."""

    rewards: torch.Tensor  # [N] task rewards
    mask: torch.Tensor  # [N, T] completion mask
    truncated: torch.Tensor  # [N] bool: cut at max_tokens
    group_size: int
    kl: torch.Tensor | None = None  # [N, T] KL(policy || reference) estimate, for KL-in-reward
    values: torch.Tensor | None = None  # [N, T] V_old from the critic (PPO)
    step_rewards: torch.Tensor | None = None  # [N, T] process rewards at step-end tokens
    step_end: torch.Tensor | None = None  # [N, T] 1 at step-end tokens


def shape_sequence_rewards(
    batch: ScoredBatch, algorithm: dict[str, Any], max_tokens: int, stats: RewardStats
) -> torch.Tensor:
    """Step 1: ``[N]`` rewards after the EOS trick, normalisation and whitening (updates ``stats``)."""
    r = batch.rewards.float()
    if algorithm["truncation_penalty"] is not None:
        r = truncation_penalty(r, batch.truncated, algorithm["truncation_penalty"])
    if algorithm["soft_overlong"]:
        soft = algorithm["soft_overlong"]
        lengths = batch.mask.sum(-1)  # [N]
        r = soft_overlong_penalty(r, lengths, max_tokens, soft["cache_len"], soft["factor"])
    if algorithm["normalise_rewards"]:
        stats.count, stats.mean, stats.var = update_running_moments(stats.count, stats.mean, stats.var, r)
        r = normalise_rewards(r, stats.mean, stats.var)
    if algorithm["whiten_rewards"] != "none":
        ones = torch.ones_like(r)
        r = whiten(r, ones, shift_mean=algorithm["whiten_rewards"] == "whiten")
    return r


def compute_advantages(
    method: str, batch: ScoredBatch, algorithm: dict[str, Any], sequence_rewards: torch.Tensor, kl_beta: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 2-4: ``(advantages [N, T], returns [N, T] or None)``; returns only for GAE."""
    mask = batch.mask
    G, eps = batch.group_size, algorithm["advantage_eps"]
    kl = batch.kl if (algorithm["kl"]["placement"] == "reward" and batch.kl is not None) else torch.zeros_like(mask)
    beta = kl_beta if algorithm["kl"]["placement"] == "reward" else 0.0
    token_rewards = kl_reward_shaping(sequence_rewards, kl, mask, beta)  # [N, T]
    returns = None
    if method == "gae":
        advantages, returns = gae(token_rewards, batch.values, mask, algorithm["gamma"], algorithm["lam"])
    elif method == "reinforce":
        to_go = reward_to_go(token_rewards, mask, algorithm["gamma"])  # G_t
        baseline = to_go[:, 0].mean()  # b = batch mean of the sequences' returns G_0
        advantages = (to_go - baseline) * mask  # A_t = G_t - b
    elif method in ("grpo", "dr_grpo", "rloo"):
        total = (token_rewards * mask).sum(-1)  # [N] sequence reward (KL-shaped when in reward)
        fn = {
            "grpo": lambda r: grpo_advantages(r, G, eps),
            "dr_grpo": lambda r: dr_grpo_advantages(r, G),
            "rloo": lambda r: rloo_advantages(r, G),
        }[method]
        advantages = broadcast_to_tokens(fn(total), mask)
    elif method == "grpo_process":
        advantages = grpo_process_advantages(batch.step_rewards, batch.step_end, mask, G, eps)
    else:
        raise ValueError(f"unknown advantage estimator {method!r}")
    if algorithm["whiten_advantages"]:
        advantages = whiten(advantages, mask)
    return advantages, returns
