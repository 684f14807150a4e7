"""The ``tandem`` command line.

    tandem demo [key=value ...]                   the built-in demo: a real RL run on the CPU
    tandem train --config FILE.yaml [key=value]   train with a config file and overrides
    tandem tiny-model DIR                         build the tiny test model + tokenizer in DIR
    tandem config-reference                       print every config key (Markdown)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from launch.config import ConfigError, config_reference, load_config

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"

# Errors that are the user's to fix: printed as one line, no traceback.
def _user_errors() -> tuple[type[BaseException], ...]:
    from actors.rewards import RewardSpecError
    from cluster.placement import PlacementError
    from cluster.weights import WeightsTimeout
    from launch.build import StartupError
    from launch.stepping import ActorFailed, DataTimeout
    from queues.prompts import DatasetError

    return (ConfigError, DatasetError, RewardSpecError, StartupError, PlacementError, DataTimeout, ActorFailed,
            WeightsTimeout)


def reward_summary(metrics_path: Path) -> dict[str, float]:
    """Mean reward over the first and last 10% of steps."""
    rewards = [json.loads(line)["reward_mean"] for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rewards:
        return {}
    tenth = max(1, len(rewards) // 10)
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    return {"steps": len(rewards), "reward_first_10pct": first, "reward_last_10pct": last, "reward_gain": last - first}


def run_training(config_path: str | Path, overrides: list[str]) -> int:
    from actors.rewards import load_reward_function
    from launch.build import prepare_model
    from launch.run_dir import RunLog, format_seconds
    from launch.train import train
    from queues.prompts import load_rows

    started = time.monotonic()
    # Everything a user can get wrong is checked before any process starts.
    cfg = load_config(config_path, overrides)
    load_reward_function(cfg.reward.function)
    rows = load_rows(cfg.data.prompts, cfg.data.num_rows, cfg.run.seed)
    model_path = prepare_model(cfg.model.model_dump())
    run = RunLog.create(cfg.run.output_dir, cfg.run.name, cfg.model_dump(mode="json"), cfg.run.steps)
    try:
        details = asyncio.run(train(cfg, run, rows, model_path))
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    summary = {**reward_summary(run.root / "metrics.jsonl"), "wall_s": round(time.monotonic() - started, 1), **details}
    run.close(summary)
    run.say(
        f"\ndone in {format_seconds(summary['wall_s'])}: {summary.get('steps', 0)} steps, mean reward "
        f"{summary.get('reward_first_10pct', 0):.3f} (first 10%) -> {summary.get('reward_last_10pct', 0):.3f} "
        f"(last 10%)\nrun files: {run.root} (config.yaml, metrics.jsonl, tb/, logs/, summary.json)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Asynchronous actor-learner RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in demo (tiny model, built-in task, CPU)")
    demo.add_argument("overrides", nargs="*", help="config overrides, key=value")
    tr = sub.add_parser("train", help="train with a YAML config")
    tr.add_argument("--config", required=True, help="YAML config file")
    tr.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. learner.lr=3e-4)")
    tiny = sub.add_parser("tiny-model", help="build the tiny random-init Qwen2 model and tokenizer")
    tiny.add_argument("dir")
    sub.add_parser("config-reference", help="print the config reference (Markdown)")
    args = parser.parse_args(argv)

    try:
        if args.command == "config-reference":
            print(config_reference())
            return 0
        if args.command == "tiny-model":
            from actors.tiny_model import build_tiny_model

            print(build_tiny_model(args.dir))
            return 0
        config = DEMO_CONFIG if args.command == "demo" else args.config
        return run_training(config, args.overrides)
    except _user_errors() as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
