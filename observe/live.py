"""What a run prints while it trains: plain progress lines, or a live view in a terminal.

``PlainLines`` prints one line a step (``step    N/T | reward ...``; people and tests grep it)
and every message. ``LiveView`` (``run.live``, a terminal only) keeps a rich display at the bottom
of the screen (a progress bar with elapsed time and ETA, and the latest reward, evaluation pass@1,
staleness, tokens/s, reward errors, actor restarts and learner idle share) and prints the
messages above it. The view never raises into the training loop: a display error stops it and
the plain lines take over. ``DriverView`` wraps either: every line also goes to the run's
``logs/driver.log``, and each step's and evaluation's metrics are shown to watchers
(``runtime/signals.py``'s ``SignalWatch``) whose warnings are printed like any message.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from cluster.logs import append_log

REFRESH_PER_SECOND = 1.0  # elapsed time and ETA tick between steps


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class PlainLines:
    """Every message and every step's progress line, printed as they come."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def step(self, status: StepStatus, line: str) -> None:
        self.say(line)

    def eval(self, metrics: dict[str, Any], line: str) -> None:
        self.say(line)

    def close(self) -> None:
        pass


@dataclass
class StepStatus:
    """The newest step, as the live view shows it."""

    done: int  # steps completed
    total: int
    elapsed_s: float  # since the run (this process) started, at ``at``
    eta_s: float  # at ``at``
    metrics: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)


def stats_lines(metrics: dict[str, Any], eval_pass1: float | None) -> list[str]:
    """The live view's numbers, in two lines that fit 80 columns: the latest step's learning and
    throughput (and the latest evaluation's pass@1), then its faults and the learner's idle share."""
    learning = [f"reward {metrics.get('reward_mean', 0.0):.3f}"]
    if eval_pass1 is not None:
        learning.append(f"eval pass@1 {eval_pass1:.3f}")
    learning.append(f"staleness {metrics.get('staleness_mean', 0.0):.2f} (max {metrics.get('staleness_max', 0)})")
    learning.append(f"{metrics.get('tokens_per_s', 0.0):,.0f} tok/s")
    health = [f"reward errors {metrics.get('reward_errors', 0)}", f"actor restarts {metrics.get('actor_restarts', 0)}"]
    step_s = metrics.get("step_seconds", 0.0)
    if step_s:  # the share of the step the learner waited for data
        health.append(f"learner idle {metrics.get('learner_wait_s', 0.0) / step_s:.0%}")
    return [" | ".join(learning), " | ".join(health)]


class LiveView:
    """A rich ``Live`` display at the bottom of ``console``; it starts with the first step (a run
    that trains nothing, ``tandem eval``, prints plain lines only) and stops on ``close``, at exit,
    or at its first error, after which ``PlainLines`` prints on ``console.file``."""

    def __init__(self, total_steps: int, console=None, stream: TextIO | None = None, refresh_per_second: float = 0):
        from rich.console import Console

        self.console = console if console is not None else Console(file=stream or sys.stdout)
        self.plain = PlainLines(self.console.file)
        self.total = total_steps
        self.refresh_per_second = refresh_per_second or REFRESH_PER_SECOND
        self.status: StepStatus | None = None
        self.eval_pass1: float | None = None
        self.live = None
        self.failed = False

    def say(self, text: str) -> None:
        if self.live is None:
            self.plain.say(text)
            return
        try:  # above the display; markup off: a message may hold [brackets]
            self.live.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
        except Exception as exc:
            self._fail(exc)
            self.plain.say(text)

    def step(self, status: StepStatus, line: str) -> None:
        if self.failed:
            self.plain.step(status, line)
            return
        try:
            self.status = status
            if self.live is None:
                self._start()
            else:
                self.live.refresh()
        except Exception as exc:
            self._fail(exc)
            self.plain.step(status, line)

    def eval(self, metrics: dict[str, Any], line: str) -> None:
        self.eval_pass1 = metrics.get("eval/pass@1", self.eval_pass1)
        self.say(line)

    def close(self) -> None:
        live, self.live = self.live, None
        if live is not None:
            atexit.unregister(self.close)
            live.stop()  # the cursor back, the last display left on screen

    def _start(self) -> None:
        from rich.live import Live

        live = Live(
            console=self.console,
            get_renderable=self._render,
            refresh_per_second=self.refresh_per_second,
            transient=False,
        )
        live.start()
        self.live = live
        atexit.register(self.close)  # an exit that skips RunLog.close still gives the terminal back

    def _fail(self, exc: Exception) -> None:
        self.failed = True
        try:
            self.close()
        except Exception:
            pass
        self.plain.say(f"live view failed ({type(exc).__name__}: {exc}); plain progress lines from here")

    def _render(self):
        """The display, drawn each refresh (the refresh thread too: it must not raise)."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        try:
            s = self.status
            if s is None:
                return Text("")
            since = time.monotonic() - s.at
            counts = (
                f"step {s.done}/{s.total} | {format_seconds(s.elapsed_s + since)} elapsed, "
                f"ETA {format_seconds(s.eta_s - since)}"
            )
            grid = Table.grid(padding=(0, 1))
            width = max(10, min(40, self.console.width - len(counts) - 1))  # the bar gives way on a narrow screen
            grid.add_row(ProgressBar(total=max(s.total, 1), completed=s.done, width=width), Text(counts))
            return Group(grid, *(Text(line) for line in stats_lines(s.metrics, self.eval_pass1)))
        except Exception as exc:  # drawn from another thread: say it there, never raise
            return Text(f"(live view: {type(exc).__name__}: {exc})")


class Watcher(Protocol):
    """Looks at each step's and evaluation round's metrics; returns a warning to print, or None."""

    def step(self, step: int, metrics: dict[str, Any]) -> str | None: ...

    def eval(self, step: int | None, metrics: dict[str, Any]) -> str | None: ...


class DriverView:
    """``view`` (plain lines or the live view), with every line it shows also appended to
    ``log`` (the run's driver.log: what the console said, kept after the terminal is gone) and
    every step and evaluation round shown to ``watchers``, whose warnings are said."""

    def __init__(self, view, log: Path, watchers: list[Watcher] | None = None):
        self.view, self.log, self.watchers = view, log, list(watchers or [])

    def say(self, text: str) -> None:
        self.view.say(text)
        self.write(text)

    def step(self, status: StepStatus, line: str) -> None:
        self.view.step(status, line)
        self.write(line)
        self._warn(lambda watcher: watcher.step(status.done - 1, status.metrics))

    def eval(self, metrics: dict[str, Any], line: str) -> None:
        self.view.eval(metrics, line)
        self.write(line)
        self._warn(lambda watcher: watcher.eval(None, metrics))

    def close(self) -> None:
        self.view.close()

    def write(self, text: str) -> None:
        """Append to driver.log; a log that cannot be written must not stop the training."""
        try:
            append_log(self.log, text)
        except OSError:
            pass

    def _warn(self, look: Callable[[Watcher], str | None]) -> None:
        for watcher in self.watchers:
            warning = look(watcher)
            if warning:
                self.say(f"warning: {warning}")


def build_view(stream: TextIO, live: bool, total_steps: int) -> PlainLines | LiveView:
    """The live view when asked for and ``stream`` is a terminal that can draw it, else plain lines."""
    is_tty = getattr(stream, "isatty", lambda: False)()
    if live and is_tty and os.environ.get("TERM") != "dumb":
        try:
            return LiveView(total_steps, stream=stream)
        except ImportError:  # rich is a dependency; a broken install still trains
            pass
    return PlainLines(stream)
