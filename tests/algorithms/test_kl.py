"""KL estimators, KL reward shaping and the adaptive KL coefficient."""

import math

import pytest
import torch

from learner.algorithms.kl import (
    KL_ESTIMATORS,
    adaptive_kl_beta,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_reward_shaping,
)

D = torch.float64
LN2 = math.log(2.0)


def test_estimators_on_log_two():
    # l = log pi - log pi_ref = +ln 2 and -ln 2
    logprobs = torch.tensor([[LN2, -LN2]], dtype=D)
    ref = torch.zeros(1, 2, dtype=D)
    # k1 = l = +-0.693147
    torch.testing.assert_close(kl_k1(logprobs, ref), torch.tensor([[LN2, -LN2]], dtype=D))
    # k2 = l^2 / 2 = 0.240227 for both signs
    torch.testing.assert_close(kl_k2(logprobs, ref), torch.tensor([[LN2**2 / 2] * 2], dtype=D))
    # k3 = e^{-l} - 1 + l: l = ln2 -> 0.5 - 1 + 0.693147 = 0.193147 ; l = -ln2 -> 2 - 1 - 0.693147 = 0.306853
    torch.testing.assert_close(kl_k3(logprobs, ref), torch.tensor([[LN2 - 0.5, 1 - LN2]], dtype=D))


def test_k1_and_k3_are_unbiased_for_kl_policy_to_reference():
    # exact expectation over a 3-way categorical, samples drawn from pi:
    # E_pi[k1] = E_pi[k3] = KL(pi || pi_ref) = sum pi log(pi / pi_ref)
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=D)
    ref = torch.tensor([0.2, 0.2, 0.6], dtype=D)
    kl = (pi * (pi / ref).log()).sum()
    logp, ref_logp = pi.log()[None], ref.log()[None]
    torch.testing.assert_close((pi * kl_k1(logp, ref_logp)[0]).sum(), kl)
    torch.testing.assert_close((pi * kl_k3(logp, ref_logp)[0]).sum(), kl)


def test_masked_positions_are_zero_even_with_garbage():
    logprobs = torch.tensor([[LN2, 1e4]], dtype=D)
    ref = torch.tensor([[0.0, -1e4]], dtype=D)  # l = 2e4 in the padded slot: e^{-l} fine, but k2 huge
    mask = torch.tensor([[1.0, 0.0]], dtype=D)
    for name, estimator in KL_ESTIMATORS.items():
        got = estimator(logprobs, ref, mask)
        assert got[0, 1].item() == 0.0, name
        assert got[0, 0].item() == pytest.approx(estimator(logprobs[:, :1], ref[:, :1])[0, 0].item())


def test_registry_rejects_unknown_names():
    assert get_kl_estimator("k3") is kl_k3
    with pytest.raises(ValueError) as err:
        get_kl_estimator("k4")
    for name in ("k1", "k2", "k3"):
        assert name in str(err.value)


def test_kl_reward_shaping_by_hand():
    task = torch.tensor([1.0, 2.0, 5.0], dtype=D)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.4, float("nan")], [9.0, 9.0, 9.0]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=D)
    got = kl_reward_shaping(task, kl, mask, beta=0.1)
    # seq 0: -0.1 * [0.1, 0.2, 0.3] + [0, 0, 1] = [-0.01, -0.02, 0.97]
    # seq 1: -0.1 * [0.5, 0.4] + [0, 2] = [-0.05, 1.96], padding 0
    # seq 2: no real token -> all zero, no task reward
    expected = torch.tensor([[-0.01, -0.02, 0.97], [-0.05, 1.96, 0.0], [0.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(got, expected)


def test_adaptive_kl_beta():
    # KL = 0.3, target 0.1: e = 3 - 1 = 2 -> clipped to 0.2 ; beta = 0.1 * (1 + 0.2 * 256/10000) = 0.100512
    assert adaptive_kl_beta(0.1, 0.3, 0.1, n_steps=256, horizon=10000) == pytest.approx(0.100512)
    # KL = 0.095: e = -0.05 ; beta = 0.1 * (1 - 0.05 * 0.0256) = 0.099872
    assert adaptive_kl_beta(0.1, 0.095, 0.1, n_steps=256, horizon=10000) == pytest.approx(0.099872)
    # KL = 0: e = -1 -> clipped to -0.2 ; beta = 0.1 * (1 - 0.2 * 0.5) = 0.09
    assert adaptive_kl_beta(0.1, 0.0, 0.1, n_steps=5000, horizon=10000) == pytest.approx(0.09)
