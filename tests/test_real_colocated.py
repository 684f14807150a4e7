"""The colocated schedule on the real stack with in-flight updates: two vLLM actors and a two-core learner
rank share two cores (the between-requests case is ``tests/test_real_run.py``'s colocated learning run).

A short ``tandem train`` run with ``max_staleness`` 2: the run's own timeline shows that no actor generated
while a learner rank scored or trained, every trained token is within ``max_staleness`` and each step's
staleness is its place in its phase (a phase of k + 1 steps is generated with one policy), and only each
phase's last version was published.
"""

from __future__ import annotations

import pytest

from tests.runs import COLOCATED, DEMO, overlapping, read_metrics, read_spans, train

pytestmark = pytest.mark.slow


def test_colocated_actors_and_learner_take_turns_with_inflight_updates(tmp_path, tiny_model_dir, capsys):
    steps, k = 9, 2
    runs = tmp_path / "runs"
    code = train(
        DEMO, tiny_model_dir, runs, f"run.steps={steps}", f"run.max_staleness={k}", "rollout.weight_update=inflight",
        "rollout.prompts_per_request=8", *COLOCATED,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    metrics = read_metrics(runs)
    assert [m["step"] for m in metrics] == list(range(steps))
    assert [m["staleness_max"] for m in metrics] == [i % (k + 1) for i in range(steps)]  # phases of k + 1 steps

    spans = read_spans(runs)
    assert {s["process"] for s in spans if s["kind"] == "generate"} == {"actor-0", "actor-1"}  # both engines
    assert overlapping(spans, ("generate",), ("score", "train")) == []  # never beside the learner's work
    publishes = [s for s in spans if s["kind"] == "publish"]
    assert len(publishes) == -(-steps // (k + 1))  # the phases' last versions, not every step's
