"""The run directory and what goes into it while a run trains.

``runs/<name>-<timestamp>/`` holds ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one line per step), ``tb/`` (TensorBoard event files),
``logs/<process>.log`` (every actor's and learner rank's output) and, at the end,
``summary.json``. ``RunLog`` also prints the live progress line.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class RunLog:
    def __init__(self, root: Path, total_steps: int, stream=None):
        self.root = root
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._metrics = (root / "metrics.jsonl").open("a", buffering=1)
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(root / "tb"))
        except ImportError:  # tensorboard is a dependency; a broken install still trains
            self.say("tensorboard is not importable; metrics go to metrics.jsonl only")
        self.start = time.monotonic()
        self.first_step_at: float | None = None
        self.placement: dict[str, str] = {}  # process name -> Ray node id

    @classmethod
    def create(cls, output_dir: str, name: str, config: dict[str, Any], total_steps: int) -> RunLog:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        root = Path(output_dir) / f"{name}-{stamp}"
        suffix = 1
        while root.exists():
            root = Path(output_dir) / f"{name}-{stamp}-{suffix}"
            suffix += 1
        root.mkdir(parents=True)
        (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        return cls(root, total_steps)

    def log_path(self, process: str) -> str:
        return str((self.logs / f"{process}.log").resolve())

    def say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics (JSONL + TensorBoard) and print the progress line."""
        now = time.monotonic()
        if self.first_step_at is None:
            self.first_step_at = now
        elapsed = now - self.start
        done = step + 1
        # ETA from the pace since the first step (start-up excluded).
        pace = (now - self.first_step_at) / max(done - 1, 1) if done > 1 else metrics.get("step_seconds", 0.0)
        eta = pace * (self.total_steps - done)
        record = {"step": step, "elapsed_s": round(elapsed, 3), **metrics}
        self._metrics.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        self.say(
            f"step {done:>4}/{self.total_steps} | reward {metrics['reward_mean']:.3f} | "
            f"{metrics['tokens_per_s']:>7.0f} tok/s | staleness {metrics['staleness_mean']:.2f} "
            f"(max {metrics['staleness_max']}) | {format_seconds(elapsed)} elapsed, ETA {format_seconds(eta)}"
        )

    def close(self, summary: dict[str, Any]) -> None:
        (self.root / "summary.json").write_text(json.dumps(summary, indent=2))
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
