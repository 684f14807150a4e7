"""The PPO value model: its three starting points and the per-completion-token alignment."""

from __future__ import annotations

import random

import torch

from learner.critic import build_value_model
from learner.packing import packed_at_completion
from tests.fakes import make_sequence
from tests.reference_batch import packed


def test_critic_from_policy_starts_at_zero_and_shares_the_transformer(tiny_model_dir):
    from transformers import AutoModel

    critic = build_value_model(tiny_model_dir, "policy", seed=0)
    base = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32)
    name, param = next(iter(base.named_parameters()))
    torch.testing.assert_close(dict(critic.backbone.named_parameters())[name], param)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.all(critic(ids, torch.ones_like(ids)) == 0)  # zero head: V = 0 before training


def test_critic_from_a_reward_model_takes_its_score_head(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
    rm.save_pretrained(tmp_path / "rm")
    critic = build_value_model(str(tmp_path / "rm"), "reward_model", seed=0)
    torch.testing.assert_close(critic.value_head.weight, rm.score.weight)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        hidden = rm.model(input_ids=ids).last_hidden_state
        # V at the last position is the reward model's score of the whole sequence (score head has no bias)
        expected = rm.score(hidden)[0, -1, 0]
        assert float(critic(ids, torch.ones_like(ids))[0, -1]) == float(expected)


def test_fresh_critic_is_random_but_seeded(tiny_model_dir):
    a, b = build_value_model(tiny_model_dir, "fresh", seed=1), build_value_model(tiny_model_dir, "fresh", seed=1)
    ids = torch.tensor([[5, 6]])
    with torch.no_grad():
        assert torch.equal(a(ids, torch.ones_like(ids)), b(ids, torch.ones_like(ids)))
        assert float(a(ids, torch.ones_like(ids)).abs().sum()) > 0


def test_values_are_read_at_the_state_before_each_completion_token():
    rng = random.Random(0)
    seqs = [make_sequence(rng, 2, 3), make_sequence(rng, 4, 1)]
    batch, _ = packed(seqs, pad_id=0)  # one row: seq 0 at 0..4, seq 1 at 5..9
    per_position = torch.arange(batch.input_ids.numel(), dtype=torch.float).reshape(batch.input_ids.shape)
    picked = packed_at_completion(per_position, batch)
    # seq 0: prompt 2 tokens -> completion at positions 2,3,4 -> states at 1,2,3
    # seq 1: starts at 5, prompt 4 tokens -> completion at 9 -> state 8
    assert picked[0].tolist() == [1.0, 2.0, 3.0]
    assert picked[1, 0].item() == 8.0
