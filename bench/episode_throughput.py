"""Multi-turn at the engine's speed: model tokens/s of episodes against single-turn completions, one run.

The tools example's task (``configs/examples/tools.yaml``: the warm-started tiny chat model, episodes of
up to 3 model turns against ``builtin:lookup``, 16 prompts x 8 per step) on both weight-update engines,
and beside each the same model on the same prompts single-turn, every completion forced to the
episodes' mean model tokens (``min_tokens = max_tokens``): the same tokens per step in one turn.

Printed per run: the model tokens each steady step trained (``trained_tokens``: an episode's model
turns, not its tool results) over the actor's busy time in that step (the union of its ``generate``
spans: sampling, tool calls and rewards), its steady steps/s, and per engine ``RATIO episodes /
single-turn`` of the model tokens/s (goal >= 0.8: turns reach the engine together, so an actor
running episodes keeps its batch as full as single-turn completions do).

Needs the warm-started model (``tandem example tools`` builds it once under
~/.cache/tandem/models/tiny-tools; ``--model`` to point elsewhere).

Run: .venv/bin/python bench/episode_throughput.py [--steps 10 --engines between_requests,inflight]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from observe.timeline_stats import clip, merge_intervals, step_windows, total  # noqa: E402

TOOLS = ROOT / "configs" / "examples" / "tools.yaml"
MODEL = Path("~/.cache/tandem/models/tiny-tools/sft-sloppy-to0.02-seed0").expanduser()


def run(name: str, out: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "launch.cli", "train", "--config", str(TOOLS), *overrides]
    cmd += [f"run.output_dir={out / name}", f"run.name={name}", "run.live=false", "eval.every=0"]
    cmd += ["run.save_final=false", "run.trackers=[jsonl]"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    run_dir = next((out / name).glob("*/metrics.jsonl")).parent
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    spans = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    windows = step_windows(spans)
    busy = merge_intervals(s for s in spans if s["process"].startswith("actor") and s["kind"] == "generate")
    rates = []
    for m in metrics[1:-1]:  # steady steps (the last window runs to the run's close)
        seconds = total(clip(busy, windows[m["step"]]))
        if seconds > 0:
            rates.append(m["trained_tokens"] / seconds)
    ends = [m["elapsed_s"] for m in metrics]
    return {
        "model_tok_s": statistics.median(rates),
        "steps_s": (len(ends) - 1) / (ends[-1] - ends[0]),
        "model_tokens": statistics.fmean(m["trained_tokens"] for m in metrics),
        "turns": statistics.fmean(m.get("episode/turns_mean", 1.0) for m in metrics),
        "wall_s": time.monotonic() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--engines", default="between_requests,inflight")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no warm-started model at {args.model}: run `tandem example tools run.steps=1` once")
    common = [f"model.path={args.model}", f"run.steps={args.steps}", "learner.lr=1e-6"]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="episodes-") as tmp:
        out = Path(tmp)
        for engine in args.engines.split(","):
            mode = [*common, f"rollout.weight_update={engine}"]
            episodes = results[f"episodes {engine}"] = run(f"episodes-{engine}", out, mode)
            per_sample = round(episodes["model_tokens"] / (16 * 8))  # model tokens of one episode
            single = [
                "rollout.kind=single_turn",
                "reward.function=builtin:lookup",
                f"rollout.max_tokens={per_sample}",
                f"rollout.min_tokens={per_sample}",
            ]
            results[f"single {engine}"] = run(f"single-{engine}", out, [*mode, *single])
            for key in (f"episodes {engine}", f"single {engine}"):
                r = results[key]
                print(f"{key}: {r['model_tok_s']:.0f} model tok/s, {r['steps_s']:.3f} steps/s", flush=True)
    print(f"\n{'run':<28} {'model tok/s':>12} {'steps/s':>8} {'model tokens/step':>18} {'turns':>6}")
    for key, r in results.items():
        print(f"{key:<28} {r['model_tok_s']:>12.0f} {r['steps_s']:>8.3f} {r['model_tokens']:>18.0f} {r['turns']:>6.2f}")
    for engine in args.engines.split(","):
        ratio = results[f"episodes {engine}"]["model_tok_s"] / results[f"single {engine}"]["model_tok_s"]
        print(f"RATIO episodes / single-turn model tok/s, {engine}: {ratio:.2f} (goal >= 0.8)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
