"""Truncation and soft overlong penalties."""

import pytest
import torch

from learner.algorithms.shaping import soft_overlong_penalty, truncation_penalty


def test_truncation_penalty_replaces_truncated_scores():
    rewards = torch.tensor([1.0, 0.5, 0.0])
    truncated = torch.tensor([False, True, True])
    # truncated responses get the penalty whatever the verifier said
    torch.testing.assert_close(truncation_penalty(rewards, truncated, -1.0), torch.tensor([1.0, -1.0, -1.0]))


def test_soft_overlong_penalty_ramps_linearly():
    rewards = torch.ones(6)
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # L_max = 20, L_cache = 4: free up to 16, then (16 - |y|)/4, -1 from 20 on
    # |y| = 10, 16 -> 0 ; 17 -> -0.25 ; 18 -> -0.5 ; 20 -> -1 ; 25 -> -1
    got = soft_overlong_penalty(rewards, lengths, max_len=20, cache_len=4, penalty_factor=1.0)
    torch.testing.assert_close(got, torch.tensor([1.0, 1.0, 0.75, 0.5, 0.0, 0.0]))
    # penalty_factor 0.5 halves the penalty: 1 + 0.5 * [0, 0, -0.25, -0.5, -1, -1]
    got = soft_overlong_penalty(rewards, lengths, max_len=20, cache_len=4, penalty_factor=0.5)
    torch.testing.assert_close(got, torch.tensor([1.0, 1.0, 0.875, 0.75, 0.5, 0.5]))


def test_soft_overlong_penalty_rejects_bad_cache():
    with pytest.raises(ValueError, match="cache_len"):
        soft_overlong_penalty(torch.ones(1), torch.ones(1), max_len=10, cache_len=0)
