"""The run's parts, built and wired once before the training loop starts.

``assemble`` starts the processes (generation actors and learner ranks side by side, or the engines
first when they share the learner's GPUs), opens the queues and the weight channel, restores a
resumed run's state, and hands back one ``RunParts``: the objects the training loop
(``launch/train.py``) calls by name. None of them calls back into the loop: admission feeds the
prompt queue, the collector routes what comes back, the actor pool replaces a dead actor with the
``ActorStarter`` it was given.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from actors.spec import ActorTimeouts
from cluster.channel import replacement_refused
from cluster.placement import PlacementError, bundle_placed_again, node_is_gone, on_this_node, reserve
from cluster.timeline import Spans
from launch.build import (
    StartupError,
    await_actors,
    build_generation_actors,
    build_learner_group,
    colocated_on_gpus,
    generation_actor,
)
from launch.config import TandemConfig
from launch.plan import Plan
from learner.group import LearnerGroup, outcome_rewards
from observe.run_dir import RunLog
from queues.bounded import build_queue
from queues.prompts import PromptStream
from queues.templates import PromptRenderer
from runtime.admission import Admission, Pace
from runtime.collector import BatchCollector
from runtime.evaluation import Evaluator, eval_line
from runtime.health import RunHealth
from runtime.ledger import PromptLedger
from runtime.saving import Progress, Resume, RunSaver
from runtime.schedule import SCHEDULES, Overlapped
from runtime.supervise import ActorFailed, ActorPool
from runtime.turns import DeviceTurns


@dataclass
class RunParts:
    """What the training loop drives: built by ``assemble``, closed by ``launch/train.py``."""

    learner: LearnerGroup  # the learner ranks: shape rewards, score, advantages, update, publish
    admission: Admission  # the rollout loop (``feed``) and the prompt ledger
    pool: ActorPool  # the generation actors, replaced when they die
    collector: BatchCollector  # a step's batch from the results queue
    evaluator: Evaluator  # held-out rounds
    health: RunHealth  # stops a run that cannot learn
    saver: RunSaver  # checkpoints and the final model
    progress: Progress  # how far the run got
    queues: tuple  # (prompt queue, results queue)
    driver_spans: Spans  # the driver's wait for each batch, for the timeline
    schedule: Overlapped  # when the actors generate and the learner trains (run.schedule)


class ActorStarter:
    """Starts generation actor ``index`` and its loop, at the run's start and as a replacement alike."""

    def __init__(
        self,
        cfg: TandemConfig,
        plan: Plan,
        model_path: str,
        run: RunLog,
        scheduling: dict,
        queues: tuple,
        channels: list,
    ):
        """``queues``: (prompt queue, results queue); ``channels``: each actor's weight receiver, in order."""
        self.cfg, self.plan, self.model_path, self.run, self.scheduling = cfg, plan, model_path, run, scheduling
        self.names = plan.actors.names()
        self.queues, self.channels = queues, channels
        self.timeouts = ActorTimeouts(data_s=cfg.run.data_timeout_s, weights_s=cfg.run.weights_timeout_s)

    def name(self, index: int) -> str:
        """Actor ``index``'s name: one the run started with, or one that joined (``tandem scale``)."""
        return self.names[index] if index < len(self.names) else f"{self.plan.actors.prefix}-{index}"

    def run_loop(self, actor, index: int):
        prompt_queue, results_queue = self.queues
        # an actor that joined: a Ray channel's receivers are all the channel itself (a distributed one,
        # whose members are fixed, takes no new actor: runtime/fleet.py)
        channel = self.channels[index] if index < len(self.channels) else self.channels[0]
        return actor.run.remote(prompt_queue, results_queue, channel, self.timeouts)

    async def start(self, index: int):
        """Actor ``index``: a replacement, or one that joins. When a replaced actor's node was lost, Ray first
        places its bundle again (on a node with room, or never: then the run checkpoints and stops naming the
        node); one that joins has no bundle and starts wherever Ray finds room."""
        name = self.name(index)
        lost = self.run.placement.get(name) if name in self.scheduling else None
        while True:
            actor = generation_actor(self.cfg, self.plan, self.model_path, self.run, self.scheduling, index)
            try:
                await await_actors(self.cfg, self.run, [actor], [name])
                return actor
            except StartupError:
                if lost is None or not node_is_gone(lost):
                    _kill(actor)  # still waiting for room, or broken: it must not start after all, unwatched
                    raise  # its node is alive: the actor itself cannot start, and the error says why
                self.run.say(f"{name}: its node {str(lost)[:8]} is gone; waiting for Ray to place it on another node")
                deadline = time.monotonic() + self.cfg.resources.placement_timeout_s
                try:
                    where = await bundle_placed_again(self.scheduling[name], deadline, lost)
                except PlacementError as missing:
                    raise ActorFailed(f"{name} cannot be replaced: {missing}") from None
                self.run.say(f"{name}: placed on node {where[:8]}; starting it there")
                lost = None  # placed again: a failure from here on is the actor's own


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass


async def _timed(run: RunLog, phase: str, building):
    built = await building
    run.mark(phase, since="ray")
    return built


