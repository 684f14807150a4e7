"""Policy and value losses: hand values, gradients, padding and micro-batch invariance."""

import math

import pytest
import torch

from learner.algorithms.aggregation import token_weights
from learner.algorithms.policy_losses import (
    POLICY_LOSSES,
    cispo_loss,
    entropy_from_logits,
    get_policy_loss,
    gspo_loss,
    ppo_clip_loss,
    value_loss,
    vanilla_pg_loss,
)

D = torch.float64
NAN = float("nan")
LN2 = math.log(2.0)


def _leaf(values):
    return torch.tensor(values, dtype=D, requires_grad=True)


# --------------------------------------------------------------------------- PPO clip


def _ppo_batch():
    # one sequence, 4 real tokens + 1 padding slot full of garbage; old logprobs all 0,
    # so log ratio = logprob: [1, ln 0.5, 0, ln 1.1]
    logprobs = _leaf([[1.0, math.log(0.5), 0.0, math.log(1.1), 1e4]])
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, -1e4]], dtype=D)
    adv = torch.tensor([[0.5, -1.0, 2.0, -1.0, NAN]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1, 1, 0]], dtype=D)
    return logprobs, old, adv, mask


def test_ppo_clip_by_hand():
    logprobs, old, adv, mask = _ppo_batch()
    weights = token_weights(mask, "token_mean", num_tokens=4)  # 1/4 each
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask, weights)
    # t0: r = e   = 2.718, A = 0.5 -> clipped to 1.2 -> l = -1.2 * 0.5 = -0.6   (clip high)
    # t1: r = 0.5,         A = -1  -> min(-0.5, 0.8 * -1) = -0.8 -> l = 0.8     (clip low)
    # t2: r = 1,           A = 2   -> l = -2
    # t3: r = 1.1,         A = -1  -> inside [0.8, 1.2] -> l = 1.1
    # loss = (-0.6 + 0.8 - 2 + 1.1) / 4 = -0.175
    assert loss.item() == pytest.approx(-0.175)
    assert metrics["clip_frac_high"].item() == pytest.approx(0.25)
    assert metrics["clip_frac_low"].item() == pytest.approx(0.25)
    # ratio mean = (e + 0.5 + 1 + 1.1) / 4, min 0.5, max e
    assert metrics["ratio_mean"].item() == pytest.approx((math.e + 2.6) / 4)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    assert metrics["ratio_max"].item() == pytest.approx(math.e)
    # approx KL = mean(r - 1 - log r) = [(e - 2) + (0.5 - 1 + ln2) + 0 + (0.1 - ln 1.1)] / 4
    expected_kl = ((math.e - 2) + (LN2 - 0.5) + 0.0 + (0.1 - math.log(1.1))) / 4
    assert metrics["approx_kl"].item() == pytest.approx(expected_kl)

    loss.backward()
    # dl/dlogp = -A * r * w where unclipped, 0 where the clip binds:
    # t0: 0, t1: 0, t2: -2 * 1 * 0.25 = -0.5, t3: -(-1) * 1.1 * 0.25 = 0.275, padding: 0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -0.5, 0.275, 0.0]], dtype=D))


def test_ppo_clip_higher_is_asymmetric():
    logprobs = _leaf([[math.log(1.25), math.log(0.75)]])
    old = torch.zeros(1, 2, dtype=D)
    adv = torch.tensor([[1.0, -1.0]], dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    weights = torch.tensor([[1.0, 0.0]], dtype=D)  # look at token 0 only
    # eps_high = 0.2: r = 1.25 clipped to 1.2 -> -1.2 ; eps_high = 0.28: not clipped -> -1.25
    assert ppo_clip_loss(logprobs, old, adv, mask, weights)[0].item() == pytest.approx(-1.2)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask, weights, eps_low=0.2, eps_high=0.28)
    assert loss.item() == pytest.approx(-1.25)
    assert metrics["clip_frac_high"].item() == 0.0
    # token 1: r = 0.75 with A = -1: eps_low = 0.2 -> clipped at 0.8 ; eps_low = 0.3 -> not clipped
    weights = torch.tensor([[0.0, 1.0]], dtype=D)
    assert ppo_clip_loss(logprobs, old, adv, mask, weights, eps_low=0.2)[0].item() == pytest.approx(0.8)
    assert ppo_clip_loss(logprobs, old, adv, mask, weights, eps_low=0.3)[0].item() == pytest.approx(0.75)


