"""Per-token loss weights: hand values, global normalisers, padding invariance."""

import pytest
import torch

from learner.algorithms.aggregation import AGGREGATIONS, check_aggregation, token_weights
from tests.tolerance import reduction_rtol

# a 4-token and a 7-token sequence, T = 7
MASK = torch.tensor([[1.0, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])


def test_seq_mean_weights_one_quarter_vs_one_seventh():
    w = token_weights(MASK, "seq_mean", num_sequences=2)
    # seq 0: 1/4 * 1/2 = 0.125 on its 4 tokens; seq 1: 1/7 * 1/2 = 1/14 on its 7 tokens
    expected = torch.tensor([[1 / 8] * 4 + [0.0] * 3, [1 / 14] * 7])
    torch.testing.assert_close(w, expected)
    # each sequence contributes total weight 1/num_sequences
    torch.testing.assert_close(w.sum(-1), torch.tensor([0.5, 0.5]))


def test_token_mean_weights_use_global_token_count():
    w = token_weights(MASK, "token_mean", num_tokens=22)  # e.g. 11 here + 11 on another rank
    expected = MASK / 22  # 1/22 on every real token
    torch.testing.assert_close(w, expected)


def test_fixed_length_weights_divide_by_l_max():
    w = token_weights(MASK, "fixed_length", num_sequences=2, max_len=8)
    expected = MASK / 16  # 1 / (L_max * N) = 1 / (8 * 2)
    torch.testing.assert_close(w, expected)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_two_ranks_half_batch_equal_one_rank_whole_batch(mode):
    torch.manual_seed(0)
    lengths = torch.tensor([3, 7, 1, 5, 6, 2])
    mask = (torch.arange(8) < lengths[:, None]).float()  # [6, 8]
    per_token_loss = torch.randn(6, 8)
    norms = dict(num_tokens=float(mask.sum()), num_sequences=6.0, max_len=8)
    whole = (per_token_loss * token_weights(mask, mode, **norms)).sum()
    rank0 = (per_token_loss[:3] * token_weights(mask[:3], mode, **norms)).sum()
    rank1 = (per_token_loss[3:] * token_weights(mask[3:], mode, **norms)).sum()
    # the same 48 float32 products, summed whole or as two halves and then added: 48 additions in another
    # order, (49 - 1) eps = 5.7e-6 x sum |terms| (atol 1.7e-6 to 8.3e-5); rank-local normalisers move it 6e-3+
    terms = (per_token_loss * token_weights(mask, mode, **norms)).abs().sum()
    atol = reduction_rtol(torch.float32, mask.numel() + 1) * float(terms)
    torch.testing.assert_close(rank0 + rank1, whole, rtol=0.0, atol=atol)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_padding_never_changes_weights(mode):
    norms = dict(num_tokens=11.0, num_sequences=2.0, max_len=7)
    w = token_weights(MASK, mode, **norms)
    padded_mask = torch.cat([MASK, torch.zeros(2, 5)], dim=1)  # 5 more padding slots
    w_padded = token_weights(padded_mask.bool(), mode, **norms)  # bool mask accepted too
    torch.testing.assert_close(w_padded[:, :7], w)
    assert torch.all(w_padded[:, 7:] == 0)


def test_unknown_mode_lists_valid_names():
    with pytest.raises(ValueError) as err:
        token_weights(MASK, "sum")
    for name in ("token_mean", "seq_mean", "fixed_length"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="seq_mean"):
        check_aggregation("mean")


def test_missing_normaliser_is_an_error():
    with pytest.raises(ValueError, match="num_tokens"):
        token_weights(MASK, "token_mean")
    with pytest.raises(ValueError, match="max_len"):
        token_weights(MASK, "fixed_length", num_sequences=2)
