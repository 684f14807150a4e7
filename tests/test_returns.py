"""From rewards to advantages, by hand: sequence shaping on the driver, the methods' estimators
in their three halves (summarise on the ranks, reduce over the batch, expand on the ranks), the
method registry, and the objective a rank minimises."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from launch.config import load_config
from learner.algorithms import masked_moments, whiten
from learner.config import AlgorithmConfig
from learner.estimators import TokenRewards
from learner.methods import METHODS, get_method
from learner.objective import build_objective
from learner.rank_batch import CompletionView
from learner.returns import RewardStats, shape_sequence_rewards, token_rewards
from learner.shard import Normaliser

REQUIRED = ["model.path=m", "data.prompts=p", "reward.function=r"]


def algo(*overrides: str) -> AlgorithmConfig:
    return load_config(None, REQUIRED + list(overrides)).algorithm


@dataclass
class Batch:
    """A batch as the hand-computed tests write it: [N] rewards, an [N, T] mask and optional extras."""

    rewards: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    group_size: int
    kl: torch.Tensor | None = None  # [N, T] KL_t, for KL-in-reward
    values: torch.Tensor | None = None  # [N, T] V_old
    step_rewards: torch.Tensor | None = None
    step_end: torch.Tensor | None = None
    completion: torch.Tensor | None = None  # [N, T] every completion token (None: the mask)


def batch(rewards, lengths, group_size=2, truncated=None, T=None) -> Batch:
    T = T or max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    return Batch(
        torch.tensor(rewards, dtype=torch.float), mask, torch.tensor(truncated or [False] * len(rewards)), group_size
    )


def shape(b: Batch, cfg: AlgorithmConfig, max_tokens: int, stats: RewardStats) -> torch.Tensor:
    return shape_sequence_rewards(b.rewards, b.truncated, b.mask.sum(-1), cfg, max_tokens, stats)


def _rows(t: TokenRewards, rows: list[int]) -> TokenRewards:
    pick = lambda x: None if x is None else x[rows]  # noqa: E731
    return TokenRewards(
        t.rewards[rows], t.mask[rows], pick(t.values), pick(t.step_rewards), pick(t.step_end), pick(t.completion)
    )


def estimate(cfg: AlgorithmConfig, b: Batch, kl_beta: float = 0.0, ranks: list[list[int]] | None = None):
    """The product's path: token rewards and ``summarise`` on each rank (``ranks``: the rows each
    holds, in its own order), ``reduce`` over the whole batch, ``expand`` on each rank; the
    ranks' advantages are put back in batch order. Returns ``(A [N, T], returns or None)``."""
    estimator = cfg.method.estimator(cfg)
    N = b.mask.shape[0]
    kl = b.kl if cfg.kl.in_reward else None
    rewards = token_rewards(b.rewards, kl, b.mask, kl_beta if cfg.kl.in_reward else 0.0, b.completion)
    tokens = TokenRewards(rewards, b.mask, b.values, b.step_rewards, b.step_end, b.completion)
    ranks = ranks or [list(range(N))]
    gathered: dict[str, torch.Tensor] = {}
    for rows in ranks:
        for name, value in estimator.summarise(_rows(tokens, rows)).items():
            gathered.setdefault(name, torch.zeros(N))[rows] = value
    reduced = estimator.reduce(gathered, b.group_size)
    advantages, returns = torch.zeros_like(b.mask), None
    for rows in ranks:
        a, r = estimator.expand(_rows(tokens, rows), {k: v[rows] for k, v in reduced.items()})
        advantages[rows] = a
        if r is not None:
            returns = torch.zeros_like(b.mask) if returns is None else returns
            returns[rows] = r
    return advantages, returns


def test_truncation_penalty_replaces_the_score_of_cut_responses():
    b = batch([1.0, 0.5, 0.25, 0.0], [2, 4, 4, 1], truncated=[False, True, False, True])
    r = shape(b, algo("algorithm.shaping.truncation_penalty=-1"), max_tokens=4, stats=RewardStats())
    assert r.tolist() == [1.0, -1.0, 0.25, -1.0]


