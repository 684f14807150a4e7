"""The live view (run.live, a terminal only): what it draws, messages above it, stopped on close and at
its first error; without a terminal the plain lines, unchanged."""

from __future__ import annotations

import io
import re

from rich.console import Console
from rich.text import Text

from observe.live import LiveView, PlainLines, StepStatus, build_view, stats_lines
from observe.run_dir import RunLog

METRICS = {
    "reward_mean": 0.412,
    "tokens_per_s": 2345.0,
    "staleness_mean": 0.84,
    "staleness_max": 1,
    "reward_errors": 2,
    "actor_restarts": 1,
    "learner_wait_s": 0.5,
    "step_seconds": 2.0,
}
PLAIN = re.compile(
    r"^step +\d+/\d+ \| reward \d\.\d{3} \| +\d+ tok/s \| staleness \d\.\d\d \(max \d+\) \| "
    r"\d+:\d\d elapsed, ETA \d+:\d\d$"
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def terminal_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=200, color_system="truecolor"), out


def screen(out: io.StringIO) -> str:
    return Text.from_ansi(out.getvalue()).plain


def test_stats_lines():
    # learner idle = learner_wait_s / step_seconds = 0.5 / 2.0 = 25%
    assert stats_lines(METRICS, 0.35) == [
        "reward 0.412 | eval pass@1 0.350 | staleness 0.84 (max 1) | 2,345 tok/s",
        "reward errors 2 | actor restarts 1 | learner idle 25%",
    ]
    assert "eval pass@1" not in stats_lines(METRICS, None)[0]
    assert all(len(line) <= 80 for line in stats_lines({**METRICS, "tokens_per_s": 1e7}, 1.0))


def test_the_bar_gives_way_on_a_narrow_screen():
    out = io.StringIO()
    view = LiveView(10000, console=Console(file=out, force_terminal=True, width=80))
    view.step(StepStatus(9999, 10000, 45296.0, 3600.0, METRICS), "unused")
    view.close()
    frame = screen(out).splitlines()[-3:]  # the last frame: bar + counts, then two lines of numbers
    # 45296 s = 12:34:56 elapsed and 3600 s = 1:00:00 to go, counting on while the display is drawn
    assert re.search(r"[━╸╺] step 9999/10000 \| 12:34:5\d elapsed, ETA (1:00:00|59:5\d)$", frame[0]), frame[0]
    assert len(frame[0]) <= 80
    assert frame[1] == "reward 0.412 | staleness 0.84 (max 1) | 2,345 tok/s"


def test_live_view_draws_progress_and_says_above(tmp_path):
    console, out = terminal_console()
    view = LiveView(10, console=console)
    run = RunLog(tmp_path, 10, config={"run": {"trackers": ["jsonl"]}}, view=view)
    run.say("starting 1 generation actor(s) [placement: PACK]")  # before the display: plain, brackets kept
    for step in range(3):
        run.step(step, METRICS)
    assert view.live is not None and view.live.is_started
    run.eval(3, {"eval/pass@1": 0.35, "eval/samples": 4}, "eval after step 3: pass@1 0.350")
    run.say("checkpoint: /x/step-3 [1.0 MB]")
    run.close(None)
    text = screen(out)
    assert "starting 1 generation actor(s) [placement: PACK]" in text
    assert "checkpoint: /x/step-3 [1.0 MB]" in text and "eval after step 3: pass@1 0.350" in text
    assert "step 3/10" in text and "elapsed, ETA" in text
    assert "reward 0.412 | eval pass@1 0.350 | staleness 0.84 (max 1) | 2,345 tok/s" in text
    assert "reward errors 2 | actor restarts 1 | learner idle 25%" in text
    assert "━" in text  # the bar
    assert not [line for line in text.splitlines() if PLAIN.match(line)]  # no plain progress lines
    assert view.live is None and out.getvalue().endswith("\x1b[?25h")  # stopped: the cursor is back
    run.say("completed")  # after close: plain
    assert screen(out).endswith("completed\n")


def test_plain_lines_without_a_terminal(tmp_path):
    out = io.StringIO()
    run = RunLog(tmp_path, 3, stream=out, config={"run": {"trackers": ["jsonl"]}})
    assert isinstance(run.view, PlainLines)
    run.say("hello")
    run.step(0, METRICS)
    run.step(1, METRICS)
    run.close(None)
    lines = out.getvalue().splitlines()
    assert lines[0] == "hello"
    assert lines[1].startswith("step    1/3 | reward 0.412 |    2345 tok/s | staleness 0.84 (max 1) | 0:00 elapsed")
    assert all(PLAIN.match(line) for line in lines[1:]) and len(lines) == 3
    assert "\x1b" not in out.getvalue()


def test_the_view_is_chosen_by_terminal_and_setting(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    assert isinstance(build_view(Terminal(), live=True, total_steps=5), LiveView)
    assert isinstance(build_view(Terminal(), live=False, total_steps=5), PlainLines)
    assert isinstance(build_view(io.StringIO(), live=True, total_steps=5), PlainLines)
    monkeypatch.setenv("TERM", "dumb")
    assert isinstance(build_view(Terminal(), live=True, total_steps=5), PlainLines)


def test_run_live_false_in_a_terminal_prints_plain_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    out = Terminal()
    run = RunLog(tmp_path, 2, stream=out, config={"run": {"trackers": ["jsonl"], "live": False}})
    run.step(0, METRICS)
    run.close(None)
    assert PLAIN.match(out.getvalue().splitlines()[0])


def test_a_display_error_falls_back_to_plain_lines(tmp_path):
    console, out = terminal_console()
    view = LiveView(4, console=console)
    run = RunLog(tmp_path, 4, config={"run": {"trackers": ["jsonl"]}}, view=view)
    run.step(0, METRICS)

    def broken():
        raise RuntimeError("terminal went away")

    view.live.refresh = broken
    run.step(1, METRICS)  # does not raise
    run.say("after")
    run.step(2, METRICS)
    run.close(None)
    lines = screen(out).splitlines()
    assert "live view failed (RuntimeError: terminal went away); plain progress lines from here" in lines
    plain = [line for line in lines if PLAIN.match(line)]
    assert [line[:12] for line in plain] == ["step    2/4 ", "step    3/4 "]
    assert "after" in lines and view.live is None


def test_close_stops_the_display_when_training_fails(tmp_path):
    console, out = terminal_console()
    view = LiveView(4, console=console)
    run = RunLog(tmp_path, 4, config={"run": {"trackers": ["jsonl"]}}, view=view)
    run.step(0, METRICS)
    try:
        try:
            raise ValueError("boom")
        finally:
            run.close(None)  # as run_training's finally does
    except ValueError:
        pass
    assert view.live is None and out.getvalue().endswith("\x1b[?25h")
