"""Policy-gradient and value losses, as pure functions over tensors.

Every policy loss has the signature

    loss_fn(logprobs, old_logprobs, advantages, mask, weights, **params) -> (loss, metrics)

with ``logprobs`` ``[B, T]`` the learner's log pi_theta(o_t | q, o_<t) (with grad),
``old_logprobs`` ``[B, T]`` those of the policy that sampled the tokens (no grad),
``advantages`` ``[B, T]`` (or ``[B]``, broadcast over tokens), ``mask`` ``[B, T]``
and ``weights`` ``[B, T]`` from ``aggregation.token_weights`` (already zero on padding).
The scalar loss is ``sum_{i,t} per_token_loss[i, t] * weights[i, t]``; because the
normaliser lives in ``weights``, losses of micro-batches simply add up.

``metrics`` are detached 0-dim tensors computed over THIS micro-batch's real tokens
(plain masked means, min, max); they are diagnostics, not part of the gradient.

Follows:
* PPO clip: Schulman et al. 2017, with decoupled eps_low / eps_high (DAPO "clip-higher").
* Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with DRL".
* GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization".
* CISPO: MiniMax 2025, "MiniMax-M1" (clipped, stop-gradient importance weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

# |log r| is clamped to this before exp: r in [2.1e-9, 4.9e8]. Unclamped, a log ratio of 100 makes
# r = inf in fp32 and the gradient NaN (0 * inf in exp's backward) even on a clipped token. A token
# beyond the bound is far outside any clip range; its ratio term there has no gradient.
LOG_RATIO_CLAMP = 20.0


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _prepare(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Float mask, per-token advantages, log-ratio and log-probs, all zero on padding.

    Computed in at least float32 (bf16 log-probs are upcast) so that ratios and token
    counts stay exact; gradients still flow back to ``logprobs`` in its own dtype. The log
    ratio is clamped to ``+-LOG_RATIO_CLAMP`` (every ratio-based loss: PPO, GSPO, CISPO).
    """
    real = mask > 0
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zeros = torch.zeros(logprobs.shape, dtype=dtype, device=logprobs.device)
    mask = real.to(dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)  # [B] -> [B, T]
    advantages = torch.where(real, advantages.to(dtype), zeros)
    logprobs = torch.where(real, logprobs.to(dtype), zeros)
    raw = (logprobs - old_logprobs.detach().to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = torch.where(real, raw, zeros)  # log pi/pi_old, |.| <= LOG_RATIO_CLAMP
    return mask, advantages, log_ratio, logprobs


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _masked_min_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    # Sync-free (no .item()/boolean indexing): fill padding with +-inf, 0 if nothing is real.
    real = mask > 0
    any_real = real.any()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    x_min = torch.where(any_real, x.masked_fill(~real, float("inf")).min(), zero)
    x_max = torch.where(any_real, x.masked_fill(~real, float("-inf")).max(), zero)
    return x_min, x_max


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    ratio, log_ratio = ratio.detach(), log_ratio.detach()
    ratio_min, ratio_max = _masked_min_max(ratio, mask)
    # k3 estimate of KL(pi_old || pi_theta) on samples from pi_old: (r - 1) - log r, r = pi/pi_old
    approx_kl = _masked_mean(ratio - 1.0 - log_ratio, mask)
    return {
        "approx_kl": approx_kl,
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
    }


def _weighted_sum(per_token_loss: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    per_token_loss = torch.where(mask > 0, per_token_loss, torch.zeros_like(per_token_loss))
    return (per_token_loss * weights).sum()  # L = sum_{i,t} l_{i,t} w_{i,t}


# ---------------------------------------------------------------------------------------
# policy losses
# ---------------------------------------------------------------------------------------


def vanilla_pg_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE / on-policy PG: ``l_t = -A_t * log pi_theta(o_t)``. Shapes ``[B, T]``.

    ``old_logprobs`` is only used for the ratio diagnostics (no importance weight).
    """
    mask, advantages, log_ratio, safe_logprobs = _prepare(logprobs, old_logprobs, advantages, mask)
    per_token = -advantages * safe_logprobs  # l_t = -A_t log pi(o_t)
    loss = _weighted_sum(per_token, weights, mask)
    return loss, _ratio_metrics(torch.exp(log_ratio), log_ratio, mask)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with decoupled clip range and optional dual clip. Shapes ``[B, T]``.

    ``r_t = exp(log pi_theta - log pi_old)``,
    ``l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)``.
    Dual clip (``dual_clip = c > 1``): for ``A_t < 0``, ``l_t = min(l_t, -c A_t)``, which
    bounds the loss (and zeroes the gradient) when ``r_t > c`` on a negative advantage.

    Metrics: ``clip_frac_low`` = fraction of tokens with ``r < 1 - eps_low`` and ``A < 0``,
    ``clip_frac_high`` = fraction with ``r > 1 + eps_high`` and ``A > 0`` (the tokens whose
    gradient the clip zeroes), ``dual_clip_frac`` (``A < 0`` and ``r > c``), ``approx_kl``
    (k3 of KL(pi_old || pi_theta)), ``ratio_mean/min/max``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask, advantages, log_ratio, _ = _prepare(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)  # r_t = pi_theta / pi_old
    unclipped = -ratio * advantages  # -r_t A_t
    clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages  # -clip(r_t) A_t
    per_token = torch.maximum(unclipped, clipped)  # l_t = -min(r A, clip(r) A)
    metrics = _ratio_metrics(ratio, log_ratio, mask)
    if dual_clip is not None:
        negative = advantages < 0
        dual_bound = -dual_clip * advantages  # -c A_t  (> 0 for A_t < 0)
        per_token = torch.where(negative, torch.minimum(per_token, dual_bound), per_token)  # A<0: l = min(l, -c A)
        metrics["dual_clip_frac"] = _masked_mean((negative & (ratio.detach() > dual_clip)).to(mask.dtype), mask)
    loss = _weighted_sum(per_token, weights, mask)
    ratio_d = ratio.detach()
    metrics["clip_frac_low"] = _masked_mean(((ratio_d < 1.0 - eps_low) & (advantages < 0)).to(mask.dtype), mask)
    metrics["clip_frac_high"] = _masked_mean(((ratio_d > 1.0 + eps_high) & (advantages > 0)).to(mask.dtype), mask)
    return loss, metrics


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO clipping on a length-normalised SEQUENCE ratio. Shapes ``[B, T]`` (``A`` may be ``[B]``).

    ``s_i = exp( (1/|o_i|) sum_t (log pi_theta(o_{i,t}) - log pi_old(o_{i,t})) )``,
    ``l_{i,t} = -min(s_i A_{i,t}, clip(s_i, 1 - eps_low, 1 + eps_high) A_{i,t})``.
    With a per-sequence advantage and ``seq_mean`` weights this is exactly the paper's
    ``-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)``. Gradients reach every token through the
    mean in ``s_i``. Default clip range (3e-4, 4e-4) is the paper's; sequence ratios sit
    much closer to 1 than token ratios.

    Metrics are over sequences with at least one real token: ``clip_frac_low/high``
    (``s < 1 - eps_low`` and ``A < 0`` / ``s > 1 + eps_high`` and ``A > 0``, using the
    sequence's mean advantage), ``seq_ratio_mean/min/max``, ``approx_kl`` (token k3).
    """
    mask, advantages, log_ratio, _ = _prepare(logprobs, old_logprobs, advantages, mask)
    seq_len = mask.sum(-1)  # [B]
    seq_log_ratio = log_ratio.sum(-1) / seq_len.clamp(min=1.0)  # [B]; (1/|o_i|) sum_t log r_{i,t}
    seq_ratio = torch.exp(seq_log_ratio).unsqueeze(-1)  # [B, 1]; s_i
    unclipped = -seq_ratio * advantages  # -s_i A_{i,t}
    clipped = -torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages  # -clip(s_i) A_{i,t}
    per_token = torch.maximum(unclipped, clipped)  # l = -min(s A, clip(s) A)
    loss = _weighted_sum(per_token, weights, mask)

    has_tokens = (seq_len > 0).to(mask.dtype)  # [B]
    s = seq_ratio.detach().squeeze(-1)  # [B]
    seq_adv = (advantages * mask).sum(-1) / seq_len.clamp(min=1.0)  # [B]
    s_min, s_max = _masked_min_max(s, has_tokens)
    metrics = {
        "approx_kl": _masked_mean(torch.exp(log_ratio.detach()) - 1.0 - log_ratio.detach(), mask),
        "seq_ratio_mean": _masked_mean(s, has_tokens),
        "seq_ratio_min": s_min,
        "seq_ratio_max": s_max,
        "clip_frac_low": _masked_mean(((s < 1.0 - eps_low) & (seq_adv < 0)).to(mask.dtype), has_tokens),
        "clip_frac_high": _masked_mean(((s > 1.0 + eps_high) & (seq_adv > 0)).to(mask.dtype), has_tokens),
    }
    return loss, metrics


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio. Shapes ``[B, T]``.

    ``l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_theta(o_t)``, so
    ``dl_t / d log pi_theta(o_t) = -clip(r_t) A_t``: unlike PPO no token loses its
    gradient, the clip only bounds its size. ``eps_low = 1.0`` (the default) means no
    lower bound, as in MiniMax-M1, which tunes only the upper bound.

    Metrics: ``clip_frac_low/high`` (fraction of tokens whose weight was clipped from
    below / above, any advantage sign), ``approx_kl``, ``ratio_mean/min/max``.
    """
    mask, advantages, log_ratio, safe_logprobs = _prepare(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio.detach())  # r_t, no gradient
    is_weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # sg(clip(r_t))
    per_token = -is_weight * advantages * safe_logprobs  # l_t = -sg(clip(r_t)) A_t log pi(o_t)
    loss = _weighted_sum(per_token, weights, mask)
    metrics = _ratio_metrics(ratio, log_ratio, mask)
    metrics["clip_frac_low"] = _masked_mean((ratio < 1.0 - eps_low).to(mask.dtype), mask)
    metrics["clip_frac_high"] = _masked_mean((ratio > 1.0 + eps_high).to(mask.dtype), mask)
    return loss, metrics


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla_pg": vanilla_pg_loss,
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def get_policy_loss(name: str) -> PolicyLoss:
    """Look a policy loss up by config name; unknown names fail with the valid ones listed."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


# ---------------------------------------------------------------------------------------
# value loss and entropy
# ---------------------------------------------------------------------------------------


def value_loss(
    values: Tensor,
    returns: Tensor,
    mask: Tensor,
    weights: Tensor,
    *,
    old_values: Tensor | None = None,
    clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic regression ``l_t = 0.5 (V_t - R_t)^2``, optionally PPO-clipped. Shapes ``[B, T]``.

    Clipped (``old_values`` and ``clip`` given):
    ``V^clip_t = V_old,t + clip(V_t - V_old,t, -clip, clip)``,
    ``l_t = 0.5 max((V_t - R_t)^2, (V^clip_t - R_t)^2)``.

    Metrics: ``value_clip_frac`` (tokens where the clipped term is larger), ``value_mean``,
    ``value_mse`` (masked mean of (V - R)^2).
    """
    if (old_values is None) != (clip is None):
        raise ValueError("value clipping needs both old_values and clip (or neither)")
    real = mask > 0
    dtype = torch.promote_types(values.dtype, torch.float32)
    mask = real.to(dtype)
    zeros = torch.zeros(values.shape, dtype=dtype, device=values.device)
    values = torch.where(real, values.to(dtype), zeros)
    returns = torch.where(real, returns.detach().to(dtype), zeros)
    sq_err = (values - returns) ** 2  # (V - R)^2
    per_token = 0.5 * sq_err
    metrics: dict[str, Tensor] = {}
    if old_values is not None and clip is not None:
        old_values = torch.where(real, old_values.detach().to(dtype), zeros)
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)  # V_old + clip(V - V_old)
        sq_err_clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(sq_err, sq_err_clipped)  # 0.5 max((V-R)^2, (V^clip-R)^2)
        metrics["value_clip_frac"] = _masked_mean((sq_err_clipped > sq_err).to(mask.dtype).detach(), mask)
    loss = _weighted_sum(per_token, weights, mask)
    metrics["value_mean"] = _masked_mean(values.detach(), mask)
    metrics["value_mse"] = _masked_mean(sq_err.detach(), mask)
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: ``[B, T, V] -> [B, T]``.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, without materialising log-softmax.
    Logits of ``-inf`` (banned tokens) are allowed.
    """
    probs = torch.softmax(logits, dim=-1)
    finite = torch.where(torch.isneginf(logits), torch.zeros_like(logits), logits)  # avoid 0 * -inf = nan
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(-1)  # H = lse(z) - E_p[z]