def test_ppo_dual_clip_bounds_negative_advantages():
    # t0: r = e^2 = 7.389, A = -1: plain PPO l = max(7.389, 1.2) = 7.389; dual c=3: min(7.389, 3) = 3
    # t1: r = 2, A = -1:  l = max(2, 1.2) = 2 < 3 -> unchanged
    # t2: r = e^2, A = +1: l = -min(7.389, 1.2) = -1.2, dual clip does not touch A > 0
    logprobs = _leaf([[2.0, LN2, 2.0]])
    old = torch.zeros(1, 3, dtype=D)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=D)
    mask = torch.ones(1, 3, dtype=D)
    weights = torch.ones(1, 3, dtype=D)  # plain sum, to read the per-token values
    plain, _ = ppo_clip_loss(logprobs, old, adv, mask, weights)
    assert plain.item() == pytest.approx(math.exp(2) + 2 - 1.2)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask, weights, dual_clip=3.0)
    assert loss.item() == pytest.approx(3 + 2 - 1.2)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # t0: constant -c*A -> 0; t1: -A r = 2; t2: clipped -> 0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 2.0, 0.0]], dtype=D))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logprobs, old, adv, mask, weights, dual_clip=0.9)


# --------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_by_hand():
    # seq 0: log ratios [0.1, 0.3] (+ padding garbage) -> mean 0.2 -> s = e^0.2 = 1.2214, A = +1
    #        -> clipped to 1.2 (eps_high = 0.2) -> l = -1.2 on each token
    # seq 1: log ratios [-0.4, 0, -0.2] -> mean -0.2 -> s = e^-0.2 = 0.8187, A = -1
    #        -> inside [0.8, 1.2] -> l = 0.8187 on each token
    # seq_mean weights over 2 sequences: loss = (-1.2 + 0.8187) / 2 = -0.19063
    logprobs = _leaf([[0.1, 0.3, 55.0], [-0.4, 0.0, -0.2]])
    old = torch.tensor([[0.0, 0.0, -55.0], [0.0, 0.0, 0.0]], dtype=D)
    adv = torch.tensor([1.0, -1.0], dtype=D)  # one advantage per sequence
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]], dtype=D)
    weights = token_weights(mask, "seq_mean", num_sequences=2)
    loss, metrics = gspo_loss(logprobs, old, adv, mask, weights, eps_low=0.2, eps_high=0.2)
    s1 = math.exp(-0.2)
    assert loss.item() == pytest.approx((-1.2 + s1) / 2)
    assert metrics["seq_ratio_max"].item() == pytest.approx(math.exp(0.2))
    assert metrics["seq_ratio_min"].item() == pytest.approx(s1)
    assert metrics["clip_frac_high"].item() == pytest.approx(0.5)
    assert metrics["clip_frac_low"].item() == 0.0
    loss.backward()
    # seq 0 clipped -> no gradient. seq 1: loss_1 = sum_t (1/6) s = s/2, ds/dlogp_t = s/3 -> s/6 each
    expected_grad = torch.tensor([[0.0, 0.0, 0.0], [s1 / 6] * 3], dtype=D)
    torch.testing.assert_close(logprobs.grad, expected_grad)


def test_gspo_token_advantages_equal_sequence_advantages():
    torch.manual_seed(0)
    mask = (torch.arange(5) < torch.tensor([[5], [2], [4]])).to(D)
    logprobs, old = torch.randn(3, 5, dtype=D) * 0.01, torch.randn(3, 5, dtype=D) * 0.01
    adv = torch.tensor([0.5, -2.0, 1.0], dtype=D)
    weights = token_weights(mask, "seq_mean", num_sequences=3)
    per_seq, _ = gspo_loss(logprobs, old, adv, mask, weights)
    per_token, _ = gspo_loss(logprobs, old, adv[:, None] * mask, mask, weights)
    torch.testing.assert_close(per_seq, per_token)


