"""Per-token KL estimators, KL reward shaping and the adaptive KL coefficient.

Convention: tokens are sampled from the policy pi, and ``l_t = log pi(o_t) - log pi_ref(o_t)``.
The estimators of KL(pi || pi_ref) follow J. Schulman, "Approximating KL Divergence" (2020):

* ``k1 = l``                      unbiased, high variance, can be negative
* ``k2 = 0.5 * l^2``              biased, low variance, >= 0
* ``k3 = exp(-l) - 1 + l``        unbiased, low variance, >= 0 (``(rho - 1) - log rho`` with
                                  ``rho = pi_ref / pi = exp(-l)``)
* ``abs = |l|``                   biased, >= 0

As a loss term (``kl.placement: loss``) what matters is the gradient. With samples from pi,
``E[grad k2] = E[l grad log pi] = grad KL(pi || pi_ref)``: k2's gradient is the KL's, unbiased.
k1's gradient ``grad log pi`` has expectation 0, and k3's, ``(1 - exp(-l)) grad log pi``, is the
gradient of KL(pi_ref || pi), the other direction. The straight-through forms keep the value of k1
or k3 (what is logged and added) and take the gradient of k2:

* ``k1_plus = k1 + k2 - stop_grad(k2)``,  ``k3_plus = k3 + k2 - stop_grad(k2)``,
  ``abs_plus = |l| + k2 - stop_grad(k2)``   (value: k1, k3, |l|)

"Unbiased" holds for tokens sampled from the current pi: with a stale sampler, several epochs or
minibatches, the samples come from another policy (the KL term is not importance-weighted).

``exact_kl`` is the KL over the whole vocabulary at each position, from both models' logits,
``sum_v p(v) (log p(v) - log q(v))``, computed ``chunk`` positions at a time.

Each estimator maps ``[B, T]`` logprobs to a ``[B, T]`` per-token KL, zero where ``mask``
is 0 (if a mask is given). Reward shaping and the adaptive coefficient follow Ziegler et al.
2019, "Fine-Tuning Language Models from Human Preferences".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

KLEstimator = Callable[..., Tensor]  # (logprobs, ref_logprobs, mask=None) -> [B, T]


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None) -> Tensor:
    log_ratio = logprobs - ref_logprobs  # l = log pi - log pi_ref
    if mask is None:
        return log_ratio
    return torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))  # KL of padding = 0


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """``k1 = l``. ``[B, T], [B, T] -> [B, T]``."""
    return _log_ratio(logprobs, ref_logprobs, mask)  # k1 = l


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """``k2 = 0.5 * l^2``. ``[B, T], [B, T] -> [B, T]``."""
    log_ratio = _log_ratio(logprobs, ref_logprobs, mask)
    return 0.5 * log_ratio**2  # k2 = l^2 / 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """``k3 = exp(-l) - 1 + l``. ``[B, T], [B, T] -> [B, T]``."""
    log_ratio = _log_ratio(logprobs, ref_logprobs, mask)
    return torch.exp(-log_ratio) - 1.0 + log_ratio  # k3 = e^{-l} - 1 + l


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """``|l|``. ``[B, T], [B, T] -> [B, T]``."""
    return _log_ratio(logprobs, ref_logprobs, mask).abs()  # |l|


def _with_k2_gradient(value: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None) -> Tensor:
    k2 = kl_k2(logprobs, ref_logprobs, mask)
    return value.detach() + (k2 - k2.detach())  # the value of `value`, the gradient of k2


def kl_k1_plus(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """``k1 + k2 - stop_grad(k2)``: k1's value, k2's (unbiased) gradient. ``[B, T] -> [B, T]``."""
    return _with_k2_gradient(kl_k1(logprobs, ref_logprobs, mask), logprobs, ref_logprobs, mask)


def kl_k3_plus(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """``k3 + k2 - stop_grad(k2)``: k3's value, k2's (unbiased) gradient. ``[B, T] -> [B, T]``."""
    return _with_k2_gradient(kl_k3(logprobs, ref_logprobs, mask), logprobs, ref_logprobs, mask)


def kl_abs_plus(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """``|l| + k2 - stop_grad(k2)``: |l|'s value, k2's (unbiased) gradient. ``[B, T] -> [B, T]``."""
    return _with_k2_gradient(kl_abs(logprobs, ref_logprobs, mask), logprobs, ref_logprobs, mask)


def exact_kl(logits: Tensor, ref_logits: Tensor, mask: Tensor | None = None, chunk: int = 1024) -> Tensor:
    """KL(pi || pi_ref) over the whole vocabulary at each position: ``[N, V], [N, V] -> [N]``
    (or ``[B, T, V] -> [B, T]``), ``sum_v softmax(z)_v (log_softmax(z)_v - log_softmax(z_ref)_v)``,
    ``chunk`` positions at a time (at most ``chunk x V`` floats of each distribution live at once;
    the gradient flows to ``logits``). 0 where ``mask`` is 0."""
    if chunk < 1:
        raise ValueError(f"exact_kl needs chunk >= 1, got {chunk}")
    shape, dtype = logits.shape[:-1], torch.promote_types(logits.dtype, torch.float32)
    flat, ref = logits.reshape(-1, logits.shape[-1]), ref_logits.reshape(-1, ref_logits.shape[-1])
    parts = []
    for start in range(0, flat.shape[0], chunk):
        logp = torch.log_softmax(flat[start : start + chunk].to(dtype), dim=-1)
        logq = torch.log_softmax(ref[start : start + chunk].to(dtype), dim=-1)
        p = logp.exp()
        # 0 log 0 = 0 (a banned token); the log-ratio is zeroed before the product, so no NaN reaches a gradient
        log_ratio = torch.where(p > 0, logp - logq, torch.zeros_like(p))
        parts.append((p * log_ratio).sum(-1))  # sum_v p (log p - log q)
    kl = torch.cat(parts).reshape(shape) if parts else flat.new_zeros(shape, dtype=dtype)
    return kl if mask is None else torch.where(mask > 0, kl, torch.zeros_like(kl))


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "abs": kl_abs,
    "k1_plus": kl_k1_plus,
    "k3_plus": kl_k3_plus,
    "abs_plus": kl_abs_plus,
}


def get_kl_estimator(name: str) -> KLEstimator:
    """Look a KL estimator up by config name; unknown names fail with the valid ones listed."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name]


