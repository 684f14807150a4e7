"""The learning-rate schedule (``learner/schedule.py``) against hand-computed factors."""

from __future__ import annotations

import math

import pytest

from learner.schedule import lr_factor


def test_warm_up_then_each_decay():
    # W = 2, U = 6: warm-up 1/2, 1; then d = (u - 2) / 4 for u = 2..6
    assert [lr_factor(u, "constant", 2, 6) for u in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(u, "linear", 2, 6) for u in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    cosine = [lr_factor(u, "cosine", 2, 6) for u in (2, 4, 6, 9)]
    assert cosine == pytest.approx([1.0, 0.5, 0.0, 0.0])  # (1 + cos(pi d)) / 2, held at the end
    assert lr_factor(3, "cosine", 2, 6, min_ratio=0.1) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_factor(5, "linear", 0, 0) == 1.0  # no length known: no decay


def test_an_unknown_schedule_is_an_error():
    with pytest.raises(ValueError, match="constant, linear or cosine"):
        lr_factor(3, "step", 0, 10)
