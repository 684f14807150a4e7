"""Factories the training program calls: Ray, the model directory, actors, learner ranks.

Each factory hands a component only its own config section, and takes placement from
``cluster.placement``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from cluster.placement import (
    check_fits,
    generation_actor_options,
    learner_rank_options,
    local_ray_cpus,
)
from launch.config import TandemConfig
from launch.run_dir import RunLog


class StartupError(RuntimeError):
    """A component could not start; the message names it and its log file."""


def prepare_model(model: dict[str, Any]) -> str:
    """The model directory or hub id to load; builds the tiny model when asked."""
    path = Path(model["path"]).expanduser()
    if model["build_tiny"]:
        from actors.tiny_model import build_tiny_model

        return str(build_tiny_model(path).resolve())
    if path.exists():
        if not (path / "config.json").is_file():
            raise StartupError(f"model.path {path} has no config.json; point it at a Hugging Face model directory")
        return str(path.resolve())
    if model["path"].startswith((".", "/", "~")) or model["path"].count("/") > 1:
        raise StartupError(
            f"model.path {model['path']} does not exist; give an existing directory, a Hugging Face id "
            "like Qwen/Qwen2.5-0.5B, or set model.build_tiny=true to build the tiny test model there"
        )
    return model["path"]  # a hub id: vLLM and transformers resolve it


def start_ray(resources: dict[str, Any], log_to_driver: bool = False) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}}
    if resources["address"]:
        ray.init(address=resources["address"], log_to_driver=log_to_driver, runtime_env=env)
    else:
        ray.init(
            num_cpus=local_ray_cpus(resources),
            log_to_driver=log_to_driver,
            include_dashboard=False,
            runtime_env=env,
        )
    check_fits(resources, ray.available_resources())


async def _await_ready(refs: list, names: list[str], log_paths: list[str], timeout: float) -> list:
    """Wait for start-up calls; a failure or timeout names the process and its log."""
    results = []
    for ref, name, log in zip(refs, names, log_paths):
        try:
            results.append(await asyncio.wait_for(asyncio.ensure_future(ref), timeout))
        except asyncio.TimeoutError:
            raise StartupError(
                f"{name} did not start within {timeout:.0f}s (run.startup_timeout_s); see {log}"
            ) from None
        except Exception as exc:
            cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise StartupError(f"{name} failed to start: {cause}; full log: {log}") from None
    return results


async def build_generation_actors(cfg: TandemConfig, model_path: str, run: RunLog, scheduling: dict) -> list:
    """``scheduling``: the placement-group bundle strategy of each process by name (from
    ``cluster.placement.reserve``)."""
    import ray

    from actors.async_generation import AsyncGenerationActor
    from actors.generation import GenerationActor

    placement = cfg.resources.actors.model_dump()
    # the engine shards over the actor's GPUs (or cores): placement decides how many
    engine = {**cfg.engine.model_dump(), "tensor_parallel_size": placement["tensor_parallel"]}
    Actor = ray.remote(AsyncGenerationActor if cfg.rollout.weight_update == "inflight" else GenerationActor)
    actors, names, logs = [], [], []
    for i in range(cfg.resources.actors.count):
        name = f"actor-{i}"
        log = run.log_path(name)
        actors.append(
            Actor.options(**generation_actor_options(placement, i, engine, scheduling[name])).remote(
                name=name,
                model_path=model_path,
                engine=engine,
                rollout=cfg.rollout.model_dump(),
                reward_function=cfg.reward.function,
                dtype=cfg.model.dtype,
                seed=cfg.run.seed + i,
                log_path=log,
                step_delimiter=cfg.algorithm.step_delimiter if cfg.algorithm.name == "grpo_process" else None,
            )
        )
        names.append(name)
        logs.append(log)
    infos = await _await_ready([a.ready.remote() for a in actors], names, logs, cfg.run.startup_timeout_s)
    run.placement.update({info["name"]: info["node"] for info in infos})
    return actors


class WeightPath:
    """How new weights travel from the learner to the actors, behind one small interface:
    ``channels[i]`` is what actor i pulls from; ``publish(version)`` sends; ``close()`` ends."""

    def __init__(self, backend: str, learner, channels: list, store=None):
        self.backend, self.learner, self.channels, self.store = backend, learner, channels, store

    async def publish(self, version: int) -> None:
        if self.backend == "distributed":
            await self.learner.publish_weights(version)
        else:
            self.store.publish(version, await self.learner.export_weights())

    async def close(self) -> None:
        if self.backend == "distributed":
            await self.learner.close_weight_channel()
        else:
            self.store.close()


async def build_weight_path(cfg: TandemConfig, learner, n_actors: int) -> WeightPath:
    from cluster.weights import build_weight_channel

    if cfg.weights.backend == "distributed":
        spec = await learner.open_weight_channel(n_actors, cfg.weights.model_dump(), cfg.run.startup_timeout_s)
        return WeightPath("distributed", learner, [spec.handle(i + 1, f"actor-{i}") for i in range(n_actors)])
    store = build_weight_channel("ray")
    return WeightPath("ray", learner, [store] * n_actors, store)


async def build_learner_group(cfg: TandemConfig, model_path: str, run: RunLog, scheduling: dict | None = None):
    """The policy ranks, and the critic ranks and reference actors when they are placed
    separately. ``scheduling``: each process's placement-group bundle strategy by name
    (None: plain resource requests)."""
    from learner.group import LearnerGroup

    plan = cfg.placement()
    roles = ("policy",) + (("critic",) if cfg.has_critic and not plan["critic"] else ())
    roles += ("reference",) if cfg.has_reference and not plan["reference"] else ()
    ranks = cfg.resources.learner.ranks
    kinds = [("learner", ranks, plan["learner"], roles)]
    if plan["critic"]:
        kinds.append(("critic", ranks, plan["critic"], ("critic",)))
    if plan["reference"]:
        kinds.append(("reference", plan["reference"]["count"], plan["reference"], ("reference",)))
    started = await asyncio.gather(*[_start_ranks(cfg, model_path, run, scheduling, *kind) for kind in kinds])
    by_kind = dict(zip((k[0] for k in kinds), started))
    return LearnerGroup(
        by_kind["learner"],
        cfg.algorithm.model_dump(),
        cfg.learner.token_budget,
        cfg.rollout.max_tokens,
        critics=by_kind.get("critic"),
        references=by_kind.get("reference"),
    )


async def _start_ranks(
    cfg: TandemConfig,
    model_path: str,
    run: RunLog,
    scheduling: dict | None,
    prefix: str,
    count: int,
    placement: dict[str, Any],
    roles: tuple[str, ...],
) -> list:
    """Start ``count`` ``LearnerWorker`` processes named ``<prefix>-<i>`` holding ``roles``; the
    ranks of one kind form one DeepSpeed group (a reference actor is a group of one and joins none)."""
    import ray

    from learner.worker import LearnerWorker

    world = 1 if roles == ("reference",) else count
    names = [f"{prefix}-{r}" for r in range(count)]
    logs = [run.log_path(n) for n in names]
    workers = [
        ray.remote(LearnerWorker)
        .options(**learner_rank_options(placement, scheduling[name] if scheduling else None))
        .remote(r % world, world, log)
        for r, (name, log) in enumerate(zip(names, logs))
    ]
    master_addr, master_port = await workers[0].rendezvous_address.remote()
    setups = [
        w.setup.remote(
            master_addr,
            master_port,
            model_path,
            cfg.learner.model_dump(),
            cfg.algorithm.model_dump(),
            cfg.model.dtype,
            cfg.run.seed,
            roles,
        )
        for w in workers
    ]
    infos = await _await_ready(setups, names, logs, cfg.run.startup_timeout_s)
    run.placement.update({name: info["node"] for name, info in zip(names, infos)})
    return workers
