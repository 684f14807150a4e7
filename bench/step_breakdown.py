"""Where a short step's time goes: Tandem (both schedules) and TRL's GRPOTrainer, phase by phase, one run.

The job is bench/vs_trl.py's (the tiny model, 16 prompts x 8 completions of exactly L tokens per optimizer
step, GRPO, one update per batch, no KL), at L = 128 and 512 (``--lengths``). Each contestant runs in a
fresh child; the table gives each phase's seconds per steady step (Tandem: its total over a window of
whole steps after the first two, divided by their count; TRL: the median over the steps after the
first), so the columns of a row add up to more than its step where processes work at once:

- Tandem, from the run's own record: ``timeline.jsonl`` (actor: ``generate``, with ``reward`` inside it,
  ``load_weights``, ``wait_weights``; learner: ``score`` = old/reference log-probs, ``advantages``,
  ``train``, ``publish``; driver: ``wait_data``) and ``metrics.jsonl`` (``learner/time_forward_s``,
  ``time_backward_s``, ``time_optimizer_s``: host wall time inside ``train``; ``step_seconds``).
  ``driver`` is the step less the learner's train, score, advantages and publish calls and its wait for
  data: the driver's own work and its calls' round trips.
- TRL, timed inside its process by wrapping GRPOTrainer's ``_generate_single_turn`` (generation),
  ``_calculate_rewards`` (reward), ``_get_per_token_logps_and_entropies`` without a gradient (old and
  reference log-probs; skipped when generation and update are aligned, as here) and with one (forward),
  accelerate's ``backward`` and its optimizer's ``step``; ``driver`` is the rest of its step.

BOUND: this machine's two cores doing a step's work with nothing idle. Tandem's work per step is
W = generation (an engine's core) + the learner's busy time (another core); packed perfectly on two
cores a step takes W / 2. ``BOUND x TRL`` = (2 / W) / TRL's steps/s; Tandem's share of its bound is
printed beside the ratio (goal: 1.5x TRL at 128 and 2x at 512, or >= 0.9 of the bound where the bound
is lower).

Run: pip install -e .[bench]; .venv/bin/python bench/step_breakdown.py [--lengths 128,512 --steps 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import vs_trl  # noqa: E402

PHASES = ["generation", "reward", "old logprobs", "forward", "backward", "optimizer", "publish+load", "driver"]
SCHEDULES = {"overlapped": vs_trl.TANDEMS["tandem"], "colocated": vs_trl.TANDEMS["colocated"]}


# --- TRL, timed from inside its process -------------------------------------------------------------
def trl_timed(argv: list[str]) -> None:
    """The ``_trl`` child: vs_trl's TRL job with its phases timed (``RESULT`` line: step ends and intervals)."""
    import torch
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from trl import GRPOTrainer

    intervals: list[tuple[str, float, float]] = []

    def timed(owner, name: str, phase) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                label = phase() if callable(phase) else phase
                intervals.append((label, start, time.monotonic()))

        setattr(owner, name, wrapper)

    timed(GRPOTrainer, "_generate_single_turn", "generation")
    timed(GRPOTrainer, "_calculate_rewards", "reward")
    grad = lambda: "forward" if torch.is_grad_enabled() else "old logprobs"  # noqa: E731
    timed(GRPOTrainer, "_get_per_token_logps_and_entropies", grad)
    timed(Accelerator, "backward", "backward")
    timed(AcceleratedOptimizer, "step", "optimizer")
    result = vs_trl.trl_child_train(argv, "step_breakdown.py _trl")
    print("RESULT " + json.dumps({"step_end": result["step_end"], "intervals": intervals}), flush=True)


def run_trl(length: int, steps: int, args) -> dict:
    threads = args.trl_threads
    cmd, env = vs_trl.trl_command(Path(__file__).resolve(), threads, length, steps, args, micro=16)
    r, _, _ = vs_trl.child_result(cmd, f"trl {threads}t", env)
    ends = r["step_end"]
    per_step: list[dict[str, float]] = []
    for a, b in zip(ends, ends[1:]):  # the steady steps: each from the end of the one before
        phases = collections.Counter()
        for label, start, end in r["intervals"]:
            phases[label] += max(0.0, min(end, b) - max(start, a))
        phases["step"] = b - a
        phases["driver"] = phases["step"] - sum(phases[p] for p in PHASES if p != "driver")
        per_step.append(dict(phases))
    return {"steps_s": vs_trl.steady(ends), "phases": medians(per_step)}


# --- Tandem, from its run's own record ---------------------------------------------------------------
def run_tandem(schedule: str, length: int, steps: int, args, tmp: Path) -> dict:
    out = tmp / f"{schedule}-L{length}"
    out.mkdir()
    figures = vs_trl.run_tandem(length, steps, args, out, SCHEDULES[schedule])
    run_dir = next(out.glob("*/metrics.jsonl")).parent
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    spans = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    return {"steps_s": figures["steps_s"], "phases": tandem_phases(metrics, spans)}


