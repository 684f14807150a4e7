"""One training run from the command line's point of view: check everything a user can get wrong,
open (or reopen) the run directory, train, resume automatically after a process failure
(``run.max_restarts``), and write the summary whatever happened.

Errors a user can fix are re-raised as they are (the command prints their one line); anything else
becomes an ``UnexpectedError`` whose traceback is in the run's driver log. Every run writes
``logs/driver.log``: each line the console showed (timed), the error that ended the run, and the
traceback of an unexpected one. summary.json also says whether the run had a learning signal
(``SignalWatch``, ``runtime/signals.py``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import yaml

from cluster.logs import append_log
from launch.config import ConfigError, load_config
from observe.live import DriverView
from runtime.disk import disk_full, is_disk_full
from runtime.signals import SignalWatch


# Errors that are the user's to fix: printed as one line, no traceback.
def user_errors() -> tuple[type[BaseException], ...]:
    from actors.env_pool import EnvironmentSpecError
    from actors.rewards import RewardSpecError
    from cluster.channel import WeightsTimeout
    from cluster.dist_channel import WeightPushError
    from cluster.placement import PlacementError
    from cluster.ray_watch import RayDied
    from launch.build import StartupError
    from launch.preflight import PreflightError
    from launch.train import LearnerFailed
    from learner.sft import WarmStartFailed
    from queues.prompts import DatasetError
    from runtime.checkpoints import CheckpointError
    from runtime.collector import DataTimeout
    from runtime.disk import DiskFull
    from runtime.health import RunCannotLearn
    from runtime.supervise import ActorFailed

    return (
        ConfigError,
        EnvironmentSpecError,
        PreflightError,
        CheckpointError,
        RunCannotLearn,
        WarmStartFailed,
        LearnerFailed,
        DatasetError,
        RewardSpecError,
        StartupError,
        PlacementError,
        DataTimeout,
        ActorFailed,
        WeightsTimeout,
        WeightPushError,
        RayDied,
        DiskFull,
    )


def error_message(exc: BaseException) -> str:
    """The error's own line. Raised inside a Ray actor, it arrives wrapped in a ``RayTaskError``
    whose text is the remote traceback; ``cause`` is the original exception."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc)


