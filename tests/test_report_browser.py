"""The report as a reader gets it: ``report.html`` opened from disk in a real headless Chromium
shows every figure, its headings, and no errors; the screenshot is kept in test-artifacts/report.png."""

from __future__ import annotations

from pathlib import Path

from observe.report import run_report
from tests.browser import open_report, require_browser
from tests.report_runs import write_run

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
HEADINGS = [
    "Runs",
    "Reward",
    "Response length",
    "Staleness",
    "Truncated importance sampling",
    "Dropped and filtered groups",
    "Idle time",
    "Throughput",
    "Timeline: run-a",
    "Timeline: run-b",
]


def test_report_opens_in_chromium(tmp_path):
    require_browser()
    run_a = write_run(tmp_path / "run-a")
    run_b = write_run(tmp_path / "run-b", timeline=False)  # the timeline's note, beside run-a's figure
    run_report([str(run_a), str(run_b)], str(tmp_path / "report"), False)
    seen = open_report(tmp_path / "report" / "report.html", ARTIFACTS / "report.png")
    assert seen["errors"] == []
    assert seen["requests"] == []  # self-contained: nothing fetched beyond the file
    ids = [image["id"] for image in seen["images"]]
    assert ids == ["reward", "length", "staleness", "tis", "drops", "idle", "throughput", "timeline"]
    assert all(image["width"] > 0 and image["height"] > 0 for image in seen["images"]), seen["images"]
    assert seen["headings"][0].startswith("Tandem run report: run-a, run-b")
    assert seen["headings"][1:] == HEADINGS
    assert (ARTIFACTS / "report.png").read_bytes().startswith(b"\x89PNG")
