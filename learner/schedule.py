"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay.

For optimizer update ``u`` (0-based), warm-up ``W`` updates and ``U`` updates in the run:

    f(u) = (u + 1) / W                                   u < W   (warm-up)
    f(u) = 1                                             constant
    f(u) = 1 - (1 - m) * d                               linear,  d = (u - W) / max(U - W, 1), capped at 1
    f(u) = m + (1 - m) * (1 + cos(pi * d)) / 2           cosine

and ``lr(u) = learner.lr * f(u)``; ``m`` is ``learner.min_lr_ratio``. The schedule is a
``LambdaLR`` that DeepSpeed steps with every applied update (a skipped, non-finite one does not
count) and saves and restores with the optimizer.
"""

from __future__ import annotations

import math


def lr_factor(update: int, kind: str, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    if update < warmup:
        return (update + 1) / warmup
    if kind == "constant" or total <= 0:
        return 1.0
    done = min((update - warmup) / max(total - warmup, 1), 1.0)
    if kind == "linear":
        return 1.0 - (1.0 - min_ratio) * done
    if kind == "cosine":
        return min_ratio + (1.0 - min_ratio) * (1.0 + math.cos(math.pi * done)) / 2.0
    raise ValueError(f"unknown learning-rate schedule {kind!r}; use constant, linear or cosine")


SCHEDULES = ("constant", "linear", "cosine")
