"""Advantage estimators: hand-computed values, loop references, padding invariance."""

import math
import statistics

import numpy as np
import pytest
import torch

from learner.algorithms.advantages import (
    accumulate_step_rewards,
    broadcast_to_tokens,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    grpo_process_advantages,
    normalise_rewards,
    reinforce_baseline_advantages,
    reward_to_go,
    rloo_advantages,
    update_running_moments,
    whiten,
)

D = torch.float64


def _right_padded_mask(lengths, length):
    return (torch.arange(length) < torch.tensor(lengths)[:, None]).to(D)


# --------------------------------------------------------------------------- GAE


def test_gae_two_sequences_by_hand():
    rewards = torch.tensor([[1.0, 2, 3], [2, 1, 0]], dtype=D)
    values = torch.tensor([[3.0, 4, 2], [2, 2, 0]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=D)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.95)
    # gamma * lam = 0.855
    # seq 0: t=2: delta = 3 + 0.9*0 - 2 = 1                 A2 = 1
    #        t=1: delta = 2 + 0.9*2 - 4 = -0.2              A1 = -0.2 + 0.855*1 = 0.655
    #        t=0: delta = 1 + 0.9*4 - 3 = 1.6               A0 = 1.6 + 0.855*0.655 = 2.160025
    # seq 1: t=2 is padding                                  A2 = 0
    #        t=1: delta = 1 + 0.9*0 - 2 = -1 (V=0 past end)  A1 = -1
    #        t=0: delta = 2 + 0.9*2 - 2 = 1.8               A0 = 1.8 + 0.855*(-1) = 0.945
    expected_adv = torch.tensor([[2.160025, 0.655, 1.0], [0.945, -1.0, 0.0]], dtype=D)
    # returns = V + A: [3+2.160025, 4+0.655, 2+1] and [2+0.945, 2-1, pad 0]
    expected_ret = torch.tensor([[5.160025, 4.655, 3.0], [2.945, 1.0, 0.0]], dtype=D)
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


def test_gae_ignores_garbage_in_padding():
    rewards = torch.tensor([[1.0, 2, 3], [2, 1, float("nan")]], dtype=D)
    values = torch.tensor([[3.0, 4, 2], [2, 2, 1e9]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=D)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.95)
    torch.testing.assert_close(adv[1], torch.tensor([0.945, -1.0, 0.0], dtype=D))
    torch.testing.assert_close(ret[1], torch.tensor([2.945, 1.0, 0.0], dtype=D))
    # more padding columns do not change anything either
    wide = [torch.cat([x, torch.full((2, 4), 7.0, dtype=D)], 1) for x in (rewards, values)]
    adv_w, _ = gae(wide[0], wide[1], torch.cat([mask, torch.zeros(2, 4, dtype=D)], 1), 0.9, 0.95)
    torch.testing.assert_close(adv_w[:, :3], adv)


def _gae_loop(rewards, values, lengths, gamma, lam):
    adv = [[0.0] * len(r) for r in rewards]
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            next_v = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    return adv


def test_gae_vectorised_equals_python_loop():
    torch.manual_seed(1)
    lengths = [5, 1, 8, 3]
    rewards, values = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    mask = _right_padded_mask(lengths, 8)
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    expected = torch.tensor(_gae_loop(rewards.tolist(), values.tolist(), lengths, 0.97, 0.9), dtype=D)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (values + expected) * mask)


def test_gae_with_lambda_one_and_zero_values_is_reward_to_go():
    # lam = 1, V = 0: A_t = sum_k gamma^k delta_{t+k} = sum_k gamma^k r_{t+k}
    torch.manual_seed(2)
    mask = _right_padded_mask([4, 6, 2], 6)
    rewards = torch.randn(3, 6, dtype=D)
    adv, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=0.8, lam=1.0)
    torch.testing.assert_close(adv, reward_to_go(rewards, mask, gamma=0.8))


# --------------------------------------------------------------------------- reward-to-go