def kl_reward_shaping(
    task_reward: Tensor, kl: Tensor, mask: Tensor, beta: float, completion_mask: Tensor | None = None
) -> Tensor:
    """Per-token rewards ``r_t = -beta * KL_t`` on trained tokens, plus the task reward on the last
    token of the completion.

    The task reward belongs to the sequence, not to the tokens that are trained: a completion whose
    tokens are all masked out (``algorithm.shaping.mask_truncated``) still carries its reward, so it still
    counts in its group's baseline. Hence two masks.

    Args:
        task_reward: ``[B]`` sequence-level reward.
        kl: ``[B, T]`` per-token KL estimate (e.g. from ``kl_k1``).
        mask: ``[B, T]`` trained tokens: where ``-beta KL_t`` applies.
        beta: KL coefficient.
        completion_mask: ``[B, T]`` the completion's real tokens (default ``mask``); the task reward
            lands on the LAST position where it is 1. A sequence with no token gets no reward.

    Returns:
        ``[B, T]`` per-token rewards, zero outside the completion.
    """
    trained = mask > 0
    real = trained if completion_mask is None else completion_mask > 0
    rewards = torch.where(trained, -beta * kl, torch.zeros_like(kl))  # r_t = -beta KL_t
    positions = torch.arange(kl.shape[-1], device=kl.device).expand_as(kl)  # [B, T]
    last = torch.where(real, positions, torch.full_like(positions, -1)).max(-1).values  # [B]; -1 if empty
    has_tokens = last >= 0  # [B]
    bonus = torch.where(has_tokens, task_reward.to(kl.dtype), torch.zeros_like(task_reward, dtype=kl.dtype))
    # r_{T_i} += R_i at the last completion token T_i
    return rewards.scatter_add(-1, last.clamp(min=0).unsqueeze(-1), bonus.unsqueeze(-1))


def adaptive_kl_beta(beta: float, kl: float, kl_target: float, n_steps: int, horizon: int) -> float:
    """Proportional controller for the KL coefficient (Ziegler et al. 2019, eq. 2).

    ``e = clip(KL / KL_target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.

    Args:
        beta: current coefficient.
        kl: observed KL(pi || pi_ref) of the last batch (a float: call ``.item()`` once).
        kl_target: desired KL.
        n_steps: samples (or steps) since the last update.
        horizon: controller horizon in the same unit.
    """
    error = min(max(kl / kl_target - 1.0, -0.2), 0.2)  # e = clip(KL/KL_target - 1, -0.2, 0.2)
    return beta * (1.0 + error * n_steps / horizon)  # beta <- beta (1 + e n / H)