# --------------------------------------------------------------------------- CISPO vs PPO gradients


def _clip_batch():
    # t0: log r = 0.5 -> r = 1.6487 > 1.2 with A = 2 > 0: PPO's clip zeroes the gradient
    # t1: log r = 0   -> r = 1;  t2: padding garbage
    logprobs = _leaf([[0.5, 0.0, 9.9]])
    old = torch.tensor([[0.0, 0.0, -3.0]], dtype=D)
    adv = torch.tensor([[2.0, 2.0, NAN]], dtype=D)
    mask = torch.tensor([[1.0, 1, 0]], dtype=D)
    weights = token_weights(mask, "token_mean", num_tokens=2)  # 0.5 each
    return logprobs, old, adv, mask, weights


def test_cispo_keeps_gradient_where_ppo_clip_zeroes_it():
    logprobs, old, adv, mask, weights = _clip_batch()
    ppo, _ = ppo_clip_loss(logprobs, old, adv, mask, weights)
    (ppo_grad,) = torch.autograd.grad(ppo, logprobs)
    # PPO: t0 clipped -> 0; t1: -A r w = -2 * 1 * 0.5 = -1
    torch.testing.assert_close(ppo_grad, torch.tensor([[0.0, -1.0, 0.0]], dtype=D))

    cispo, metrics = cispo_loss(logprobs, old, adv, mask, weights, eps_high=0.2)
    # value: -(1.2 * 2 * 0.5 * 0.5) - (1 * 2 * 0 * 0.5) = -0.6
    assert cispo.item() == pytest.approx(-0.6)
    assert metrics["clip_frac_high"].item() == pytest.approx(0.5)
    (cispo_grad,) = torch.autograd.grad(cispo, logprobs)
    # CISPO: dl/dlogp = -sg(clip(r)) A w: t0: -1.2 * 2 * 0.5 = -1.2 ; t1: -1 * 2 * 0.5 = -1
    torch.testing.assert_close(cispo_grad, torch.tensor([[-1.2, -1.0, 0.0]], dtype=D))


def test_cispo_stop_gradient_excludes_ratio_derivative():
    # r = e^0.1 = 1.10517 inside the clip range, A = 3, w = 1, logp = 0.1
    # with the stop-gradient: d/dlogp [-sg(r) A logp] = -r A           = -3.3155
    # without it:             d/dlogp [-r A logp]     = -(r + r logp) A = -3.6471
    logprobs = _leaf([[0.1]])
    old = torch.zeros(1, 1, dtype=D)
    adv = torch.tensor([[3.0]], dtype=D)
    mask = weights = torch.ones(1, 1, dtype=D)
    loss, _ = cispo_loss(logprobs, old, adv, mask, weights)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad.item() == pytest.approx(-math.exp(0.1) * 3)


def test_cispo_has_no_lower_bound_by_default():
    # r = 0.5, A = -1, logp = ln 0.5: weight stays 0.5 (eps_low = 1 -> lower clip at 0)
    # l = -0.5 * (-1) * ln 0.5 = -0.34657 ; with eps_low = 0.2 the weight is 0.8 -> -0.55452
    logprobs = _leaf([[-LN2]])
    old = torch.zeros(1, 1, dtype=D)
    adv = torch.tensor([[-1.0]], dtype=D)
    mask = weights = torch.ones(1, 1, dtype=D)
    assert cispo_loss(logprobs, old, adv, mask, weights)[0].item() == pytest.approx(-0.5 * LN2)
    assert cispo_loss(logprobs, old, adv, mask, weights, eps_low=0.2)[0].item() == pytest.approx(-0.8 * LN2)


