"""The long tail of reasoning lengths: synchronous against asynchronous RL, side by side in one run.

Real reasoning traces are mostly short with a tail to many times the median, and a synchronous step
waits for its longest completion. This bench gives each prompt its own completion length from a
heavy-tailed distribution (log-normal, median ``--median`` tokens, cut at ``--tail`` x the median: the
rows' ``budget`` column through ``rollout.max_tokens_field``, with ``min_tokens`` as large, so a
completion is exactly its row's budget) and a verifiable reward (the successor task's), and runs the
same prompts, samples and steps under:

  sync k=0       max_staleness 0, weights between requests: generation and training take turns
  between k=1,2  weights between requests: the next request generates while the learner trains
  inflight k=1,2 weights swapped in mid-generation: the engine always holds up to 2 steps of prompts,
                 the first groups to finish are trained, the others go on generating under the new
                 weights and are trained in a later step (partial rollouts carried across steps)
  carry k=2      in flight, admitting 3 steps of prompts at once (``--carry`` x prompts per step)

Printed per mode: steady steps/s (step 0's warm-up left out), the learner's idle share (waiting for
data / step time), the generator's idle share (the actor's time outside any generation, from the
timeline), the staleness seen, groups dropped as too stale (generated again), whether every prompt
was trained at most once, and the mean completion length of the trained groups against sync's (sync
trains the prompts in order and drops none: a mode that drops its long groups as too stale and
generates them again, only to drop them again, trains a shorter distribution than the data's).

BOUND Y = (G + T) / max(G, T) from the synchronous run (G: its wait for generation per step, T: its
training), as ``bench/async_vs_sync.py`` derives it: two processes that each keep their own work
make a step no shorter than max(G, T). RATIO best-async/sync X is the fastest async mode's steps/s
over sync's. Going past Y needs less work per step, not more overlap: an engine whose cost per token
falls with its batch (a GPU's) has slack while a synchronous step waits for its longest completion,
and carried-over rollouts fill it. A CPU engine's cost per token is nearly flat in the batch.

Run: .venv/bin/python bench/long_tail.py [--steps 12 --median 24 --tail 16 --modes sync,inflight2]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from observe.timeline_stats import actor_idle  # noqa: E402

MODES = {  # name -> overrides (over the common ones)
    "sync": ["run.max_staleness=0", "rollout.weight_update=between_requests"],
    "between1": ["run.max_staleness=1", "rollout.weight_update=between_requests"],
    "between2": ["run.max_staleness=2", "rollout.weight_update=between_requests"],
    "inflight1": ["run.max_staleness=1", "rollout.weight_update=inflight"],
    "inflight2": ["run.max_staleness=2", "rollout.weight_update=inflight"],
    "carry2": ["run.max_staleness=2", "rollout.weight_update=inflight"],  # + max_inflight_prompts = carry x P
}


def budgets(n: int, median: int, tail: float, seed: int) -> list[int]:
    """``n`` completion lengths, log-normal around ``median`` with the 99th percentile at ``tail`` x the
    median, cut there (sigma = ln(tail) / 2.326)."""
    rng = random.Random(seed)
    sigma = math.log(tail) / 2.326
    cap = int(median * tail)
    return [max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


def write_rows(path: Path, n: int, median: int, tail: float, seed: int) -> list[int]:
    from actors.tasks import successor_rows

    lengths = budgets(n, median, tail, seed)
    rows = successor_rows(n, seed)
    with path.open("w") as f:
        for row, length in zip(rows, lengths):
            f.write(json.dumps({**row, "budget": length}) + "\n")
    return lengths


def run(name: str, out: Path, common: list[str], extra: list[str]) -> dict:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "launch.cli", "train", "--config", str(ROOT / "configs" / "demo.yaml")]
    cmd += [f"run.output_dir={out / name}", f"run.name={name}", *common, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    wall = time.monotonic() - start
    run_dir = next((out / name).glob("*/metrics.jsonl")).parent
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timeline = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    later = metrics[1:]  # step 0 includes the engines' warm-up
    trained = [pid for m in metrics for pid in m["prompt_ids"]]
    return {
        "steps_per_s": len(later) / (metrics[-1]["elapsed_s"] - metrics[0]["elapsed_s"]),
        "wall_s": wall,
        "learner_idle": sum(m["learner_wait_s"] for m in later) / sum(m["step_seconds"] for m in later),
        "generator_idle": actor_idle(timeline),
        "wait_s": statistics.median(m["learner_wait_s"] for m in later),
        "step_s": statistics.median(m["step_seconds"] for m in later),
        "trained_len": statistics.fmean(m["completion_len_mean"] for m in metrics),
        "staleness_mean": statistics.fmean(m["staleness_mean"] for m in metrics),
        "staleness_max": max(m["staleness_max"] for m in metrics),
        "dropped": sum(m["dropped_stale"] for m in metrics),
        "starved": sum(m.get("starved_prompts", 0) for m in metrics),  # given up: too stale at every try
        "once": len(trained) == len(set(trained)),
        "prompt_ids": trained,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (8 samples each)")
    parser.add_argument("--median", type=int, default=24, help="median completion length, tokens")
    parser.add_argument("--tail", type=float, default=16.0, help="the longest completion, x the median")
    parser.add_argument("--carry", type=int, default=3, help="carry2: prompts in flight, x prompts per step")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "sync":
        raise SystemExit("--modes must start with sync: the bound and the ratio are measured against it")
    longest = int(args.median * args.tail)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rows = out / "rows.jsonl"
        lengths = write_rows(rows, 2048, args.median, args.tail, seed=0)
        common = [
            f"data.prompts={rows}",
            "eval.fraction=0",
            "rollout.max_tokens_field=budget",
            f"rollout.max_tokens={longest}",
            f"rollout.min_tokens={longest}",  # each completion exactly its row's budget
            f"engine.max_model_len={longest + 64}",
            f"run.steps={args.steps}",
            f"rollout.prompts_per_step={args.prompts}",
            "rollout.group_size=8",
            f"rollout.prompts_per_request={args.prompts}",
            f"rollout.max_inflight_prompts={2 * args.prompts}",
            "learner.lr=1e-6",  # the policy barely moves: every mode samples the same distribution
            "run.checkpoint_every=0",
        ]
        print(
            f"{args.steps} steps x {args.prompts} prompts x 8 samples; completion lengths: median {args.median}, "
            f"mean {statistics.fmean(lengths):.1f}, longest {longest} ({args.tail:g}x the median)",
            flush=True,
        )
        results = {}
        for mode in modes:
            extra = list(MODES[mode])
            if mode == "carry2":
                extra.append(f"rollout.max_inflight_prompts={args.carry * args.prompts}")
            results[mode] = run(mode, out, common, extra)
            r = results[mode]
            print(f"  {mode}: {r['steps_per_s']:.3f} steps/s ({r['wall_s']:.0f} s)", flush=True)
    print(
        f"\n{'mode':<10} {'steps/s':>8} {'step s':>7} {'learner idle':>13} {'generator idle':>15} "
        f"{'stale mean/max':>15} {'dropped':>8} {'given up':>9} {'once':>5} {'trained len':>12} {'/ sync':>7}"
    )
    for mode, r in results.items():
        idle = "-" if r["generator_idle"] is None else f"{r['generator_idle']:.0%}"
        print(
            f"{mode:<10} {r['steps_per_s']:>8.3f} {r['step_s']:>7.2f} {r['learner_idle']:>13.0%} {idle:>15} "
            f"{r['staleness_mean']:>9.2f} / {r['staleness_max']:<3} {r['dropped']:>8} {r['starved']:>9} "
            f"{str(r['once']):>5} "
            f"{r['trained_len']:>12.1f} {r['trained_len'] / results['sync']['trained_len']:>7.2f}"
        )
    sync = results["sync"]
    g, t = sync["wait_s"], sync["step_s"] - sync["wait_s"]
    bound = (g + t) / max(g, t)
    print(f"\nBOUND {bound:.2f} = (G + T) / max(G, T) from the sync run: G {g:.2f} s generation, T {t:.2f} s training")
    asyncs = {m: r for m, r in results.items() if m != "sync"}
    if asyncs:
        best = max(asyncs, key=lambda m: asyncs[m]["steps_per_s"])
        ratio = asyncs[best]["steps_per_s"] / sync["steps_per_s"]
        idle = asyncs[best]["generator_idle"]
        goal = "X >= 2" if bound >= 2 / 0.9 else f"X >= 0.9 Y = {0.9 * bound:.2f} (the bound is under 2.2)"
        met = ratio >= 2 if bound >= 2 / 0.9 else ratio >= 0.9 * bound
        print(
            f"RATIO best-async/sync {ratio:.2f} ({best}; {ratio / bound:.0%} of the bound; generator idle "
            f"{'-' if idle is None else f'{idle:.0%}'}); goal {goal}: {'met' if met else 'not met'}"
        )
    if args.out:
        for r in results.values():
            r.pop("prompt_ids")
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
