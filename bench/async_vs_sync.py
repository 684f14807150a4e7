"""Asynchronous vs synchronous RL on a long-tail workload, side by side in one run.

Two real `tandem train` runs on the same prompts, samples and steps:
  sync : max_staleness 0, weights updated between requests (generation and training alternate)
  async: max_staleness 2, in-flight weight updates (generation never stops for training)
The tiny random-init model samples until EOS (p ~ 1/64 per token) or max_tokens, so
completion lengths are geometric: most are short, a few hit the limit, the long tail
that stalls synchronous RL. The learning rate is tiny so the distribution stays put.

Printed: wall time of the training phase (first to last step) and of the whole run,
their ratio, the learner's idle fraction (time waiting for data / step time) and the overlap
(the share of the learner's training time during which an actor generated, from the timeline).

Also printed, the BOUND of overlap on this machine: in the sync run a step is the wait for
generation G plus training T, and the learner's idle share is G / (G + T). Two processes that each
keep their own work make a step no shorter than max(G, T), so async can be at most
(G + T) / max(G, T) = 1 / max(idle, 1 - idle) faster, at the sync run's cost per step. Going past
it needs less work per step, not more overlap: e.g. an engine that is underused while a sync step
waits for its longest completion (a GPU's batch) and that async fills with the next step's
prompts. On the CPU the engine's cost per token per sequence is nearly flat in the batch size, so
there is little such slack to fill.

Run: .venv/bin/python bench/async_vs_sync.py [--steps 12 --max-tokens 384]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from observe.timeline_stats import overlap_share  # noqa: E402


def run(name: str, out: Path, common: list[str], extra: list[str]) -> dict:
    start = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        f"run.output_dir={out / name}",
        f"run.name={name}",
        *common,
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    wall = time.monotonic() - start
    metrics_file = next((out / name).glob("*/metrics.jsonl"))
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    later = metrics[1:]  # step 0 includes the engines' warm-up
    timeline = [json.loads(line) for line in next((out / name).glob("*/timeline.jsonl")).read_text().splitlines()]
    return {
        "overlap": overlap_share(timeline),
        "wall_s": wall,
        "train_phase_s": metrics[-1]["elapsed_s"] - metrics[0]["elapsed_s"],
        "learner_idle": sum(m["learner_wait_s"] for m in later) / sum(m["step_seconds"] for m in later),
        "completion_len": sum(m["completion_len_mean"] for m in metrics) / len(metrics),
        "truncated": sum(m["truncated_frac"] for m in metrics) / len(metrics),
        "staleness_max": max(m["staleness_max"] for m in metrics),
        "dropped": sum(m["dropped_stale"] for m in metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--async-k", type=int, nargs="+", default=[2], help="max_staleness of the async runs")
    args = parser.parse_args()
    common = [
        f"run.steps={args.steps}",
        f"rollout.max_tokens={args.max_tokens}",
        "rollout.min_tokens=0",
        f"rollout.prompts_per_step={args.prompts}",
        "rollout.group_size=8",
        "learner.lr=1e-7",
        "rollout.prompts_per_request=16",
        f"rollout.max_inflight_prompts={args.prompts * 2}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        print(f"{args.steps} steps x {args.prompts} prompts x 8 samples, max_tokens {args.max_tokens}", flush=True)
        results = {
            "sync k=0": run("sync", out, common, ["run.max_staleness=0", "rollout.weight_update=between_requests"])
        }
        for k in args.async_k:
            results[f"async k={k}"] = run(
                f"async{k}", out, common, [f"run.max_staleness={k}", "rollout.weight_update=inflight"]
            )
    print(
        f"\n{'mode':<10} {'train phase s':>14} {'whole run s':>12} {'learner idle':>13} {'mean len':>9} "
        f"{'truncated':>10} {'max stale':>10} {'dropped':>8} {'overlap':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<10} {r['train_phase_s']:>14.1f} {r['wall_s']:>12.1f} {r['learner_idle']:>12.0%} "
            f"{r['completion_len']:>9.1f} {r['truncated']:>10.1%} {r['staleness_max']:>10} {r['dropped']:>8} "
            f"{r['overlap'] or 0:>8.0%}"
        )
    sync = results["sync k=0"]
    idle = sync["learner_idle"]
    print(
        f"\nBOUND of overlapping the sync run's generation and training: 1 / max({idle:.2f}, {1 - idle:.2f}) = "
        f"{1 / max(idle, 1 - idle):.2f}x"
    )
    for name, r in list(results.items())[1:]:
        print(
            f"\nRATIO sync / {name} training-phase wall time: {sync['train_phase_s'] / r['train_phase_s']:.2f}x "
            f"(goal >= 2.5x); whole run: {sync['wall_s'] / r['wall_s']:.2f}x; "
            f"learner idle {r['learner_idle']:.1%} (goal <= 10% when generation keeps up); "
            f"generation ran during {r['overlap'] or 0:.0%} of the training time"
        )


if __name__ == "__main__":
    main()
