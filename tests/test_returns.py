"""The batch-level advantage step (learner/returns.py) and the method registry, by hand."""

from __future__ import annotations

import pytest
import torch

from launch.config import load_config
from learner.batch import MiniBatch, PaddedBatch
from learner.methods import METHODS, build_objective, get_method
from learner.returns import RewardStats, ScoredBatch, compute_advantages, shape_sequence_rewards

REQUIRED = ["model.path=m", "data.prompts=p", "reward.function=r"]


def algo(*overrides: str) -> dict:
    return load_config(None, REQUIRED + list(overrides)).algorithm.model_dump()


def batch(rewards, lengths, group_size=2, truncated=None, T=None) -> ScoredBatch:
    T = T or max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    return ScoredBatch(
        rewards=torch.tensor(rewards, dtype=torch.float),
        mask=mask,
        truncated=torch.tensor(truncated or [False] * len(rewards)),
        group_size=group_size,
    )


def test_truncation_penalty_replaces_the_score_of_cut_responses():
    b = batch([1.0, 0.5, 0.25, 0.0], [2, 4, 4, 1], truncated=[False, True, False, True])
    r = shape_sequence_rewards(b, algo("algorithm.truncation_penalty=-1"), max_tokens=4, stats=RewardStats())
    assert r.tolist() == [1.0, -1.0, 0.25, -1.0]


def test_soft_overlong_ramps_over_the_last_tokens():
    # max 4 tokens, ramp over the last 2: lengths 2 -> 0, 3 -> -0.5, 4 -> -1 (times factor 1)
    b = batch([1.0, 1.0, 1.0], [2, 3, 4], group_size=3)
    cfg = algo("rollout.max_tokens=4", "algorithm.soft_overlong={cache_len: 2, factor: 1.0}")
    r = shape_sequence_rewards(b, cfg, max_tokens=4, stats=RewardStats())
    assert r.tolist() == pytest.approx([1.0, 0.5, 0.0])


def test_reward_whitening_variants_and_running_normalisation():
    b = batch([1.0, 3.0], [1, 1])  # mean 2, population std 1
    assert shape_sequence_rewards(b, algo("algorithm.whiten_rewards=whiten"), 4, RewardStats()).tolist() == (
        pytest.approx([-1.0, 1.0], abs=1e-6)
    )
    # keep_mean: (r - 2)/1 + 2 -> 1, 3
    assert shape_sequence_rewards(b, algo("algorithm.whiten_rewards=whiten_keep_mean"), 4, RewardStats()).tolist() == (
        pytest.approx([1.0, 3.0], abs=1e-6)
    )
    stats = RewardStats()
    shape_sequence_rewards(b, algo("algorithm.normalise_rewards=true"), 4, stats)
    b2 = batch([5.0, 7.0], [1, 1])
    r = shape_sequence_rewards(b2, algo("algorithm.normalise_rewards=true"), 4, stats)
    # running over [1, 3, 5, 7]: mean 4, population var 5 -> (5 - 4)/sqrt(5), (7 - 4)/sqrt(5)
    assert r.tolist() == pytest.approx([1 / 5**0.5, 3 / 5**0.5], abs=1e-5)
    assert float(stats.count) == 4


def test_reinforce_advantage_is_return_minus_batch_mean_return():
    b = batch([1.0, 0.0, 0.5, 0.5], [2, 1, 3, 2])
    adv, returns = compute_advantages("reinforce", b, algo(), b.rewards, kl_beta=0.0)
    # gamma = 1: G_t = R on every token; baseline = mean(1, 0, .5, .5) = 0.5
    expected = torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    assert returns is None


def test_rloo_and_dr_grpo_group_baselines():
    b = batch([1.0, 0.0, 0.0, 0.0], [1, 1, 1, 1], group_size=4)
    rloo, _ = compute_advantages("rloo", b, algo(), b.rewards, 0.0)
    dr, _ = compute_advantages("dr_grpo", b, algo(), b.rewards, 0.0)
    # Dr. GRPO: r - mean = 0.75, -0.25 x3; RLOO: 1 - 0 = 1, 0 - 1/3 = -1/3 x3 = 4/3 x Dr. GRPO
    assert dr[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert rloo[:, 0].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_kl_in_reward_shapes_group_and_token_rewards():
    b = batch([1.0, 1.0], [2, 2])
    b.kl = torch.tensor([[0.5, 0.5], [0.0, 0.0]])
    cfg = algo("algorithm.kl.placement=reward", "algorithm.kl.beta=0.1")
    adv, _ = compute_advantages("dr_grpo", b, cfg, b.rewards, kl_beta=0.1)
    # sequence rewards 1 - 0.1 x (0.5 + 0.5) = 0.9 and 1.0; mean 0.95 -> -0.05, +0.05
    assert adv[:, 0].tolist() == pytest.approx([-0.05, 0.05], abs=1e-6)


def test_gae_with_the_critic_values_gives_returns_for_the_critic():
    b = batch([1.0, 0.0], [2, 1])
    b.values = torch.tensor([[0.5, 0.25], [0.5, 9.0]])  # 9.0 sits in padding and must not matter
    adv, returns = compute_advantages("gae", b, algo("algorithm.lam=1.0"), b.rewards, 0.0)
    # lambda = gamma = 1: A_t = R - V_t. Seq 0: 1 - 0.5 = 0.5, 1 - 0.25 = 0.75. Seq 1: 0 - 0.5 = -0.5.
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75], [-0.5, 0.0]]))
    torch.testing.assert_close(returns[:, 0], torch.tensor([1.0, 0.0]))  # V + A = R


