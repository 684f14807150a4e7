"""The Tandem training program: actors and a learner, a rollout loop and a training loop.

    rows ──▶ prompt queue ──▶ generation actors (vLLM) ──▶ results queue ──▶ learner (DeepSpeed)
                 ▲                   ▲                                           │
        admission control            └──────────── weight channel ◀──────────────┘

The rollout loop admits a prompt only while it can still be trained on within
``max_staleness`` policy versions; the training loop drops anything older, and has it
generated again. With ``max_staleness: 0`` the two loops alternate (synchronous RL).

Nothing is lost: the prompt ledger (``runtime/ledger.py``) knows every prompt admitted and not yet
trained; checkpoints (``runtime/saving.py``) store it with the learner's state, and a resumed
run generates those prompts again. A dead generation actor is replaced (``runtime/supervise.py``);
a signal or the time limit stops at a step boundary (``runtime/stopping.py``); a run that cannot
learn stops and says why (``runtime/health.py``).
"""

from __future__ import annotations

import asyncio
import time

from actors.spec import ActorTimeouts
from cluster.channel import WeightsTimeout
from cluster.dist_channel import WeightPushError
from cluster.placement import PlacementError, bundle_placed_again, node_is_gone, on_this_node, reserve
from cluster.timeline import Spans
from launch.build import (
    StartupError,
    await_actors,
    build_generation_actors,
    build_learner_group,
    generation_actor,
    start_ray,
)
from launch.config import TandemConfig, parse_duration
from launch.plan import build_plan
from learner.group import outcome_rewards
from observe.run_dir import RunLog
from queues.bounded import build_queue
from queues.messages import PromptRequest
from queues.prompts import PromptStream
from queues.templates import PromptRenderer
from runtime.evaluation import Evaluator, eval_line
from runtime.health import RunHealth
from runtime.ledger import PromptLedger
from runtime.saving import Progress, Resume, RunSaver
from runtime.stepping import (
    ActorFailed,
    BatchCollector,
    DataTimeout,
    Pace,
    ray_death,
    sample_records,
    settled,
    step_distributions,
    step_metrics,
)
from runtime.stopping import StopRequest
from runtime.supervise import ActorPool

CLOSE_TIMEOUT_S = 15.0  # a close call to a process that may be stuck or gone


class LearnerFailed(RuntimeError):
    """A learner rank died; the message names it, its log and how to resume."""


# failures after which the learner still holds a good state: the run checkpoints before it stops
CHECKPOINT_ON = (ActorFailed, DataTimeout, WeightsTimeout, WeightPushError)


def resume_hint(run: RunLog, progress: Progress) -> str:
    """Where the run can go on from: its newest checkpoint and the command, or (none yet) that a
    resume would find nothing."""
    if progress.checkpoint is None:
        return "no checkpoint yet, so nothing to resume: start the run again"
    return f"checkpoint {progress.checkpoint}; resume with: tandem train --resume {run.root}"


def _rank_name(exc: BaseException, learner, plan) -> str | None:
    """The learner process a ``RayActorError`` is about, by actor id."""
    actor_id = getattr(exc, "actor_id", None)
    kinds = [(learner.workers, plan.learner), (learner.critics, plan.critic), (learner.references, plan.reference)]
    for handles, kind in kinds:
        for handle, name in zip(handles, kind.names() if kind else []):
            if actor_id and handle._actor_id.hex() == actor_id:
                return name
    return None


