"""The Tandem training program: actors and a learner, a rollout loop and a training loop.

    rows ──▶ prompt queue ──▶ generation actors (vLLM) ──▶ results queue ──▶ learner (DeepSpeed)
                 ▲                   ▲                                           │
        admission control            └──────────── weight channel ◀──────────────┘

The rollout loop (``Admission.feed``, ``runtime/admission.py``) admits a prompt only while it can
still be trained on within ``max_staleness`` policy versions; the training loop below drops anything
older, and has it generated again. With ``max_staleness: 0`` the two loops alternate (synchronous RL).
Each step of the training loop is a call found by name: collect a batch, shape rewards, score
(pi_old, reference), advantages, update, publish, log, evaluate, checkpoint.

Nothing is lost: the prompt ledger (``runtime/ledger.py``) knows every prompt admitted and not yet
trained; checkpoints (``runtime/saving.py``) store it with the learner's state, and a resumed run
generates those prompts again. A dead generation actor is replaced (``runtime/supervise.py``); a
signal or the time limit stops at a step boundary (``runtime/stopping.py``); a run that cannot learn
stops and says why (``runtime/health.py``). The parts are built in ``launch/assemble.py``.
"""

from __future__ import annotations

import asyncio
import collections
import time

from cluster.channel import WeightsTimeout, replacement_refused
from cluster.dist_channel import WeightPushError
from launch.assemble import RunParts, assemble
from launch.config import TandemConfig, parse_duration
from launch.plan import Plan
from launch.ray_session import start_ray
from observe.run_dir import RunLog
from queues.messages import ActorReport
from runtime.collector import Batch, DataTimeout, settled
from runtime.disk import DiskFull
from runtime.fleet import FleetWatch
from runtime.saving import Progress, Resume
from runtime.step_metrics import sample_records, step_distributions, step_metrics
from runtime.stopping import StopRequest
from runtime.supervise import ActorFailed, ray_death

CLOSE_TIMEOUT_S = 15.0  # a close call to a process that may be stuck or gone


class LearnerFailed(RuntimeError):
    """A learner rank died; the message names it, its log and how to resume."""


# failures after which the learner still holds a good state: the run checkpoints before it stops
CHECKPOINT_ON = (ActorFailed, DataTimeout, WeightsTimeout, WeightPushError)


def fleet_refused(cfg: TandemConfig) -> str | None:
    """Why this run's fleet of generation actors cannot grow or shrink (``runtime/fleet.py``), or None."""
    if cfg.run.schedule == "colocated":
        return "run.schedule=colocated: its actors live on the learner's devices"
    return replacement_refused(cfg.weights)


def resume_hint(run: RunLog, progress: Progress) -> str:
    """Where the run can go on from: its newest checkpoint and the command, or (none yet) that a
    resume would find nothing."""
    if progress.checkpoint is None:
        return "no checkpoint yet, so nothing to resume: start the run again"
    return f"checkpoint {progress.checkpoint}; resume with: tandem train --resume {run.root}"


async def train(
    cfg: TandemConfig,
    plan: Plan,
    run: RunLog,
    rows: list[dict],
    model_path: str,
    stop: StopRequest,
    resume: Resume | None = None,
    eval_rows: list[dict] | None = None,
) -> Progress:
    from cluster.ray_watch import RayDied, RayWatch

    start_ray(cfg, plan, wait_s=resume.wait_s if resume else 0.0)
    run.mark("ray")
    watch = RayWatch.of_session()  # Ray's own processes: a death stops the run (GCS) or names the cause (raylet)
    watching = asyncio.create_task(watch.watch(stop.fail))
    progress: list[Progress] = []  # the run's, once its parts are built
    try:
        await _train(cfg, plan, run, rows, model_path, stop, resume, eval_rows, progress)
    except Exception as exc:
        if (death := watch.check()) is None:
            raise
        if progress:
            hint = resume_hint(run, progress[0])
        else:  # before the run's parts were built: where it stood when this start began
            hint = f"resume with: tandem train --resume {run.root}" if resume else "nothing trained yet: start it again"
        raise RayDied(f"{death}; {hint}") from exc
    finally:
        watching.cancel()
    if stop.failure:  # the learner's state is saved: the run still failed
        raise RayDied(f"{stop.failure}; {resume_hint(run, progress[0])}")
    return progress[0]


