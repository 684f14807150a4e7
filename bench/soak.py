"""A long run's memory, process by process: does anything grow without bound (issue 38, item 6)?

Starts ``tandem train`` (the demo config unless ``--config``) for ``--steps`` steps in a subprocess and samples
the resident memory (RSS) of every process below the command (the driver, Ray's GCS server, raylet and
agents, the queue actors, the weight store, the generation actors, the learner ranks) every ``--every``
steps. Prints, per process: RSS at the first sample after ``--warmup`` steps, at the middle and at the
end, and its growth per 1,000 steps over the first half and over the second half of the window. A leak
grows alike in both halves; a cache that fills levels off (its second-half slope is near 0).

    .venv/bin/python bench/soak.py --model /tmp/tinym --steps 5000 --out bench/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from process_cpu import label, steps_done, tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rss_of(procs: list[psutil.Process]) -> dict[str, float]:
    """MB of resident memory by process label (several of one label: ``label #pid``)."""
    out: dict[str, float] = {}
    for p in procs:
        try:
            name, rss = label(p), p.memory_info().rss / 1e6
        except psutil.Error:
            continue
        out[name if name not in out else f"{name} #{p.pid}"] = rss
    return out


def slope(samples: list[tuple[int, dict[str, float]]], name: str) -> float | None:
    """MB per 1,000 steps between the first and last of ``samples`` that have ``name``."""
    have = [(step, rss[name]) for step, rss in samples if name in rss]
    if len(have) < 2 or have[-1][0] == have[0][0]:
        return None
    return (have[-1][1] - have[0][1]) / (have[-1][0] - have[0][0]) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--model", required=True, help="an existing tiny model directory")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=100, help="steps between samples")
    parser.add_argument("--warmup", type=int, default=200, help="steps before the first sample counts")
    parser.add_argument("--overrides", default="", help="extra overrides, space-separated")
    parser.add_argument("--out", default=None, help="write every sample as JSON here")
    parser.add_argument("--minutes", type=float, default=None, help="stop the run after this long (fewer steps)")
    args = parser.parse_args()

    out_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    command = [
        sys.executable, "-m", "launch.cli", "train", "--config", args.config, f"model.path={args.model}",
        "model.build_tiny=false", f"run.output_dir={out_dir}", f"run.steps={args.steps}", "run.save_final=false",
        "run.checkpoint_every=500", "run.log_samples=0", *shlex.split(args.overrides),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (out_dir / "driver-console.log").open("w")
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    root = psutil.Process(child.pid)
    samples: list[tuple[int, dict[str, float]]] = []
    started, next_at = time.monotonic(), args.warmup
    try:
        while child.poll() is None:
            if args.minutes and time.monotonic() - started > 60 * args.minutes:
                break  # the time given is up: the table covers the steps done
            done = steps_done(out_dir)
            if done >= next_at:
                samples.append((done, rss_of(tree(root))))
                next_at = done + args.every
                total = sum(samples[-1][1].values())
                print(f"step {done:>5d}: {total:8.0f} MB in {len(samples[-1][1])} processes", flush=True)
            time.sleep(1.0)
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
            child.wait(timeout=120)
    wall = time.monotonic() - started
    if len(samples) < 3:
        print(f"too few samples ({len(samples)}); see {out_dir}", file=sys.stderr)
        return 1
    mid = len(samples) // 2
    first, middle, last = samples[0], samples[mid], samples[-1]
    print(f"\n{last[0]} steps in {wall / 60:.1f} min; samples every {args.every} steps from step {first[0]}")
    print(f"{'process':40s} {'MB@' + str(first[0]):>9s} {'MB@' + str(middle[0]):>9s} {'MB@' + str(last[0]):>9s}"
          f" {'1st half':>9s} {'2nd half':>9s}  (MB per 1,000 steps)")  # fmt: skip
    for name in sorted(last[1], key=lambda n: -last[1][n]):
        a, b = slope(samples[: mid + 1], name), slope(samples[mid:], name)
        fmt = lambda x: f"{x:+9.1f}" if x is not None else f"{'-':>9s}"  # noqa: E731
        values = [s[1].get(name) for s in (first, middle, last)]
        cells = " ".join(f"{v:9.0f}" if v is not None else f"{'-':>9s}" for v in values)
        print(f"{name:40s} {cells} {fmt(a)} {fmt(b)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"wall_s": wall, "samples": samples}, indent=1))
    return child.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
