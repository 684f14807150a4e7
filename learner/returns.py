"""From task rewards to the rewards the advantage estimators see.

Order of operations (each optional step is a switch in ``algorithm``):
  1. sequence rewards, on the driver over the whole batch (``[N]``): the truncation penalty
     (EOS trick) or its soft ramp, running normalisation, batch whitening (optionally
     keeping the mean);
  2. per-token rewards, on the rank that holds the tokens (``[n, T]``): the sequence reward
     on the last real token, ``- beta * KL_t`` on every token when the KL is placed in the
     reward;
  3. advantages by the method's estimator (``learner/estimators.py``), then optional
     advantage whitening over the whole batch (moments summed over the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from learner.algorithms import (
    kl_reward_shaping,
    normalise_rewards,
    soft_overlong_penalty,
    truncation_penalty,
    update_running_moments,
    whiten,
)
from learner.config import AlgorithmConfig


@dataclass
class RewardStats:
    """Running moments of the task reward, for ``normalise_rewards``."""

    count: Tensor = field(default_factory=lambda: torch.tensor(0.0))
    mean: Tensor = field(default_factory=lambda: torch.tensor(0.0))
    var: Tensor = field(default_factory=lambda: torch.tensor(1.0))


def penalised_rewards(
    rewards: Tensor, truncated: Tensor, lengths: Tensor, algorithm: AlgorithmConfig, max_tokens: int
) -> Tensor:
    """``[N]`` rewards after the per-sequence penalties alone (the EOS trick, the soft overlong ramp):
    what each sequence scores before any batch statistic, so what decides whether a group's completions
    differ at all (dynamic sampling, ``zero_variance_frac``)."""
    r = rewards.float()
    if algorithm.shaping.truncation_penalty is not None:
        r = truncation_penalty(r, truncated, algorithm.shaping.truncation_penalty)
    if algorithm.shaping.soft_overlong:
        soft = algorithm.shaping.soft_overlong
        r = soft_overlong_penalty(r, lengths.float(), max_tokens, soft.cache_len, soft.factor)
    return r


def shape_sequence_rewards(
    rewards: Tensor,
    truncated: Tensor,
    lengths: Tensor,
    algorithm: AlgorithmConfig,
    max_tokens: int,
    stats: RewardStats,
) -> Tensor:
    """Step 1: ``[N]`` rewards after the EOS trick, normalisation and whitening (updates ``stats``).

    ``truncated`` ``[N]`` bool: cut at ``max_tokens``; ``lengths`` ``[N]``: completion tokens, trained or not
    (a truncated completion whose tokens are masked out still has its length, and its penalty).
    """
    r = penalised_rewards(rewards, truncated, lengths, algorithm, max_tokens)
    if algorithm.shaping.normalise_rewards:
        stats.count, stats.mean, stats.var = update_running_moments(stats.count, stats.mean, stats.var, r)
        r = normalise_rewards(r, stats.mean, stats.var)
    if algorithm.shaping.whiten_rewards != "none":
        r = whiten(r, torch.ones_like(r), shift_mean=algorithm.shaping.whiten_rewards == "whiten")
    return r


def token_rewards(
    sequence_rewards: Tensor, kl: Tensor | None, mask: Tensor, kl_beta: float, completion: Tensor | None = None
) -> Tensor:
    """Step 2: ``[n, T]`` per-token rewards, ``r_t = -beta KL_t`` on trained tokens (``mask``; ``kl`` given
    only when the KL is in the reward) plus the sequence reward on the last token of the completion
    (``completion``, default ``mask``): a completion that trains no token keeps its reward."""
    kl = kl if kl is not None else torch.zeros_like(mask)
    return kl_reward_shaping(sequence_rewards, kl, mask, kl_beta, completion)