def test_soft_overlong_ramps_over_the_last_tokens():
    # max 4 tokens, ramp over the last 2: lengths 2 -> 0, 3 -> -0.5, 4 -> -1 (times factor 1)
    b = batch([1.0, 1.0, 1.0], [2, 3, 4], group_size=3)
    cfg = algo("rollout.max_tokens=4", "algorithm.shaping.soft_overlong={cache_len: 2, factor: 1.0}")
    r = shape(b, cfg, max_tokens=4, stats=RewardStats())
    assert r.tolist() == pytest.approx([1.0, 0.5, 0.0])


def test_reward_whitening_variants_and_running_normalisation():
    b = batch([1.0, 3.0], [1, 1])  # mean 2, population std 1
    assert shape(b, algo("algorithm.shaping.whiten_rewards=whiten"), 4, RewardStats()).tolist() == (
        pytest.approx([-1.0, 1.0], abs=1e-6)
    )
    # keep_mean: (r - 2)/1 + 2 -> 1, 3
    assert shape(b, algo("algorithm.shaping.whiten_rewards=whiten_keep_mean"), 4, RewardStats()).tolist() == (
        pytest.approx([1.0, 3.0], abs=1e-6)
    )
    stats = RewardStats()
    shape(b, algo("algorithm.shaping.normalise_rewards=true"), 4, stats)
    b2 = batch([5.0, 7.0], [1, 1])
    r = shape(b2, algo("algorithm.shaping.normalise_rewards=true"), 4, stats)
    # running over [1, 3, 5, 7]: mean 4, population var 5 -> (5 - 4)/sqrt(5), (7 - 4)/sqrt(5)
    assert r.tolist() == pytest.approx([1 / 5**0.5, 3 / 5**0.5], abs=1e-5)
    assert float(stats.count) == 4


def test_reinforce_advantage_is_return_minus_batch_mean_return():
    b = batch([1.0, 0.0, 0.5, 0.5], [2, 1, 3, 2])
    adv, returns = estimate(algo("algorithm.name=reinforce"), b)
    # gamma = 1: G_t = R on every token; baseline = mean(1, 0, .5, .5) = 0.5
    expected = torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    assert returns is None


def test_rloo_and_dr_grpo_group_baselines():
    b = batch([1.0, 0.0, 0.0, 0.0], [1, 1, 1, 1], group_size=4)
    rloo, _ = estimate(algo("algorithm.name=rloo"), b)
    dr, _ = estimate(algo("algorithm.name=dr_grpo"), b)
    # Dr. GRPO: r - mean = 0.75, -0.25 x3; RLOO: 1 - 0 = 1, 0 - 1/3 = -1/3 x3 = 4/3 x Dr. GRPO
    assert dr[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert rloo[:, 0].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_kl_in_reward_shapes_group_and_token_rewards():
    b = batch([1.0, 1.0], [2, 2])
    b.kl = torch.tensor([[0.5, 0.5], [0.0, 0.0]])
    cfg = algo("algorithm.name=dr_grpo", "algorithm.kl.placement=reward", "algorithm.kl.beta=0.1")
    adv, _ = estimate(cfg, b, kl_beta=0.1)
    # sequence rewards 1 - 0.1 x (0.5 + 0.5) = 0.9 and 1.0; mean 0.95 -> -0.05, +0.05
    assert adv[:, 0].tolist() == pytest.approx([-0.05, 0.05], abs=1e-6)


def test_gae_with_the_critic_values_gives_returns_for_the_critic():
    b = batch([1.0, 0.0], [2, 1])
    b.values = torch.tensor([[0.5, 0.25], [0.5, 9.0]])  # 9.0 sits in padding and must not matter
    adv, returns = estimate(algo("algorithm.name=ppo", "algorithm.estimator.lam=1.0"), b)
    # lambda = gamma = 1: A_t = R - V_t. Seq 0: 1 - 0.5 = 0.5, 1 - 0.25 = 0.75. Seq 1: 0 - 0.5 = -0.5.
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75], [-0.5, 0.0]]))
    torch.testing.assert_close(returns[:, 0], torch.tensor([1.0, 0.0]))  # V + A = R


