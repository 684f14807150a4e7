"""Off-policy corrections and KL forms (issue 30), against numbers worked out by hand:
band masking, batch-normalised weights, rejection by divergence, the k+ KL gradients, the exact
KL in chunks, and the token-sum aggregations."""

import math

import pytest
import torch

from learner.algorithms.aggregation import token_weights
from learner.algorithms.importance import tis_weights, weight_sums
from learner.algorithms.kl import exact_kl, kl_abs, kl_abs_plus, kl_k1, kl_k1_plus, kl_k2, kl_k3, kl_k3_plus
from learner.algorithms.rejection import RejectRule, rejection_mask, token_divergences

D = torch.float64
LN2 = math.log(2.0)


def _t(rows):
    return torch.tensor(rows, dtype=D)


# --- band masking --------------------------------------------------------------------------------
def test_band_keeps_the_ratio_inside_and_drops_outside_token_level():
    rho = [0.4, 0.5, 1.0, 2.5, 5.0, 6.0]  # band [0.5, 5]: the ends are kept
    learner, sampler, mask = _t([[math.log(r) for r in rho]]), _t([[0.0] * 6]), _t([[1.0] * 6])
    w, m = tis_weights(learner, sampler, mask, mode="band", low=0.5, high=5.0)
    assert w[0].tolist() == pytest.approx([0.0, 0.5, 1.0, 2.5, 5.0, 0.0])
    assert m["tis_masked_frac"].item() == pytest.approx(2 / 6)
    # the default band is [1/C, C]
    w, _ = tis_weights(learner, sampler, mask, mode="band", cap=2.0)
    assert w[0].tolist() == pytest.approx([0.0, 0.5, 1.0, 0.0, 0.0, 0.0])


def test_band_at_the_sequence_level_weighs_whole_sequences_by_their_geometric_mean():
    # row 0: token ratios 4 and 1/4 -> geometric mean 1 (kept, weight 1 on both)
    # row 1: token ratios 4 and 4 -> 4 > high = 3 (dropped); row 2: 2 and padding -> 2 (kept, weight 2)
    learner = _t([[2 * LN2, -2 * LN2], [2 * LN2, 2 * LN2], [LN2, 9.0]])
    mask = _t([[1, 1], [1, 1], [1, 0]])
    w, m = tis_weights(learner, torch.zeros_like(learner), mask, level="sequence", mode="band", low=0.5, high=3.0)
    assert torch.allclose(w, _t([[1.0, 1.0], [0.0, 0.0], [2.0, 0.0]]))
    assert m["tis_masked_frac"].item() == pytest.approx(1 / 3)


def test_band_bounds_are_checked():
    x = _t([[0.0]])
    with pytest.raises(ValueError, match="0 <= low < 1 < high"):
        tis_weights(x, x, x + 1, mode="band", low=1.5, high=3.0)


# --- batch normalisation -------------------------------------------------------------------------
def test_batch_normalised_weights_have_mean_one_over_the_steps_trained_tokens():
    # two micro-batches (or ranks): truncated weights [2, 1, 0.5] and [0.25, padding]
    w1, mask1 = _t([[2.0, 1.0, 0.5]]), _t([[1, 1, 1]])
    w2, mask2 = _t([[0.25, 7.0]]), _t([[1, 0]])
    (s1, n1), (s2, n2) = weight_sums(w1, mask1), weight_sums(w2, mask2)
    assert (s1, n1, s2, n2) == (3.5, 3.0, 0.25, 1.0)  # padding counts in neither
    mean = (s1 + s2) / (n1 + n2)  # 3.75 / 4 = 0.9375
    normalised = torch.cat([w1[0], w2[0, :1]]) / mean
    assert normalised.mean().item() == pytest.approx(1.0)
    assert normalised.tolist() == pytest.approx([2 / 0.9375, 1 / 0.9375, 0.5 / 0.9375, 0.25 / 0.9375])
    # sequence level: one weight per sequence (its tokens share it), averaged over sequences
    seq_w = _t([[2.0, 2.0, 0.0], [0.5, 0.0, 0.0], [9.0, 9.0, 9.0]])
    assert weight_sums(seq_w, _t([[1, 1, 0], [1, 0, 0], [0, 0, 0]]), "sequence") == (2.5, 2.0)


