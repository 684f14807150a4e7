"""``tandem report``: the interval arithmetic and idle shares by hand, the run's numbers, the page
and its PNGs, overlays, missing files, bad directories and the Chrome trace. No Ray, no vLLM."""

from __future__ import annotations

import json
import re

import pytest

from launch.config import ConfigError
from observe import report_figures as figures
from observe.report import run_report
from observe.run_stats import load_run, run_summary
from observe.timeline_stats import (
    actor_idle_per_step,
    busy_fractions,
    idle_fractions,
    lanes,
    merge_intervals,
    overlap_share,
    step_windows,
    subtract,
    window_totals,
)
from observe.trace import write_trace
from tests.report_runs import T0, spans, write_run

PNG = b"\x89PNG\r\n\x1a\n"
FIGURES = ["reward", "length", "staleness", "tis", "drops", "idle", "throughput", "timeline"]


def test_interval_union_and_difference():
    pairs = [(5, 6), (0, 2), (1, 3), (3, 4)]
    # (0, 2) and (1, 3) overlap, (3, 4) touches -> (0, 4); (5, 6) alone
    assert merge_intervals({"start": s, "end": e} for s, e in pairs) == [(0, 4), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert subtract([(0, 1), (4, 5)], [(0.5, 4.5)]) == [(0, 0.5), (4.5, 5)]
    assert subtract([(0, 2), (3, 4), (6, 8)], [(1, 3.5), (7, 9)]) == [(0, 1), (3.5, 4), (6, 7)]
    # per-window lengths in one sweep: an interval across a window edge counts on both sides
    assert window_totals([(0, 1), (2, 5), (9, 10)], [(0, 3), (3, 6), (6, 9.5)]) == [2.0, 2.0, 0.5]


def test_overlap_share_is_the_training_time_while_anything_generated():
    def span(process, kind, start, end):
        return {"process": process, "kind": kind, "start": start, "end": end}

    timeline = [
        span("learner-0", "train", 0, 4),
        span("learner-0", "train", 6, 10),  # trained 8 s
        span("actor-0", "generate", 1, 3),
        span("actor-1", "generate", 2, 5),  # with actor-0: [1, 5] -> 3 s inside [0, 4]
        span("actor-0", "generate", 9, 12),  # 1 s inside [6, 10]
        span("actor-0", "wait_prompts", 6, 9),  # a wait is not generation
    ]
    assert overlap_share(timeline) == pytest.approx(4 / 8)
    assert overlap_share(timeline, during="generate", doing="train") == pytest.approx(4 / 7)
    assert overlap_share([span("actor-0", "generate", 0, 1)]) is None  # nothing trained


def test_busy_fractions_merge_overlapping_generation():
    busy = busy_fractions(spans())
    # actor-0 spans [0, 10]: generate [1, 4] u [2, 5] = [1, 5] and [6, 9] u [7, 10] = [6, 10] -> 8 s of 10
    assert busy["actor-0"] == pytest.approx(
        {"wait_prompts": 0.1, "generate": 0.8, "wait_weights": 0.1, "load_weights": 0.05}
    )
    # learner-0 spans [4, 9.5] = 5.5 s; train 0.6 + 1.6 + 1.0 = 3.2 s
    assert busy["learner-0"]["train"] == pytest.approx(3.2 / 5.5)
    assert busy["driver"] == pytest.approx({"wait_data": 5.5 / 8.5})  # 4 + 1 + 0.5 of [0, 8.5]


def test_idle_is_waiting_while_nothing_runs():
    idle = idle_fractions(spans())
    # actor-0: wait_prompts [0, 1] + wait_weights [4.5, 5.5] less its 0.5 s under generate [2, 5] = 1.5 s of 10
    assert idle["actor-0"] == pytest.approx(0.15)
    assert idle["driver"] == pytest.approx(5.5 / 8.5)
    assert "learner-0" not in idle  # a learner rank records no waits: its idle is in the metrics


def test_step_windows_and_actor_idle_per_step():
    windows = step_windows(spans())
    assert {k: (a - T0, b - T0) for k, (a, b) in windows.items()} == {0: (0, 5), 1: (5, 8), 2: (8, 10)}
    steps, idle = actor_idle_per_step(spans())
    # step 0 [0, 5]: wait_prompts 1 s (wait_weights [4.5, 5] is under generation) -> 1/5
    # step 1 [5, 8]: wait_weights [5, 5.5] -> 0.5/3; step 2 [8, 10]: no wait -> 0
    assert steps == [0, 1, 2]
    assert idle == pytest.approx([0.2, 0.5 / 3, 0.0])


def test_lanes_order_driver_learners_others_actors():
    names = ["actor-10", "actor-2", "learner-1", "reference-0", "driver", "learner-0"]
    fake = [{"process": n, "kind": "x", "start": 0, "end": 1} for n in names]
    assert list(lanes(fake)) == ["driver", "learner-0", "learner-1", "reference-0", "actor-2", "actor-10"]


def test_run_summary_numbers(tmp_path):
    summary = run_summary(load_run(write_run(tmp_path / "run")))
    assert summary["steps"] == 3
    # the steady state is steps 1 and 2: (3 s * 300 + 2 s * 500) tokens / 5 s = 380 tokens/s
    assert summary["tokens_per_s"] == pytest.approx(380.0)
    # trained (completion) tokens, learner/tokens: (600 + 800) / 5 s
    assert summary["trained_tokens_per_s"] == pytest.approx(280.0)
    assert summary["mean_step_s"] == pytest.approx(2.5)
    assert summary["learner_idle"] == pytest.approx(0.3)  # (1 + 0.5) / (3 + 2)
    assert summary["actor_idle"] == pytest.approx(0.1)  # after step 0: wait_weights [5, 5.5] in [5, 10]
    # tokens by staleness 0: 800, 1: 900, 2: 200 -> (900 + 2 * 200) / 1900
    assert summary["staleness_mean"] == pytest.approx(13 / 19)
    assert summary["groups"] == 12  # 4 prompt ids a step
    assert summary["dropped_stale"] == 3 and summary["filtered_groups"] == 1
    assert summary["tis_truncated_frac"] == pytest.approx(0.1)  # mean of 0, 0.1, 0.2
    assert summary["tis_mismatch_kl"] == pytest.approx(0.01)  # mean of 0, 0.01, 0.02
    assert summary["reward_final"] == pytest.approx(0.5) and summary["eval_pass1_final"] == pytest.approx(0.4)
    assert (summary["method"], summary["max_staleness"], summary["weight_update"]) == ("grpo", 2, "inflight")
    assert (summary["actors"], summary["learner_ranks"], summary["startup_s"]) == (1, 1, 12.5)


def _strip_images(page: str) -> str:
    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:", page)


def test_report_writes_a_self_contained_page_and_pngs(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert run_report([str(run)], None, False) == 0
    out = run / "report"
    page = (out / "report.html").read_text()
    for name in FIGURES:
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
        assert f"id='{name}'" in page, name
    text = _strip_images(page)
    assert "http" not in text.lower()
    assert re.findall(r"(?:src|href)='([^']*)'", text) == ["data:"] * len(FIGURES)  # nothing outside the page
    assert not (out / "trace.json").exists()
    assert str(out / "report.html") in capsys.readouterr().out


def test_two_runs_overlay(tmp_path):
    a, b = load_run(write_run(tmp_path / "run-a")), load_run(write_run(tmp_path / "run-b"))
    for draw in (figures.reward_figure, figures.length_figure, figures.tis_figure, figures.idle_figure):
        legend = draw([a, b]).axes[0].get_legend()
        assert [t.get_text() for t in legend.get_texts()] == ["run-a", "run-b"], draw.__name__
    assert len(figures.staleness_figure([a, b]).axes) == 2  # a panel per run
    run_report([str(a.path), str(b.path)], str(tmp_path / "out"), False)
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<td>run-a</td>" in page and "<td>run-b</td>" in page
    assert (tmp_path / "out" / "timeline-2.png").read_bytes().startswith(PNG)


def test_missing_timeline_and_files_are_notes_not_crashes(tmp_path):
    run = write_run(tmp_path / "run", timeline=False, evals=False)
    (run / "summary.json").unlink()  # a run still going
    assert run_report([str(run)], str(tmp_path / "out"), True) == 0
    page = (tmp_path / "out" / "report.html").read_text()
    assert "no timeline.jsonl" in page
    assert not (tmp_path / "out" / "timeline.png").exists() and not (tmp_path / "out" / "trace.json").exists()
    assert (tmp_path / "out" / "idle.png").read_bytes().startswith(PNG)
    assert run_summary(load_run(run))["actor_idle"] is None


def test_not_a_run_directory_and_no_steps_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory .no metrics.jsonl.") as error:
        run_report([str(tmp_path)], None, False)
    assert "\n" not in str(error.value)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no steps yet"):
        load_run(tmp_path)


def test_a_torn_last_line_is_left_out(tmp_path):
    run = load_run(write_run(tmp_path / "run", torn=True))
    assert [m["step"] for m in run.metrics] == [0, 1, 2]
    (run.path / "metrics.jsonl").write_text('{"step": 0\n{"step": 1}\n')
    with pytest.raises(ConfigError, match="metrics.jsonl:1: not a JSON line"):
        load_run(run.path)


def test_zoom_window_is_five_steps_from_the_middle():
    driver = [{"process": "driver", "kind": "wait_data", "start": k, "end": k + 0.5, "version": k} for k in range(12)]
    # windows [k, k + 1), the last [11, 11.5]; after step 0, steps 1..11 -> the middle five are 4..8 -> [4, 9)
    assert figures.zoom_window(driver) == (4, 9)
    assert figures.zoom_window(driver[:5]) is None  # five steps or fewer: the whole run


def test_trace_events_lanes_and_durations(tmp_path):
    trace = json.loads(write_trace(spans(), tmp_path / "trace.json").read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {1: "driver", 2: "learner-0", 3: "actor-0"}
    order = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    assert order == {1: 1, 2: 2, 3: 3}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(spans()) and {e["pid"] for e in complete} == {1}
    generate = [e for e in complete if e["tid"] == 3 and e["name"] == "generate"]
    # [1, 4] and [2, 5] s from the first span -> ts 1e6 us, dur 3e6 us; the overlap is kept for the viewer
    assert (generate[0]["ts"], generate[0]["dur"]) == pytest.approx((1e6, 3e6), abs=1)
    assert (generate[1]["ts"], generate[1]["dur"]) == pytest.approx((2e6, 3e6), abs=1)
    assert generate[0]["args"] == {"version": 0}


def test_report_trace_flag_writes_the_trace(tmp_path):
    run = write_run(tmp_path / "run")
    run_report([str(run)], str(tmp_path / "out"), True)
    events = json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(spans())


def test_cli_report(tmp_path, capsys):
    from launch.cli import main

    run = write_run(tmp_path / "run")
    assert main(["report", str(run), "--out", str(tmp_path / "out"), "--trace"]) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "out" / "report.html") in printed and str(tmp_path / "out" / "trace.json") in printed
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "tandem: error:" in capsys.readouterr().err