def test_process_rewards_reach_tokens_at_and_before_their_step_end():
    b = batch([0.7, 0.0], [3, 1], group_size=2)
    b.step_rewards = torch.tensor([[0.2, -0.5, 1.0], [0.0, 0.0, 0.0]])
    b.step_end = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv, _ = estimate(algo("algorithm.name=grpo_process"), b)
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


def _view(old, adv, ref=None, sampler=None) -> CompletionView:
    """One micro-batch's completion tensors: sampler log-probs default to the old ones."""
    sampler = old if sampler is None else sampler
    return CompletionView(torch.ones_like(old), sampler, adv, old_logprobs=old, ref_logprobs=ref)


def test_objective_adds_the_kl_loss_term_with_the_global_normaliser():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0 - torch.log(torch.tensor(2.0)).item()]])  # l = (0, log 2)
    b = _view(logp.detach().clone(), torch.zeros(1, 2), ref=ref)
    objective = build_objective(algo("algorithm.kl.placement=loss", "algorithm.kl.estimator=k3"), max_tokens=2)
    loss, metrics = objective(logp, b, Normaliser(num_tokens=4.0, num_sequences=1.0), kl_beta=0.5)
    # A = 0 so the policy term is 0; k3(l) = e^-l - 1 + l: 0 and 0.5 - 1 + log 2 = 0.1931
    # weights 1/4 (global token count 4): loss = 0.5 x (0 + 0.1931)/4 = 0.02414
    assert float(loss.detach()) == pytest.approx(0.5 * (0.5 - 1 + 0.6931472) / 4, abs=1e-6)
    assert float(metrics["kl_ref"]) == pytest.approx((0.5 - 1 + 0.6931472) / 2, abs=1e-6)


def test_several_updates_use_the_stored_old_policy():
    logp = torch.tensor([[0.0]], requires_grad=True)  # current log pi = 0, old = -1: ratio e = 2.718
    b = _view(torch.tensor([[-1.0]]), torch.tensor([[1.0]]))
    objective = build_objective(algo("algorithm.tis.mode=none"), max_tokens=1)
    loss, metrics = objective(logp, b, Normaliser(1.0, 1.0), kl_beta=0.0)
    # ratio e -> clipped to 1.2 with A = 1 > 0 -> loss = -1.2
    assert float(loss.detach()) == pytest.approx(-1.2)
    assert float(metrics["clip_frac_high"]) == 1.0


def test_truncated_importance_weight_multiplies_the_policy_term():
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    # the learner before the update (old) gave 0 and -1; the sampler -1 and -1
    b = _view(torch.tensor([[0.0, -1.0]]), torch.tensor([[1.0, 1.0]]), sampler=torch.tensor([[-1.0, -1.0]]))
    loss, metrics = build_objective(algo(), max_tokens=2)(logp, b, Normaliser(2.0, 1.0), kl_beta=0.0)
    # token 0: rho = pi_old / pi_sampler = e^(0 - -1) = 2.72 -> truncated to C = 2; PPO ratio 1
    #          -> -1 x 2 x 1/2 = -1; token 1: rho = 1, ratio 1 -> -1 x 1 x 1/2 = -0.5. Total -1.5
    assert float(loss.detach()) == pytest.approx(-1.5)
    assert float(metrics["tis_truncated_frac"]) == 0.5
    grad = torch.autograd.grad(loss, logp)[0]
    assert grad[0].tolist() == pytest.approx([-1.0, -0.5])  # d/dlogp of -r A w: -rho_w A w at r = 1


