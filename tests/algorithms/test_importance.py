"""Truncated importance sampling: hand values, clamping, levels, modes, padding, no gradient."""

import math

import pytest
import torch

from learner.algorithms.importance import tis_weights

D = torch.float64
E = math.e
NAN = float("nan")


def _t(rows):
    return torch.tensor(rows, dtype=D)


def test_log_ratio_clamped_at_10_before_exp():
    # log ratio +50 -> clamped to 10 -> rho = e^10 -> min(e^10, 2) = 2
    # log ratio -50 -> clamped to -10 -> rho = e^-10 (below the cap, kept as is)
    learner, sampler, mask = _t([[50.0, -50.0]]), _t([[0.0, 0.0]]), _t([[1.0, 1.0]])
    w, m = tis_weights(learner, sampler, mask, cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, math.exp(-10)])
    assert m["tis_rho_max"].item() == pytest.approx(math.exp(10))  # e^10, not e^50
    # k3 = (rho - 1) - log rho: (e^10 - 1 - 10) + (e^-10 - 1 + 10) = e^10 + e^-10 - 2, mean over 2
    assert m["tis_mismatch_kl"].item() == pytest.approx((math.exp(10) + math.exp(-10) - 2) / 2)
    assert torch.isfinite(w).all()


def test_token_truncation_by_hand():
    # log ratios 1, -1, 0 -> rho = e, 1/e, 1 -> w = min(rho, 2) = 2, 0.3679, 1
    learner, sampler = _t([[1.5, -1.0, 0.25]]), _t([[0.5, 0.0, 0.25]])
    mask = _t([[1.0, 1.0, 1.0]])
    w, m = tis_weights(learner, sampler, mask, cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 1 / E, 1.0])
    assert m["tis_rho_mean"].item() == pytest.approx((E + 1 / E + 1) / 3)  # 1.3620
    assert m["tis_rho_max"].item() == pytest.approx(E)
    assert m["tis_truncated_frac"].item() == pytest.approx(1 / 3)  # only e > 2
    # ESS = (2 + e^-1 + 1)^2 / (3 * (4 + e^-2 + 1)) = 3.3679^2 / (3 * 5.1353) = 0.7363
    assert m["tis_ess"].item() == pytest.approx((3 + 1 / E) ** 2 / (3 * (5 + E**-2)))
    assert m["tis_ess"].item() == pytest.approx(0.7363, abs=1e-4)
    # k3 per token: (e - 1 - 1) + (e^-1 - 1 + 1) + 0 = e - 2 + e^-1, mean over 3 = 0.3621
    assert m["tis_mismatch_kl"].item() == pytest.approx((E - 2 + 1 / E) / 3)


def test_sequence_level_geometric_mean():
    # seq A: log ratios 1, 0, 2      -> mean 1    -> rho_A = e        -> w = min(e, 2) = 2 on 3 tokens
    # seq B: log ratios -0.3, 0.1    -> mean -0.1 -> rho_B = e^-0.1   -> w = 0.904837 on 2 tokens
    learner = _t([[1.0, 0.0, 2.0, 9.0], [-0.3, 0.1, 9.0, 9.0]])
    sampler = torch.zeros_like(learner)
    mask = _t([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    w, m = tis_weights(learner, sampler, mask, cap=2.0, level="sequence")
    rho_b = math.exp(-0.1)
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 2.0, 0.0, rho_b, rho_b, 0.0, 0.0])
    assert m["tis_rho_mean"].item() == pytest.approx((E + rho_b) / 2)  # over 2 sequences
    assert m["tis_rho_max"].item() == pytest.approx(E)
    assert m["tis_truncated_frac"].item() == pytest.approx(0.5)  # 1 of 2 sequences
    # ESS over 5 tokens: (3*2 + 2*0.904837)^2 / (5 * (3*4 + 2*0.818731)) = 7.8097^2 / 68.187 = 0.8945
    assert m["tis_ess"].item() == pytest.approx((6 + 2 * rho_b) ** 2 / (5 * (12 + 2 * rho_b**2)))


