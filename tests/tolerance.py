"""Tolerances for comparing floating-point results that may be summed in another order.

A sum of ``n`` terms evaluated in two orders (other thread counts, SIMD widths, packing, ranks) gives
two results that both carry rounding error; neither is "the" answer, so an equality test must allow
the error bound of the sum itself, which depends on the dtype and on ``n``, not on the machine.
"""

from __future__ import annotations

import torch


def reduction_rtol(dtype: torch.dtype, terms: int) -> float:
    """The relative tolerance between two evaluations of a sum of ``terms`` terms of ``dtype``, in
    any order: ``(terms - 1) * eps`` (at least ``eps``), ``eps = torch.finfo(dtype).eps``.

    Recursive summation of ``x_1 .. x_n`` in any order computes ``sum(x) + d`` with
    ``|d| <= (n - 1) * u * sum(|x|)`` to first order, ``u = eps / 2`` the unit roundoff (Higham,
    *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2); two orders can err in opposite
    directions, hence ``2 * u = eps`` per added term. It is the worst case, not the typical one (about
    ``sqrt(n) * u``): a test held to it cannot fail by rounding on any machine, and it is still far
    below a real error (a wrong normaliser, a missing term), which moves results by a whole term or
    more. It holds relative to ``sum(|x|)``: equal to the sum's magnitude when the terms have one sign
    (weights, probabilities, counts), larger under cancellation, where a test should compare
    ``sum(|x|) * reduction_rtol(...)`` as an absolute tolerance instead. A pairwise or blocked sum
    (torch's CPU reductions, GEMM) has a smaller bound, so this one covers them too.

    float32: ``eps = 1.19e-7``, so 92 terms -> 1.1e-5; float64: ``eps = 2.2e-16``, 92 terms -> 2.0e-14.
    """
    return max(terms - 1, 1) * torch.finfo(dtype).eps


# The tiny model's float32 log-prob of one token, computed in two layouts (packed or padded rows, other
# row lengths, one rank or two), differs by the end of a chain of reductions through the whole forward
# (attention, projections, norms, the log-softmax); a worst-case bound compounded over the chain is far
# looser than any use, so the suite holds the model to this absolute bound instead (tests/test_packing.py,
# tests/test_attention.py, tests/test_pipeline_parts.py assert it). The largest difference measured under
# every row of bench/numerics_matrix.sh is 9.5e-7: two ulps of a log-prob in [-8, -4] (ulp 4.8e-7), so 1e-5
# leaves 10x; a sequence that sees another's tokens moves by more than 1e-2.
PACKED_LOGPROB_ATOL = 1e-5
