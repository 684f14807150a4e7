"""Real runs for the slow tests: ``tandem train`` in this process on the tiny model, what a run
wrote, and a learner group trained on given batches."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

from actors.config import ActorPlacement, EngineConfig, RewardConfig, RolloutConfig
from actors.environment import actor_env
from actors.spec import ActorSpec
from cluster.placement import ProcessKind, ray_options
from launch.build import build_learner_group
from launch.cli import main
from launch.plan import build_plan
from learner.environment import rank_env
from tests.fakes import make_group

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO = CONFIGS / "demo.yaml"


def train(config: Path, model_dir: str, out_dir: Path, *overrides: str) -> int:
    """``tandem train --config F`` on the prebuilt tiny model, writing under ``out_dir``; the exit code."""
    return main(
        [
            "train",
            "--config",
            str(config),
            f"model.path={model_dir}",
            "model.build_tiny=false",
            f"run.output_dir={out_dir}",
            *overrides,
        ]
    )


def run_dir(out_dir: Path) -> Path:
    """The one run directory ``train`` made under ``out_dir``."""
    (only,) = list(out_dir.iterdir())
    return only


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir(out_dir) / "metrics.jsonl").read_text().splitlines()]


def read_spans(out_dir: Path) -> list[dict]:
    """The run's timeline (``timeline.jsonl``)."""
    return [json.loads(line) for line in (run_dir(out_dir) / "timeline.jsonl").read_text().splitlines()]


def overlapping(spans: list[dict], a: tuple[str, ...], b: tuple[str, ...]) -> list[tuple[dict, dict]]:
    """Pairs of spans, one of a kind in ``a`` and one of a kind in ``b``, whose times intersect."""
    first = [s for s in spans if s["kind"] in a]
    second = [s for s in spans if s["kind"] in b]
    return [(x, y) for x in first for y in second if x["start"] < y["end"] and y["start"] < x["end"]]


# The colocated schedule on two cores: an engine per core, the learner rank on both (docs/schedules.md)
COLOCATED = ("run.schedule=colocated", "resources.actors.count=2", "resources.learner.num_cpus=2")


def read_summary(out_dir: Path) -> dict:
    return json.loads((run_dir(out_dir) / "summary.json").read_text())


# A learner group's config needs no model, data or reward: train_group is handed the model and batches.
GROUP_BASE = [
    "model.path=x",
    "data.prompts=x",
    "reward.function=x",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "learner.lr=0.01",
]


def varied_batches(seed: int, steps: int = 2) -> list:
    """``steps`` batches of 4 prompts x 4 samples with random rewards and completion lengths
    (uneven lengths exercise the global loss normaliser)."""
    rng = random.Random(seed)
    return [
        [make_group(p, [rng.random() for _ in range(4)], completion_len=rng.randint(2, 9), seed=s) for p in range(4)]
        for s in range(steps)
    ]


def train_group(ray, cfg, model_path: str, run, batches: list) -> tuple[tuple[int, int, int], list[dict], dict]:
    """Build the learner group of ``cfg`` (ranks, and separate critic ranks / reference actors),
    train one step per batch, export the weights and stop its processes. Returns (how many
    policy ranks, critic ranks, reference actors), each step's metrics, and the weights by name."""

    async def go():
        group = await build_learner_group(cfg, build_plan(cfg), model_path, run)
        kinds = (len(group.workers), len(group.critics), len(group.references))
        metrics = [await group.train_step(b) for b in batches]
        exported = await asyncio.gather(*[w.export_weights.remote() for w in group.workers])  # ZeRO-3: all ranks
        weights = exported[0]  # rank 0's (name, tensor) pairs
        for w in group.workers + group.critics + group.references:
            ray.kill(w)
        return kinds, metrics, dict(weights)

    return asyncio.run(go())


def actor_spec(
    model_dir: str,
    log_path: str,
    reward: str = "builtin:echo",
    tensor_parallel: int = 1,
    engine: EngineConfig | None = None,
    **rollout,
):
    """A generation actor's spec as the launcher builds it, with ``rollout`` overrides."""
    return ActorSpec(
        name="actor-0",
        model_path=model_dir,
        engine=engine or EngineConfig(),
        rollout=RolloutConfig(**rollout),
        reward=RewardConfig(function=reward),
        dtype="float32",
        seed=0,
        tensor_parallel=tensor_parallel,
        log_path=log_path,
    )


def actor_options(tensor_parallel: int = 1) -> dict:
    """Ray options of generation actor 0 on the CPU, as the launcher gives them."""
    placement = ActorPlacement(num_cpus=tensor_parallel, tensor_parallel=tensor_parallel)
    kind = ProcessKind("actor", "actor", 1, placement.num_cpus, 0)
    return ray_options(kind, actor_env(placement, 0, EngineConfig()))


def rank_options() -> dict:
    """Ray options of one learner rank on the CPU."""
    return ray_options(ProcessKind("learner", "learner rank", 1, 1, 0), rank_env(1, 0))