def test_importance_weights_use_the_old_policy_not_the_updated_one():
    # A second update of the same batch (epochs = 2): the policy has moved to log pi = 0.5 since
    # scoring (old = 0, sampler = -1). rho must stay pi_old / pi_sampler = e -> 2, counting the
    # sampler's staleness once; with the updated policy it would be e^1.5 and PPO's ratio
    # e^0.5 = 1.65 (clipped to 1.2) would count the same drift a second time.
    logp = torch.tensor([[0.5]], requires_grad=True)
    b = _view(torch.tensor([[0.0]]), torch.tensor([[1.0]]), sampler=torch.tensor([[-1.0]]))
    cfg = algo("algorithm.loss.epochs=2", "algorithm.tis.mode=truncate", "algorithm.tis.cap=10")
    loss, metrics = build_objective(cfg, max_tokens=1)(logp, b, Normaliser(1.0, 1.0), kl_beta=0.0)
    # rho = e^(0 - -1) = 2.718 (under the cap 10); PPO: ratio e^0.5 = 1.649 -> clipped 1.2, A = 1
    # loss = -1.2 x 2.718 = -3.262 (the updated policy would give rho = e^1.5 = 4.48, loss -5.38)
    assert float(metrics["tis_rho_mean"]) == pytest.approx(2.718282, abs=1e-5)
    assert float(loss.detach()) == pytest.approx(-1.2 * 2.718282, abs=1e-5)


def test_fixed_length_normaliser_is_the_generation_limit():
    # Dr. GRPO: w = m / (L_max N_seqs) with L_max = rollout.max_tokens = 8, whatever the step's longest
    logp = torch.tensor([[-1.0, -1.0, 0.0]], requires_grad=True)
    b = _view(logp.detach().clone(), torch.ones(1, 3))
    b.completion_mask = torch.tensor([[1.0, 1.0, 0.0]])  # a 2-token completion in a 3-wide table
    objective = build_objective(algo("algorithm.name=dr_grpo", "algorithm.tis.mode=none"), max_tokens=8)
    loss, _ = objective(logp, b, Normaliser(num_tokens=2.0, num_sequences=1.0), kl_beta=0.0)
    # ratio 1, A = 1: l_t = -1 per real token, w = 1/(8 x 1) -> loss = -2/8 (not -2/2 or -2/3)
    assert float(loss.detach()) == pytest.approx(-0.25)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_advantages_split_over_ranks_equal_the_whole_batch(name):
    """Any split of the batch over ranks, each in its own order, gives the same advantages and
    returns as one rank holding everything; so does whitening from summed moments."""
    g = random.Random(len(name))
    N, T, G = 8, 6, 4
    lengths = [g.randint(1, T) for _ in range(N)]
    b = batch([g.random() for _ in range(N)], lengths, group_size=G, T=T)
    b.kl = torch.rand(N, T) * b.mask
    b.values = torch.randn(N, T) * b.mask
    b.step_end = (torch.rand(N, T) < 0.4).float() * b.mask
    b.step_rewards = torch.randn(N, T) * b.step_end
    placement = "loss" if name == "grpo_process" else "reward"
    cfg = algo(f"algorithm.name={name}", f"algorithm.kl.placement={placement}", "algorithm.estimator.gamma=0.9")
    whole, whole_returns = estimate(cfg, b, kl_beta=0.2)
    split, split_returns = estimate(cfg, b, kl_beta=0.2, ranks=[[5, 0, 3], [7, 1, 6, 2, 4]])
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)
    assert (whole_returns is None) == (split_returns is None) == (not get_method(name).needs_critic)
    if whole_returns is not None:
        torch.testing.assert_close(split_returns, whole_returns)
    assert (whole * b.mask).abs().sum() > 0  # a real signal, not all zeros
    moments = masked_moments(whole[[5, 0, 3]], b.mask[[5, 0, 3]]) + masked_moments(
        whole[[7, 1, 6, 2, 4]], b.mask[[7, 1, 6, 2, 4]]
    )
    torch.testing.assert_close(whiten(whole[:3], b.mask[:3], moments=moments), whiten(whole, b.mask)[:3])


# --- algorithm.shaping.mask_truncated: a completion that trains no token still counts in its baselines -------------
def masked_first_row(b: Batch) -> Batch:
    """Row 0 trains no token (its loss mask zeroed, as mask_truncated does) but keeps its completion."""
    b.completion = b.mask.clone()
    b.mask = b.mask.clone()
    b.mask[0] = 0.0
    return b