async def train(
    cfg: TandemConfig,
    run: RunLog,
    rows: list[dict],
    model_path: str,
    stop: StopRequest,
    resume: Resume | None = None,
    eval_rows: list[dict] | None = None,
) -> Progress:
    import ray

    plan = build_plan(cfg)
    start_ray(cfg, wait_s=resume.wait_s if resume else 0.0)
    run.mark("ray")
    extra = "".join(f", {k.count} separate {k.prefix} process(es)" for k in (plan.critic, plan.reference) if k)
    run.say(
        f"run directory: {run.root}\nstarting {plan.actors.count} generation actor(s) and "
        f"{plan.learner.count} learner rank(s){extra} ..."
    )
    state = resume.state if resume else {}
    first = int(state.get("step", 0))
    progress = Progress(done=first, checkpoint=resume.path if resume else None)
    renderer = PromptRenderer.load(model_path, cfg.data.chat_template, cfg.data.system_prompt)
    stream = PromptStream(rows, cfg.run.seed, cfg.data.shuffle)
    ledger = PromptLedger.restore(stream, state["ledger"]) if resume else PromptLedger(stream)
    health = RunHealth(cfg.learner.lr, cfg.reward.max_error_steps, cfg.run.max_nonfinite_steps, run.say)
    health.restore(state.get("health", {}))

    P, k, steps = cfg.rollout.prompts_per_step, cfg.run.max_staleness, cfg.run.steps
    prompt_queue = build_queue("ray", "prompt", maxsize=P * (k + 1), actor_options=on_this_node())
    results_queue = build_queue("ray", "results", maxsize=P * (k + 2), actor_options=on_this_node())
    scheduling = reserve(plan.kinds, cfg.resources.strategy, cfg.resources.placement_timeout_s)

    async def ready(phase: str, building):
        built = await building
        run.mark(phase, since="ray")
        return built

    actors, learner = await asyncio.gather(
        ready("actors", build_generation_actors(cfg, model_path, run, scheduling)),
        ready("learner", build_learner_group(cfg, model_path, run, scheduling)),
    )
    run.mark("processes")  # the generation actors and the learner ranks started side by side
    run.say("placement: " + ", ".join(f"{name} on node {node[:8]}" for name, node in sorted(run.placement.items())))
    if resume:
        await learner.load_checkpoint(str(resume.path))
        learner.restore(state["learner"])
        run.say(
            f"resumed from {resume.path} at step {first}: {len(ledger.outstanding)} prompt(s) admitted before it "
            "are generated again"
        )
    names = plan.actors.names()
    channels = await learner.open_weight_channel(cfg.weights, names, cfg.run.startup_timeout_s)
    run.mark("weight_channel")
    timeouts = ActorTimeouts(data_s=cfg.run.data_timeout_s, weights_s=cfg.run.weights_timeout_s)
    pace = Pace(prompts_per_step=P, max_staleness=k, start_version=first)
    evaluator = Evaluator(
        eval_rows or [],
        cfg.eval,
        put=lambda requests: prompt_queue.put_many_async(requests, timeout=cfg.run.data_timeout_s),
        render=renderer.token_ids,
        record=lambda step, metrics: run.eval(step, metrics, eval_line(step, metrics)),
        chunk=P,
    )

    async def start_actor(index: int):
        """A replacement for actor ``index``. When its node was lost, Ray first places its bundle again
        (on a node with room, or never: then the run checkpoints and stops naming the node)."""
        name, lost = names[index], run.placement.get(names[index])
        while True:
            actor = generation_actor(cfg, model_path, run, scheduling, index)
            try:
                await await_actors(cfg, run, [actor], [name])
                return actor
            except StartupError:
                if not node_is_gone(lost):
                    raise  # its node is alive: the actor itself cannot start, and the error says why
                run.say(f"{name}: its node {str(lost)[:8]} is gone; waiting for Ray to place it on another node")
                deadline = time.monotonic() + cfg.resources.placement_timeout_s
                try:
                    where = await bundle_placed_again(scheduling[name], deadline, lost)
                except PlacementError as missing:
                    raise ActorFailed(f"{name} cannot be replaced: {missing}") from None
                run.say(f"{name}: placed on node {where[:8]}; starting it there")
                lost = None  # placed again: a failure from here on is the actor's own

    pool = ActorPool(
        actors,
        names,
        start_loop=lambda actor, i: actor.run.remote(prompt_queue, results_queue, channels[i], timeouts),
        start_actor=start_actor,
        run=run,
        ledger=ledger,
        queues=(prompt_queue, results_queue),
        on_requeue=pace.drop,
        max_restarts=cfg.resources.actors.max_restarts,
        cannot_restart=None
        if cfg.weights.backend == "ray"
        else "the distributed weight channel is one process group and cannot take a new actor",
        restarts=state.get("restarts"),
    )
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
    run.say(f"training {steps} steps: {P} prompts x {cfg.rollout.group_size} samples per step, max staleness {k}")

    async def rollout_loop() -> None:
        slot = 0
        while True:
            await pace.admit(slot)  # waits until this prompt can be trained on within k versions
            # every prompt admissible now goes in one put (up to a step's): one queue call, not one
            # per prompt, and an actor waiting for prompts wakes to a full request, not to the first one
            count = min(P, pace.allowance() - slot)
            requests = []
            for _ in range(count):
                prompt_id, row = ledger.take()
                requests.append(
                    PromptRequest(
                        prompt_id=prompt_id, row=row, min_version=pace.version, prompt_token_ids=renderer.token_ids(row)
                    )
                )
            slot += count
            await prompt_queue.put_many_async(requests, timeout=cfg.run.data_timeout_s)

    async def on_filter(group) -> None:
        """A group left out by dynamic sampling: its prompt is done (not generated again), and one
        more prompt may be admitted in its place."""
        ledger.trained(group.prompt_id)
        await pace.drop()

    async def on_drop(group) -> None:
        if ledger.is_outstanding(group.prompt_id):
            ledger.again([group.prompt_id])
            await pace.drop()

    async def collect_or_stop(collector: BatchCollector, step: int):
        collecting = asyncio.ensure_future(collector.collect(P, step=step, max_staleness=k))
        stopping = asyncio.ensure_future(stop.event.wait())
        await asyncio.wait({collecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not collecting.done():
            collecting.cancel()  # abandoned: its prompts stay outstanding in the ledger
            return None
        return collecting.result()

    async def training_loop() -> None:
        accept = lambda group: ledger.is_outstanding(group.prompt_id)  # noqa: E731
        filtering = cfg.algorithm.filter_groups == "zero_variance"
        collector = BatchCollector(
            results_queue,
            pool,
            run,
            cfg.run.data_timeout_s,
            on_drop=on_drop,
            accept=accept,
            max_filtered=int((cfg.algorithm.max_oversample - 1) * P) if filtering else None,
            on_filter=on_filter,
            on_eval=evaluator.add,
            on_spans=run.timeline,
            outcomes=lambda group: outcome_rewards(group.trajectories, cfg.algorithm, cfg.rollout.max_tokens),
        )
        said_oversample = False
        step_s = 0.0
        if first == 0 and evaluator.due(0, steps):
            evaluator.start(0, version=0)  # the starting point, generated beside the first batches
        try:
            for step in range(first, steps):
                evaluator.check_sending()
                if stop.requested or stop.time_is_short(step_s, progress.checkpoint_s):
                    break
                t0, wall = time.monotonic(), time.time()
                batch = await collect_or_stop(collector, step)
                driver_spans.add("wait_data", wall, time.time(), step)
                if batch is None:
                    break
                if batch.oversample_reached and not said_oversample:
                    said_oversample = True
                    run.say(
                        f"step {step + 1}: dynamic sampling reached algorithm.max_oversample "
                        f"({cfg.algorithm.max_oversample:g} x {P} groups): zero-variance groups fill the batch; "
                        "most groups have equal rewards (too easy or too hard a task?)"
                    )
                if step == steps - 1:
                    rollout.cancel()  # nothing more will be trained: admit no prompt for step `steps`
                learner_metrics = await learner.train_step(batch.groups)
                for group in batch.groups:
                    ledger.trained(group.prompt_id)
                health.check(step, batch.groups, learner_metrics)
                try:
                    run.timeline(await learner.publish_weights(step + 1) + driver_spans.take())
                    await pace.advance(step + 1)  # policy version step + 1 is now on the channel
                finally:  # the update is applied, published or not: the step is done, and the
                    # checkpoint written after a failed push says so (its optimizer has step + 1 updates)
                    step_s = time.monotonic() - t0
                    metrics = step_metrics(batch, learner_metrics, step_s)
                    metrics.update(
                        prompt_ids=[g.prompt_id for g in batch.groups],
                        filtered_prompt_ids=batch.filtered_ids,
                        duplicates=batch.duplicates,
                        actor_restarts=pool.total_restarts,
                    )
                    run.step(step, metrics, step_distributions(batch))
                    run.samples(sample_records(batch, step, cfg.run.log_samples))
                    progress.done = step + 1
                if evaluator.due(progress.done, steps):
                    evaluator.start(progress.done, version=progress.done)
                every = cfg.run.checkpoint_every
                if progress.done < steps and ((every and progress.done % every == 0) or saver.time_due()):
                    await saver.checkpoint()
            if evaluator.pending:  # the rounds still out (the last one at least) come back before the end
                await collector.drain_eval(lambda: evaluator.pending, cfg.run.data_timeout_s)
        finally:
            evaluator.give_up()
            collector.close()
            run.timeline(driver_spans.take())  # the wait of a step that did not train (a stop, an error)

    driver_spans = Spans("driver", cfg.run.timeline)  # the learner's wait for each batch
    rollout = settled(asyncio.create_task(rollout_loop()), run.say, "the rollout loop")
    try:
        if first:  # the actors generate with the resumed policy, version `first` (a distributed
            run.timeline(await learner.publish_weights(first))  # receiver joins when its actor takes a prompt)
        await training_loop()
        progress.stopped = stop.reason
        await saver.finish()
    except CHECKPOINT_ON as exc:
        cause = getattr(exc, "cause", None)  # raised in a Ray actor: the original error, not the traceback
        exc = cause if isinstance(cause, CHECKPOINT_ON) else exc
        if saver.checkpoint_due():
            try:
                await asyncio.wait_for(saver.checkpoint(), cfg.run.startup_timeout_s)
            except Exception as ckpt_exc:  # the run's own error matters more
                run.say(f"could not checkpoint: {type(ckpt_exc).__name__}: {ckpt_exc}")
        raise type(exc)(f"{exc}; {resume_hint(run, progress)}") from None
    except ray.exceptions.RayActorError as exc:
        name = _rank_name(exc, learner, plan)
        if name is None:
            raise
        raise LearnerFailed(
            f"{name} (node {run.placement.get(name, '?')[:8]}) died: {ray_death(str(exc))}; its log: "
            f"{run.log_path(name)}; {resume_hint(run, progress)}"
        ) from None
    finally:
        rollout.cancel()
        # Weights first (a distributed receiver tears its group down on the close header), then the
        # queues: every actor waiting on them wakes with QueueClosed and its loop returns.
        for close in (learner.close_weight_channel, prompt_queue.close, results_queue.close):
            try:
                await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)
            except Exception as exc:  # a failed run's own error matters more than a failed close
                cause = ray_death(str(exc)) if str(exc).strip() else f"no answer within {CLOSE_TIMEOUT_S:.0f}s"
                run.say(f"while stopping: {type(exc).__name__}: {cause}")
    loops = list(pool.refs.values())
    try:
        finals = await asyncio.wait_for(asyncio.gather(*loops, return_exceptions=True), cfg.run.weights_timeout_s)
    except asyncio.TimeoutError:
        run.say(f"some actors did not stop within {cfg.run.weights_timeout_s:.0f}s; shutting them down")
        finals = [f"did not stop within {cfg.run.weights_timeout_s:.0f}s"] * len(loops)
    for final in finals:  # the spans an actor recorded after its last pushed group
        if isinstance(final, dict):
            run.timeline(final.pop("spans", []))
    progress.details = {
        "actors": [f if isinstance(f, dict) else repr(f) for f in finals],
        "placement": run.placement,
        "actor_restarts": dict(pool.restarts),
        "nonfinite_updates": health.nonfinite_total,
        "eval": evaluator.results,
    }
    return progress


def time_limit_s(cfg: TandemConfig) -> float | None:
    return parse_duration(cfg.run.time_limit) if cfg.run.time_limit is not None else None
