"""Sequence-level reward shaping for responses that hit the length limit.

* ``truncation_penalty``: a truncated response (no EOS before the generation limit) gets
  a fixed score instead of whatever the verifier said about its unfinished text.
* ``soft_overlong_penalty``: DAPO's "soft overlong punishment" (Yu et al. 2025, eq. 13),
  a penalty that ramps linearly over the last ``L_cache`` tokens before ``L_max``:

      R_len(y) = 0                                     if |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
               = -1                                    if |y| > L_max

  scaled by ``penalty_factor`` and ADDED to the task reward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncation_penalty(rewards: Tensor, truncated: Tensor, penalty: float) -> Tensor:
    """Replace the reward of truncated responses with ``penalty``.

    Args:
        rewards: ``[B]`` task rewards.
        truncated: ``[B]`` bool, True where the response was cut by the length limit.
        penalty: the score a truncated response gets (e.g. 0.0 or -1.0).

    Returns:
        ``[B]`` rewards.
    """
    return torch.where(truncated.bool(), torch.full_like(rewards, penalty), rewards)  # r = penalty if truncated


def soft_overlong_penalty(
    rewards: Tensor, lengths: Tensor, max_len: int, cache_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """Add DAPO's linear overlong penalty to the rewards.

    Args:
        rewards: ``[B]`` task rewards.
        lengths: ``[B]`` completion lengths in tokens.
        max_len: L_max, where the penalty reaches ``-penalty_factor``.
        cache_len: L_cache, the width of the ramp; no penalty up to ``max_len - cache_len``.
        penalty_factor: magnitude of the full penalty.

    Returns:
        ``[B]`` rewards ``r + penalty_factor * R_len(|y|)``.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    free_len = max_len - cache_len  # L_max - L_cache
    excess = lengths.to(rewards.dtype) - free_len  # |y| - (L_max - L_cache)
    ramp = -(excess / cache_len).clamp(min=0.0, max=1.0)  # R_len = ((L_max - L_cache) - |y|) / L_cache, in [-1, 0]
    return rewards + penalty_factor * ramp