def test_vanilla_pg_by_hand():
    # l = -A logp: -(1 * -1) - (0.5 * -2) = 2 ; w = 0.5 -> loss 1 ; grad = -A w = [-0.5, -0.25]
    logprobs = _leaf([[-1.0, -2.0, 4.0]])
    old = torch.zeros(1, 3, dtype=D)
    adv = torch.tensor([[1.0, 0.5, NAN]], dtype=D)
    mask = torch.tensor([[1.0, 1, 0]], dtype=D)
    loss, _ = vanilla_pg_loss(logprobs, old, adv, mask, token_weights(mask, "token_mean", num_tokens=2))
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.25, 0.0]], dtype=D))


# --------------------------------------------------------------------------- invariances, all losses


def _random_batch(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 3])
    mask = (torch.arange(6) < lengths[:, None]).to(D)  # [8, 6]
    logprobs = -torch.rand(8, 6, generator=g, dtype=D) * 2
    old = logprobs + torch.randn(8, 6, generator=g, dtype=D) * 0.3  # ratios on both sides of the clip
    adv = torch.randn(8, generator=g, dtype=D)[:, None] * mask
    return logprobs, old, adv, mask


LOSS_PARAMS = {
    "vanilla_pg": {},
    "ppo_clip": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0},
    "gspo": {"eps_low": 0.05, "eps_high": 0.05},
    "cispo": {"eps_high": 0.1},
}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean"])
def test_eight_micro_batches_of_one_equal_one_batch_of_eight(name, mode):
    loss_fn, params = get_policy_loss(name), LOSS_PARAMS[name]
    logprobs, old, adv, mask = _random_batch(seed=11)
    norms = dict(num_tokens=float(mask.sum()), num_sequences=8.0)  # global, computed once

    whole_lp = logprobs.clone().requires_grad_(True)
    whole, _ = loss_fn(whole_lp, old, adv, mask, token_weights(mask, mode, **norms), **params)
    whole.backward()

    micro_lp = logprobs.clone().requires_grad_(True)
    total = torch.zeros((), dtype=D)
    for i in range(8):
        rows = slice(i, i + 1)
        weights = token_weights(mask[rows], mode, **norms)
        loss, _ = loss_fn(micro_lp[rows], old[rows], adv[rows], mask[rows], weights, **params)
        loss.backward()  # gradients accumulate as in gradient accumulation
        total = total + loss.detach()

    torch.testing.assert_close(total, whole.detach())
    torch.testing.assert_close(micro_lp.grad, whole_lp.grad)
    assert whole_lp.grad.abs().sum() > 0  # the comparison is not vacuous


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_padding_garbage_never_changes_loss_or_gradient(name):
    loss_fn, params = get_policy_loss(name), LOSS_PARAMS[name]
    logprobs, old, adv, mask = _random_batch(seed=12)
    weights = token_weights(mask, "seq_mean", num_sequences=8)
    clean_lp = logprobs.clone().requires_grad_(True)
    clean, clean_metrics = loss_fn(clean_lp, old, adv, mask, weights, **params)
    clean.backward()

    padding = mask == 0
    dirty_lp = logprobs.masked_fill(padding, 1e6).requires_grad_(True)
    dirty_old = old.masked_fill(padding, -1e6)
    dirty_adv = adv.masked_fill(padding, NAN)
    dirty, dirty_metrics = loss_fn(dirty_lp, dirty_old, dirty_adv, mask, weights, **params)
    dirty.backward()

    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(dirty_lp.grad, clean_lp.grad)
    for key, value in clean_metrics.items():
        torch.testing.assert_close(dirty_metrics[key], value)