def test_process_rewards_reach_tokens_at_and_before_their_step_end():
    b = batch([0.7, 0.0], [3, 1], group_size=2)
    b.step_rewards = torch.tensor([[0.2, -0.5, 1.0], [0.0, 0.0, 0.0]])
    b.step_end = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv, _ = compute_advantages("grpo_process", b, algo("algorithm.name=grpo_process"), b.rewards, 0.0)
    # 4 steps in the group: (0.2, -0.5, 1.0, 0.0), mean 0.175, population std 0.5403
    mean, std = 0.175, (((0.2 - 0.175) ** 2 + (-0.675) ** 2 + 0.825**2 + 0.175**2) / 4) ** 0.5
    n = [(x - mean) / (std + 1e-6) for x in (0.2, -0.5, 1.0, 0.0)]
    assert adv[0].tolist() == pytest.approx([n[0] + n[1] + n[2], n[1] + n[2], n[2]], abs=1e-5)
    assert adv[1, 0].item() == pytest.approx(n[3], abs=1e-5)


def test_every_method_is_registered_and_unknown_names_fail_at_config_time():
    assert set(METHODS) == {"reinforce", "rloo", "grpo", "grpo_process", "dr_grpo", "gspo", "cispo", "ppo"}
    assert get_method("ppo").needs_critic and not get_method("grpo").needs_critic
    with pytest.raises(ValueError, match="valid: reinforce, rloo"):
        get_method("a2c")
    from launch.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm.name"):
        load_config(None, REQUIRED + ["algorithm.name=a2c"])


def _padded(logp_old, adv, ref=None) -> PaddedBatch:
    mask = torch.ones_like(logp_old)
    zeros = torch.zeros_like(logp_old, dtype=torch.long)
    return PaddedBatch(zeros, zeros, zeros, zeros, mask, adv, logp_old, old_logprobs=logp_old, ref_logprobs=ref)


def test_objective_adds_the_kl_loss_term_with_the_global_normaliser():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0 - torch.log(torch.tensor(2.0)).item()]])  # l = (0, log 2)
    b = _padded(logp.detach().clone(), torch.zeros(1, 2), ref=ref)
    objective = build_objective(algo("algorithm.kl.placement=loss", "algorithm.kl.estimator=k3"))
    loss, metrics = objective(logp, b, MiniBatch([], num_tokens=4.0, num_sequences=1.0, max_len=2), kl_beta=0.5)
    # A = 0 so the policy term is 0; k3(l) = e^-l - 1 + l: 0 and 0.5 - 1 + log 2 = 0.1931
    # weights 1/4 (global token count 4): loss = 0.5 x (0 + 0.1931)/4 = 0.02414
    assert float(loss.detach()) == pytest.approx(0.5 * (0.5 - 1 + 0.6931472) / 4, abs=1e-6)
    assert float(metrics["kl_ref"]) == pytest.approx((0.5 - 1 + 0.6931472) / 2, abs=1e-6)


def test_several_updates_use_the_stored_old_policy():
    logp = torch.tensor([[0.0]], requires_grad=True)  # current log pi = 0, old = -1: ratio e = 2.718
    b = _padded(torch.tensor([[-1.0]]), torch.tensor([[1.0]]))
    loss, metrics = build_objective(algo("algorithm.tis.mode=none"))(logp, b, MiniBatch([], 1.0, 1.0, 1), kl_beta=0.0)
    # ratio e -> clipped to 1.2 with A = 1 > 0 -> loss = -1.2
    assert float(loss.detach()) == pytest.approx(-1.2)
    assert float(metrics["clip_frac_high"]) == 1.0


def test_truncated_importance_weight_multiplies_the_policy_term():
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    b = _padded(torch.tensor([[-1.0, -1.0]]), torch.tensor([[1.0, 1.0]]))  # sampler log-probs -1, -1
    loss, metrics = build_objective(algo())(logp, b, MiniBatch([], 2.0, 1.0, 2), kl_beta=0.0)
    # token 0: rho = e^(0 - -1) = 2.72 -> truncated to C = 2; PPO ratio vs old (-1) = e -> clipped 1.2
    #          -> -1.2 x 2 x 1/2 = -1.2; token 1: rho = 1, ratio 1 -> -1 x 1 x 1/2 = -0.5. Total -1.7
    assert float(loss.detach()) == pytest.approx(-1.7)
    assert float(metrics["tis_truncated_frac"]) == 0.5
    grad = torch.autograd.grad(loss, logp)[0]
    assert grad[0, 0] == 0.0 and grad[0, 1] == pytest.approx(-0.5)  # clipped token: no gradient