def test_reward_to_go_by_hand():
    rewards = torch.tensor([[1.0, 2, 3], [4, 5, 99]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=D)
    got = reward_to_go(rewards, mask, gamma=0.5)
    # seq 0: G2 = 3, G1 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75
    # seq 1: padding 99 ignored: G1 = 5, G0 = 4 + 0.5*5 = 6.5
    torch.testing.assert_close(got, torch.tensor([[2.75, 3.5, 3.0], [6.5, 5.0, 0.0]], dtype=D))


def test_reward_to_go_vectorised_equals_python_loop():
    torch.manual_seed(3)
    lengths = [7, 2, 4]
    rewards = torch.randn(3, 7, dtype=D)
    got = reward_to_go(rewards, _right_padded_mask(lengths, 7), gamma=0.9)
    expected = torch.zeros(3, 7, dtype=D)
    for b, n in enumerate(lengths):
        for t in range(n):
            expected[b, t] = sum(0.9 ** (k - t) * rewards[b, k].item() for k in range(t, n))
    torch.testing.assert_close(got, expected)


# --------------------------------------------------------------------------- group advantages


def test_grpo_uses_population_std():
    rewards = torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2], dtype=D)
    adv = grpo_advantages(rewards, group_size=4, eps=1e-12)
    # group 0: mean 0.25, pop var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875, std = 0.4330127
    #   A = 0.75 / 0.4330127 = sqrt(3), -0.25 / 0.4330127 = -1/sqrt(3)
    #   (the sample std would be 0.5 and give 1.5)
    # group 1: all equal -> 0 / (0 + eps) = 0
    s3 = math.sqrt(3.0)
    expected = torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3, 0, 0, 0, 0], dtype=D)
    torch.testing.assert_close(adv, expected)


def test_dr_grpo_and_rloo_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 0], dtype=D)
    # Dr. GRPO: r - 0.25
    torch.testing.assert_close(dr_grpo_advantages(rewards, 4), torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=D))
    # RLOO: 1 - mean(0,0,0) = 1; 0 - mean(1,0,0) = -1/3
    torch.testing.assert_close(rloo_advantages(rewards, 4), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=D))


@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_rloo_is_rescaled_dr_grpo(group_size):
    torch.manual_seed(group_size)
    rewards = torch.randn(5 * group_size, dtype=D)
    # A_rloo = r - (S - r)/(G-1) = (G r - S)/(G-1) = G/(G-1) (r - S/G)
    torch.testing.assert_close(
        rloo_advantages(rewards, group_size), group_size / (group_size - 1) * dr_grpo_advantages(rewards, group_size)
    )


def test_group_advantages_equal_python_loop():
    torch.manual_seed(4)
    group_size = 5
    rewards = torch.randn(4 * group_size, dtype=D)
    grpo, dr, rloo = (
        grpo_advantages(rewards, group_size),
        dr_grpo_advantages(rewards, group_size),
        rloo_advantages(rewards, group_size),
    )
    values = rewards.tolist()
    for g in range(4):
        group = values[g * group_size : (g + 1) * group_size]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        for j, r in enumerate(group):
            i = g * group_size + j
            assert grpo[i].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-9)
            assert dr[i].item() == pytest.approx(r - mean, rel=1e-9, abs=1e-12)
            others = group[:j] + group[j + 1 :]
            assert rloo[i].item() == pytest.approx(r - sum(others) / len(others), rel=1e-9, abs=1e-12)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.zeros(4), 1)


