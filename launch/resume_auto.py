"""``tandem train --config F --resume auto``: the same command line, repeated, continues one run.

A requeued SLURM job or a retried Kubernetes job runs its command again. With ``--resume auto`` that
command looks at the newest run directory of the config's ``run.name`` under ``run.output_dir``
(``NAME-YYYYMMDD-HHMMSS``, made by ``observe/run_dir.py``) and

- resumes it when it is unfinished and has a checkpoint (stopped, failed, killed with ``kill -9``: no
  ``summary.json``, or one left from an earlier segment);
- says it is complete and trains nothing (exit 0) when its ``summary.json`` says ``completed`` with
  at least the ``run.steps`` the command asks for: a requeue after the end must not train twice;
- starts a new run when there is none of that name, or when the newest has no checkpoint (it
  stopped before its first one: nothing to continue; its directory is left as it is, logs and all).

Only the newest run of the name counts: an older unfinished one was given up by a later start.
A run that is running holds its directory's lock (``runtime/run_lock.py``): ``--resume auto`` is
refused in one line then, as a second ``--resume`` is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from launch.config import load_config
from runtime.checkpoints import CheckpointStore, step_of
from runtime.run_lock import RunLock

AUTO = "auto"  # the --resume value that asks for this resolution


@dataclass(frozen=True)
class AutoChoice:
    """What ``--resume auto`` does, and the line that says it."""

    action: Literal["new", "resume", "complete"]  # start a run, continue ``run_dir``, or do nothing
    run_dir: Path | None  # the run to continue (``resume``) or the completed one (``complete``)
    line: str  # said on the console before anything starts


def run_dirs(output_dir: str | Path, name: str) -> list[Path]:
    """The run directories of ``name`` under ``output_dir``, newest first: ``NAME-YYYYMMDD-HHMMSS`` and
    ``NAME-YYYYMMDD-HHMMSS-K`` (two starts in one second) holding a ``config.yaml``. Runs of other
    names (``NAME-x-...`` included) do not match."""
    pattern = re.compile(re.escape(name) + r"-(\d{8})-(\d{6})(?:-(\d+))?")
    found = []
    for path in Path(output_dir).iterdir() if Path(output_dir).is_dir() else []:
        match = pattern.fullmatch(path.name)
        if match and (path / "config.yaml").is_file():
            date, time, suffix = match.groups()
            found.append(((date, time, int(suffix or 0)), path))
    return [path for _, path in sorted(found, reverse=True)]


def summary_of(root: Path) -> dict:
    """``summary.json`` of the run at ``root``; ``{}`` when missing or unreadable (a ``kill -9`` before
    the first summary, or a torn write)."""
    try:
        summary = json.loads((root / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def is_complete(summary: dict, steps: int) -> bool:
    """Whether a run whose summary is ``summary`` has done all of ``steps``: status ``completed`` and
    at least that many steps. A summary of fewer steps (the command now asks for more) is a run to
    continue, as ``--resume RUN_DIR run.steps=N`` continues one."""
    done = summary.get("steps", 0)
    return summary.get("status") == "completed" and isinstance(done, int) and done >= steps


def check_not_running(root: Path) -> None:
    """Raise ``RunDirBusy`` (one line naming the holder) when a process holds the run's lock now. The
    lock is released at once: ``run_training`` takes it again for the whole run."""
    RunLock.acquire(root).release()


def choose(output_dir: str | Path, name: str, steps: int) -> AutoChoice:
    """What ``--resume auto`` does for the run ``name`` under ``output_dir`` asked to train ``steps``."""
    where = f"{name!r} under {output_dir}"
    runs = run_dirs(output_dir, name)
    if not runs:
        return AutoChoice("new", None, f"--resume auto: no run named {where}; starting a new one")
    newest = runs[0]
    check_not_running(newest)
    summary = summary_of(newest)
    if is_complete(summary, steps):
        return AutoChoice(
            "complete", newest, f"--resume auto: {newest} completed its {summary['steps']} steps; nothing to train"
        )
    checkpoints = CheckpointStore(newest, keep=0).all()
    if not checkpoints:
        return AutoChoice(
            "new",
            None,
            f"--resume auto: {newest} (the newest run named {name!r}) stopped before its first checkpoint; "
            "starting a new run",
        )
    status = summary.get("status") or "no summary (killed)"
    if status == "completed":  # of fewer steps than the command asks now
        status = f"completed {summary.get('steps', 0)} steps, {steps} asked"
    return AutoChoice(
        "resume",
        newest,
        f"--resume auto: resuming {newest} ({status}; newest checkpoint step {step_of(checkpoints[0])})",
    )


def choose_for(config_path: str | list[str], overrides: list[str]) -> AutoChoice:
    """``choose`` for the run that ``tandem train --config F [overrides]`` would start: its
    ``run.name``, ``run.output_dir`` and ``run.steps``."""
    run = load_config(config_path, overrides).run
    return choose(run.output_dir, run.name, run.steps)