# --- rejection by divergence ---------------------------------------------------------------------
def test_token_divergences_by_hand():
    # l = ln 2: k1 = -ln 2, k2 = (ln 2)^2 / 2, k3 = 2 - 1 - ln 2
    d = token_divergences(_t([[LN2, 0.0]]), _t([[0.0, 0.0]]), _t([[1, 1]]))
    assert d["k1"][0].tolist() == pytest.approx([-LN2, 0.0])
    assert d["k2"][0].tolist() == pytest.approx([LN2**2 / 2, 0.0])
    assert d["k3"][0].tolist() == pytest.approx([1 - LN2, 0.0])


def test_a_sequence_is_rejected_by_its_mean_k3():
    # row 0: l = [ln 2, 0, 0, 0] -> k3 = [0.30685, 0, 0, 0], mean 0.0767 (kept by high = 0.1)
    # row 1: l = [ln 2, ln 2] -> mean k3 0.30685 (rejected); row 2: identical policies, k3 = 0 (kept)
    learner = _t([[LN2, 0, 0, 0], [LN2, LN2, 0, 0], [0, 0, 0, 0]])
    mask = _t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    rule = RejectRule("sequence", "k3", "mean", high=0.1)
    keep, m = rejection_mask(learner, torch.zeros_like(learner), mask, (rule,))
    assert keep.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert m["reject_seq_mean_k3_frac"].item() == pytest.approx(1 / 3)
    assert m["reject_token_frac"].item() == pytest.approx(2 / 9)
    assert m["reject_seq_frac"].item() == pytest.approx(1 / 3)
    # the same rule by the sum: row 0's 0.30685 now exceeds 0.1 too; by the max, the same
    for reduce in ("sum", "max"):
        keep, _ = rejection_mask(
            learner, torch.zeros_like(learner), mask, (RejectRule("sequence", "k3", reduce, high=0.1),)
        )
        assert keep[:, 0].tolist() == [0, 0, 1]


def test_token_k2_and_a_sequence_mean_k1_band_combine():
    # token k2 <= 0.2 drops the token with l = ln 2 (k2 = 0.2402) and keeps l = -0.5 (k2 = 0.125);
    # sequence mean k1 = mean(-l) in [-0.3, 0.3]: row 0 mean(-[ln2, 0]) = -0.3466 (rejected whole),
    # row 1 mean(-[-0.5, 0]) = 0.25 (kept)
    learner, mask = _t([[LN2, 0.0], [-0.5, 0.0]]), _t([[1, 1], [1, 1]])
    rules = (RejectRule("token", "k2", high=0.2), RejectRule("sequence", "k1", "mean", low=-0.3, high=0.3))
    keep, m = rejection_mask(learner, torch.zeros_like(learner), mask, rules)
    assert keep.tolist() == [[0, 0], [1, 1]]
    assert m["reject_token_k2_frac"].item() == pytest.approx(1 / 4)
    assert m["reject_seq_mean_k1_frac"].item() == pytest.approx(1 / 2)
    assert m["reject_token_frac"].item() == pytest.approx(2 / 4)


def test_padding_is_never_kept_and_rules_need_a_bound():
    keep, _ = rejection_mask(_t([[5.0, 5.0]]), _t([[0.0, 0.0]]), _t([[1, 0]]), (RejectRule(high=1000.0),))
    assert keep.tolist() == [[1, 0]]
    with pytest.raises(ValueError, match="neither low nor high"):
        RejectRule().check()
    with pytest.raises(ValueError, match="low < high"):
        RejectRule(low=1.0, high=0.5).check()


# --- KL with unbiased gradients ----------------------------------------------------------------
def _grad(estimator, logprobs, ref):
    x = logprobs.clone().requires_grad_(True)
    value = estimator(x, ref, torch.ones_like(ref))
    value.sum().backward()
    return value.detach(), x.grad


