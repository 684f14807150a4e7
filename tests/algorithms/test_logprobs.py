"""Chunked log-probs and entropies of sampled tokens (``learner/logprobs.py``): hand-computed
numbers, and the same values and gradients as a full log-softmax for every chunk size."""

from __future__ import annotations

import math

import pytest
import torch

from learner.logprobs import token_entropy, token_logprobs
from tests.tolerance import reduction_rtol


def test_hand_computed_logprob_entropy_and_gradient():
    # row 0: logits [0, ln 3] -> p = [1/4, 3/4]; token 1: log(3/4); H = -(1/4 ln 1/4 + 3/4 ln 3/4)
    # row 1: logits [0, 0] -> p = [1/2, 1/2]; token 0: log(1/2); H = ln 2
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], requires_grad=True)
    logp = token_logprobs(logits, torch.tensor([1, 0]), chunk=1)
    assert torch.allclose(logp, torch.tensor([math.log(0.75), math.log(0.5)]))
    entropy = token_entropy(logits, chunk=1)
    assert torch.allclose(entropy, torch.tensor([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0)]))
    logp.sum().backward()  # d/dz = onehot(y) - p
    assert torch.allclose(logits.grad, torch.tensor([[-0.25, 0.25], [0.5, -0.5]]))


@pytest.mark.parametrize("chunk", [0, 1, 3, 7, 64])
def test_chunked_equals_a_full_log_softmax_in_values_and_gradients(chunk):
    torch.manual_seed(0)
    logits = (torch.randn(23, 101) * 4).requires_grad_()
    ids = torch.randint(0, 101, (23,))
    weights = torch.randn(23)  # a loss that weighs tokens differently
    full = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
    (full * weights).sum().backward()
    reference_grad, logits.grad = logits.grad.clone(), None
    chunked = token_logprobs(logits, ids, chunk)
    (chunked * weights).sum().backward()
    # The two compute the same float32 formulas with other kernels (logsumexp vs log_softmax, chunk by chunk),
    # so their sums run in other orders. log pi(y) = z_y - lse, lse = m + log sum_v e^(z_v - m): the sum of
    # V = 101 positive terms moves by (V - 1) eps relative, i.e. by (V - 1) eps absolute after the log, each
    # e^x by an ulp (eps), adding back m and subtracting from z_y by an ulp of |lse| + |log pi| (< 37 here):
    #   |d log pi| <= 100 eps + eps + eps (|lse| + |log pi|) <= 1.19e-5 + 1.2e-7 + 4.4e-6 = 1.6e-5
    # per token (measured: at most 12% of it, 1.9e-6); a chunk that mixed rows up would be off by units
    z, eps = logits.detach(), torch.finfo(torch.float32).eps
    lse = torch.logsumexp(z, -1)
    d_logp = reduction_rtol(torch.float32, z.shape[1]) + eps + eps * (lse.abs() + full.detach().abs())  # [N]
    assert ((chunked - full).abs() <= d_logp).all()
    # d/dz_v = w (1[v = y] - p_v), p_v = e^(z_v - lse): p_v moves by d_logp relative, the difference by an ulp
    d_grad = weights.abs()[:, None] * (torch.softmax(z, -1) * (d_logp[:, None] + eps) + eps)  # [N, V]
    assert ((logits.grad - reference_grad).abs() <= d_grad).all()  # measured: at most 7% of it
    # H = lse - sum_v p_v z_v vs -sum_v p_v log p_v: lse and log p_v move by d_logp, p_v by d_logp relative,
    # and the sum over V terms by (V - 1) eps relative to sum_v p_v |z_v| (|log p_v|):
    p = torch.softmax(z, -1)
    spread = (p * z.abs()).sum(-1) + (p * p.log().abs()).sum(-1)  # [N]
    d_entropy = 2 * d_logp + (d_logp + reduction_rtol(torch.float32, z.shape[1])) * spread  # <= 4.9e-4
    assert ((token_entropy(logits, chunk) - (-(p * p.log()).sum(-1))).abs() <= d_entropy).all()  # used: 1.1%


