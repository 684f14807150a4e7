"""What recording the timeline costs a step (``cluster/timeline.py``).

A span costs its process two ``time.time()`` calls and a dict appended to a list, then a pickle
on the message it rides on to the driver, and the driver a ``json.dumps`` and a buffered write.
This script measures each per span (medians of interleaved rounds, against an empty ``with``),
counts the spans a real run's processes record per step (``RUN_DIR/timeline.jsonl``), and prints
the share of the run's median step time they cost, per process and for the driver.

    .venv/bin/python bench/span_overhead.py --run RUN_DIR     # a finished run, e.g. a demo's
    .venv/bin/python bench/span_overhead.py                   # runs a 30-step demo first (~1 min)

With ``--ab N`` it also runs the demo N times with and N times without spans, interleaved, and
prints the ratio of their median step times (noisy on a shared machine: a ratio, not a test).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.timeline import Spans  # noqa: E402
from observe.run_stats import load_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def per_span_costs(n: int = 20_000, rounds: int = 7) -> dict[str, float]:
    """Seconds per span: recording (less an empty ``with``), pickling, the driver's JSON write."""
    record, pickled, written = [], [], []
    for _ in range(rounds):
        spans = Spans("actor-0")
        t0 = time.perf_counter()
        for i in range(n):
            with spans.span("generate", i):
                pass
        t1 = time.perf_counter()
        for _ in range(n):
            with contextlib.nullcontext():
                pass
        t2 = time.perf_counter()
        batch = spans.take()
        t3 = time.perf_counter()
        pickle.loads(pickle.dumps(batch))  # what Ray does to the list riding on a group
        t4 = time.perf_counter()
        with tempfile.TemporaryFile("w") as f:
            f.writelines(json.dumps(span) + "\n" for span in batch)
            f.flush()
        t5 = time.perf_counter()
        record.append(((t1 - t0) - (t2 - t1)) / n)
        pickled.append((t4 - t3) / n)
        written.append((t5 - t4) / n)
    return {k: statistics.median(v) for k, v in (("record", record), ("pickle", pickled), ("write", written))}


def run_demo(steps: int, out: str, timeline: bool = True) -> Path:
    cmd = [str(ROOT / ".venv/bin/tandem"), "demo", f"run.steps={steps}", f"run.output_dir={out}"]
    cmd += [f"run.timeline={str(timeline).lower()}", "run.save_final=false"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1200)
    return max(Path(out).glob("demo-*"), key=lambda p: p.stat().st_mtime)


def step_seconds(run: Path) -> list[float]:
    return [m["step_seconds"] for m in load_run(run).metrics[1:]]  # the first step warms up


def spans_per_step(run: Path) -> tuple[dict[str, float], int]:
    data = load_run(run)
    counts = collections.Counter(s["process"] for s in data.spans)
    return {p: c / len(data.metrics) for p, c in sorted(counts.items())}, len(data.metrics)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a finished run directory (default: run a demo)")
    ap.add_argument("--steps", type=int, default=30, help="demo steps when no --run is given")
    ap.add_argument("--ab", type=int, default=0, help="also time N demo runs with and N without spans")
    args = ap.parse_args()
    cost = per_span_costs()
    print("per span: " + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in cost.items()))
    run = Path(args.run) if args.run else run_demo(args.steps, tempfile.mkdtemp(prefix="bench-spans-"))
    per_step, steps = spans_per_step(run)
    step_s = statistics.median(step_seconds(run))
    print(f"run {run.name}: {steps} steps, median step {step_s * 1e3:.1f} ms")
    worst = 0.0
    for process, n in per_step.items():
        own = n * (cost["record"] + cost["pickle"])
        worst = max(worst, own)
        print(f"  {process:<12} {n:5.1f} spans/step  {own * 1e6:7.1f} us/step  {own / step_s:.4%} of a step")
    total = sum(per_step.values())
    driver = total * (cost["write"] + cost["pickle"])
    print(f"  driver writes {total:.1f} spans/step: {driver * 1e6:.1f} us/step, {driver / step_s:.4%} of a step")
    print(f"RATIO span cost / step time (worst process or driver): {max(worst, driver) / step_s:.5f}")
    if args.ab:
        on, off = [], []
        for _ in range(args.ab):
            with contextlib.redirect_stdout(io.StringIO()):
                for timeline, into in ((True, on), (False, off)):
                    into += step_seconds(run_demo(args.steps, tempfile.mkdtemp(prefix="bench-spans-"), timeline))
        ratio = statistics.median(on) / statistics.median(off)
        print(f"A/B over {args.ab} x 2 demo runs: median step {statistics.median(on) * 1e3:.1f} ms with spans, "
              f"{statistics.median(off) * 1e3:.1f} ms without")  # fmt: skip
        print(f"RATIO step time with / without spans: {ratio:.3f}")


if __name__ == "__main__":
    main()
