"""The run directory and what goes into it while a run trains.

``runs/<name>-<timestamp>/`` holds ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one line per step, with the prompt ids it trained on), ``samples.jsonl``
(a few completions per step), ``eval.jsonl`` (one line per evaluation round,
``runtime/evaluation.py``), ``timeline.jsonl`` (every process's spans, ``cluster/timeline.py``),
``tb/`` (TensorBoard event files) and ``wandb/`` (W&B's files) as ``run.trackers`` asks
(``observe/trackers.py``), ``logs/<process>.log`` (every actor's and learner rank's output),
``processes.json`` (each process's pid and node), ``checkpoints/`` (``runtime/checkpoints.py``),
``model/`` (the trained policy) and, at the end, ``summary.json``. ``RunLog`` also shows the
progress: a line a step, or the live view in a terminal (``observe/live.py``).

A resumed run reopens its directory: the lines of steps after the checkpoint it resumes from
are dropped (those steps are trained again), TensorBoard purges them too, and W&B continues
the same run (its id is in ``wandb-run-id``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from observe.live import StepStatus, build_view, format_seconds
from observe.trackers import Tracker, TrackerContext, TrackingConfig, build_trackers

__all__ = ["RunLog", "format_seconds"]  # format_seconds: launch/cli.py takes it from here
SAMPLE_COLUMNS = ["prompt", "completion", "reward", "staleness"]  # the samples table in the trackers


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line; lines that do not parse (a killed run leaves a torn
    last line) are left out. ``[]`` for a missing file."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _keep_steps_before(path: Path, step: int) -> None:
    """Drop the JSONL lines of steps >= ``step`` (and a torn last line)."""
    if path.is_file():
        kept = [r for r in _records(path) if isinstance(r.get("step"), (int, float)) and r["step"] < step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _keep_spans_before(path: Path, version: int) -> None:
    """A resumed run's timeline: keep the spans up to the learner's publication of ``version`` (the
    checkpoint's step); later ones, of steps trained again, and torn lines (a killed run) go."""
    if path.is_file():
        spans = _records(path)
        published = [s["end"] for s in spans if s.get("kind") == "publish" and s.get("version") == version]
        cut = max(published, default=float("inf"))
        path.write_text("".join(json.dumps(s) + "\n" for s in spans if s.get("start", 0) < cut))


def write_config(root: Path, config: dict[str, Any], first_step: int) -> None:
    """``config.yaml``, the config the run trains with now, and ``configs/from-step-N.yaml``, the config of
    the segment that starts at step ``N`` (a resume with other settings leaves the earlier ones there)."""
    text = yaml.safe_dump(config, sort_keys=False)
    history = root / "configs"
    if not history.is_dir() and (root / "config.yaml").is_file():  # a run from before configs/ existed:
        history.mkdir()  # its config.yaml is the last segment's, which began at a step unknown here
        (history / f"before-step-{first_step}.yaml").write_text((root / "config.yaml").read_text())
    history.mkdir(exist_ok=True)
    (history / f"from-step-{first_step}.yaml").write_text(text)
    (root / "config.yaml").write_text(text)


# What processes.json keeps of a process's ready report: where it runs, and what vLLM chose for an
# actor's engine (actors/spec.py EngineChoices) or which attention kernel a learner rank runs.
PROCESS_KEYS = ("pid", "node", "async_scheduling", "model_runner", "kv_cache_bytes", "kv_cache_blocks",
                "block_size", "attention")  # fmt: skip

class RunLog:
    """The run directory while a run trains: its JSONL record, the trackers (``run.trackers``) and
    the progress the user sees (``run.live``). ``settings`` is the run section (default: read from
    ``config``, the resolved config saved as config.yaml); ``view`` replaces the progress display."""

    def __init__(
        self,
        root: Path,
        total_steps: int,
        stream=None,
        first_step: int = 0,
        settings: TrackingConfig | None = None,
        config: dict[str, Any] | None = None,
        view=None,
    ):
        self.root = root
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        run_section = (config or {}).get("run") or {}  # the resolved config: its tracking fields
        settings = settings or TrackingConfig.model_validate(
            {k: v for k, v in run_section.items() if k in TrackingConfig.model_fields}
        )
        self.view = view or build_view(self.stream, settings.live, total_steps)
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "samples.jsonl"):
            _keep_steps_before(root / name, first_step)
        # an evaluation "after step s" is kept when s steps were done by the checkpoint resumed from
        _keep_steps_before(root / "eval.jsonl", first_step + 1 if first_step else 0)
        if first_step:
            _keep_spans_before(root / "timeline.jsonl", first_step)
        self._metrics = (root / "metrics.jsonl").open("a", buffering=1)
        self._samples = (root / "samples.jsonl").open("a", buffering=1)
        self._eval = (root / "eval.jsonl").open("a", buffering=1)
        self._timeline = (root / "timeline.jsonl").open("a")  # spans come in bursts: flushed per step
        self.first_step = first_step
        self.processes: dict[str, dict[str, Any]] = {}
        context = TrackerContext(
            root=root,
            config=config or {},
            first_step=first_step,
            project=settings.wandb_project,
            mode=settings.wandb_mode,
            say=self.say,
        )
        self.trackers: dict[str, Tracker] = build_trackers(settings.trackers, context)
        self.start = time.monotonic()
        self.first_step_at: float | None = None
        self.marks: dict[str, tuple[float, str | None]] = {}  # start-up phase -> (its end, the phase it began after)
        self.placement: dict[str, str] = {}  # process name -> Ray node id

    @classmethod
    def create(
        cls,
        output_dir: str,
        name: str,
        config: dict[str, Any],
        total_steps: int,
        private: bool = False,
        settings: TrackingConfig | None = None,
    ) -> RunLog:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        suffix = 0
        while True:  # mkdir itself decides: two runs started in the same second get two directories
            # absolute: the ranks and actors get paths under it, and a Ray worker's directory is not this one's
            root = Path(output_dir).absolute() / (f"{name}-{stamp}-{suffix}" if suffix else f"{name}-{stamp}")
            try:
                root.mkdir(mode=0o700 if private else 0o777)  # 0o777 less the umask
                break
            except FileExistsError:
                suffix += 1
        write_config(root, config, 0)
        return cls(root, total_steps, settings=settings, config=config)

    @classmethod
    def reopen(
        cls,
        root: Path,
        config: dict[str, Any],
        total_steps: int,
        first_step: int,
        settings: TrackingConfig | None = None,
    ) -> RunLog:
        """A resumed run: the same directory, continued at ``first_step``."""
        root = Path(root).absolute()
        write_config(root, config, first_step)
        return cls(root, total_steps, first_step=first_step, settings=settings, config=config)

    def process(self, name: str, info: dict[str, Any]) -> None:
        """Record a started process (pid, node, and what its engine or kernel chose) in ``processes.json``."""
        self.processes[name] = {k: info[k] for k in PROCESS_KEYS if k in info}
        self.placement[name] = info.get("node", "?")
        (self.root / "processes.json").write_text(json.dumps(self.processes, indent=1))

    def samples(self, records: list[dict[str, Any]]) -> None:
        """A step's sample completions (``sample_records``): ``samples.jsonl`` and a table in each tracker."""
        for record in records:
            self._samples.write(json.dumps(record) + "\n")
        if records:
            rows = [[r.get(column) for column in SAMPLE_COLUMNS] for r in records]
            self._track(lambda t: t.table(records[0]["step"], "samples", SAMPLE_COLUMNS, rows))

    def timeline(self, spans: list) -> None:
        """Append spans (``cluster.timeline.Span``) to ``timeline.jsonl``, one JSON object a line."""
        self._timeline.writelines(json.dumps(dataclasses.asdict(span)) + "\n" for span in spans)

    def mark(self, phase: str, since: str | None = None) -> None:
        """Note that the start-up phase ``phase`` ended now. It began when ``since`` ended, or (None)
        when the previous phase marked without ``since`` did: those chain, the others ran beside them."""
        self.marks[phase] = (time.monotonic(), since)

    def log_path(self, process: str) -> str:
        return str((self.logs / f"{process}.log").resolve())

    def say(self, text: str) -> None:
        self.view.say(text)

    def step(self, step: int, metrics: dict[str, Any], distributions: dict[str, np.ndarray] | None = None) -> None:
        """Record one step's metrics (JSONL + trackers), its distributions (``step_distributions``:
        histograms in the trackers) and show the progress."""
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
        self._track(lambda t: t.scalars(step, _numbers(metrics)))
        if distributions:
            finite = {k: v[np.isfinite(v)] for k, v in ((k, np.asarray(v, float)) for k, v in distributions.items())}
            self._track(lambda t: t.histograms(step, finite))  # a NaN reward must not switch a tracker off
        line = (
            f"step {done:>4}/{self.total_steps} | reward {metrics['reward_mean']:.3f} | "
            f"{metrics['tokens_per_s']:>7.0f} tok/s | staleness {metrics['staleness_mean']:.2f} "
            f"(max {metrics['staleness_max']}) | {format_seconds(elapsed)} elapsed, ETA {format_seconds(eta)}"
        )
        if metrics.get("episode/failed"):  # episodes their environment ended (the first texts are said apart)
            line += f" | {metrics['episode/failed']} episodes failed"
        self.view.step(StepStatus(done, self.total_steps, elapsed, eta, metrics, now), line)

    def eval(self, step: int, metrics: dict[str, Any], line: str) -> None:
        """Record one evaluation round, made after ``step`` steps (``eval.jsonl`` + trackers), and say ``line``."""
        self._eval.write(json.dumps({"step": step, "elapsed_s": round(time.monotonic() - self.start, 3), **metrics}))
        self._eval.write("\n")
        self._track(lambda t: t.scalars(step, _numbers(metrics)))
        self.view.eval(metrics, line)

    def _track(self, call) -> None:
        """``call(tracker)`` for each tracker; one that fails is told once and left out from then on
        (a tracker must not stop the training: metrics.jsonl has everything)."""
        for name, tracker in list(self.trackers.items()):
            try:
                call(tracker)
            except Exception as exc:
                del self.trackers[name]
                self.say(f"tracker {name} failed ({type(exc).__name__}: {exc}); it is off for the rest of the run")

    def close(self, summary: dict[str, Any] | None) -> None:
        try:
            if summary is not None:
                (self.root / "summary.json").write_text(json.dumps(summary, indent=2))
            self._metrics.close()
            self._samples.close()
            self._eval.close()
            self._timeline.close()
            for name, tracker in self.trackers.items():
                try:
                    tracker.close()
                except Exception as exc:  # its data is flushed or lost; the run's own files are whole
                    self.say(f"tracker {name} did not close cleanly ({type(exc).__name__}: {exc})")
        finally:
            self.view.close()  # the terminal back whatever happened


def startup_phases(
    started: float, marks: dict[str, tuple[float, str | None]], first_step_at: float | None
) -> dict[str, float]:
    """Seconds per start-up phase (``RunLog.mark``) as ``{"<phase>_s": seconds}``, in the order
    marked, with ``first_step_s`` from the last chained phase to the end of the first step."""
    phases, last = {}, started
    for phase, (end, since) in marks.items():
        phases[f"{phase}_s"] = round(end - (marks[since][0] if since else last), 1)
        if since is None:
            last = end
    if first_step_at is not None:
        phases["first_step_s"] = round(first_step_at - last, 1)
    return phases


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The scalar metrics (lists and histograms such as ``prompt_ids`` or ``staleness_hist`` stay in the JSONL)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
