"""Truncated importance sampling (TIS) between the sampler and the learner.

The tokens were sampled by the generation actors (vLLM, possibly weights a few versions
old, and a different numeric stack), but the loss treats them as samples of the
learner's policy. The per-token ratio

    rho_t = pi_learner(o_t) / pi_sampler(o_t) = exp(log pi_learner - log pi_sampler)

corrects for that mismatch; truncating it bounds the variance (Ionides 2008, "Truncated
importance sampling"; applied to the sampler/learner mismatch of LLM RL by Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"). Variants: a
sequence-level ratio (the geometric mean of the token ratios, as GSPO's length-normalised
ratio); masking, which drops outlying tokens or sequences instead of shrinking them; and band
masking, which keeps the ratio itself as the weight while it lies inside a band and drops the
token (or sequence) outside it (IcePop's double-sided masking, Ling Team 2025).

``learner_logprobs`` is the learner's log-prob of the policy the loss treats as "old"
(``old_logprobs`` when they were scored up front, otherwise the current learner log-probs,
detached). The weights are constants (no gradient flows through them) and are zero on
padding, so they plug into any policy loss as an extra factor on its aggregation weights:

    weights = token_weights(mask, aggregation, ...) * tis_w     # [B, T]
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, weights)

Masked tokens still count in the aggregation's normaliser (``N_tokens``): they contribute
zero, they are not dropped from the mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 10.0  # |log rho| <= 10 before exp: rho in [4.5e-5, 2.2e4], never inf
LEVELS = ("token", "sequence")
MODES = ("truncate", "mask", "band")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    real = mask > 0
    return torch.where(real.any(), x.masked_fill(~real, float("-inf")).max(), x.new_zeros(()))


def tis_weights(
    learner_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    cap: float = 2.0,
    level: str = "token",
    mode: str = "truncate",
    low: float | None = None,
    high: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights of the sampled tokens, ``[B, T]`` (detached, 0 on padding).

    ``learner_logprobs``, ``sampler_logprobs``, ``mask``: ``[B, T]``; ``cap`` = C >= 1.

    * ``log rho_t = clamp(log pi_learner(o_t) - log pi_sampler(o_t), -10, 10)``
    * ``level="token"``:    ``rho_t`` per token.
      ``level="sequence"``: ``rho_i = exp((1/|o_i|) sum_t log rho_t)`` (geometric mean of
      the token ratios over the sequence's real tokens), the same for all its tokens.
    * ``mode="truncate"``:  ``w = min(rho, C)``.
      ``mode="mask"``:      ``w = 1 if 1/C <= rho <= C else 0`` (whole sequences at the
      sequence level); no truncation of the kept ones.
      ``mode="band"``:      ``w = rho if low <= rho <= high else 0`` (``low``, ``high``: the band,
      default ``[1/C, C]``); the kept ones keep their ratio.

    Metrics (detached 0-dim tensors):

    * ``tis_rho_mean``, ``tis_rho_max``: of rho over real tokens (token level) or over
      sequences with at least one real token (sequence level);
    * ``tis_truncated_frac`` (truncate: rho > C) or ``tis_masked_frac`` (mask: rho outside
      [1/C, C]; band: outside [low, high]), over the same units;
    * ``tis_mismatch_kl``: k3 estimate of KL(pi_sampler || pi_learner) from the samples
      (drawn from pi_sampler), ``mean_t (rho_t - 1) - log rho_t`` over real tokens, with the
      clamped token ratio; >= 0, 0 iff the two policies agree on every sampled token;
    * ``tis_ess``: effective sample size of the weights over the N real tokens,
      ``ESS = (sum_t w_t)^2 / (N sum_t w_t^2)`` in [0, 1] (Kish 1965, divided by N): 1 when
      all weights are equal, 1/N when a single token carries all the weight, 0 when all
      weights are 0.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; valid: {', '.join(LEVELS)}")
    if mode not in MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; valid: {', '.join(MODES)}")
    if not cap >= 1.0:
        raise ValueError(f"importance-sampling cap must be >= 1, got {cap}")
    low, high = (1.0 / cap if low is None else low), (cap if high is None else high)
    if mode == "band" and not 0.0 <= low < 1.0 < high:
        raise ValueError(f"importance-sampling band must satisfy 0 <= low < 1 < high, got [{low}, {high}]")
    real = mask > 0
    dtype = torch.promote_types(learner_logprobs.dtype, torch.float32)
    zeros = torch.zeros(real.shape, dtype=dtype, device=real.device)
    token_mask = real.to(dtype)  # [B, T]
    raw = learner_logprobs.detach().to(dtype) - sampler_logprobs.detach().to(dtype)
    log_ratio = torch.where(real, raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), zeros)  # log rho_t, 0 on padding

    if level == "token":
        unit_ratio, unit_mask = torch.exp(log_ratio), token_mask  # [B, T]; rho_t
        ratio = unit_ratio
    else:
        seq_len = token_mask.sum(-1)  # [B]; |o_i|
        unit_ratio = torch.exp(log_ratio.sum(-1) / seq_len.clamp(min=1.0))  # [B]; rho_i = exp(mean_t log rho_t)
        unit_mask = (seq_len > 0).to(dtype)  # [B]
        ratio = unit_ratio.unsqueeze(-1).expand_as(log_ratio)  # [B, T]

    if mode == "truncate":
        weights = torch.clamp(ratio, max=cap)  # w = min(rho, C)
        flagged, flag_name = unit_ratio > cap, "tis_truncated_frac"
    elif mode == "mask":
        keep = (ratio >= 1.0 / cap) & (ratio <= cap)  # 1/C <= rho <= C
        weights = keep.to(dtype)  # w = 1[kept]
        flagged, flag_name = (unit_ratio < 1.0 / cap) | (unit_ratio > cap), "tis_masked_frac"
    else:
        keep = (ratio >= low) & (ratio <= high)  # low <= rho <= high
        weights = torch.where(keep, ratio, zeros)  # w = rho 1[kept]
        flagged, flag_name = (unit_ratio < low) | (unit_ratio > high), "tis_masked_frac"
    weights = torch.where(real, weights, zeros)  # [B, T]; padding -> 0

    w64 = weights.double()  # sums in float64: fp32 rounding put the ESS of equal weights at 1 + 1e-7
    w_sum, w_sq, n_tokens = w64.sum(), (w64 * w64).sum(), token_mask.double().sum()
    ess = torch.where(w_sq > 0, w_sum**2 / (n_tokens * w_sq).clamp(min=1e-30), torch.zeros((), dtype=torch.float64))
    ess = ess.clamp(max=1.0).to(dtype)  # <= 1 by Cauchy-Schwarz; the clamp only removes rounding
    k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # (rho - 1) - log rho, estimates KL(pi_sampler || pi_learner)
    metrics = {
        "tis_rho_mean": _masked_mean(unit_ratio, unit_mask),
        "tis_rho_max": _masked_max(unit_ratio, unit_mask),
        flag_name: _masked_mean(flagged.to(dtype), unit_mask),
        "tis_mismatch_kl": _masked_mean(k3, token_mask),
        "tis_ess": ess,  # (sum w)^2 / (N sum w^2)
    }
    return weights, metrics


def weight_sums(weights: Tensor, mask: Tensor, level: str = "token") -> tuple[float, float]:
    """``(sum, count)`` of the importance weights over the trained units of a micro-batch: tokens
    (``sum_t w_t`` over real tokens) or sequences (``sum_i w_i`` over sequences with a real token,
    ``w_i`` its tokens' common weight). Summed over every micro-batch and rank of an optimizer step,
    ``sum / count`` is the batch mean that batch normalisation (``tis.normalize``) divides by:

        w_t <- w_t / mean(w)      so that the mean weight over the step's trained units is 1
    """
    real = mask > 0
    w = torch.where(real, weights.double(), torch.zeros((), dtype=torch.float64))
    if level == "token":
        return float(w.sum()), float(real.sum())
    seq_len = real.sum(-1)
    has_tokens = seq_len > 0
    per_sequence = w.sum(-1) / seq_len.clamp(min=1)  # w_i: the mean of equal weights
    return float(per_sequence[has_tokens].sum()), float(has_tokens.sum())