async def start_processes(actors, learner, in_turn: bool):
    """The generation actors and the learner ranks, started side by side, or ``in_turn``: the engines
    first (each has measured the free memory and taken its share once it is ready), then the learner."""
    if in_turn:
        return await actors, await learner
    return tuple(await asyncio.gather(actors, learner))


async def assemble(
    cfg: TandemConfig,
    plan: Plan,
    run: RunLog,
    rows: list[dict],
    model_path: str,
    resume: Resume | None,
    eval_rows: list[dict] | None,
) -> RunParts:
    """Start every process, open the queues and the weight channel, and wire the run's parts."""
    state = resume.state if resume else {}
    first = int(state.get("step", 0))
    renderer = PromptRenderer.load(model_path, cfg.data.chat_template, cfg.data.system_prompt)
    stream = PromptStream(rows, cfg.run.seed, cfg.data.shuffle)
    ledger = PromptLedger.restore(stream, state["ledger"]) if resume else PromptLedger(stream)
    health = RunHealth(
        cfg.learner.lr,
        cfg.reward.max_error_steps,
        cfg.run.max_nonfinite_steps,
        run.say,
        cfg.run.max_empty_steps,
        lora=cfg.learner.lora is not None,
    )
    health.restore(state.get("health", {}))
    P, k = cfg.rollout.prompts_per_step, cfg.run.max_staleness
    prompt_queue = build_queue("ray", "prompt", maxsize=P * (k + 1), actor_options=on_this_node())
    results_queue = build_queue("ray", "results", maxsize=P * (k + 2), actor_options=on_this_node())
    scheduling = reserve(plan.kinds, cfg.resources.strategy, cfg.resources.placement_timeout_s)
    actors, learner = await start_processes(
        _timed(run, "actors", build_generation_actors(cfg, plan, model_path, run, scheduling)),
        _timed(run, "learner", build_learner_group(cfg, plan, model_path, run, scheduling)),
        in_turn=colocated_on_gpus(cfg),
    )
    run.mark("processes")
    run.say("placement: " + ", ".join(f"{name} on node {node[:8]}" for name, node in sorted(run.placement.items())))
    if resume:
        await learner.load_checkpoint(str(resume.path))
        learner.restore(state["learner"])
        run.say(
            f"resumed from {resume.path} at step {first}: {len(ledger.outstanding)} prompt(s) admitted before it "
            "are generated again"
        )
    channels = await learner.open_weight_channel(cfg.weights, plan.actors.names(), cfg.run.startup_timeout_s)
    starter = ActorStarter(cfg, plan, model_path, run, scheduling, (prompt_queue, results_queue), channels)
    run.mark("weight_channel")
    pace = Pace(prompts_per_step=P, max_staleness=k, start_version=first)
    admission = Admission(ledger, pace, prompt_queue, renderer.token_ids, cfg.run.data_timeout_s)
    pool = ActorPool(
        actors,
        starter.names,
        starter,
        run,
        admission,
        queues=(prompt_queue, results_queue),
        max_restarts=cfg.resources.actors.max_restarts,
        cannot_restart=replacement_refused(cfg.weights),
        restarts=state.get("restarts"),
    )
    evaluator = Evaluator(
        eval_rows or [],
        cfg.eval,
        put=lambda requests: prompt_queue.put_many_async(requests, timeout=cfg.run.data_timeout_s),
        render=renderer.token_ids,
        record=lambda step, metrics: run.eval(step, metrics, eval_line(step, metrics)),
        chunk=P,
    )
    filtering = cfg.algorithm.filtering.groups == "zero_variance"
    collector = BatchCollector(
        results_queue,
        pool,
        run,
        cfg.run.data_timeout_s,
        admission=admission,
        evaluator=evaluator,
        max_filtered=int((cfg.algorithm.filtering.max_oversample - 1) * P) if filtering else None,
        outcomes=lambda group: outcome_rewards(group.trajectories, cfg.algorithm, cfg.rollout.max_tokens),
    )
    progress = Progress(done=first, checkpoint=resume.path if resume else None)
    saver = RunSaver(
        cfg.run,
        run,
        learner,
        progress,
        lambda: {
            "ledger": ledger.state(),
            "learner": learner.state(),
            "restarts": dict(pool.restarts),
            "health": health.state(),
        },
    )
    return RunParts(
        learner,
        admission,
        pool,
        collector,
        evaluator,
        health,
        saver,
        progress,
        (prompt_queue, results_queue),
        Spans("driver", cfg.run.timeline),
        SCHEDULES[cfg.run.schedule](admission, k, turns=device_turns(cfg, pool, learner)),
    )


def device_turns(cfg: TandemConfig, pool: ActorPool, learner) -> DeviceTurns | None:
    """The colocated schedule's phase changes (``runtime/turns.py``): a GPU learner offloads its states while
    the engines generate; on CPUs only the actors take turns."""
    if cfg.run.schedule != "colocated":
        return None
    offload = cfg.resources.learner.num_gpus > 0
    turns = DeviceTurns(lambda: list(pool.actors), learner, offload, cfg.run.startup_timeout_s)
    pool.on_replaced = turns.joined  # a replacement started during training sleeps like the others
    return turns
