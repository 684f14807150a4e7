"""Where the CPU goes during training steps: every process of a real run, its CPU seconds and threads.

Starts ``tandem train`` (the demo config unless ``--config``) in a subprocess, waits until
``--warmup`` steps are in ``metrics.jsonl``, then samples every process below the command (the
driver, Ray's GCS, raylet and daemons, the queue actors, the generation actors and their reward
workers, the learner ranks) over ``--window`` seconds: CPU seconds used in the window, the share
of one core, the thread count, and the steps trained meanwhile. Issue 13, item 1: find what steals
the cores the actor and the learner need.

    .venv/bin/python bench/process_cpu.py --model /tmp/tinym
    .venv/bin/python bench/process_cpu.py --model /tmp/vs-trl-model \
        --overrides 'rollout.prompts_per_step=16 rollout.max_tokens=128 rollout.min_tokens=128'
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

ROOT = Path(__file__).resolve().parents[1]


def label(proc: psutil.Process) -> str:
    """``ray::GenerationActor.run`` and the like for Ray's workers, the program name otherwise."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    names = [Path(part).name for part in cmd[:3]]
    for known in ("gcs_server", "raylet", "log_monitor.py", "dashboard.py", "agent.py", "runtime_env"):
        if any(known in n for n in names):
            return known.removesuffix(".py")
    if "-m" in cmd and "launch.cli" in cmd:
        return "driver (tandem train)"
    if any("multiprocessing" in part or "spawn_main" in part for part in cmd):
        return "python (spawned child)"
    return " ".join(names)[:40]


def tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_of(procs: list[psutil.Process]) -> dict[int, tuple[str, float, int]]:
    out = {}
    for p in procs:
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[p.pid] = (label(p), t.user + t.system, p.num_threads())
        except psutil.Error:
            continue
    return out


def steps_done(out_dir: Path) -> int:
    files = list(out_dir.glob("*/metrics.jsonl"))
    return len(files[0].read_text().splitlines()) if files else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--model", required=True, help="an existing tiny model directory")
    parser.add_argument("--overrides", default="", help="extra overrides, space-separated")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the window opens")
    parser.add_argument("--window", type=float, default=20.0, help="seconds sampled")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args()

    out_dir = Path(tempfile.mkdtemp(prefix="process-cpu-"))
    command = [
        sys.executable, "-m", "launch.cli", "train", "--config", args.config, f"model.path={args.model}",
        "model.build_tiny=false", f"run.output_dir={out_dir}", "run.steps=100000", "run.save_final=false",
        "run.checkpoint_every=0", *shlex.split(args.overrides),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = psutil.Process(child.pid)
    try:
        deadline = time.monotonic() + 600
        while steps_done(out_dir) < args.warmup:
            if child.poll() is not None or time.monotonic() > deadline:
                print(f"the run ended or stalled before step {args.warmup}; see {out_dir}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        procs = tree(root)
        first, steps0, t0 = cpu_of(procs), steps_done(out_dir), time.monotonic()
        time.sleep(args.window)
        last, steps1, wall = cpu_of(procs), steps_done(out_dir), time.monotonic() - t0
    finally:
        child.send_signal(signal.SIGINT)  # the run stops at a step boundary and saves nothing (save_final=false)
        try:
            child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()

    rows = []
    for pid, (name, cpu, threads) in last.items():
        used = cpu - first[pid][1] if pid in first else cpu  # its first read failed: all it used so far
        rows.append({"pid": pid, "process": name, "cpu_s": round(used, 2), "threads": threads})
    rows.sort(key=lambda r: -r["cpu_s"])
    total = sum(r["cpu_s"] for r in rows)
    steps = steps1 - steps0
    busy = total / wall
    print(f"{steps} steps in {wall:.1f}s ({steps / wall:.2f} steps/s); {total:.1f} CPU-s = {busy:.2f} cores busy")
    print(f"{'process':40s} {'pid':>7s} {'CPU s':>7s} {'% core':>7s} {'threads':>7s}")
    for r in rows:
        if r["cpu_s"] >= 0.05 or "Generation" in r["process"] or "Learner" in r["process"]:
            share = 100 * r["cpu_s"] / wall
            print(f"{r['process']:40s} {r['pid']:>7d} {r['cpu_s']:>7.2f} {share:>6.1f}% {r['threads']:>7d}")
    if args.out:
        Path(args.out).write_text(json.dumps({"window_s": wall, "steps": steps, "processes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