def test_bf16_logprobs_are_computed_in_float32():
    # 1000 tokens: a bf16 token count would stop at 256; ratio = 1 everywhere, A = 0.5
    # -> loss = -mean(r A) = -0.5, ratio_mean = 1, gradient -A w = -0.5/1000 back in bf16
    logprobs = torch.full((1, 1000), -1.0, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(1, 1000)
    loss, metrics = ppo_clip_loss(
        logprobs, logprobs.detach(), torch.full((1,), 0.5), mask, token_weights(mask, "token_mean", num_tokens=1000)
    )
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(-0.5)
    assert metrics["ratio_mean"].item() == 1.0
    loss.backward()
    assert logprobs.grad.dtype == torch.bfloat16
    assert logprobs.grad.float().mean().item() == pytest.approx(-0.5 / 1000, rel=1e-2)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient(name, dtype):
    # log r = 100: exp overflows fp32 (r = inf) and, unclamped, 0 * inf in exp's backward is NaN.
    # The log ratio is clamped to +-20 first (r <= 4.9e8).
    logprobs = torch.tensor([[100.0, 0.5]], dtype=dtype, requires_grad=True)
    old = torch.zeros((1, 2), dtype=dtype)
    mask = torch.ones((1, 2), dtype=dtype)
    for advantage in (1.0, -1.0):
        adv = torch.full((1, 2), advantage, dtype=dtype)
        w = token_weights(mask, "token_mean", num_tokens=2.0)
        loss, metrics = get_policy_loss(name)(logprobs, old, adv, mask, w)
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (name, advantage, loss, grad)
        assert all(torch.isfinite(v) for v in metrics.values())
    if name == "ppo_clip":
        # A = -1 on token 0: unclipped -r A = r = e^20 (the clamp's bound), and no gradient beyond it
        assert float(loss.detach()) == pytest.approx((math.exp(20.0) + math.exp(0.5)) / 2, rel=1e-5)
        assert grad[0, 0] == 0.0 and grad[0, 1] == pytest.approx(math.exp(0.5) / 2, rel=1e-5)


def test_registry_rejects_unknown_names():
    assert set(POLICY_LOSSES) == {"vanilla_pg", "ppo_clip", "gspo", "cispo"}
    assert get_policy_loss("ppo_clip") is ppo_clip_loss
    with pytest.raises(ValueError) as err:
        get_policy_loss("ppo")
    for name in POLICY_LOSSES:
        assert name in str(err.value)


# --------------------------------------------------------------------------- value loss, entropy


def test_value_loss_by_hand():
    values = _leaf([[2.4, 1.0, 8.0]])
    returns = torch.tensor([[2.5, 2.0, NAN]], dtype=D)
    old_values = torch.tensor([[1.5, 1.1, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1, 0]], dtype=D)
    weights = token_weights(mask, "token_mean", num_tokens=2)
    # unclipped: 0.5 * [(2.4-2.5)^2, (1-2)^2] = [0.005, 0.5] -> mean 0.2525
    loss, metrics = value_loss(values, returns, mask, weights)
    assert loss.item() == pytest.approx(0.2525)
    assert metrics["value_mse"].item() == pytest.approx((0.01 + 1.0) / 2)
    # clipped (0.2): t0: V_clip = 1.5 + 0.2 = 1.7 -> (1.7-2.5)^2 = 0.64 > 0.01 -> 0.5*0.64 = 0.32
    #                t1: V - V_old = -0.1 inside -> V_clip = 1.0 -> 0.5 * 1 = 0.5
    # loss = (0.32 + 0.5) / 2 = 0.41
    loss, metrics = value_loss(values, returns, mask, weights, old_values=old_values, clip=0.2)
    assert loss.item() == pytest.approx(0.41)
    assert metrics["value_clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # t0: clipped term is constant in V -> 0 ; t1: (V - R) * w = (1 - 2) * 0.5 = -0.5
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.5, 0.0]], dtype=D))
    with pytest.raises(ValueError, match="both"):
        value_loss(values, returns, mask, weights, clip=0.2)


def test_entropy_from_logits_by_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, float("-inf")]]], dtype=D)
    # uniform over 4 -> ln 4 ; p = [0.25, 0.75] -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    expected = torch.tensor([[math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]], dtype=D)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    logits.requires_grad_(True)
    entropy_from_logits(logits).sum().backward()
    assert not torch.isnan(logits.grad).any()  # a banned (-inf) token does not poison the gradient
