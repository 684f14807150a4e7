"""Time on a run's timeline (``timeline.jsonl``, ``cluster/timeline.py``): interval unions, what
share of its time each process spent on each kind of span, idle shares, and the step windows.

With in-flight weight updates a lane's spans overlap (several groups generate at once), so every
length here is of an interval union, never a sum of spans. Times are wall-clock seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Interval = tuple[float, float]
WAIT_KINDS = ("wait_prompts", "wait_weights", "wait_data")  # the process has nothing to do


# --- intervals ----------------------------------------------------------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time: ``[(0, 2), (1, 3), (5, 6)] -> [(0, 3), (5, 6)]``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def merge_intervals(spans: Iterable[dict[str, Any]]) -> list[Interval]:
    """The union of spans' ``(start, end)``: what the timeline draws for one kind in one lane."""
    return union((s["start"], s["end"]) for s in spans)


def total(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The parts of ``intervals`` inside ``window``."""
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def subtract(intervals: Iterable[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """``intervals`` minus ``holes``: ``[(0, 10)] - [(2, 3), (5, 6)] -> [(0, 2), (3, 5), (6, 10)]``."""
    out, holes, first = [], union(holes), 0
    for start, end in union(intervals):  # both sorted: one sweep, O(n + m)
        while first < len(holes) and holes[first][1] <= start:
            first += 1  # holes that end before this interval end before every later one
        for h_start, h_end in holes[first:]:
            if h_start >= end:
                break
            if h_start > start:
                out.append((start, h_start))
            start = max(start, h_end)
        if end > start:
            out.append((start, end))
    return out


def window_totals(intervals: list[Interval], windows: list[Interval]) -> list[float]:
    """The length of sorted, disjoint ``intervals`` inside each of the sorted, disjoint ``windows``
    (one sweep over both: a long run's thousands of steps stay linear)."""
    out, first = [], 0
    for lo, hi in windows:
        while first < len(intervals) and intervals[first][1] <= lo:
            first += 1
        length = 0.0
        for start, end in intervals[first:]:
            if start >= hi:
                break
            length += min(end, hi) - max(start, lo)
        out.append(length)
    return out


# --- lanes --------------------------------------------------------------------------------------
def lanes(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Spans by process, in display order: the driver, learner ranks, other roles, then actors."""
    by_process: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_process.setdefault(span["process"], []).append(span)

    def order(name: str) -> tuple[int, str]:
        rank = 0 if name == "driver" else 1 if name.startswith("learner") else 3 if name.startswith("actor") else 2
        return rank, name.rjust(40)  # rjust: actor-10 after actor-9

    return {name: by_process[name] for name in sorted(by_process, key=order)}


def extent(spans: list[dict[str, Any]]) -> Interval:
    return min(s["start"] for s in spans), max(s["end"] for s in spans)


def busy_fractions(spans: list[dict[str, Any]], window: Interval | None = None) -> dict[str, dict[str, float]]:
    """``{process: {kind: fraction}}``: the share of each lane's extent (its first start to its last
    end, within ``window`` when given) covered by the union of that kind's spans. Kinds may overlap
    each other (an in-flight actor generates while it waits for weights), so a lane's fractions can
    sum above 1; the time in no span at all is ``1 - total(union of every span) / extent``."""
    out = {}
    for process, lane in lanes(spans).items():
        span_window = clip([extent(lane)], window) if window else [extent(lane)]
        length = total(span_window)
        if length <= 0:
            continue
        kinds = sorted({s["kind"] for s in lane})
        out[process] = {
            k: total(clip(merge_intervals(s for s in lane if s["kind"] == k), span_window[0])) / length for k in kinds
        }
    return out


def lane_idle(lane: list[dict[str, Any]]) -> list[Interval]:
    """The lane's idle time: its waits while no other kind of span runs (sorted, disjoint)."""
    waits = merge_intervals(s for s in lane if s["kind"] in WAIT_KINDS)
    return subtract(waits, merge_intervals(s for s in lane if s["kind"] not in WAIT_KINDS))


def idle_fractions(spans: list[dict[str, Any]], window: Interval | None = None) -> dict[str, float]:
    """``{process: fraction}`` for the lanes that record waits (actors, the driver): the share of the
    lane's extent (within ``window`` when given) spent in a wait kind while no other kind runs.
    For the driver this is the learner's wait for data; for an actor, ``wait_prompts`` + ``wait_weights``."""
    out = {}
    for process, lane in lanes(spans).items():
        if not any(s["kind"] in WAIT_KINDS for s in lane):
            continue
        span_window = clip([extent(lane)], window) if window else [extent(lane)]
        length = total(span_window)
        if length <= 0:
            continue
        out[process] = total(clip(lane_idle(lane), span_window[0])) / length
    return out


def step_windows(spans: list[dict[str, Any]]) -> dict[int, Interval]:
    """``{step: (start, end)}`` in wall-clock seconds: a step runs from the start of the driver's
    ``wait_data`` for it (its version is the step) to the start of the next one, the last to the
    timeline's end. ``{}`` without driver spans. After a resume the newest span of a step counts."""
    waits = sorted(
        (s for s in spans if s["process"] == "driver" and s["kind"] == "wait_data"), key=lambda s: s["start"]
    )
    newest = {int(s["version"]): s["start"] for s in waits if s.get("version") is not None}
    starts = sorted((start, step) for step, start in newest.items())
    ends = [start for start, _ in starts[1:]] + [extent(spans)[1]]
    return {step: (start, end) for (start, step), end in zip(starts, ends)}


def actor_idle_per_step(spans: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """``(steps, fractions)``: the actors' mean idle fraction inside each step window."""
    windows = sorted(step_windows(spans).items())
    per_lane = []  # each actor lane's idle share of every window, None where the lane is absent
    for process, lane in lanes(spans).items():
        if not process.startswith("actor") or not any(s["kind"] in WAIT_KINDS for s in lane):
            continue
        lo, hi = extent(lane)
        lengths = [max(min(b, hi) - max(a, lo), 0.0) for _, (a, b) in windows]
        idle_s = window_totals(lane_idle(lane), [w for _, w in windows])
        per_lane.append([i / n if n > 0 else None for i, n in zip(idle_s, lengths)])
    steps, values = [], []
    for index, (step, _) in enumerate(windows):
        shares = [lane[index] for lane in per_lane if lane[index] is not None]
        if shares:
            steps.append(step)
            values.append(sum(shares) / len(shares))
    return steps, values


def actor_idle(spans: list[dict[str, Any]]) -> float | None:
    """The actors' mean idle fraction after the first step window (all of the timeline when there
    is one window or none); ``None`` when no actor lane is on the timeline."""
    windows = sorted(step_windows(spans).values()) if spans else []
    window = (windows[1][0], windows[-1][1]) if len(windows) > 1 else None
    idle = [f for p, f in idle_fractions(spans, window).items() if p.startswith("actor")]
    return sum(idle) / len(idle) if idle else None


def overlap_share(spans: list[dict[str, Any]], during: str = "train", doing: str = "generate") -> float | None:
    """The share of the time some process spent in ``during`` spans (the learner training) while
    another kind, ``doing``, ran anywhere (an actor generating): ``|D & G| / |D|`` over the unions
    ``D`` and ``G``. ``None`` when no ``during`` span is on the timeline."""
    busy = merge_intervals(s for s in spans if s["kind"] == during)
    length = total(busy)
    if length <= 0:
        return None
    alone = subtract(busy, merge_intervals(s for s in spans if s["kind"] == doing))
    return (length - total(alone)) / length