def test_mask_mode_token_level():
    # log ratios 1, -1, 0, ln 1.5, ln 0.4 -> rho = e, 0.368, 1, 1.5, 0.4; keep iff 0.5 <= rho <= 2
    learner = _t([[1.0, -1.0, 0.0, math.log(1.5), math.log(0.4)]])
    w, m = tis_weights(learner, torch.zeros_like(learner), torch.ones_like(learner), cap=2.0, mode="mask")
    assert w.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0]]  # kept ones are 1, not rho (no truncation)
    assert m["tis_masked_frac"].item() == pytest.approx(3 / 5)
    # ESS = (1 + 1)^2 / (5 * (1 + 1)) = 0.4
    assert m["tis_ess"].item() == pytest.approx(0.4)


def test_mask_mode_sequence_level():
    # seq A: token log ratios 0.9, -0.9 -> mean 0 -> rho = 1 -> kept whole (although e^0.9 = 2.46 > 2)
    # seq B: 0.8, 0.8, 0.8            -> mean 0.8 -> rho = 2.23 > 2 -> masked whole
    # seq C: -0.6                      -> rho = 0.549 in [0.5, 2] -> kept
    learner = _t([[0.9, -0.9, 0.0], [0.8, 0.8, 0.8], [-0.6, 0.0, 0.0]])
    mask = _t([[1.0, 1, 0], [1, 1, 1], [1, 0, 0]])
    w, m = tis_weights(learner, torch.zeros_like(learner), mask, cap=2.0, level="sequence", mode="mask")
    assert w.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert m["tis_masked_frac"].item() == pytest.approx(1 / 3)  # 1 of 3 sequences
    # ESS over 6 real tokens: (1+1+1)^2 / (6 * 3) = 0.5
    assert m["tis_ess"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_padding_never_changes_results(level, mode):
    learner = _t([[0.3, -0.2, 1.1], [0.05, -0.9, 0.4]])
    sampler = _t([[0.0, 0.1, 0.2], [0.3, 0.0, -0.1]])
    mask = _t([[1.0, 1, 1], [1, 1, 0]])
    w, m = tis_weights(learner, sampler, mask, level=level, mode=mode)
    # pad: two extra columns of garbage and a fully padded third row
    pad_l = _t([[0.3, -0.2, 1.1, NAN, 1e4], [0.05, -0.9, -7.0, 3.0, NAN], [NAN, 5.0, 1.0, 2.0, 0.0]])
    pad_s = _t([[0.0, 0.1, 0.2, -1e4, NAN], [0.3, 0.0, 50.0, NAN, 0.0], [0.0, NAN, 9.0, 1.0, 0.0]])
    pad_m = _t([[1.0, 1, 1, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    pw, pm = tis_weights(pad_l, pad_s, pad_m, level=level, mode=mode)
    assert torch.equal(pw[:2, :3], w) and (pw[:, 3:] == 0).all() and (pw[2] == 0).all()
    for key in m:
        if key == "tis_ess":
            continue  # N counts real tokens: unchanged, checked below
        assert pm[key].item() == pytest.approx(m[key].item(), abs=1e-12), key
    assert pm["tis_ess"].item() == pytest.approx(m["tis_ess"].item())


def test_weights_carry_no_gradient():
    learner = torch.tensor([[1.0, -0.5, 0.2]], dtype=D, requires_grad=True)
    sampler = torch.tensor([[0.0, 0.0, 0.0]], dtype=D, requires_grad=True)
    mask = _t([[1.0, 1, 1]])
    for level in ("token", "sequence"):
        w, _ = tis_weights(learner, sampler, mask, level=level)
        assert not w.requires_grad
        # d/dlp sum_t w_t lp_t = w_t exactly: no term from d w / d lp
        (grad,) = torch.autograd.grad((w * learner).sum(), learner)
        assert torch.equal(grad, w)


def test_ess_of_equal_weights_is_one():
    # every log ratio 0.5 -> rho = e^0.5 = 1.65 < 2 -> w all equal -> ESS = (4w)^2 / (4 * 4w^2) = 1
    learner = torch.full((2, 2), 0.5, dtype=D)
    _, m = tis_weights(learner, torch.zeros_like(learner), torch.ones_like(learner))
    assert m["tis_ess"].item() == pytest.approx(1.0)


def test_ess_never_exceeds_one_in_float32():
    # 1,000 equal weights rho = e^0.5 = 1.65 in fp32: summed in fp32, (sum w)^2 / (N sum w^2) came out
    # as 1.0000004; it is <= 1 by Cauchy-Schwarz
    sampler = torch.zeros((10, 100), dtype=torch.float32)
    _, m = tis_weights(sampler + 0.5, sampler, torch.ones_like(sampler))
    assert m["tis_ess"].dtype == torch.float32 and m["tis_ess"].item() <= 1.0
    assert m["tis_ess"].item() == pytest.approx(1.0)


def test_ess_hand_example():
    # log ratios ln 3, 0, 0, ln 0.5 -> rho 3, 1, 1, 0.5 -> w = 2, 1, 1, 0.5
    # ESS = (2 + 1 + 1 + 0.5)^2 / (4 * (4 + 1 + 1 + 0.25)) = 20.25 / 25 = 0.81
    learner = _t([[math.log(3), 0.0, 0.0, math.log(0.5)]])
    w, m = tis_weights(learner, torch.zeros_like(learner), torch.ones_like(learner), cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 1.0, 1.0, 0.5])
    assert m["tis_ess"].item() == pytest.approx(0.81)


def test_mismatch_kl_hand_example():
    # learner - sampler = ln 2, ln 0.5 -> rho = 2, 0.5
    # k3 = (2 - 1 - ln 2) + (0.5 - 1 + ln 2) = 0.5 -> mean over 2 tokens = 0.25
    learner, sampler = _t([[math.log(2) - 1.0, math.log(0.5) - 2.0]]), _t([[-1.0, -2.0]])
    _, m = tis_weights(learner, sampler, _t([[1.0, 1.0]]))
    assert m["tis_mismatch_kl"].item() == pytest.approx(0.25)
    # identical policies -> 0
    _, m = tis_weights(sampler, sampler, _t([[1.0, 1.0]]))
    assert m["tis_mismatch_kl"].item() == 0.0


def test_all_padding_gives_zero_weights_and_metrics():
    learner = _t([[0.5, NAN]])
    w, m = tis_weights(learner, torch.zeros_like(learner), _t([[0.0, 0.0]]), level="sequence")
    assert w.tolist() == [[0.0, 0.0]]
    assert {k: v.item() for k, v in m.items()} == {
        "tis_rho_mean": 0.0,
        "tis_rho_max": 0.0,
        "tis_truncated_frac": 0.0,
        "tis_mismatch_kl": 0.0,
        "tis_ess": 0.0,
    }


def test_float32_inputs_give_float32_weights():
    # rho = e^1 -> truncated to 2; in float32 the arithmetic is the same
    learner = torch.tensor([[1.0, 0.0]])
    w, _ = tis_weights(learner, torch.zeros_like(learner), torch.ones_like(learner))
    assert w.dtype == torch.float32 and w.tolist() == [[2.0, 1.0]]


@pytest.mark.parametrize("kwargs", [{"level": "batch"}, {"mode": "clip"}, {"cap": 0.5}, {"cap": NAN}])
def test_bad_arguments_fail(kwargs):
    x = torch.zeros((1, 1))
    with pytest.raises(ValueError):
        tis_weights(x, x, torch.ones((1, 1)), **kwargs)
