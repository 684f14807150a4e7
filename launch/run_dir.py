"""The run directory and what goes into it while a run trains.

``runs/<name>-<timestamp>/`` holds ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one line per step, with the prompt ids it trained on), ``samples.jsonl``
(a few completions per step), ``eval.jsonl`` (one line per evaluation round,
``launch/evaluation.py``), ``timeline.jsonl`` (every process's spans, ``cluster/timeline.py``),
``tb/`` (TensorBoard event files), ``logs/<process>.log`` (every actor's and learner rank's
output), ``processes.json`` (each process's pid and node), ``checkpoints/``
(``launch/checkpoints.py``), ``model/`` (the trained policy) and, at the end,
``summary.json``. ``RunLog`` also prints the live progress line.

A resumed run reopens its directory: the lines of steps after the checkpoint it resumes from
are dropped (those steps are trained again) and TensorBoard purges them too.
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


def _keep_steps_before(path: Path, step: int) -> None:
    """Drop the JSONL lines of steps >= ``step`` (and a torn last line)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(line + "\n" for line in kept))


class RunLog:
    def __init__(self, root: Path, total_steps: int, stream=None, first_step: int = 0):
        self.root = root
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "samples.jsonl"):
            _keep_steps_before(root / name, first_step)
        # an evaluation "after step s" is kept when s steps were done by the checkpoint resumed from
        _keep_steps_before(root / "eval.jsonl", first_step + 1 if first_step else 0)
        self._metrics = (root / "metrics.jsonl").open("a", buffering=1)
        self._samples = (root / "samples.jsonl").open("a", buffering=1)
        self._eval = (root / "eval.jsonl").open("a", buffering=1)
        self._timeline = (root / "timeline.jsonl").open("a")  # spans come in bursts: flushed per step
        self.first_step = first_step
        self.processes: dict[str, dict[str, Any]] = {}
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(root / "tb"), purge_step=first_step or None)
        except ImportError:  # tensorboard is a dependency; a broken install still trains
            self.say("tensorboard is not importable; metrics go to metrics.jsonl only")
        self.start = time.monotonic()
        self.first_step_at: float | None = None
        self.placement: dict[str, str] = {}  # process name -> Ray node id

    @classmethod
    def create(
        cls, output_dir: str, name: str, config: dict[str, Any], total_steps: int, private: bool = False
    ) -> RunLog:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        root = Path(output_dir) / f"{name}-{stamp}"
        suffix = 1
        while root.exists():
            root = Path(output_dir) / f"{name}-{stamp}-{suffix}"
            suffix += 1
        root.mkdir(parents=True, mode=0o700 if private else 0o777)  # 0o777 less the umask
        (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        return cls(root, total_steps)

    @classmethod
    def reopen(cls, root: Path, config: dict[str, Any], total_steps: int, first_step: int) -> RunLog:
        """A resumed run: the same directory, continued at ``first_step``."""
        (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        return cls(root, total_steps, first_step=first_step)

    def process(self, name: str, info: dict[str, Any]) -> None:
        """Record a started process (pid, node) in ``processes.json``."""
        self.processes[name] = {k: info[k] for k in ("pid", "node") if k in info}
        self.placement[name] = info.get("node", "?")
        (self.root / "processes.json").write_text(json.dumps(self.processes, indent=1))

    def samples(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self._samples.write(json.dumps(record) + "\n")

    def timeline(self, spans: list[dict[str, Any]]) -> None:
        """Append spans (``cluster/timeline.py``) to ``timeline.jsonl``."""
        self._timeline.writelines(json.dumps(span) + "\n" for span in spans)

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
        # ETA from the pace since the first step of this process (start-up excluded).
        timed = done - self.first_step
        pace = (now - self.first_step_at) / max(timed - 1, 1) if timed > 1 else metrics.get("step_seconds", 0.0)
        eta = pace * (self.total_steps - done)
        record = {"step": step, "elapsed_s": round(elapsed, 3), **metrics}
        self._metrics.write(json.dumps(record) + "\n")
        self._timeline.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        self.say(
            f"step {done:>4}/{self.total_steps} | reward {metrics['reward_mean']:.3f} | "
            f"{metrics['tokens_per_s']:>7.0f} tok/s | staleness {metrics['staleness_mean']:.2f} "
            f"(max {metrics['staleness_max']}) | {format_seconds(elapsed)} elapsed, ETA {format_seconds(eta)}"
        )

    def eval(self, step: int, metrics: dict[str, Any], line: str) -> None:
        """Record one evaluation round, made after ``step`` steps (``eval.jsonl`` + TensorBoard), and say ``line``."""
        self._eval.write(json.dumps({"step": step, "elapsed_s": round(time.monotonic() - self.start, 3), **metrics}))
        self._eval.write("\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        self.say(line)

    def close(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            (self.root / "summary.json").write_text(json.dumps(summary, indent=2))
        self._metrics.close()
        self._samples.close()
        self._eval.close()
        self._timeline.close()
        if self._tb is not None:
            self._tb.close()