async def _train(cfg, plan, run, rows, model_path, stop, resume, eval_rows, out: list[Progress]) -> None:
    """``train``'s run once Ray is up; the run's ``Progress`` goes into ``out`` as soon as it exists."""
    import ray

    extra = "".join(f", {k.count} separate {k.prefix} process(es)" for k in (plan.critic, plan.reference) if k)
    run.say(
        f"run directory: {run.root}\nstarting {plan.actors.count} generation actor(s) and "
        f"{plan.learner.count} learner rank(s){extra} ..."
    )
    parts = await assemble(cfg, plan, run, rows, model_path, resume, eval_rows)
    progress, learner = parts.progress, parts.learner
    out.append(progress)
    which = f"steps {progress.done + 1}-{cfg.run.steps}" if progress.done else f"{cfg.run.steps} steps"
    run.say(
        f"training {which}: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} "
        f"samples per step, max staleness {cfg.run.max_staleness}"
    )
    feeding = settled(asyncio.create_task(parts.admission.feed()), run.say, "the rollout loop")
    fleet = FleetWatch(run.root, parts.pool.resize, run.say, fleet_refused(cfg))  # `tandem scale RUN_DIR`
    scaling = settled(asyncio.create_task(fleet.watch()), run.say, "the fleet's watch")
    try:
        if progress.done:  # the actors generate with the resumed policy, version `first` (a distributed
            run.timeline(await learner.publish_weights(progress.done))  # receiver joins when its actor takes a prompt)
        await training_loop(cfg, run, parts, stop, feeding)
        progress.stopped = stop.reason
        await parts.saver.finish()
    except CHECKPOINT_ON as exc:
        cause = getattr(exc, "cause", None)  # raised in a Ray actor: the original error, not the traceback
        exc = cause if isinstance(cause, CHECKPOINT_ON) else exc
        if parts.saver.checkpoint_due():
            try:
                await asyncio.wait_for(parts.saver.checkpoint(), cfg.run.startup_timeout_s)
            except Exception as ckpt_exc:  # the run's own error matters more
                run.say(f"could not checkpoint: {type(ckpt_exc).__name__}: {ckpt_exc}")
        raise type(exc)(f"{exc}; {resume_hint(run, progress)}") from None
    except DiskFull as exc:  # the newest whole checkpoint is where a resume starts, once there is room
        raise DiskFull(f"{exc}; then {resume_hint(run, progress)}") from None
    except ray.exceptions.RayActorError as exc:
        name = learner.process_names.get(getattr(exc, "actor_id", None) or "")
        if name is None:
            raise
        raise LearnerFailed(
            f"{name} (node {run.placement.get(name, '?')[:8]}) died: {ray_death(str(exc))}; its log: "
            f"{run.log_path(name)}; {resume_hint(run, progress)}"
        ) from None
    finally:
        scaling.cancel()
        feeding.cancel()
        await close_channels(run, parts)
    await actor_reports(cfg, run, parts)


async def training_loop(cfg: TandemConfig, run: RunLog, parts: RunParts, stop: StopRequest, feeding) -> None:
    """One step per iteration, each part a named call; stops at a step boundary on a stop request."""
    learner, progress, steps = parts.learner, parts.progress, cfg.run.steps
    step_s, recent = 0.0, collections.deque(maxlen=cfg.run.max_staleness + 1)  # the last phase's step times
    if progress.done == 0 and parts.evaluator.due(0, steps):
        parts.evaluator.start(0, version=0)  # the starting point, generated beside the first batches
    try:
        for step in range(progress.done, steps):
            parts.evaluator.check_sending()
            # the next step may start a colocated generation phase: the longest step of the last phase
            if stop.requested or stop.time_is_short(max(recent, default=0.0), progress.checkpoint_s):
                break
            t0 = time.monotonic()
            batch = await collect(cfg, run, parts, stop, step)
            if batch is None:
                break  # a stop request came while the batch was collected
            if step == steps - 1:
                feeding.cancel()  # nothing more will be trained: admit no prompt for step `steps`
            plan = learner.shape_rewards(batch.groups)
            scores = await learner.score(plan)
            advantages = await learner.advantages(scores)
            learner_metrics = await learner.update(advantages)
            parts.admission.trained(batch.groups)
            parts.health.check(step, batch.groups, learner_metrics)
            try:
                await publish(run, parts, step + 1, steps)
            finally:  # the update is applied, published or not: the step is done, and the
                # checkpoint written after a failed push says so (its optimizer has step + 1 updates)
                step_s = time.monotonic() - t0
                recent.append(step_s)
                metrics = log_step(cfg, run, parts, step, batch, learner_metrics, step_s)
            parts.health.trained(step, metrics)  # run.max_empty_steps steps in a row that trained nothing stop it
            evaluate(parts, steps)
            await checkpoint(parts, steps)
        # the rounds still out (the last one at least) come back before the end; not after a stop request,
        # which ends the run as soon as its step is saved (a held-out round can take as long as a step)
        if parts.evaluator.pending and not stop.requested:
            async with parts.schedule.rest():  # colocated: the engines wake for them
                await parts.collector.drain_eval(lambda: parts.evaluator.pending, cfg.run.data_timeout_s)
    finally:
        parts.evaluator.give_up()
        parts.collector.close()
        run.timeline(parts.driver_spans.take())  # the wait of a step that did not train (a stop, an error)


# --- the named steps ------------------------------------------------------------------------


