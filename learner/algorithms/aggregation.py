"""Loss aggregation as explicit per-token weights.

A loss over a batch is ``sum_{i,t} per_token_loss[i, t] * weights[i, t]``. Writing the
reduction as weights (instead of ``.mean()`` inside the loss) makes the normaliser
explicit: it is computed ONCE over the whole optimizer step (all data-parallel ranks and
all micro-batches) and passed in, so that 2 ranks x half a batch give the same gradient
as 1 rank x the whole batch, and 8 micro-batches of 1 give the same gradient as one
micro-batch of 8.

Modes (``mask`` is ``[B, T]``, 1.0 on real completion tokens, 0.0 on padding):

* ``"token_mean"``   w_{i,t} = m_{i,t} / N_tokens                  (DAPO token-level mean)
* ``"seq_mean"``     w_{i,t} = m_{i,t} / (|o_i| * N_seqs)          (GRPO: mean of per-sequence means)
* ``"fixed_length"`` w_{i,t} = m_{i,t} / (L_max * N_seqs)          (Dr. GRPO, Liu et al. 2025)
* ``"token_sum"``    w_{i,t} = m_{i,t}                             (the sum over every trained token)
* ``"seq_mean_token_sum"`` w_{i,t} = m_{i,t} / N_seqs              (each sequence's token sum, averaged)

The two sums let a sequence's weight grow with its length (as the mean modes do not); with them the
step's size grows with the number of tokens, so the learning rate must be set for it.

``N_tokens`` and ``N_seqs`` are GLOBAL counts; ``|o_i|`` is the sequence's own token
count, which is local to the sequence and therefore safe to compute here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _float_mask(mask: Tensor) -> Tensor:
    return mask if mask.is_floating_point() else mask.to(torch.get_default_dtype())


def _require(value: float | int | None, name: str, mode: str) -> float:
    if value is None:
        raise ValueError(f"aggregation mode {mode!r} needs {name}= (a global count passed in)")
    if value <= 0:
        raise ValueError(f"aggregation mode {mode!r} needs {name} > 0, got {value}")
    return float(value)


def _token_mean(mask: Tensor, num_tokens: float | None, num_sequences: float | None, max_len: int | None) -> Tensor:
    n_tokens = _require(num_tokens, "num_tokens", "token_mean")
    return mask / n_tokens  # w = m / N_tokens


def _seq_mean(mask: Tensor, num_tokens: float | None, num_sequences: float | None, max_len: int | None) -> Tensor:
    n_seqs = _require(num_sequences, "num_sequences", "seq_mean")
    seq_len = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)  # [B, 1]; |o_i|, empty rows get weight 0 anyway
    return mask / (seq_len * n_seqs)  # w = m / (|o_i| * N_seqs)


def _fixed_length(mask: Tensor, num_tokens: float | None, num_sequences: float | None, max_len: int | None) -> Tensor:
    n_seqs = _require(num_sequences, "num_sequences", "fixed_length")
    l_max = _require(max_len, "max_len", "fixed_length")
    return mask / (l_max * n_seqs)  # w = m / (L_max * N_seqs)


def _token_sum(mask: Tensor, num_tokens: float | None, num_sequences: float | None, max_len: int | None) -> Tensor:
    return mask.clone()  # w = m


def _seq_mean_token_sum(
    mask: Tensor, num_tokens: float | None, num_sequences: float | None, max_len: int | None
) -> Tensor:
    n_seqs = _require(num_sequences, "num_sequences", "seq_mean_token_sum")
    return mask / n_seqs  # w = m / N_seqs


_WEIGHT_FNS: dict[str, Callable[[Tensor, float | None, float | None, int | None], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean": _seq_mean,
    "fixed_length": _fixed_length,
    "token_sum": _token_sum,
    "seq_mean_token_sum": _seq_mean_token_sum,
}

AGGREGATIONS: tuple[str, ...] = tuple(_WEIGHT_FNS)


def check_aggregation(mode: str) -> str:
    """Validate an aggregation name at config time; returns it unchanged."""
    if mode not in _WEIGHT_FNS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    return mode


def token_weights(
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Per-token loss weights ``[B, T]`` for ``loss = sum(per_token_loss * weights)``.

    Args:
        mask: ``[B, T]`` completion mask (1 real token, 0 padding; bool or float).
        mode: one of ``AGGREGATIONS``.
        num_tokens: global number of real tokens in the optimizer step (``token_mean``).
        num_sequences: global number of sequences in the optimizer step
            (``seq_mean``, ``fixed_length``).
        max_len: the fixed length L_max, usually the max completion length (``fixed_length``).

    Returns:
        ``[B, T]`` weights, zero wherever ``mask`` is zero.
    """
    weight_fn = _WEIGHT_FNS[check_aggregation(mode)]
    return weight_fn(_float_mask(mask), num_tokens, num_sequences, max_len)
