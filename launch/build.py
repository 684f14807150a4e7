"""Factories the training program calls: Ray, the model directory, actors, learner ranks.

Each factory hands a component only its own typed config section, and takes placement from
the plan (``launch/plan.py``, ``cluster/placement.py``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.adapters import AdapterSpec
from cluster.placement import ray_options
from launch.config import ModelConfig, TandemConfig
from launch.plan import Plan, actor_environment, rank_environment, reward_model_environment
from observe.run_dir import RunLog


class StartupError(RuntimeError):
    """A component could not start; the message names it and its log file."""


def prepare_model(model: ModelConfig) -> str:
    """The model directory or hub id to load; builds the tiny model when asked."""
    path = Path(model.path).expanduser()
    if model.build_tiny:
        from actors.tiny_model import build_tiny_model

        return str(build_tiny_model(path).resolve())
    if path.exists():
        if not (path / "config.json").is_file():
            raise StartupError(f"model.path {path} has no config.json; point it at a Hugging Face model directory")
        return str(path.resolve())
    if model.path.startswith((".", "/", "~")) or model.path.count("/") > 1:
        raise StartupError(
            f"model.path {model.path} does not exist; give an existing directory, a Hugging Face id "
            "like Qwen/Qwen2.5-0.5B, or set model.build_tiny=true to build the tiny test model there"
        )
    return model.path  # a hub id: vLLM and transformers resolve it


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


def generation_actor(cfg: TandemConfig, plan: Plan, model_path: str, run: RunLog, scheduling: dict, index: int):
    """Start generation actor ``index`` (not waiting for it); ``scheduling``: the placement-group
    bundle strategy of each process by name (from ``cluster.placement.reserve``)."""
    import ray

    from actors.generation import GenerationActor
    from actors.spec import ActorSpec

    kind = plan.actors
    Actor = ray.remote(GenerationActor)
    name = f"{kind.prefix}-{index}"  # one the run started with, or one that joined (runtime/fleet.py)
    spec = ActorSpec(
        name=name,
        model_path=model_path,
        engine=cfg.engine,
        rollout=cfg.rollout,
        reward=cfg.reward,
        dtype=cfg.model.dtype,
        seed=cfg.run.seed + index,
        tensor_parallel=cfg.resources.actors.tensor_parallel,  # the engine shards over the actor's GPUs/cores
        log_path=run.log_path(name),
        step_delimiter=cfg.algorithm.estimator.step_delimiter if cfg.algorithm.method.per_step_rewards else None,
        reward_model_actors=tuple(reward_model_names(plan, run)),
        timeline=cfg.run.timeline,
        chat_template=episode_template(cfg.data.chat_template),
        system_prompt=cfg.data.system_prompt,
        adapter=adapter_spec(cfg),
        sleep_level=engine_sleep_level(cfg),
    )
    # one that joined has no placement bundle: it asks for its own resources, on any node with room
    return Actor.options(**ray_options(kind, actor_environment(cfg, index), scheduling.get(name))).remote(spec)


def adapter_spec(cfg: TandemConfig) -> AdapterSpec | None:
    """What the actors need to serve ``learner.lora``'s adapters: their shape, and a slot for each version
    that may still be generating (``run.max_staleness + 1``)."""
    lora = cfg.learner.lora
    return None if lora is None else AdapterSpec(lora.rank, lora.alpha, slots=cfg.run.max_staleness + 1)


def engine_sleep_level(cfg: TandemConfig) -> int:
    """What an engine frees between its generation phases (``actors/sleep.py``): only a colocated one on a GPU."""
    from actors.sleep import sleep_level

    return sleep_level(cfg.run.schedule == "colocated" and cfg.resources.actors.num_gpus > 0)


def episode_template(chat_template: str) -> str | None:
    """The text of ``data.chat_template``'s file, which an episode's turns are rendered with on the actor
    (None: the tokenizer's own)."""
    if chat_template in ("auto", "none"):
        return None
    return Path(chat_template).expanduser().read_text()


async def await_actors(cfg: TandemConfig, run: RunLog, actors: list, names: list[str]) -> None:
    """Wait until the actors' engines are up; each one's pid and node go into the run directory."""
    logs = [run.log_path(n) for n in names]
    infos = await _await_ready([a.ready.remote() for a in actors], names, logs, cfg.run.startup_timeout_s)
    for info in infos:
        run.process(info["name"], info)


# The reward model actors of this driver by Ray name: held here so they live as long as the driver.
_REWARD_MODELS: dict[str, object] = {}


def reward_model_names(plan: Plan, run: RunLog) -> list[str]:
    """Ray names of the reward model actors (none without reward.model), unique to the run directory."""
    kind = plan.reward_model
    return [f"{run.root.name}-{name}" for name in kind.names()] if kind else []


async def build_reward_models(cfg: TandemConfig, plan: Plan, run: RunLog, scheduling: dict) -> None:
    """Start the reward model actors (``reward.model``) once per driver and wait until they are up; a
    process without a bundle in ``scheduling`` asks for plain resources."""
    import ray

    from actors.reward_model import RewardModelActor

    kind = plan.reward_model
    if kind is None:
        return
    names, ray_names = kind.names(), reward_model_names(plan, run)
    env = reward_model_environment(kind)
    new = [(n, r) for n, r in zip(names, ray_names) if r not in _REWARD_MODELS]
    for name, ray_name in new:
        options = ray_options(kind, env, scheduling.get(name))
        _REWARD_MODELS[ray_name] = (
            ray.remote(RewardModelActor)
            .options(name=ray_name, **options)
            .remote(cfg.reward.model, name, run.log_path(name))
        )
    refs = [_REWARD_MODELS[r].ready.remote() for _, r in new]
    infos = await _await_ready(refs, [n for n, _ in new], [run.log_path(n) for n, _ in new], cfg.run.startup_timeout_s)
    for info in infos:
        run.process(info["name"], info)


async def build_generation_actors(
    cfg: TandemConfig, plan: Plan, model_path: str, run: RunLog, scheduling: dict
) -> list:
    await build_reward_models(cfg, plan, run, scheduling)  # the actors look them up by name as they start
    names = plan.actors.names()
    actors: list = []
    for wave in engine_waves(len(names), cfg.resources.learner.ranks if colocated_on_gpus(cfg) else len(names)):
        started = [generation_actor(cfg, plan, model_path, run, scheduling, i) for i in wave]
        await await_actors(cfg, run, started, [names[i] for i in wave])
        actors += started
    return actors


def colocated_on_gpus(cfg: TandemConfig) -> bool:
    """The colocated schedule on GPUs: vLLM sizes its KV cache from the whole device's free memory
    (``MemorySnapshot``: total - free), so whatever another process allocates on the shared GPU while
    an engine starts is charged to that engine's cache."""
    return cfg.run.schedule == "colocated" and bool(cfg.resources.actors.num_gpus)


def engine_waves(count: int, per_wave: int) -> list[list[int]]:
    """Actor indices started together: colocated, actor i shares learner rank i's GPU modulo the ranks
    (``launch/plan.py colocate``), so waves of one actor per rank put one starting engine on each GPU."""
    return [list(range(start, min(start + per_wave, count))) for start in range(0, count, per_wave)]


async def build_learner_group(
    cfg: TandemConfig, plan: Plan, model_path: str, run: RunLog, scheduling: dict | None = None
):
    """The policy ranks, and the critic ranks and reference actors when they are placed
    separately. ``scheduling``: each process's placement-group bundle strategy by name
    (None: plain resource requests)."""
    from learner.group import LearnerGroup

    roles = ("policy",) + (("critic",) if cfg.has_critic and plan.critic is None else ())
    roles += ("reference",) if cfg.has_reference and plan.reference is None else ()
    kinds = [(plan.learner, roles)]
    if plan.critic:
        kinds.append((plan.critic, ("critic",)))
    if plan.reference:
        kinds.append((plan.reference, ("reference",)))
    process_names: dict[str, str] = {}  # Ray actor id -> process name: a death's error names the process
    started = await asyncio.gather(
        *[_start_ranks(cfg, model_path, run, scheduling, process_names, *kind) for kind in kinds]
    )
    by_prefix = dict(zip((k.prefix for k, _ in kinds), started))
    return LearnerGroup(
        by_prefix["learner"],
        cfg.algorithm,
        cfg.learner.token_budget,
        cfg.rollout.max_tokens,
        critics=by_prefix.get("critic"),
        references=by_prefix.get("reference"),
        process_names=process_names,
    )


async def _start_ranks(
    cfg: TandemConfig, model_path: str, run: RunLog, scheduling, process_names: dict, kind, roles
) -> list:
    """Start the ``LearnerWorker`` processes of ``kind`` holding ``roles``; the ranks of one kind
    form one DeepSpeed group (a reference actor is a group of one and joins none)."""
    import ray

    from learner.worker import LearnerWorker, RankSpec

    world = 1 if roles == ("reference",) else kind.count
    names = kind.names()
    logs = [run.log_path(n) for n in names]
    env = rank_environment(kind)
    workers = [
        ray.remote(LearnerWorker)
        .options(**ray_options(kind, env, scheduling[name] if scheduling else None))
        .remote(r % world, world, log, name)
        for r, (name, log) in enumerate(zip(names, logs))
    ]
    master_addr, master_port = await workers[0].rendezvous_address.remote()
    spec = RankSpec(
        model_path,
        cfg.learner,
        cfg.algorithm,
        cfg.model.dtype,
        cfg.run.seed,
        cfg.rollout.max_tokens,
        roles,
        total_updates=cfg.run.steps * cfg.algorithm.updates_per_batch,
        timeline=cfg.run.timeline,
        temperature=cfg.rollout.temperature,
        min_tokens=cfg.rollout.min_tokens,
    )
    setups = [w.setup.remote(master_addr, master_port, spec) for w in workers]
    infos = await _await_ready(setups, names, logs, cfg.run.startup_timeout_s)
    for name, info in zip(names, infos):
        run.process(name, info)
        process_names[info["actor_id"]] = name
    if "policy" in roles and "attention" in infos[0]:
        run.say(f"learner: {infos[0]['attention']}")  # which kernel trains, and on a GPU why auto fell back
    if cfg.learner.lora is not None and "lora" in infos[0]:
        from learner.lora import describe_lora

        run.say(describe_lora(cfg.learner.lora, infos[0]["lora"]))
    return workers
