"""A live run whose generation actor stalls or dies: the weight push names it within its deadline.

``tandem train`` with ``weights.backend=distributed`` and two vLLM actors; once a few steps
have trained, actor-1's process is frozen (SIGSTOP: alive to Ray, silent to the channel) or
killed (SIGKILL). The run must stop with an error naming actor-1, within the push deadline
plus shutdown, never hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.runs import DEMO, read_metrics, run_dir, train

pytestmark = pytest.mark.slow
PUSH_TIMEOUT_S = 5


def _freeze_after_steps(out_dir: Path, sig: int, steps: int, report: dict) -> None:
    """Wait (at most 5 min) for ``steps`` trained steps, then send ``sig`` to actor-1's process."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = list(out_dir.iterdir())
        metrics = runs[0] / "metrics.jsonl" if runs else None
        if metrics and metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            found = re.search(r"\[actor-1\] engine ready \(pid (\d+)", (runs[0] / "logs" / "actor-1.log").read_text())
            report["pid"] = int(found.group(1))
            os.kill(report["pid"], sig)
            report["sent_at"] = time.monotonic()
            return
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stalled", "dead"])
def test_a_stalled_or_dead_actor_stops_the_run_naming_it(tmp_path, tiny_model_dir, capsys, sig):
    report: dict = {}
    watcher = threading.Thread(target=_freeze_after_steps, args=(tmp_path, sig, 3, report), daemon=True)
    watcher.start()
    try:
        code = train(
            DEMO,
            tiny_model_dir,
            tmp_path,
            "run.steps=200",  # never reached: the run must fail first
            "resources.actors.count=2",
            "weights.backend=distributed",
            f"weights.push_timeout_s={PUSH_TIMEOUT_S}",
        )
        ended_at = time.monotonic()
    finally:
        if "pid" in report:
            try:
                os.kill(report["pid"], signal.SIGKILL)  # a frozen process must not outlive the test
            except ProcessLookupError:
                pass
    err = capsys.readouterr().err
    if "sent_at" in report:
        print(f"\n{sig.name}: stopped {ended_at - report['sent_at']:.1f}s after the signal:\n{err}")
    assert "sent_at" in report, "the run never reached step 3"
    assert code != 0
    assert "actor-1" in err, err
    error_lines = [line for line in err.splitlines() if line.startswith("tandem: error:")]
    assert len(error_lines) == 1 and "actor-1" in error_lines[0], err
    assert "Traceback" not in err.split("tandem: error:")[1], err  # one line, not the remote traceback
    assert "pair.cc" not in error_lines[0] and "GLHF" not in error_lines[0]  # gloo's location and advice left out
    if sig == signal.SIGSTOP:  # alive to Ray: only the channel's deadline can notice
        assert f"did not acknowledge within {PUSH_TIMEOUT_S}s" in err, err
    # the deadline plus start-up of the failing step and Ray's shutdown; a hang would take minutes
    assert ended_at - report["sent_at"] < PUSH_TIMEOUT_S + 60
    assert_checkpoint_is_of_its_step(run_dir(tmp_path))


def assert_checkpoint_is_of_its_step(root: Path) -> None:
    """The checkpoint written as the run stopped holds as many optimizer updates as it says steps, every
    logged step, and a ledger in which each prompt is trained (logged) or pending, never both or
    neither (issue 26, item 5: after a failed push it said step 5 and held 6 updates, and the failed
    step's prompts were neither trained nor pending after resume)."""
    newest = max((root / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    state = json.loads((newest / "state.json").read_text())
    metrics = read_metrics(root.parent)
    assert state["step"] == len(metrics), (state["step"], len(metrics))
    model_states = torch.load(
        newest / "deepspeed" / "policy" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
    )
    assert model_states["global_steps"] == state["step"]
    trained = [i for m in metrics for i in m["prompt_ids"] + m.get("filtered_prompt_ids", [])]
    ledger = state["ledger"]
    assert len(trained) == len(set(trained)) and not set(trained) & set(ledger["pending"])
    assert set(trained) | set(ledger["pending"]) == set(range(ledger["next_id"]))
