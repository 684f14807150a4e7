"""Factories the training program calls: Ray, the model directory, actors, learner ranks.

Each factory hands a component only its own typed config section, and takes placement from
the plan (``launch/plan.py``, ``cluster/placement.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import threading
import time
from pathlib import Path

from actors.adapters import AdapterSpec
from cluster import reaper
from cluster.placement import PlacementError, check_fits, local_ray_cpus, ray_options
from cluster.process_env import signals_blocked
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


def start_ray(cfg: TandemConfig, plan: Plan, log_to_driver: bool = False, wait_s: float = 0.0) -> None:
    """Join ``resources.address`` or start a local Ray, then check the plan fits: at once, or (``wait_s``,
    a restart after a lost node) once the cluster has room again, within ``wait_s``."""
    import ray

    if ray.is_initialized():
        return
    kinds = plan.kinds
    # ray.init sets its own SIGTERM handler (sys.exit), which would replace the run's clean stop
    # (runtime/stopping.py): a preemption's SIGTERM must checkpoint like Ctrl-C, so ours is put back.
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        _init_ray(cfg, kinds, log_to_driver)
    finally:
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
    _quiet_worker_deaths()  # a cluster's worker deaths too
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            check_fits(kinds, ray.available_resources())
            return
        except PlacementError as exc:
            if time.monotonic() > deadline:
                raise
            if not said:
                print(f"tandem: waiting up to {wait_s:.0f}s for the cluster to have room again: {exc}", flush=True)
                said = True
            time.sleep(2.0)


def _private_token() -> None:
    """Ray writes its cluster token (``~/.ray/auth_token``) readable by every user of the machine:
    anyone holding it can run code in the cluster. Only its owner may read it."""
    path = Path.home() / ".ray" / "auth_token"
    try:
        if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except OSError:
        pass  # no token file (authentication off): nothing to protect


LOCAL_SESSIONS: list[str] = []  # the session folders of the local Rays this process started


def remove_local_sessions() -> None:
    """Delete the session folders (Ray's logs and spilled objects, under /tmp/ray) of the local Rays this
    process started and has shut down: a finished run's own logs are in its run directory, and the
    folders of run after run would fill the disk. A failed run keeps its folder for Ray's own logs."""
    import ray

    if ray.is_initialized():
        return
    while LOCAL_SESSIONS:
        session = Path(LOCAL_SESSIONS.pop())
        shutil.rmtree(session, ignore_errors=True)
        latest = session.parent / "session_latest"
        if latest.is_symlink() and not latest.exists():
            latest.unlink(missing_ok=True)


SIDE_PROCESSES = ("monitor", "dashboard", "log_monitor")  # a local Ray's processes that hold no run state


def stop_ray() -> None:
    """``ray.shutdown``. A local session's processes hold SIGTERM blocked (``_init_ray``), so Ray's own
    shutdown would wait a second for each before its SIGKILL: the run's workers (done by now) and the side
    processes that hold nothing of the run are killed first, and the raylet and GCS server (raylet first,
    as Ray does) keep their turn. The command returns with no process of the run left."""
    import ray

    if not ray.is_initialized():
        return
    node = getattr(ray._private.worker, "_global_node", None)
    for info in node.all_processes.get("raylet", []) if node is not None else ():
        _kill_below(info.process.pid)  # the run's workers: none outlives the command (they finished)
    for name in SIDE_PROCESSES if node is not None else ():
        for info in node.all_processes.get(name, []):
            if info.process.poll() is None:
                info.process.kill()
                info.process.wait()
    ray.shutdown()


def _kill_below(pid: int, wait_s: float = 5.0) -> None:
    """SIGKILL every process below ``pid`` and wait for them (a raylet's workers outlived it by seconds)."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for process in below:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(below, timeout=wait_s)


WORKER_DIED = "A worker died or was killed while executing a task"  # the raylet's paragraph begins so
GCS_GONE_S = 600  # a local session's processes wait this long for a dead GCS server before Ray aborts them
RAYLET_DIED = "Raylet is terminated"  # ... and Ray's 20-line dump of a dead raylet's log (cluster/ray_watch.py says it)


def _quiet_worker_deaths() -> None:
    """At every worker death the raylet prints a ~700-character paragraph of possible causes on the
    driver's console, and at a raylet's death the last 20 lines of its log; the run says what died, what
    happened and where its log is in one line of its own (``runtime/supervise.py``,
    ``cluster/ray_watch.py``), so those are left out. Ray's other messages pass."""
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "tandem_filter", False):
        return

    def printer(data, ignore_prefix: bool):
        lines = data.get("lines", [])
        if data.get("pid") == "raylet" and any(WORKER_DIED in line or RAYLET_DIED in line for line in lines):
            return None
        return original(data, ignore_prefix)

    printer.tandem_filter = True
    ray_worker.print_to_stdstream = printer


def _init_ray(cfg: TandemConfig, kinds, log_to_driver: bool) -> None:
    import ray

    source = str(Path(__file__).resolve().parents[1])  # Ray's workers import Tandem from this checkout
    if cfg.resources.address:
        env = {"env_vars": {"PYTHONPATH": source}}
        ray.init(address=cfg.resources.address, log_to_driver=log_to_driver, runtime_env=env)
    else:
        from ray._private import ray_constants

        # Ray's servers bind to 127.0.0.1 only when the node address is loopback, and ray.init turns
        # even an explicit _node_ip_address="127.0.0.1" into the routable address unless clusters are
        # off: switched off for the call, a local Ray cannot be reached from other machines.
        clusters, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
        token = secrets.token_hex(8)
        # A local Ray's processes inherit PYTHONPATH from here instead of a job runtime env: the
        # workers Ray starts with the node then serve the queue actors (a runtime env would need
        # new ones, each started through Ray's runtime-env setup, seconds of start-up on 2 cores).
        python_path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        # Token authentication is Ray's default for a local cluster: its warning saying so at every
        # start is noise around the lines that matter.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        try:
            # SIGTERM blocked in every process Ray starts (as Ray blocks SIGINT in them): a SIGTERM to the
            # process group or to every process of a job (a pod stop, scancel) reaches only the driver,
            # which stops them in order after the checkpoint (runtime/stopping.py); SIGKILL still ends them.
            with reaper.marked_environment(token, PYTHONPATH=python_path), signals_blocked(signal.SIGTERM):
                ray.init(
                    num_cpus=local_ray_cpus(kinds, cfg.resources.local_num_cpus),
                    log_to_driver=log_to_driver,
                    include_dashboard=False,
                    # a dead GCS server aborts every Ray process after this long: room for the driver to
                    # finish the step, checkpoint and stop (cluster/ray_watch.py) instead of Ray's default 60 s
                    _system_config={"gcs_rpc_server_reconnect_timeout_s": GCS_GONE_S},
                )
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = clusters
        _private_token()
        # a watchdog that ends the session's processes if this process dies without ray.shutdown
        node = ray._private.worker._global_node
        LOCAL_SESSIONS.append(node.get_session_dir_path())
        gcs = node.all_processes.get(ray_constants.PROCESS_TYPE_GCS_SERVER)
        reaper.start_watchdog(token, node.get_session_dir_path(), gcs[0].process.pid if gcs else None)


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
