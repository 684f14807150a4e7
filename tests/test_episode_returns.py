"""Returns and advantages of multi-turn episodes, against hand-computed numbers: environment tokens are
skipped (no reward, no discount, zero advantage), and gamma may discount per turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.algorithms import gae, reward_to_go, turn_discounts
from learner.config import AlgorithmConfig
from learner.estimators import ReinforceBaseline, TokenRewards

# one episode: model turn [0, 1], environment [2, 3], model turn [4], padding [5]
MASK = torch.tensor([[1.0, 1, 0, 0, 1, 0]])
REWARDS = torch.tensor([[0.0, 0, 9, 9, 1, 0]])  # 9 on environment tokens must never count
VALUES = torch.tensor([[0.2, 0.4, 7, 7, 0.6, 0]])


def test_turn_discounts_discount_at_the_end_of_each_turn_that_another_turn_follows():
    assert turn_discounts(MASK, 0.5).tolist() == [[1, 0.5, 1, 1, 1, 1]]
    assert turn_discounts(torch.tensor([[1.0, 1, 1, 0]]), 0.5).tolist() == [[1, 1, 1, 1]]  # one turn
    two = torch.tensor([[1.0, 0, 1, 0, 0, 1]])
    assert torch.allclose(turn_discounts(two, 0.9), torch.tensor([[0.9, 1, 0.9, 1, 1, 1]]))


def test_reward_to_go_skips_environment_tokens():
    # per turn: G4 = 1; G1 = 0 + 0.5 * G4 = 0.5; G0 = 0 + 1 * G1 = 0.5
    per_turn = reward_to_go(REWARDS, MASK, turn_discounts(MASK, 0.5))
    assert torch.allclose(per_turn, torch.tensor([[0.5, 0.5, 0, 0, 1, 0]]))
    # per token: the gap is one step, G1 = 0.5, G0 = 0.25
    per_token = reward_to_go(REWARDS, MASK, 0.5)
    assert torch.allclose(per_token, torch.tensor([[0.25, 0.5, 0, 0, 1, 0]]))
    # gamma = 1: the first turn sees the episode's reward
    assert torch.allclose(reward_to_go(REWARDS, MASK, 1.0), torch.tensor([[1.0, 1, 0, 0, 1, 0]]))


def test_gae_skips_environment_tokens_with_per_turn_discounts():
    # t4: delta = 1 - 0.6 = 0.4, A4 = 0.4
    # t1: gamma_1 = 0.5: delta = 0.5 * 0.6 - 0.4 = -0.1, A1 = -0.1 + 0.5 * 1 * 0.4 = 0.1
    # t0: delta = 0.4 - 0.2 = 0.2, A0 = 0.2 + 0.1 = 0.3
    advantages, returns = gae(REWARDS, VALUES, MASK, turn_discounts(MASK, 0.5), lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[0.3, 0.1, 0, 0, 0.4, 0]]))
    assert torch.allclose(returns, torch.tensor([[0.5, 0.5, 0, 0, 1.0, 0]]))  # lam = 1: the Monte Carlo returns


def test_a_contiguous_mask_gives_the_returns_it_always_did():
    rewards, mask = torch.tensor([[0.0, 0, 1, 5]]), torch.tensor([[1.0, 1, 1, 0]])
    assert torch.allclose(reward_to_go(rewards, mask, 0.5), torch.tensor([[0.25, 0.5, 1, 0]]))
    values = torch.tensor([[0.1, 0.2, 0.3, 9]])
    advantages, _ = gae(rewards, values, mask, 0.5, 0.5)
    # t2: 1 - 0.3 = 0.7; t1: 0.15 - 0.2 = -0.05 + 0.25 * 0.7 = 0.125; t0: 0.1 - 0.1 = 0 + 0.25 * 0.125
    assert torch.allclose(advantages, torch.tensor([[0.03125, 0.125, 0.7, 0]]))


def test_reinforce_discounts_per_turn_when_configured():
    algo = AlgorithmConfig(name="reinforce", estimator={"gamma": 0.5, "discount": "turn"})
    estimator = algo.method.estimator(algo)
    assert isinstance(estimator, ReinforceBaseline) and estimator.per_turn
    tokens = TokenRewards(REWARDS, MASK, completion=MASK)
    assert np.allclose(estimator.summarise(tokens)["return"].numpy(), [0.5])


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "gspo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_environment_tokens_change_no_loss_no_gradient_and_no_tis_weight(method, level):
    """An episode's loss with its environment tokens (mask 0, sampler log-prob 0.0, any learner log-prob
    and advantage) equals the loss of the same model tokens with the environment's removed: the policy
    loss, TIS (token and sequence level), the KL term and every aggregation count model tokens only."""
    from learner.objective import build_objective
    from learner.rank_batch import CompletionView
    from learner.shard import Normaliser

    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1, 0, 0, 0, 1, 1], [1.0, 0, 0, 1, 1, 1, 0]])  # two episodes, padding at the end
    model = mask > 0
    learner = torch.randn(2, 7) - 2.0
    learner[~model] = -9.0  # an environment token the policy would never write
    sampler = torch.where(model, learner.detach() + 0.1 * torch.randn(2, 7), torch.zeros(2, 7))
    old = torch.where(model, learner.detach() + 0.05 * torch.randn(2, 7), torch.full((2, 7), -9.0))
    ref = learner.detach() + 0.2
    advantages = torch.where(model, torch.randn(2, 7), torch.full((2, 7), 50.0))
    algo = AlgorithmConfig(name=method, tis={"mode": "truncate", "level": level}, kl={"placement": "loss", "beta": 0.1})
    objective = build_objective(algo, max_tokens=16)
    normaliser = Normaliser(num_tokens=float(mask.sum()), num_sequences=2.0)

    def loss_of(keep):
        rows = [keep[i].nonzero().flatten() for i in range(2)]
        width = max(len(r) for r in rows)

        def pack(x, fill=0.0):
            out = torch.full((2, width), fill)
            for i, r in enumerate(rows):
                out[i, : len(r)] = x[i, r]
            return out

        lp = pack(learner.detach()).requires_grad_(True)
        view = CompletionView(pack(mask), pack(sampler), pack(advantages), pack(old), pack(ref))
        loss, metrics = objective(lp, view, normaliser, 0.1)
        loss.backward()
        grads = torch.cat([lp.grad[i, : len(r)] for i, r in enumerate(rows)])
        return loss.detach(), grads, metrics

    with_env, grad_with, metrics = loss_of(torch.ones_like(model))
    without, grad_without, _ = loss_of(model)
    # rows 7 wide vs 4: the same <= 8 model-token terms summed in another order, within 7 eps = 8.3e-7 of
    # their magnitudes' sum (O(1) here, and allclose adds 1e-5 |without|); measured 2.4e-7 in every matrix row
    assert torch.allclose(with_env, without, atol=1e-6), (with_env, without)
    assert torch.allclose(grad_with.view(2, 7)[model], grad_without, atol=1e-6)
    assert float(grad_with.view(2, 7)[~model].abs().max()) == 0.0
