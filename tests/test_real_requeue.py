"""A requeued job on the real stack: the same ``tandem train --config F --resume auto`` command line run three
times, as SLURM's requeue or a Kubernetes retry runs it, on the tiny model (Ray + vLLM + DeepSpeed).

The first start is stopped by SIGTERM to its process group (a preemption, ``scancel``, a pod stop), the second
continues that run to its end, the third finds it complete and trains nothing. What must hold: one run
directory, every prompt of the data order trained exactly once across the segments, the final summary
completed with every step, rc 143 for the stopped start and 0 for the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_real_recovery
from tests.runs import DEMO, read_metrics, run_dir
from tests.test_real_recovery import final_state, trained_ids, wait_for_steps

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
slow_reward = test_real_recovery.slow_reward  # the fixture: a reward that sleeps 20 ms, so a signal lands mid-run


def test_the_same_command_three_times_stopped_then_resumed_then_complete(tmp_path, tiny_model_dir, slow_reward):
    out = tmp_path / "runs"
    command = [sys.executable, "-m", "launch.cli", "train", "--config", str(DEMO), "--resume", "auto",
               f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.output_dir={out}",
               f"run.steps={STEPS}", "rollout.prompts_per_step=8", "run.log_samples=2", slow_reward]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def start(segment: int) -> subprocess.Popen:
        log = (tmp_path / f"segment-{segment}.log").open("w")
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def said(segment: int) -> str:
        return (tmp_path / f"segment-{segment}.log").read_text()

    first = start(1)
    root = wait_for_steps(out, 2, first)
    os.killpg(first.pid, signal.SIGTERM)  # the driver leads its own group (start_new_session)
    assert first.wait(timeout=120) == 143, said(1)[-3000:]
    stopped = json.loads((root / "summary.json").read_text())
    assert stopped["status"] == "stopped (SIGTERM)" and 2 <= stopped["steps"] < STEPS
    assert f"--resume auto: no run named 'demo' under {out}; starting a new one" in said(1)

    second = start(2)
    assert second.wait(timeout=300) == 0, said(2)[-3000:]
    assert f"--resume auto: resuming {root} (stopped (SIGTERM); newest checkpoint step {stopped['steps']})" in said(2)

    third = start(3)
    assert third.wait(timeout=120) == 0, said(3)[-3000:]
    assert f"--resume auto: {root} completed its {STEPS} steps; nothing to train" in said(3)
    assert "starting" not in said(3)  # no Ray, no actors: nothing trained

    assert run_dir(out) == root  # one run directory
    summary = json.loads((root / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert [m["step"] for m in read_metrics(out)] == list(range(STEPS))
    ids, ledger = trained_ids(out), final_state(root)["ledger"]
    assert len(ids) == STEPS * 8 and len(set(ids)) == len(ids)  # none twice across the segments
    assert set(ids) | set(ledger["pending"]) == set(range(ledger["next_id"]))  # none lost