def reward_summary(metrics_path: Path) -> dict[str, float]:
    """Mean reward over the first and last 10% of steps."""
    rewards = [json.loads(line)["reward_mean"] for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rewards:
        return {}
    tenth = max(1, len(rewards) // 10)
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    return {"steps": len(rewards), "reward_first_10pct": first, "reward_last_10pct": last, "reward_gain": last - first}


def signal_summary(root: Path) -> dict:
    """``SignalWatch.summary`` of the whole run, replayed from metrics.jsonl and eval.jsonl (a
    resumed run's earlier steps count too)."""
    watch = SignalWatch()
    for name, look in (("metrics.jsonl", watch.step), ("eval.jsonl", watch.eval)):
        path = root / name
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                record = json.loads(line)
            except ValueError:  # a killed run's torn last line
                continue
            look(record.get("step"), record)
    return watch.summary()


def attach_driver_log(run, early: list[str] | None = None) -> Path:
    """Every line the run shows also goes to ``logs/driver.log`` (with what was said before the
    run directory existed, ``early``), and each step is watched for a missing learning signal."""
    log = run.logs / "driver.log"
    for line in early or []:
        append_log(log, line)
    run.view = DriverView(run.view, log, [SignalWatch()])
    return log


def _log(path: Path, text: str) -> None:
    """Append to driver.log; a log that cannot be written (a full disk) must not hide the error it records."""
    try:
        append_log(path, text)
    except OSError:
        pass


def aborted_summary(run, started: float, restarts: int):
    """What a second Ctrl-C (stop at once, no checkpoint) still writes: ``summary.json`` saying so."""

    def write(signals: str) -> None:
        summary = {**reward_summary(run.root / "metrics.jsonl"), "status": f"aborted ({signals})"}
        summary.update(restarts=restarts, wall_s=round(time.monotonic() - started, 1))
        summary["error"] = "stopped at once by a second Ctrl-C: no checkpoint of the steps since the last one"
        (run.root / "summary.json").write_text(json.dumps(summary, indent=2))

    return write


class UnexpectedError(RuntimeError):
    """Anything else that ended a run: its last line here, the traceback in the run's driver log."""


def _restartable() -> tuple[type[BaseException], ...]:
    """Failures ``run.max_restarts`` resumes from: a process died or stopped answering."""
    from cluster.channel import WeightsTimeout
    from cluster.dist_channel import WeightPushError
    from launch.train import LearnerFailed
    from runtime.collector import DataTimeout
    from runtime.supervise import ActorFailed

    return LearnerFailed, ActorFailed, WeightPushError, WeightsTimeout, DataTimeout


def _shutdown_ray() -> None:
    from launch.ray_session import stop_ray

    stop_ray()


async def _train_with_signals(cfg, plan, run, rows, model_path, stop, resume, eval_rows):
    from launch.train import train

    stop.install()
    try:
        return await train(cfg, plan, run, rows, model_path, stop, resume, eval_rows)
    finally:
        stop.uninstall()


def run_training(
    config_path: str | Path | list | None,
    overrides: list[str],
    resume_dir: str | None = None,
    result: dict | None = None,
    allow_changes: bool = False,
) -> int:
    """Train; ``result`` (when given) receives the run directory as ``run_dir`` once it exists. The run
    directory is locked while this runs (``runtime/run_lock.py``): one writer at a time. A resume may
    change what its steps mean (model, data, reward, sampling, learner, algorithm) only with
    ``allow_changes``."""
    locks: list = []
    try:
        return _run_training(config_path, overrides, resume_dir, result, locks, allow_changes)
    finally:
        for lock in locks:
            lock.release()


def _run_training(config_path, overrides, resume_dir, result, locks: list, allow_changes: bool) -> int:
    from actors.env_pool import check_environment
    from actors.rewards import check_rewards
    from cluster.ray_watch import RayDied, object_store_full
    from launch.build import prepare_model
    from launch.data import load_run_rows
    from launch.plan import build_plan
    from launch.preflight import check_answers, check_prompt_lengths, preflight
    from launch.ray_session import remove_local_sessions
    from launch.train import time_limit_s
    from learner.config import regroup
    from observe.run_dir import RunLog, format_seconds, startup_phases
    from runtime.checkpoints import CheckpointError, CheckpointStore
    from runtime.run_lock import RunLock
    from runtime.saving import PARTIAL_MODEL, Resume, check_config_changes, check_resumable
    from runtime.stopping import StopRequest, threads_on_sigusr1
    from runtime.supervise import ActorKeepsFailing

    started = time.monotonic()
    threads_on_sigusr1()  # a run that seems stuck before its loop starts: kill -USR1 says where, not kills it
    early: list[str] = []  # said before the run directory exists: driver.log begins with them

    def tell(line: str) -> None:
        early.append(f"tandem: {line}")
        print(f"tandem: {line}", file=sys.stderr, flush=True)

    if resume_dir is not None:
        root = Path(resume_dir)
        if not (root / "config.yaml").is_file():
            raise ConfigError(f"--resume {root}: not a run directory (no config.yaml); give the RUN_DIR a run printed")
        locks.append(RunLock.acquire(root))  # before anything reads or rewrites the run's files
        config_path = config_path or root / "config.yaml"
    # Everything a user can get wrong is checked before any process starts.
    cfg = load_config(config_path, overrides)
    plan = build_plan(cfg)  # the run's processes, computed once
    for line in cfg.warnings:
        tell(f"warning: {line}")
    check_rewards(cfg.reward)
    tools = None
    if cfg.rollout.kind == "multi_turn":  # a file that is missing, broken, hangs or exits at import
        tools = check_environment(cfg.rollout.episode).tools
    rows, eval_rows = load_run_rows(cfg, tell)
    model_path = prepare_model(cfg.model)
    rows = preflight(cfg, model_path, rows, tools)
    check_answers(cfg.reward, cfg.data, eval_rows, "the held-out set")
    eval_rows = check_prompt_lengths(cfg, model_path, eval_rows, "the held-out set")
    dumped = cfg.model_dump(mode="json")
    resume = None
    if resume_dir is not None:
        then = yaml.safe_load((root / "config.yaml").read_text()) or {}
        if isinstance(then.get("algorithm"), dict):  # a run from before the algorithm keys were grouped
            then["algorithm"], _ = regroup(then["algorithm"])
        check_config_changes(then, dumped, allow_changes, tell)
        store = CheckpointStore(root, cfg.run.keep_checkpoints)
        for name in store.clear_partials():
            tell(f"removed {name}: a checkpoint left half-written when the run was stopped")
        shutil.rmtree(root / PARTIAL_MODEL, ignore_errors=True)
        checkpoint, state = store.newest(lambda text: print(text, file=sys.stderr))
        check_resumable(state, rows, cfg.run.seed, cfg.data.shuffle)
        resume = Resume(checkpoint, state)
        run = RunLog.reopen(root, dumped, cfg.run.steps, first_step=int(state["step"]))
    else:
        run = RunLog.create(cfg.run.output_dir, cfg.run.name, dumped, cfg.run.steps, private=cfg.run.private)
        locks.append(RunLock.acquire(run.root))
        store = CheckpointStore(run.root, cfg.run.keep_checkpoints)
    driver_log = attach_driver_log(run, early)
    run.mark("prepare")  # config, data, model and preflight checks, the run directory
    if result is not None:
        result["run_dir"] = str(run.root)
    status, error, restarts = "failed", None, 0
    try:
        while True:
            stop = StopRequest(run.say, time_limit_s(cfg), started, on_abort=aborted_summary(run, started, restarts))
            try:
                progress = asyncio.run(_train_with_signals(cfg, plan, run, rows, model_path, stop, resume, eval_rows))
                break
            except _restartable() as exc:
                _shutdown_ray()
                if restarts >= cfg.run.max_restarts or isinstance(exc, ActorKeepsFailing):
                    raise  # the same error each time: resuming would meet it again
                try:
                    checkpoint, state = store.newest(run.say)
                except CheckpointError:
                    raise exc from None
                restarts += 1
                run.say(
                    f"{error_message(exc)}\nresuming from {checkpoint} (run.max_restarts: {restarts} of "
                    f"{cfg.run.max_restarts})"
                )
                resume = Resume(checkpoint, state, wait_s=cfg.resources.placement_timeout_s)  # a node may come back
                run.close(None)
                run = RunLog.reopen(run.root, dumped, cfg.run.steps, first_step=int(state["step"]))
                attach_driver_log(run)
            finally:
                _shutdown_ray()
        status = f"stopped ({progress.stopped})" if progress.stopped else "completed"
    except user_errors() as exc:
        error = error_message(exc)
        _log(driver_log, f"error: {error}")
        raise
    except Exception as exc:
        if (full := object_store_full(exc)) is not None:
            error = full
            _log(driver_log, f"error: {error}\n{traceback.format_exc()}")
            raise RayDied(full) from None
        if is_disk_full(exc):  # a write of the run's own files (metrics, samples, logs)
            full = disk_full("the run's files", run.root)
            error = str(full)
            _log(driver_log, f"error: {error}\n{traceback.format_exc()}")
            raise full from None
        error = f"{type(exc).__name__}: {(error_message(exc).strip().splitlines() or [''])[-1]}"
        _log(driver_log, f"error: {error}\n{traceback.format_exc()}")
        raise UnexpectedError(f"{error}; full traceback: {driver_log}") from None
    finally:
        summary = {**reward_summary(run.root / "metrics.jsonl"), "status": status, "restarts": restarts}
        summary.update(signal_summary(run.root))
        summary["wall_s"] = round(time.monotonic() - started, 1)
        if run.first_step_at is not None:  # start-up: from the command to this process's first step
            summary["startup_s"] = round(run.first_step_at - started, 1)
            if "prepare" in run.marks:  # not after an automatic restart: its phases began earlier
                summary["startup"] = startup_phases(started, run.marks, run.first_step_at)
        if error:
            summary["error"] = error
            saved = store.all()  # a failed step may come after checkpoints: the newest is where a resume starts
            summary["last_checkpoint"] = str(saved[0]) if saved else ""
        if status != "failed":
            summary.update(last_checkpoint=str(progress.checkpoint or ""), **progress.details)
            remove_local_sessions()
        try:
            run.close(summary)
        except OSError as exc:  # a full disk: the error line above still reaches the console
            print(f"tandem: summary.json could not be written: {exc}", file=sys.stderr)
    run.say(
        f"\n{status} in {format_seconds(summary['wall_s'])}: {summary.get('steps', 0)} steps, mean reward "
        f"{summary.get('reward_first_10pct', 0):.3f} (first 10%) -> {summary.get('reward_last_10pct', 0):.3f} "
        f"(last 10%)\nrun files: {run.root} (config.yaml, metrics.jsonl, samples.jsonl, model/, checkpoints/, "
        "tb/, logs/, summary.json)"
    )
    if "learned_reason" in summary:
        run.say(f"warning: {summary['learned_reason']}")
    if progress.stopped:
        run.say(f"resume with: tandem train --resume {run.root}")
    return stop.exit_code
