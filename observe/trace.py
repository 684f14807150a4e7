"""A run's timeline spans as a Chrome trace (the Trace Event Format), for ui.perfetto.dev and chrome://tracing.

Each span becomes a complete event (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds from the
run's first span; the run is process 1 (several runs: 1, 2, ..., each from its own first span, so
they line up for comparison) and each lane (``actor-0``, ``learner-0``, ``driver``) a
thread of it, named and ordered (driver, learner ranks, other roles, actors) by metadata events
(``"ph": "M"``). Spans of one lane may overlap (in-flight generation): both viewers stack them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from observe.timeline_stats import extent, lanes


def trace_events(spans: list[dict[str, Any]], name: str = "tandem run", pid: int = 1) -> list[dict[str, Any]]:
    """The trace events of one run's ``spans``: metadata naming the process ``pid`` and each lane,
    then one ``X`` event per span."""
    if not spans:
        return []
    t0 = extent(spans)[0]
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for tid, (process, lane) in enumerate(lanes(spans).items(), 1):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": process}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for span in sorted(lane, key=lambda s: s["start"]):
            events.append(
                {
                    "name": span["kind"],
                    "cat": process.split("-")[0],
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": round((span["start"] - t0) * 1e6, 3),  # microseconds from the first span
                    "dur": round(max(span["end"] - span["start"], 0.0) * 1e6, 3),
                    "args": {"version": span.get("version")},
                }
            )
    return events


def write_trace(spans: list[dict[str, Any]], path: str | Path, name: str = "tandem run") -> Path:
    """Write one run's spans as ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` to ``path``; returns the path."""
    return write_traces([(name, spans)], path)


def write_traces(runs: list[tuple[str, list[dict[str, Any]]]], path: str | Path) -> Path:
    """Write several runs (``(run name, spans)`` pairs) into one trace, the ``i``-th as process ``i``."""
    events = [e for pid, (name, spans) in enumerate(runs, 1) for e in trace_events(spans, name, pid)]
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