def tandem_phases(metrics: list[dict], spans: list[dict]) -> dict[str, float]:
    """Each phase's seconds per step over the steady steps: from the start of step 2 (steps 0 and 1 hold the
    warm-up and, colocated, the first phase) to the start of an even step before the last (a colocated phase
    collects two steps back to back, so only phase-aligned windows split its time rightly), divided by the
    steps between. Spans are merged per process and kind (in-flight groups overlap), then summed over the
    processes of a role (two actors: two cores' worth)."""
    from observe.timeline_stats import clip, merge_intervals, step_windows, total

    windows = step_windows(spans)
    last = 2 + 2 * ((len(metrics) - 3) // 2)
    if last <= 2:
        raise SystemExit(
            "--steps must be at least 5: the steady window runs from step 2 to an even step before the last"
        )
    window, steps = (windows[2][0], windows[last][0]), last - 2
    kinds = collections.Counter()
    for process in {s["process"] for s in spans}:
        for kind in {s["kind"] for s in spans if s["process"] == process}:
            merged = merge_intervals(s for s in spans if s["process"] == process and s["kind"] == kind)
            kinds[(process.split("-")[0], kind)] += total(clip(merged, window)) / steps
    steady = [m for m in metrics if 2 <= m["step"] < last]
    learner = {p: sum(m.get(f"learner/time_{p}_s", 0.0) for m in steady) / steps for p in ("forward", "backward")}
    learner_busy = sum(kinds[("learner", k)] for k in ("score", "advantages", "train", "publish"))
    phases = {
        "generation": kinds[("actor", "generate")] - kinds[("actor", "reward")],
        "reward": kinds[("actor", "reward")],
        "old logprobs": kinds[("learner", "score")],
        **learner,
        "optimizer": sum(m.get("learner/time_optimizer_s", 0.0) for m in steady) / steps,
        "publish+load": kinds[("learner", "publish")] + kinds[("actor", "load_weights")],
        "train": kinds[("learner", "train")],
        "learner busy": learner_busy,
        "learner idle": kinds[("driver", "wait_data")],
        "step": (window[1] - window[0]) / steps,
    }
    phases["driver"] = max(0.0, phases["step"] - learner_busy - phases["learner idle"])
    return phases


def medians(per_step: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for step in per_step for k in step)
    return {k: statistics.median(step.get(k, 0.0) for step in per_step) for k in keys}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_trl":
        return trl_timed(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trl-threads", type=int, default=2, help="TRL's torch threads (2: its faster on 2 cores)")
    parser.add_argument("--schedules", default="overlapped,colocated")
    parser.add_argument("--tandem-overrides", default="", help="extra Tandem overrides, space-separated")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    import yaml

    from actors.tiny_model import build_tiny_model

    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    args.lr, args.betas = float(demo["learner"]["lr"]), [float(b) for b in demo["learner"]["betas"]]
    args.root, args.colocated_overrides = None, ""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="breakdown-") as tmp:
        args.model = str(build_tiny_model(Path(tmp) / "tiny-qwen2-4k", max_positions=4096).resolve())
        for length in [int(x) for x in args.lengths.split(",")]:
            row = results[str(length)] = {}
            for schedule in args.schedules.split(","):
                row[schedule] = run_tandem(schedule, length, args.steps, args, Path(tmp))
                print(f"L={length} {schedule}: {row[schedule]['steps_s']:.3f} steps/s", flush=True)
            row["trl"] = run_trl(length, args.steps, args)
            print(f"L={length} trl-{args.trl_threads}t: {row['trl']['steps_s']:.3f} steps/s", flush=True)
    for length, row in results.items():
        print(
            f"\nL = {length}: seconds per steady step (Tandem: over whole phases; TRL: median); "
            "Tandem's processes work at once"
        )
        print(f"{'contestant':<11} {'steps/s':>8} {'step':>6} " + " ".join(f"{p:>12}" for p in PHASES) + "  idle")
        for name, r in row.items():
            ph = r["phases"]
            idle = f"learner {ph['learner idle']:.2f}" if "learner idle" in ph else "-"
            cells = " ".join(f"{ph.get(p, 0.0):>12.3f}" for p in PHASES)
            print(f"{name:<11} {r['steps_s']:>8.3f} {ph['step']:>6.2f} {cells}  {idle}")
        trl = row["trl"]["steps_s"]
        base = row.get("overlapped")  # its work: one engine's core-seconds and the learner's on one core
        bound = None
        if base is not None:
            ph = base["phases"]
            work = ph["generation"] + ph["reward"] + ph["learner busy"]
            bound = 2 / work / trl
            print(
                f"BOUND {bound:.2f}x TRL: two cores with nothing idle (Tandem's work per step {work:.2f} s: "
                f"generation and reward {ph['generation'] + ph['reward']:.2f} + learner {ph['learner busy']:.2f})"
            )
        for name, r in row.items():
            if name != "trl":
                ratio = r["steps_s"] / trl
                share = f"; {ratio / bound:.0%} of the bound" if bound else ""
                print(f"RATIO {name}/TRL {ratio:.2f}x{share}")
        row["bound"] = bound
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
