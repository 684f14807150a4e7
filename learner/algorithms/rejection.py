"""Rejection of tokens and whole sequences by the divergence between the learner and the sampler.

Truncation shrinks an outlying importance weight; rejection drops the token, or the whole sequence,
when the learner and the sampler disagree too much on it: stale samples of a long asynchronous run,
or a sampler whose numerics drifted from the learner's. With the per-token log-ratio of the
sampled token (clamped as in ``importance.py``)

    l_t = log pi_learner(o_t) - log pi_sampler(o_t),      rho_t = exp(l_t)

the per-token divergences, each an estimate of KL(pi_sampler || pi_learner) from samples of the
sampler (Schulman 2020, "Approximating KL Divergence", with the roles of the two policies as here):

    k1_t = -l_t                    unbiased, either sign
    k2_t = l_t^2 / 2               >= 0
    k3_t = rho_t - 1 - l_t         >= 0, unbiased

A rule (``tis.reject``) keeps a unit while ``low <= D <= high`` (a bound left empty is open):

    level = token:     D = k_t, token by token
    level = sequence:  D = mean_t k_t, sum_t k_t or max_t k_t over the sequence's real tokens

Rules combine with AND: a token is trained only if every token rule keeps it and every sequence
rule keeps its sequence. The result is a 0/1 ``[B, T]`` factor on the policy term's token weights,
stacked with the TIS weights; rejected tokens still count in the aggregation's normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from learner.algorithms.importance import LOG_RATIO_CLAMP

DIVERGENCES = ("k1", "k2", "k3")
REDUCTIONS = ("mean", "sum", "max")
LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class RejectRule:
    """Keep a token (``level="token"``) or a sequence while ``low <= D <= high``."""

    level: str = "token"
    divergence: str = "k3"
    reduce: str = "mean"  # sequence level: how the sequence's token divergences are reduced
    low: float | None = None
    high: float | None = None

    @property
    def name(self) -> str:
        """The rule in metric names: ``token_k2``, ``seq_mean_k1``."""
        return f"token_{self.divergence}" if self.level == "token" else f"seq_{self.reduce}_{self.divergence}"

    def check(self) -> RejectRule:
        if self.level not in LEVELS or self.divergence not in DIVERGENCES or self.reduce not in REDUCTIONS:
            raise ValueError(
                f"unknown rejection rule {self}; valid: level {LEVELS}, divergence {DIVERGENCES}, reduce {REDUCTIONS}"
            )
        if self.low is None and self.high is None:
            raise ValueError(
                f"rejection rule {self.name} has neither low nor high: it would reject nothing; set low, high or both"
            )
        if self.low is not None and self.high is not None and not self.low < self.high:
            raise ValueError(f"rejection rule {self.name} needs low < high, got [{self.low}, {self.high}]")
        return self


def token_divergences(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``{"k1", "k2", "k3"}`` -> ``[B, T]`` per-token divergences (detached, 0 on padding)."""
    real = mask > 0
    dtype = torch.promote_types(learner_logprobs.dtype, torch.float32)
    raw = learner_logprobs.detach().to(dtype) - sampler_logprobs.detach().to(dtype)
    log_ratio = torch.where(real, raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(raw))  # l_t
    return {
        "k1": -log_ratio,  # k1 = -l
        "k2": 0.5 * log_ratio**2,  # k2 = l^2 / 2
        "k3": torch.exp(log_ratio) - 1.0 - log_ratio,  # k3 = rho - 1 - l
    }


def _reduce(values: Tensor, real: Tensor, how: str) -> Tensor:
    """``[B, T] -> [B]``: mean, sum or max over each sequence's real tokens (0 for an empty one)."""
    masked = torch.where(real, values, torch.zeros_like(values))
    if how == "sum":
        return masked.sum(-1)
    if how == "mean":
        return masked.sum(-1) / real.sum(-1).clamp(min=1)
    top = torch.where(real, values, torch.full_like(values, float("-inf"))).max(-1).values
    return torch.where(real.any(-1), top, torch.zeros_like(top))


def _inside(values: Tensor, rule: RejectRule) -> Tensor:
    keep = torch.ones_like(values, dtype=torch.bool)
    if rule.low is not None:
        keep &= values >= rule.low
    if rule.high is not None:
        keep &= values <= rule.high
    return keep


def rejection_mask(
    learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, rules: tuple[RejectRule, ...]
) -> tuple[Tensor, dict[str, Tensor]]:
    """``[B, T]`` 0/1 keep factor (detached, 0 on padding) and metrics.

    ``learner_logprobs``, ``sampler_logprobs``, ``mask``: ``[B, T]``. Metrics (0-dim tensors):
    ``reject_<rule>_frac`` per rule, the fraction of its units it rejects (tokens over real tokens,
    sequences over sequences with a real token); ``reject_token_frac``, the real tokens rejected by
    any rule; ``reject_seq_frac``, the sequences with a real token that have every token rejected.
    """
    real = mask > 0
    dtype = torch.promote_types(learner_logprobs.dtype, torch.float32)
    keep = real.clone()
    metrics: dict[str, Tensor] = {}
    divergences = token_divergences(learner_logprobs, sampler_logprobs, mask)
    n_tokens = real.sum().clamp(min=1).to(dtype)
    has_tokens = real.any(-1)  # [B]
    n_seqs = has_tokens.sum().clamp(min=1).to(dtype)
    for rule in rules:
        values = divergences[rule.divergence]
        if rule.level == "token":
            kept = _inside(values, rule) | ~real  # [B, T]
            metrics[f"reject_{rule.name}_frac"] = (~kept & real).sum().to(dtype) / n_tokens
        else:
            kept_seq = _inside(_reduce(values, real, rule.reduce), rule) | ~has_tokens  # [B]
            metrics[f"reject_{rule.name}_frac"] = (~kept_seq & has_tokens).sum().to(dtype) / n_seqs
            kept = kept_seq.unsqueeze(-1).expand_as(real)
        keep &= kept
    metrics["reject_token_frac"] = (real & ~keep).sum().to(dtype) / n_tokens
    metrics["reject_seq_frac"] = (has_tokens & ~(keep & real).any(-1)).sum().to(dtype) / n_seqs
    return keep.to(dtype), metrics