def test_reinforce_baseline_and_broadcast():
    adv = reinforce_baseline_advantages(torch.tensor([1.0, 0.5]), 0.25)
    torch.testing.assert_close(adv, torch.tensor([0.75, 0.25]))  # r - b
    tokens = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    torch.testing.assert_close(tokens, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


# --------------------------------------------------------------------------- process supervision


def test_process_rewards_accumulate_to_later_steps():
    # one sequence, three 2-token steps ending at t = 1, 3, 5 with rewards 0.2, -0.5, 1.0;
    # slots 6, 7 are padding holding garbage (even a fake step end)
    step_rewards = torch.tensor([[0.0, 0.2, 0, -0.5, 0, 1.0, 0, 123.0]], dtype=D)
    step_end = torch.tensor([[0.0, 1, 0, 1, 0, 1, 0, 1]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1, 0, 0]], dtype=D)
    # step 1 tokens: 0.2 - 0.5 + 1.0 = 0.7; step 2 tokens: -0.5 + 1.0 = 0.5; step 3 tokens: 1.0
    expected = torch.tensor([[0.7, 0.7, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(accumulate_step_rewards(step_rewards, step_end, mask), expected)
    got = grpo_process_advantages(step_rewards, step_end, mask, group_size=1, normalise=False)
    torch.testing.assert_close(got, expected)


def test_process_rewards_normalised_over_all_steps_of_the_group():
    # group of 2 sequences, T = 4
    # seq A: steps end at t=1 (r=1) and t=3 (r=0); seq B: steps end at t=0 (r=0) and t=3 (r=1)
    step_rewards = torch.tensor([[0.0, 1, 0, 0], [0, 0, 0, 1]], dtype=D)
    step_end = torch.tensor([[0.0, 1, 0, 1], [1, 0, 0, 1]], dtype=D)
    mask = torch.ones(2, 4, dtype=D)
    got = grpo_process_advantages(step_rewards, step_end, mask, group_size=2, eps=1e-12)
    # all 4 step rewards {1, 0, 0, 1}: mean 0.5, pop std 0.5 -> normalised {+1, -1, -1, +1}
    # seq A: t0,t1 -> +1 - 1 = 0; t2,t3 -> -1
    # seq B: t0 -> -1 + 1 = 0;    t1..t3 -> +1
    expected = torch.tensor([[0.0, 0, -1, -1], [0, 1, 1, 1]], dtype=D)
    torch.testing.assert_close(got, expected)


# --------------------------------------------------------------------------- whitening, running moments


def test_whiten_by_hand_ignores_padding():
    x = torch.tensor([[1.0, 2, 3, float("nan")]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1, 0]], dtype=D)
    # mean 2, pop var (1 + 0 + 1)/3 = 2/3 -> (x - 2) / sqrt(2/3) = (x - 2) * 1.2247449
    k = math.sqrt(1.5)
    torch.testing.assert_close(whiten(x, mask, eps=0.0), torch.tensor([[-k, 0, k, 0]], dtype=D))
    # shift_mean=False adds the mean back: [2 - k, 2, 2 + k]
    torch.testing.assert_close(
        whiten(x, mask, shift_mean=False, eps=0.0), torch.tensor([[2 - k, 2, 2 + k, 0]], dtype=D)
    )


def test_running_moments_by_hand():
    count, mean, var = update_running_moments(0, 0.0, 1.0, torch.tensor([1.0, 2, 3], dtype=D))
    count, mean, var = update_running_moments(count, mean, var, torch.tensor([5.0], dtype=D))
    # data 1,2,3,5: mean 11/4 = 2.75
    # var = (1.75^2 + 0.75^2 + 0.25^2 + 2.25^2) / 4 = (3.0625 + 0.5625 + 0.0625 + 5.0625) / 4 = 2.1875
    assert count.item() == 4
    assert mean.item() == pytest.approx(2.75)
    assert var.item() == pytest.approx(2.1875)


def test_running_moments_equal_statistics_of_concatenated_data():
    torch.manual_seed(5)
    batches = [torch.randn(n, dtype=D) * 3 + 1 for n in (7, 1, 30, 12)]
    count, mean, var = torch.tensor(0.0, dtype=D), torch.tensor(0.0, dtype=D), torch.tensor(1.0, dtype=D)
    for batch in batches:
        count, mean, var = update_running_moments(count, mean, var, batch)
    everything = torch.cat(batches)
    assert count.item() == 50
    torch.testing.assert_close(mean, everything.mean())
    torch.testing.assert_close(var, everything.var(unbiased=False))
    assert var.item() == pytest.approx(float(np.var(everything.numpy())), rel=1e-12)


def test_normalise_rewards_by_hand():
    # (r - mean) / sqrt(var): (3 - 1)/2 = 1, (-1 - 1)/2 = -1
    got = normalise_rewards(torch.tensor([3.0, -1.0]), torch.tensor(1.0), torch.tensor(4.0), eps=0.0)
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0]))