def test_bf16_logits_get_bf16_gradients_and_no_rows_is_fine():
    logits = torch.randn(5, 11).to(torch.bfloat16).requires_grad_()
    out = token_logprobs(logits, torch.randint(0, 11, (5,)), chunk=2)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert token_logprobs(torch.zeros(0, 11), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_temperature_scores_the_distribution_that_was_sampled():
    # z = [2, 0], T = 0.6: the sampler draws from softmax(z / T) = softmax([10/3, 0]):
    #   p_T = [1 / (1 + e^{-10/3}), e^{-10/3} / (1 + e^{-10/3})] = [0.96555, 0.03445]
    # while softmax(z) = [0.88080, 0.11920]. Scored at T = 1, the ratio to the sampler would be off by
    # 0.8808 / 0.96555 = 0.912 for token 0 and 0.1192 / 0.03445 = 3.46 for token 1: TIS would "correct" a
    # difference that is only the temperature. Scored at T, the ratio is exactly 1.
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0]], requires_grad=True)
    e = math.exp(-10 / 3)
    p_t = [1 / (1 + e), e / (1 + e)]
    logp = token_logprobs(logits, torch.tensor([0, 1]), chunk=1, temperature=0.6)
    assert logp.tolist() == pytest.approx([math.log(p_t[0]), math.log(p_t[1])], rel=1e-5)
    raw = token_logprobs(logits.detach(), torch.tensor([0, 1]))
    assert torch.exp(raw - logp).tolist() == pytest.approx([0.9122, 3.4600], abs=1e-3)
    # d log p_T(y) / dz_v = (1[v = y] - p_T,v) / T
    logp.sum().backward()
    expected = [[(1 - p_t[0]) / 0.6, -p_t[1] / 0.6], [-p_t[0] / 0.6, (1 - p_t[1]) / 0.6]]
    assert logits.grad.tolist()[0] == pytest.approx(expected[0], rel=1e-5)
    assert logits.grad.tolist()[1] == pytest.approx(expected[1], rel=1e-5)
    # the entropy is the sampled distribution's too
    h = -(p_t[0] * math.log(p_t[0]) + p_t[1] * math.log(p_t[1]))
    assert token_entropy(logits.detach(), temperature=0.6).tolist() == pytest.approx([h, h], rel=1e-5)


@pytest.mark.parametrize("chunk", [0, 3])
def test_tempered_chunks_equal_a_full_log_softmax_of_scaled_logits(chunk):
    torch.manual_seed(1)
    logits = (torch.randn(11, 37) * 3).requires_grad_()
    ids = torch.randint(0, 37, (11,))
    weights = torch.randn(11)
    (token_logprobs(logits, ids, chunk, temperature=0.7) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    full = torch.log_softmax(logits / 0.7, -1).gather(1, ids[:, None]).squeeze(1)
    (full * weights).sum().backward()
    torch.testing.assert_close(ours, logits.grad)


def test_stop_tokens_banned_before_min_tokens_are_not_in_the_distribution():
    # z = [2, 0, 1], stop token 2 banned (the engine's min_tokens): the sampler drew token 0 from
    # softmax([2, 0]) -> log p = 2 - log(e^2 + 1) = -0.12693, where the whole softmax gives
    # 2 - log(e^2 + 1 + e) = -0.40761 (a TIS ratio of 0.7553 that is not a real mismatch).
    # Gradient: 1[v = y] - p over the two remaining tokens, 0 on the banned one.
    logits = torch.tensor([[2.0, 0.0, 1.0], [2.0, 0.0, 1.0]], requires_grad=True)
    ban = (torch.tensor([True, False]), torch.tensor([2]))
    logp = token_logprobs(logits, torch.tensor([0, 0]), chunk=1, ban=ban)
    assert logp.tolist() == pytest.approx([2 - math.log(math.e**2 + 1), 2 - math.log(math.e**2 + 1 + math.e)], rel=1e-5)
    logp.sum().backward()
    p = math.e**2 / (math.e**2 + 1)
    assert logits.grad[0].tolist() == pytest.approx([1 - p, -(1 - p), 0.0], abs=1e-6)
    q = torch.softmax(torch.tensor([2.0, 0.0, 1.0]), -1).tolist()
    assert logits.grad[1].tolist() == pytest.approx([1 - q[0], -q[1], -q[2]], abs=1e-6)
    h = -(p * math.log(p) + (1 - p) * math.log(1 - p))  # the entropy of the two tokens that remain
    assert token_entropy(logits.detach(), ban=ban)[0].item() == pytest.approx(h, rel=1e-5)
