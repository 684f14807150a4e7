"""The colocated schedule on the real stack: two vLLM actors and a two-core learner rank share two cores.

A short ``tandem train`` run per weight-update mode, with ``max_staleness`` 1 or 2: the run's own
timeline shows that no actor generated while a learner rank scored or trained, every trained token is
within ``max_staleness`` (and some are that old: a phase of k + 1 steps was generated with one policy),
and only each phase's last version was published.
"""

from __future__ import annotations

import json

import pytest

from tests.runs import DEMO, read_metrics, run_dir, train

pytestmark = pytest.mark.slow

COLOCATED = (
    "run.schedule=colocated",
    "resources.actors.count=2",
    "resources.learner.num_cpus=2",
    "rollout.prompts_per_request=8",
)


def overlaps(spans: list[dict], a: tuple[str, ...], b: tuple[str, ...]) -> list[tuple[dict, dict]]:
    """Pairs of spans, one of kind ``a`` and one of kind ``b``, whose times intersect."""
    first = [s for s in spans if s["kind"] in a]
    second = [s for s in spans if s["kind"] in b]
    return [(x, y) for x in first for y in second if x["start"] < y["end"] and y["start"] < x["end"]]


@pytest.mark.parametrize(("k", "weight_update"), [(1, "between_requests"), (2, "inflight")])
def test_colocated_actors_and_learner_take_turns(k, weight_update, tmp_path, tiny_model_dir, capsys):
    steps = 9
    runs = tmp_path / "runs"
    code = train(
        DEMO, tiny_model_dir, runs, f"run.steps={steps}", f"run.max_staleness={k}",
        f"rollout.weight_update={weight_update}", *COLOCATED,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    metrics = read_metrics(runs)
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(m["staleness_max"] <= k for m in metrics)
    assert [m["staleness_max"] for m in metrics] == [i % (k + 1) for i in range(steps)]  # phases of k + 1 steps

    spans = [json.loads(line) for line in (run_dir(runs) / "timeline.jsonl").read_text().splitlines()]
    actors = {s["process"] for s in spans if s["kind"] == "generate"}
    assert actors == {"actor-0", "actor-1"}  # both engines generated
    assert overlaps(spans, ("generate",), ("score", "train")) == []  # never beside the learner's work
    publishes = [s for s in spans if s["kind"] == "publish"]
    assert len(publishes) == -(-steps // (k + 1))  # the phases' last versions, not every step's
