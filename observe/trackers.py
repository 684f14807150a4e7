"""Where a run's numbers go besides its own files: TensorBoard and Weights & Biases (``run.trackers``).

The run directory's JSONL files (``metrics.jsonl``, ``samples.jsonl``, ``eval.jsonl``) are written
by ``RunLog`` whatever else is chosen: ``tandem report``, ``tandem tune`` and ``--resume`` read
them, so ``jsonl`` must be in the list. The other names come from ``TRACKERS``; ``build_trackers``
picks them once, at start-up, and every tracker takes the same calls: scalars, histograms, a
markdown text, a table (the step's sample completions), close.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field, field_validator

from schema import ConfigError, Section

RUN_FILES = "jsonl"  # the run directory's own record, always on (RunLog writes it)
WANDB_MISSING = (
    "run.trackers has wandb but the wandb package is not installed; pip install 'tandem-rl[wandb]' or drop it"
)
WANDB_FINISH_TIMEOUT_S = 120.0  # and its end, which uploads what is left
WANDB_INIT_TIMEOUT_S = 60.0  # W&B's start (its service, the server in online mode) may hang: never longer
MAX_UNIT_BUCKETS = 64  # integer values over a narrower range get one histogram bucket each
HIST_BINS = 32  # otherwise, equal-width buckets
MAX_CELL_CHARS = 2000  # a sample's prompt or completion in a text table (samples.jsonl has them whole)


class Tracker(Protocol):
    """One place a run's numbers go. ``step`` is the step index (0-based; an evaluation's: steps done)."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def histograms(self, step: int, values: dict[str, np.ndarray]) -> None: ...

    def text(self, step: int, name: str, markdown: str) -> None: ...

    def table(self, step: int, name: str, columns: list[str], rows: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


@dataclass
class TrackerContext:
    """What a tracker is started with."""

    root: Path  # the run directory
    config: dict[str, Any]  # the resolved config, as saved in config.yaml
    first_step: int = 0  # a resumed run continues here: what a tracker holds from this step on is replaced
    project: str = "tandem"  # run.wandb_project
    mode: str = "offline"  # run.wandb_mode
    say: Callable[[str], None] = field(default=print)


def histogram(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)`` of ``values`` (len(edges) = len(counts) + 1): one bucket per integer when the
    values are integers over a narrow range (staleness, 0/1 rewards), else ``HIST_BINS`` equal ones."""
    values = np.asarray(values, dtype=np.float64)
    lo, hi = float(values.min()), float(values.max())
    if np.all(values == np.floor(values)) and hi - lo < MAX_UNIT_BUCKETS:
        edges = lo - 0.5 + np.arange(int(hi - lo) + 2)  # [v - 0.5, v + 0.5) for each integer v
    else:
        edges = np.histogram_bin_edges(values, bins=HIST_BINS)
    counts, edges = np.histogram(values, bins=edges)
    return counts, edges


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else "" if value is None else str(value)
        if len(text) > MAX_CELL_CHARS:
            text = text[:MAX_CELL_CHARS] + " …"
        return escape(text).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardTracker:
    """Event files in ``RUN_DIR/tb``; a resumed run purges the events of the steps it trains again."""

    def __init__(self, ctx: TrackerContext):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(ctx.root / "tb"), purge_step=ctx.first_step or None)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def histograms(self, step: int, values: dict[str, np.ndarray]) -> None:
        for key, array in values.items():
            if len(array) == 0:
                continue
            counts, edges = histogram(array)
            array = np.asarray(array, dtype=np.float64)
            self.writer.add_histogram_raw(
                key,
                min=float(edges[0]),
                max=float(edges[-1]),
                num=int(array.size),
                sum=float(array.sum()),
                sum_squares=float(np.square(array).sum()),
                bucket_limits=edges[1:].tolist(),  # each bucket's upper edge
                bucket_counts=counts.tolist(),
                global_step=step,
            )

    def text(self, step: int, name: str, markdown: str) -> None:
        self.writer.add_text(name, markdown, step)

    def table(self, step: int, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.text(step, name, markdown_table(columns, rows))

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named after the run directory, its files in ``RUN_DIR/wandb``. Its id is kept in
    ``RUN_DIR/wandb-run-id`` so that a resumed run continues the same W&B run. Every row carries
    ``step`` and every metric is charted against it, so rows may come in any order (an evaluation
    round finishes steps after the one it scores; a resumed run logs its steps again)."""

    def __init__(self, ctx: TrackerContext):
        self.root = ctx.root
        try:
            import wandb
        except ImportError:
            raise ConfigError(WANDB_MISSING) from None
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        id_file = ctx.root / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        if ctx.mode == "online" and not wandb.login(prompt=False, verify=False):
            raise ConfigError(
                "run.wandb_mode is online but W&B has no API key; run `wandb login` (or set WANDB_API_KEY), "
                f"or use run.wandb_mode=offline and `wandb sync {ctx.root / 'wandb' / 'offline-run-*'}` later"
            )
        self.run = self._init(ctx, run_id, ctx.mode)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def _init(self, ctx: TrackerContext, run_id: str, mode: str):
        start = lambda mode: self.wandb.init(  # noqa: E731
            project=ctx.project,
            name=ctx.root.name,
            id=run_id,
            resume="allow",
            dir=str(ctx.root),
            config=ctx.config,
            mode=mode,
            settings=self.wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S, console="off", silent=True),
        )
        if mode == "offline":
            return start(mode)
        try:
            return start(mode)
        except Exception as exc:  # the server is slow or away: keep the data for `wandb sync`
            ctx.say(
                f"W&B did not start online ({type(exc).__name__}: {str(exc).strip()[:200]}); logging offline to "
                f"{ctx.root / 'wandb'} instead: `wandb sync {ctx.root / 'wandb' / 'offline-run-*'}` later"
            )
            return start("offline")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def histograms(self, step: int, values: dict[str, np.ndarray]) -> None:
        hists = {key: self.wandb.Histogram(np_histogram=histogram(a)) for key, a in values.items() if len(a)}
        if hists:
            self.run.log({"step": step, **hists})

    def text(self, step: int, name: str, markdown: str) -> None:
        self.run.log({"step": step, name: self.wandb.Html(f"<pre>{escape(markdown)}</pre>")})

    def table(self, step: int, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({"step": step, name: self.wandb.Table(columns=columns, data=rows)})

    def close(self) -> None:
        """Finish the W&B run within ``WANDB_FINISH_TIMEOUT_S`` (online, it waits for its uploads)."""
        import threading

        done = threading.Thread(target=self.run.finish, daemon=True, name="wandb-finish")
        done.start()
        done.join(WANDB_FINISH_TIMEOUT_S)
        if done.is_alive():
            raise TimeoutError(
                f"W&B did not finish within {WANDB_FINISH_TIMEOUT_S:.0f}s; the run's data is in {self.root / 'wandb'}: "
                f"upload it with `wandb sync {self.root / 'wandb' / '*run-*'}`"
            )


TRACKERS: dict[str, Callable[[TrackerContext], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
}
CHOICES = (RUN_FILES, *TRACKERS)


def check_trackers(names: list[str]) -> list[str]:
    """``run.trackers`` as given, or a ``ValueError`` that says what is wrong and how to fix it."""
    unknown = [name for name in names if name not in CHOICES]
    if unknown:
        raise ValueError(f"run.trackers: unknown tracker {unknown[0]!r}; choose from {', '.join(CHOICES)}")
    if RUN_FILES not in names:
        raise ValueError(
            "run.trackers must include jsonl: metrics.jsonl feeds tandem report, tandem tune and --resume; "
            f"add it, e.g. run.trackers=[{','.join([RUN_FILES, *names])}]"
        )
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ValueError(WANDB_MISSING)
    return list(dict.fromkeys(names))  # each once


def build_trackers(names: list[str], ctx: TrackerContext) -> dict[str, Tracker]:
    """The trackers ``names`` asks for, by name (``jsonl`` is RunLog's own). TensorBoard that cannot
    be imported is left out with a message, as before trackers were a choice; the others raise."""
    trackers: dict[str, Tracker] = {}
    for name in names:
        if name == RUN_FILES:
            continue
        try:
            trackers[name] = TRACKERS[name](ctx)
        except ImportError as exc:
            if name != "tensorboard":
                raise
            ctx.say(
                f"tensorboard is not importable ({exc}); metrics go to metrics.jsonl only: "
                "pip install 'tandem-rl[tensorboard]', or set run.trackers=[jsonl] to say so"
            )
    return trackers


class TrackingConfig(Section):
    """Where a run's metrics go and how the console shows them: the tracking fields of the ``run`` section."""

    trackers: list[str] = Field(
        default_factory=lambda: [RUN_FILES, "tensorboard"],
        description=f"Where metrics go, from {', '.join(CHOICES)}: jsonl (metrics/samples/eval.jsonl in "
        "the run directory, required: the report, the tuner and resume read them), tensorboard (RUN_DIR/tb: "
        "scalars, staleness/reward/length histograms, sample completions), wandb (Weights & Biases, RUN_DIR/wandb; "
        "pip install 'tandem-rl[wandb]'). On the command line: run.trackers=[jsonl,tensorboard,wandb].",
    )
    wandb_project: str = Field("tandem", description="W&B project of the run (run.trackers has wandb).")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: W&B writes RUN_DIR/wandb only (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it "
        "later); online: streams to the W&B server and needs a login (`wandb login` or WANDB_API_KEY).",
    )
    live: bool = Field(
        True,
        description="In a terminal, a live view at the bottom (progress bar, ETA, latest numbers) instead of a "
        "line a step; without a terminal (a pipe, a file, CI, Ray job logs) the plain lines either way.",
    )

    @field_validator("trackers")
    @classmethod
    def _trackers(cls, names: list[str]) -> list[str]:
        return check_trackers(names)
