"""What a run keeps: checkpoints on the way, the final model at a clean end, and where a resume starts.

A checkpoint is the learner's state (DeepSpeed's, through the learner group) plus the run state
beside it: the step, the prompt ledger (every prompt admitted and not yet trained), the learner's
counters, the actor restarts and the health counters. ``CheckpointStore`` writes it to a partial
directory and commits it atomically; the final model is written the same way (``.partial-model``
renamed to ``model``).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from observe.run_dir import RunLog
from runtime.checkpoints import CheckpointError, CheckpointStore
from runtime.disk import (
    DiskFull,
    disk_full,
    free_bytes,
    is_disk_full,
    quota,
    torch_write_failed,
    tree_bytes,
)
from schema import Section

NO_ROOM = 1 << 20  # free bytes below which a failed write found the disk full
PARTIAL_MODEL = ".partial-model"  # the final model while it is written; renamed to model/ when whole


class CheckpointConfig(Section):
    """When a run checkpoints and saves its model: these fields of the ``run`` section."""

    checkpoint_every: int = Field(
        50,
        ge=0,
        description="Checkpoint (DeepSpeed state + run state) every N steps (0: by step never), and at every stop "
        "and every run.checkpoint_every_s.",
    )
    checkpoint_every_s: float = Field(
        3600,
        ge=0,
        description="Also checkpoint when this many seconds have passed since the last checkpoint (0: off): "
        "steps of long-reasoning jobs take minutes, so a step count alone can leave hours unsaved.",
    )
    save_every: int = Field(
        0,
        ge=0,
        description="Also write the policy as a Hugging Face model into the checkpoint every N steps (0: never).",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    save_final: bool = Field(
        True, description="Checkpoint and write model/ at the end of the run (`tandem tune`'s short probes do not)."
    )


@dataclass
class Resume:
    """Where a resumed run starts: the checkpoint directory and its run state."""

    path: Path
    state: dict[str, Any]
    wait_s: float = 0.0  # an automatic restart: how long to wait for the cluster to have room again


@dataclass
class Progress:
    """How far the run got (for the summary and the resume line)."""

    done: int = 0  # steps completed
    checkpoint: Path | None = None
    checkpoint_s: float = 0.0
    stopped: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


class RunSaver:
    """Checkpoints and the final model of one run.

    ``run_state`` returns the driver's part of a checkpoint (ledger, learner counters, restarts,
    health) at the moment it is taken; the step and version are added here.
    """

    def __init__(
        self,
        settings: CheckpointConfig,
        run: RunLog,
        learner,
        progress: Progress,
        run_state: Callable[[], dict[str, Any]],
    ) -> None:
        self.settings, self.run, self.learner, self.progress = settings, run, learner, progress
        self.run_state = run_state
        self.store = CheckpointStore(run.root, settings.keep_checkpoints)
        self.last_at = time.monotonic()  # the last checkpoint, or the start

    def time_due(self) -> bool:
        """``run.checkpoint_every_s`` has passed since the last checkpoint (or the start)."""
        every_s = self.settings.checkpoint_every_s
        return bool(every_s) and time.monotonic() - self.last_at >= every_s

    def due(self, done: int) -> bool:
        """A checkpoint belongs after ``done`` steps: every ``run.checkpoint_every`` steps, or by time."""
        every = self.settings.checkpoint_every
        return bool(every and done % every == 0) or self.time_due()

    async def checkpoint(self) -> None:
        progress = self.progress
        done, t0 = progress.done, time.monotonic()
        partial = self.store.begin(done)
        try:
            await self.learner.save_checkpoint(str(partial))
            if self.settings.save_every and done % self.settings.save_every == 0:
                await self.learner.save_model(str(partial / "model"))
            state = {"step": done, "version": done, **self.run_state()}
            progress.checkpoint, size = self.store.commit(partial, done, state)
        except Exception as exc:
            if (full := self._full(exc, partial, f"checkpoint step-{done}", self.store.all()[:1])) is None:
                raise
            raise full from None
        progress.checkpoint_s = time.monotonic() - t0
        self.last_at = time.monotonic()
        self.run.say(f"checkpoint: {progress.checkpoint} ({size / 1e6:.1f} MB in {progress.checkpoint_s:.1f}s)")

    @staticmethod
    def _full(exc: BaseException, partial: Path, what: str, previous: list[Path]) -> DiskFull | None:
        """A failed write of ``partial`` as a full disk (its one line, the partial removed for its space), or
        None. A full disk says so (ENOSPC, EDQUOT), or torch's writer failed with less room on the disk than
        the write takes (the last such write's size, ``previous``, else what was written so far). A process
        that died mid-write is never a full disk, whatever the room."""
        written, free = tree_bytes(partial), free_bytes(partial)
        need = tree_bytes(previous[0]) if previous else written
        no_room = free is not None and (free + written < need or free < NO_ROOM)  # the partial's space is the write's
        if not is_disk_full(exc) and not (torch_write_failed(exc) and no_room):
            return None
        shutil.rmtree(partial, ignore_errors=True)  # its space back, for summary.json at least
        return disk_full(what, partial.parent, need, at_least=not previous, in_quota=quota(exc))

    def checkpoint_due(self) -> bool:
        """Steps were trained since the newest checkpoint."""
        last, done = self.progress.checkpoint, self.progress.done
        return done > 0 and (last is None or last.name != f"step-{done}")

    async def finish(self) -> None:
        """A clean end (all steps, a signal, the time limit): checkpoint, then the model."""
        done, run = self.progress.done, self.run
        if done == 0:
            run.say("stopped before the first step: nothing to checkpoint")
            return
        if not self.settings.save_final:
            run.say(f"not saved (run.save_final: false): {done} steps trained")
            return
        if self.checkpoint_due():
            await self.checkpoint()
        partial, final = run.root / PARTIAL_MODEL, run.root / "model"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            await self.learner.save_model(str(partial))
        except Exception as exc:
            previous = [final] if final.is_dir() else []
            if (full := self._full(exc, partial, f"the model of step {done}", previous)) is None:
                raise
            raise full from None
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        run.say(f"model: {final} (Hugging Face format, step {done})")


def check_resumable(state: dict[str, Any], rows: list[dict], seed: int, shuffle: bool) -> None:
    """The data order of the checkpoint must be this run's."""
    ledger = state["ledger"]
    now = {"rows": len(rows), "seed": seed, "shuffle": shuffle}
    then = {key: ledger[key] for key in now}
    if then != now:
        raise CheckpointError(
            f"the data order changed since the checkpoint ({then} then, {now} now); resume with the same "
            "data.prompts, run.seed and data.shuffle"
        )


# What a resumed run may change freely: how it runs (placement, engine, weight channel, evaluation, the
# run's length, checkpoints, logging, deadlines). Everything else decides what a step trains on and how.
FREE_SECTIONS = ("resources", "engine", "weights", "eval", "run")
# ... except these, which do decide it: the data order, the off-policy bound, and the number of ranks
# the checkpoint's optimizer state is split over
MEANING_KEYS = ("run.seed", "run.max_staleness", "resources.learner.ranks")
# ... and, in the other sections, settings of speed, memory and error handling that do not
FREE_KEYS = (
    "reward.workers",
    "reward.max_error_steps",
    "rollout.prompts_per_request",
    "rollout.max_inflight_prompts",
    "learner.token_budget",
    "learner.pack_row_tokens",
    "learner.attention",
    "learner.gradient_checkpointing",
    "learner.logprob_chunk_tokens",
)


def config_changes(then: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, then, now)`` for every setting that differs between two resolved configs. A key on
    one side only (a setting another Tandem version added or dropped) is not a change."""
    out = []
    for key in sorted(set(then) & set(now), key=str):
        a, b, name = then[key], now[key], f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{name}.")
        elif a != b:
            out.append((name, a, b))
    return out


def changes_meaning(key: str) -> bool:
    """A change of ``key`` changes what the run's steps mean (its model, data, reward, sampling,
    learner or algorithm); deadlines (``*timeout_s``) never do."""
    if key.rsplit(".", 1)[-1].endswith("timeout_s") or key in FREE_KEYS:
        return False
    return key in MEANING_KEYS or key.split(".", 1)[0] not in FREE_SECTIONS


def check_config_changes(then: dict[str, Any], now: dict[str, Any], allow: bool, say: Callable[[str], None]) -> None:
    """A resume with another config: settings that change what the steps mean need ``allow``
    (``--allow-changes``); the others are said and taken."""
    changes = config_changes(then, now)
    shown = [f"{key} {a!r} -> {b!r}" for key, a, b in changes]
    meaning = [line for (key, _, _), line in zip(changes, shown) if changes_meaning(key)]
    if meaning and not allow:
        more = f" (and {len(meaning) - 3} more)" if len(meaning) > 3 else ""
        raise CheckpointError(
            f"the config changed what the run's steps mean: {', '.join(meaning[:3])}{more}; resume with the run's "
            "own settings, or pass --allow-changes to train the remaining steps so (RUN_DIR/configs/ keeps each "
            "segment's config)"
        )
    if shown:
        say(f"resuming with changed settings: {', '.join(shown)}")