def test_k_plus_has_the_value_of_k1_or_k3_and_the_gradient_of_k2():
    logprobs, ref = _t([[-0.2, -1.5, -3.0]]), _t([[-0.9, -1.0, -2.0]])
    _, g2 = _grad(kl_k2, logprobs, ref)
    assert torch.allclose(g2, _t([[0.7, -0.5, -1.0]]))  # d(l^2/2)/dlog pi = l
    for plain, plus in ((kl_k1, kl_k1_plus), (kl_k3, kl_k3_plus), (kl_abs, kl_abs_plus)):
        value, grad = _grad(plus, logprobs, ref)
        assert torch.allclose(value, plain(logprobs, ref, torch.ones_like(ref)))
        assert torch.allclose(grad, g2)
    assert kl_abs(logprobs, ref)[0].tolist() == pytest.approx([0.7, 0.5, 1.0])
    # abs_plus: |l| = [0.7, 0.5, 1.0] as its value, and l = [0.7, -0.5, -1.0] as its gradient (|l|'s own is sign(l))
    value, grad = _grad(kl_abs_plus, logprobs, ref)
    assert value[0].tolist() == pytest.approx([0.7, 0.5, 1.0]) and grad[0].tolist() == pytest.approx([0.7, -0.5, -1.0])


def test_k2_gradient_is_the_exact_kl_gradient_in_expectation():
    """Over a whole 3-token vocabulary, sum_v pi(v) grad_z k2(v) = grad_z KL(pi || pi_ref): k2's
    gradient is unbiased; k1's sums to 0 and k3's to the gradient of the reverse KL."""
    z = torch.tensor([0.3, -0.2, 1.1], dtype=D, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.4], dtype=D), -1)
    exact = torch.autograd.grad(exact_kl(z, ref), z)[0]
    logp = torch.log_softmax(z, -1)
    p = logp.exp().detach()
    grads = {}
    for name, est in (("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)):
        grads[name] = torch.autograd.grad((p * est(logp, ref)).sum(), z, retain_graph=True)[0]
    assert torch.allclose(grads["k2"], exact)
    assert torch.allclose(grads["k1"], torch.zeros(3, dtype=D), atol=1e-12)
    reverse = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), z)[0]  # grad KL(pi_ref || pi)
    assert torch.allclose(grads["k3"], reverse)


def test_chunked_exact_kl_equals_the_full_vocabulary_kl():
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(2, 7, 11, dtype=D), torch.randn(2, 7, 11, dtype=D)
    mask = torch.ones(2, 7)
    mask[1, 5:] = 0
    full = torch.nn.functional.kl_div(
        torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1), log_target=True, reduction="none"
    ).sum(-1)  # sum_v p (log p - log q)
    chunked = exact_kl(logits, ref_logits, mask, chunk=3)
    assert torch.allclose(chunked, full * mask, atol=1e-12)  # float64 in, float64 out
    # by hand on two tokens: p = (1/2, 1/2), q = (1/4, 3/4): KL = 0.5 ln 2 + 0.5 ln(2/3)
    one = exact_kl(torch.log(_t([[0.5, 0.5]])), torch.log(_t([[0.25, 0.75]])))
    assert one.item() == pytest.approx(0.5 * LN2 + 0.5 * math.log(2 / 3))