def test_masked_truncated_reward_still_counts_in_the_group_baseline():
    # {truncated r=1 -> penalty -1; finished r=1; finished r=0}: shaped [-1, 1, 0], mean 0,
    # population std sqrt(2/3) = 0.8165 -> A = [-1.2247, 1.2247, 0]. Masking row 0 removes its tokens
    # from the loss only: rows 1 and 2 keep 1.2247 and 0 (before the fix: 1.414 and -0.707, row 0 as 0).
    cfg = algo("algorithm.shaping.truncation_penalty=-1", "algorithm.shaping.mask_truncated=true")
    b = batch([1.0, 1.0, 0.0], [3, 2, 2], group_size=3, truncated=[True, False, False])
    b.rewards = shape(b, cfg, max_tokens=3, stats=RewardStats())
    assert b.rewards.tolist() == [-1.0, 1.0, 0.0]
    unmasked, _ = estimate(cfg, b)
    masked, _ = estimate(cfg, masked_first_row(b))
    a = 1 / (2 / 3) ** 0.5  # 1.2247
    assert unmasked[:, 0].tolist() == pytest.approx([-a, a, 0.0], abs=1e-5)
    assert masked[0].abs().sum() == 0.0  # it trains nothing ...
    assert masked[1:, 0].tolist() == pytest.approx([a, 0.0], abs=1e-5)  # ... and its reward still counts
    torch.testing.assert_close(masked[1:], unmasked[1:])


@pytest.mark.parametrize("name", ["rloo", "dr_grpo", "gspo", "reinforce"])
def test_masking_a_row_changes_no_other_rows_advantages(name):
    b = batch([1.0, 0.0, 0.5, 0.25], [3, 2, 2, 1], group_size=4)
    unmasked, _ = estimate(algo(f"algorithm.name={name}"), b)
    masked, _ = estimate(algo(f"algorithm.name={name}"), masked_first_row(b))
    assert masked[0].abs().sum() == 0.0
    torch.testing.assert_close(masked[1:], unmasked[1:])


def test_masked_truncated_completion_keeps_its_soft_overlong_penalty():
    # max 4, ramp over the last 2: a cut completion of 4 tokens gets 1 - 1 = 0 whether or not its tokens
    # train; the length is the completion's, not its trained tokens' (before: 0 tokens -> no penalty, [1, 1]).
    from learner.group import sequence_rewards
    from tests.fakes import make_trajectory

    cut = make_trajectory([5, 6], [7, 8, 9, 10], 1.0, 0)
    cut.finish_reason = "length"
    cut.completion_mask[:] = 0  # as mask_truncated leaves it
    done = make_trajectory([5, 6], [7, 8], 1.0, 0)
    rewards, truncated, lengths = sequence_rewards([cut, done])
    assert lengths.tolist() == [4.0, 2.0]
    cfg = algo("rollout.max_tokens=4", "algorithm.shaping.soft_overlong={cache_len: 2, factor: 1.0}")
    shaped = shape_sequence_rewards(rewards, truncated, lengths, cfg, 4, RewardStats())
    assert shaped.tolist() == pytest.approx([0.0, 1.0])


def test_masked_row_steps_count_in_the_process_statistics():
    # grpo_process, G = 2: row 0 (masked) has steps [1, 1], row 1 has steps [0, 0]; pooled mean 0.5,
    # population std 0.5 -> row 1's normalised steps are -1, -1 -> A_1 = [-2, -1] at tokens 0, 1.
    # Without row 0's steps the pool is [0, 0]: std 0, A_1 = 0 (before the fix).
    cfg = algo("algorithm.name=grpo_process")
    b = batch([2.0, 0.0], [2, 2], group_size=2)
    b.step_rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    b.step_end = torch.ones(2, 2)
    adv, _ = estimate(cfg, masked_first_row(b))
    assert adv[0].tolist() == [0.0, 0.0]
    assert adv[1].tolist() == pytest.approx([-2.0, -1.0], abs=1e-4)
