"""``tandem tune`` on the real stack, then ``tandem report`` of its probes, opened in Chromium.

Two probes of the demo (k = 0, updates between requests, 4 steps each: the overlapped schedule with
one actor and one learner core, and the colocated one with two engines taking turns with the learner on
both cores) train for real: each writes a run directory with a timeline. The tuner's table, its recommendation and
the overrides file it writes are checked against what the probes recorded; the overrides
load with the job's config as ``tandem train --config job --config overrides`` would. Then
the two probes' report opens in a real headless browser with no errors (its screenshot is kept
in test-artifacts/report-real.png) and the Perfetto trace holds every process's lane.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.cli import main
from launch.config import load_config
from tests.browser import open_report, require_browser
from tests.runs import DEMO

pytestmark = pytest.mark.slow

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def test_tune_probes_the_demo_recommends_and_its_report_renders(tmp_path, tiny_model_dir, capsys):
    require_browser()  # before minutes of probing
    out = tmp_path / "runs"
    code = main(
        [
            "tune",
            "--config",
            str(DEMO),
            "--steps",
            "4",
            "--staleness",
            "0",
            "--modes",
            "between_requests",
            f"model.path={tiny_model_dir}",
            "model.build_tiny=false",
            f"run.output_dir={out}",
            "data.num_rows=512",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    (root,) = out.glob("tune-demo-*")
    tune = json.loads((root / "tune.json").read_text())
    measured = tune["measurements"]
    assert [(m["setting"]["schedule"], m["error"]) for m in measured] == [("overlapped", None), ("colocated", None)]
    assert all(m["tokens_per_s"] > 0 and 0 <= m["learner_idle"] <= 1 and 0 <= m["actor_idle"] <= 1 for m in measured)
    assert all(m["mismatch_kl"] < 1e-3 for m in measured)  # k = 0: the sampler's policy is the learner's (numerics)
    assert "k=0, between requests, 1:1" in printed and "k=0, between requests, 2:1, colocated" in printed  # the table
    assert "<- recommended" in printed and "train with: tandem train --config" in printed

    overrides = root / "overrides.yaml"
    cfg = load_config([str(DEMO), str(overrides)], [f"model.path={tiny_model_dir}"])
    fastest = max(measured, key=lambda m: m["tokens_per_s"])
    chosen = [m for m in measured if m["setting"]["schedule"] == cfg.run.schedule]
    assert chosen and chosen[0]["tokens_per_s"] >= 0.9 * fastest["tokens_per_s"]  # within the tie margin
    assert cfg.rollout.weight_update == "between_requests" and cfg.run.max_staleness == 0
    assert cfg.resources.actors.count == chosen[0]["setting"]["actors"]

    probes = sorted(Path(m["run_dir"]) for m in measured)
    for probe in probes:
        spans = [json.loads(line) for line in (probe / "timeline.jsonl").read_text().splitlines()]
        kinds = {(s["process"], s["kind"]) for s in spans}
        assert {
            ("actor-0", "generate"),
            *((("actor-1", "generate"),) if "colocated" in probe.name else ()),
            ("learner-0", "train"),
            ("learner-0", "publish"),
            ("driver", "wait_data"),
        } <= kinds
        published = sorted({s["version"] for s in spans if s["process"] == "learner-0"})
        assert published == [1, 2, 3, 4]  # each step's spans carry the version it produced
        assert all(s["start"] <= s["end"] for s in spans)
        assert not (probe / "model").exists()  # run.save_final: false in a probe

    report = tmp_path / "report"
    assert main(["report", *map(str, probes), "--out", str(report), "--trace"]) == 0
    seen = open_report(report / "report.html", ARTIFACTS / "report-real.png")
    assert seen["errors"] == [] and seen["requests"] == []
    assert seen["images"] and all(image["width"] > 0 for image in seen["images"])
    assert f"Timeline: {probes[0].name}" in seen["headings"]
    trace = json.loads((report / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"actor-0", "learner-0", "driver"} <= lanes
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == sum(
        len((p / "timeline.jsonl").read_text().splitlines()) for p in probes
    )