# --- token-sum aggregations ----------------------------------------------------------------------
def test_token_sum_aggregations_by_hand_and_split_over_micro_batches():
    mask = _t([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert token_weights(mask, "token_sum").tolist() == mask.tolist()  # w = m
    assert token_weights(mask, "seq_mean_token_sum", num_sequences=4).tolist() == (mask / 4).tolist()
    loss = _t([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    # seq_mean_token_sum over 2 sequences: ((1 + 2 + 3) + 4) / 2 = 5, the same when each row is its own micro-batch
    whole = (loss * token_weights(mask, "seq_mean_token_sum", num_sequences=2)).sum()
    parts = sum(
        (loss[i : i + 1] * token_weights(mask[i : i + 1], "seq_mean_token_sum", num_sequences=2)).sum()
        for i in range(2)
    )
    assert whole.item() == pytest.approx(5.0) and parts.item() == pytest.approx(5.0)
    assert (loss * token_weights(mask, "token_sum")).sum().item() == pytest.approx(10.0)


def test_exact_kl_edge_cases():
    empty = exact_kl(torch.zeros(0, 5), torch.zeros(0, 5))
    assert empty.shape == (0,)
    x, y = torch.randn(3, 5, dtype=D), torch.randn(3, 5, dtype=D)
    assert torch.allclose(exact_kl(x, y, chunk=100), exact_kl(x, y, chunk=1))  # chunk beyond N, chunk of 1
    assert exact_kl(x, y).dtype == D  # float64 stays float64
    banned = torch.tensor([[0.0, 0.0, float("-inf")]])  # a stop token banned before min_tokens: p = 0 there
    kl = exact_kl(banned, torch.tensor([[0.0, 1.0, float("-inf")]]))
    assert torch.isfinite(kl).all()
    with pytest.raises(ValueError, match="chunk >= 1"):
        exact_kl(x, y, chunk=0)


def test_normalisation_comes_after_rejection_and_makes_the_mean_kept_weight_one():
    """Ratios [0.8, 0.8, 2, 2] truncated at 10 keep themselves; the token rule k2 <= 0.05 rejects the last two
    (k2 = (ln 2)^2 / 2 = 0.24); the step's mean weight over its 4 trained tokens is (0.8 + 0.8) / 4 = 0.4, so
    the kept two weigh 2 each. GRPO with A = 1 at the first update and token_mean: loss = -(2 + 2) / 4 = -1."""
    from launch.config import load_config
    from learner.objective import build_objective, importance_weights, rejection
    from learner.rank_batch import CompletionView
    from learner.shard import Normaliser

    required = ["model.path=m", "data.prompts=builtin:successor", "reward.function=builtin:successor"]
    tis = ["algorithm.tis.cap=10", "algorithm.tis.normalize=true"]
    rule = ["algorithm.tis.reject=[{level: token, divergence: k2, high: 0.05}]"]
    algorithm = load_config(None, required + tis + rule + ["algorithm.loss.aggregation=token_mean"]).algorithm
    learner = _t([[math.log(0.8), math.log(0.8), LN2, LN2]])
    sampler, mask = torch.zeros_like(learner), torch.ones_like(learner)
    weights, _ = importance_weights(algorithm.tis)(learner, sampler, mask)
    keep, _ = rejection(algorithm.tis)(learner, sampler, mask)
    total, count = weight_sums(weights * keep, mask)
    assert (total, count) == pytest.approx((1.6, 4.0))
    view = CompletionView(mask, sampler, advantages=torch.ones_like(learner), old_logprobs=learner)
    objective = build_objective(algorithm, max_tokens=4)
    loss, metrics = objective(learner.clone().requires_grad_(True), view, Normaliser(4.0, 1.0, total / count), 0.0)
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["reject_token_k2_frac"].item() == pytest.approx(0.5)


def test_batch_means_per_minibatch_over_ranks_floored_and_the_batch_mean_unfloored():
    from types import SimpleNamespace

    from learner.group import MIN_IS_MEAN, importance_means

    ranks = [SimpleNamespace(is_sums=[(3.0, 4.0), (0.1, 10.0)]), SimpleNamespace(is_sums=[(1.0, 4.0), (0.1, 10.0)])]
    means, batch = importance_means(ranks)
    assert means == pytest.approx([0.5, MIN_IS_MEAN])  # (3 + 1) / 8; 0.2 / 20 = 0.01 floored
    assert batch == pytest.approx(4.2 / 28)  # all sums over all counts, as logged
    assert importance_means([SimpleNamespace(is_sums=None)]) is None


def test_the_learners_chunked_exact_kl_and_its_gradient_equal_autograd_through_the_full_vocabulary():
    """``token_kl`` (what the update uses for ``kl.estimator: exact``): value and gradient, at temperature
    0.7 with a stop token banned at the first two positions, equal autograd through ``exact_kl`` on the
    whole vocabulary at once."""
    from learner.logprobs import token_kl

    torch.manual_seed(1)
    z, r, g = torch.randn(5, 9, dtype=D), torch.randn(5, 9, dtype=D), torch.randn(5, dtype=D)
    ban = (torch.tensor([True, True, False, False, False]), torch.tensor([3]))
    banned = torch.zeros(5, 9, dtype=torch.bool)
    banned[:2, 3] = True

    def reference(x):  # the same distributions, by hand: z / tau with the banned logit at -inf
        return exact_kl((x / 0.7).masked_fill(banned, float("-inf")), (r / 0.7).masked_fill(banned, float("-inf")))

    x1, x2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    ours = token_kl(x1, r, chunk=2, temperature=0.7, ban=ban)
    theirs = reference(x2)
    assert torch.allclose(ours.double(), theirs, atol=1e-5)
    (ours * g.float()).sum().backward()
    (theirs * g).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)
    assert x1.grad[:2, 3].abs().max() == 0  # no gradient to a token the sampler could not pick
