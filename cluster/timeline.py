"""Spans: what each process was doing, when, for the run's timeline.

Every generation actor and learner rank (and the driver) keeps a ``Spans`` buffer. A span is a
``Span``; in ``RUN_DIR/timeline.jsonl`` it is one line::

    {"process": "actor-0", "kind": "generate", "start": 1764650000.125, "end": 1764650000.9, "version": 3}

``start``/``end`` are wall-clock seconds (``time.time()``: comparable between the processes of a
node, and between nodes as far as their clocks agree). ``version`` is the policy version the
process held (an actor) or produced (a learner rank), ``None`` where none applies.

The buffers travel on messages that already go to the driver: an actor's spans ride on the next
group it pushes (``TrajectoryGroup.spans``) and on its loop's final report; a learner rank's
come back from ``publish_weights``, once per step. Recording a span is a ``time.time()`` call
and a list append (about a microsecond; ``bench/span_overhead.py`` measures it against a step).

Kinds, by lane: actors ``wait_prompts`` (nothing to generate), ``wait_weights`` (weights not yet
published), ``load_weights``, ``generate`` (sampling and scoring the rewards), ``sleep`` and ``wake``
(the colocated schedule's turns, ``actors/sleep.py``); learner ranks
``score`` (old, reference log-probs, values), ``advantages``, ``train``, ``publish``; the driver
``wait_data`` (the learner waits for a batch).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One stretch of one process's time."""

    process: str  # who: actor-0, learner-1, driver, ...
    kind: str  # what it did (the kinds above)
    start: float  # wall-clock seconds, time.time()
    end: float
    version: int | None = None  # the policy version it held (an actor) or produced (a learner rank)


class Spans:
    """The spans one process recorded since they were last taken. ``enabled=False`` records nothing."""

    def __init__(self, process: str, enabled: bool = True):
        self.process = process
        self.enabled = enabled
        self._spans: list[Span] = []

    def add(self, kind: str, start: float, end: float, version: int | None = None) -> None:
        if self.enabled:
            self._spans.append(Span(self.process, kind, start, end, version))

    @contextmanager
    def span(self, kind: str, version: int | None = None):
        """Record the ``with`` block as one span (also when it raises)."""
        start = time.time()
        try:
            yield
        finally:
            self.add(kind, start, time.time(), version)

    def take(self) -> list[Span]:
        """The spans recorded so far, leaving the buffer empty."""
        spans, self._spans = self._spans, []
        return spans

    def __len__(self) -> int:
        return len(self._spans)
