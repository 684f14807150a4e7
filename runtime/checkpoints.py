"""Checkpoints of a run: written atomically, checked on the way back in.

    RUN_DIR/checkpoints/step-N/           N = steps completed (the next step to train is N)
        deepspeed/policy/, deepspeed/critic/  every rank's DeepSpeed state (learner/saving.py)
        hf/                                   the policy's config and tokenizer
        model/                                the policy as a Hugging Face model (every run.save_every)
        state.json                            the run's own state: step, version, prompt ledger,
                                              reward moments, KL beta, counters
        manifest.json                         every file's size and SHA-256, written last

A checkpoint is built in ``checkpoints/.partial-step-N`` and renamed into place when complete, so
a crash while writing leaves no half checkpoint under a real name. ``newest`` skips a checkpoint
whose manifest is missing or does not match its files, and says which one it fell back to.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANIFEST, STATE = "manifest.json", "state.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint; the message says where it looked and what it found."""


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> dict[str, Any]:
    files = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": _digest(p)} for p in _files(root)}
    manifest = {"files": files, "bytes": sum(f["bytes"] for f in files.values())}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def problem(root: Path) -> str | None:
    """What is wrong with the checkpoint at ``root``, or None when every file matches its manifest."""
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        return "it has no manifest.json (it was never completed)"
    try:
        listed = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError):
        return "its manifest.json is not readable"
    for name, meta in listed.items():
        path = root / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {meta['bytes']} (truncated?)"
        if _digest(path) != meta["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (corrupt)"
    return None


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


class CheckpointStore:
    def __init__(self, run_root: Path, keep: int):
        self.root = Path(run_root) / "checkpoints"
        self.keep = keep

    def all(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step-*") if p.is_dir() and p.name.removeprefix("step-").isdigit()]
        return sorted(found, key=step_of, reverse=True)

    def begin(self, step: int) -> Path:
        """An empty directory to build the checkpoint of ``step`` in."""
        partial = self.root / f".partial-step-{step}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return partial

    def commit(self, partial: Path, step: int, state: dict[str, Any]) -> tuple[Path, int]:
        """Write the run state and the manifest, move the checkpoint into place, drop old ones.
        Returns its path and size in bytes."""
        (partial / STATE).write_text(json.dumps(state, indent=1))
        manifest = write_manifest(partial)
        final = self.root / f"step-{step}"
        if final.exists():  # the same step again (a stop right after a periodic checkpoint)
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in self.all()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        return final, manifest["bytes"]

    def clear_partials(self) -> list[str]:
        """Remove checkpoints a stopped process left half-built (``.partial-step-N``, never resumable);
        their names. Called by the run directory's one writer (``runtime/run_lock.py``) as it starts."""
        partials = sorted(self.root.glob(".partial-step-*")) if self.root.is_dir() else []
        for partial in partials:
            shutil.rmtree(partial, ignore_errors=True)
        return [p.name for p in partials]

    def newest(self, say: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
        """The newest checkpoint whose files match its manifest, and its run state."""
        candidates = self.all()
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.root}; nothing to resume (was run.checkpoint_every 0?)")
        for i, path in enumerate(candidates):
            bad = problem(path)
            if bad is None:
                return path, json.loads((path / STATE).read_text())
            later = f"; trying {candidates[i + 1].name}" if i + 1 < len(candidates) else ""
            say(f"checkpoint {path} is unusable: {bad}{later}")
        raise CheckpointError(f"every checkpoint in {self.root} is damaged (see above); nothing to resume")