async def collect(cfg: TandemConfig, run: RunLog, parts: RunParts, stop: StopRequest, step: int) -> Batch | None:
    """A step's batch of prompt groups, or None when a stop request comes first (the abandoned prompts
    stay outstanding in the ledger). A generation phase of the schedule (``runtime/schedule.py``)
    collects the batches of its steps from the results queue; a later step of the phase takes its own."""
    schedule = parts.schedule
    if schedule.ready:
        return schedule.ready.popleft()
    batches, phase = [], schedule.phase_steps(step, cfg.run.steps)
    async with schedule.generation(phase, cfg.rollout.prompts_per_step):
        for i in range(phase):
            batch = await collect_one(cfg, parts, stop, step + i)
            if batch is None:
                return None
            batches.append(batch)
    schedule.ready.extend(batches[1:])
    return batches[0]


async def collect_one(cfg: TandemConfig, parts: RunParts, stop: StopRequest, step: int) -> Batch | None:
    """Step ``step``'s batch from the results queue, or None when a stop request comes first."""
    wall = time.time()
    collecting = asyncio.ensure_future(
        parts.collector.collect(cfg.rollout.prompts_per_step, step=step, max_staleness=cfg.run.max_staleness)
    )
    stopping = asyncio.ensure_future(stop.event.wait())
    await asyncio.wait({collecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    parts.driver_spans.add("wait_data", wall, time.time(), step)
    if not collecting.done():
        collecting.cancel()
        return None
    batch = collecting.result()
    if batch.oversample_reached:
        parts.health.oversample_reached(
            step, cfg.algorithm.filtering.max_oversample, cfg.rollout.prompts_per_step, batch.groups
        )
    return batch


async def publish(run: RunLog, parts: RunParts, version: int, steps: int) -> None:
    """Every rank exports its weights, rank 0 publishes ``version``; admission may then let a step's
    more prompts out. The colocated schedule publishes only the version its next phase generates with
    (and one a held-out round needs)."""
    if parts.schedule.publishes() or parts.evaluator.due(version, steps):
        run.timeline(await parts.learner.publish_weights(version))
        parts.schedule.published(version)
    run.timeline(parts.driver_spans.take())
    await parts.admission.published(version)  # policy version `version` is now on the channel


def log_step(
    cfg: TandemConfig, run: RunLog, parts: RunParts, step: int, batch: Batch, learner_metrics, step_s: float
) -> dict:
    """The step's metrics line, distributions and sample completions; the step counts as done. Returns
    the step's metrics."""
    metrics = step_metrics(batch, learner_metrics, step_s)
    metrics.update(
        prompt_ids=[g.prompt_id for g in batch.groups],
        filtered_prompt_ids=batch.filtered_ids,
        duplicates=batch.duplicates,
        actor_restarts=parts.pool.total_restarts,
    )
    run.step(step, metrics, step_distributions(batch))
    run.samples(sample_records(batch, step, cfg.run.log_samples))
    parts.progress.done = step + 1
    return metrics


def evaluate(parts: RunParts, steps: int) -> None:
    """A held-out round after this step, when one is due: generated beside the next steps' batches."""
    done = parts.progress.done
    if parts.evaluator.due(done, steps):
        parts.evaluator.start(done, version=done)


async def checkpoint(parts: RunParts, steps: int) -> None:
    """A checkpoint after this step, when one is due (by steps or by time; the last step's is the
    final save's)."""
    if parts.progress.done < steps and parts.saver.due(parts.progress.done):
        await parts.saver.checkpoint()


# --- the end ------------------------------------------------------------------------------


async def close_channels(run: RunLog, parts: RunParts) -> None:
    """Weights first (a distributed receiver tears its group down on the close header), then the queues:
    every actor waiting on them wakes with ``QueueClosed`` and its loop returns."""
    prompt_queue, results_queue = parts.queues
    for close in (parts.schedule.end, parts.learner.close_weight_channel, prompt_queue.close, results_queue.close):
        try:
            await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)
        except Exception as exc:  # a failed run's own error matters more than a failed close
            cause = ray_death(str(exc)) if str(exc).strip() else f"no answer within {CLOSE_TIMEOUT_S:.0f}s"
            run.say(f"while stopping: {type(exc).__name__}: {cause}")


async def actor_reports(cfg: TandemConfig, run: RunLog, parts: RunParts) -> None:
    """Each actor's final report (its last spans go to the timeline) and the run's details."""
    loops = list(parts.pool.refs.values())
    try:
        finals = await asyncio.wait_for(asyncio.gather(*loops, return_exceptions=True), cfg.run.weights_timeout_s)
    except asyncio.TimeoutError:
        run.say(f"some actors did not stop within {cfg.run.weights_timeout_s:.0f}s; shutting them down")
        finals = [f"did not stop within {cfg.run.weights_timeout_s:.0f}s"] * len(loops)
    for final in finals:  # the spans an actor recorded after its last pushed group
        if isinstance(final, ActorReport):
            run.timeline(final.spans)
    parts.progress.details = {
        "actors": [f.summary() if isinstance(f, ActorReport) else repr(f) for f in finals],
        "placement": run.placement,
        "actor_restarts": dict(parts.pool.restarts),
        "nonfinite_updates": parts.health.nonfinite_total,
        "eval": parts.evaluator.results,
    }


def time_limit_s(cfg: TandemConfig) -> float | None:
    return parse_duration(cfg.run.time_limit) if cfg.run.time_limit is not None else None
