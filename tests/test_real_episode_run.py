"""A multi-turn run on the real stack, killed and resumed: every episode is trained once, none is lost.

The tiny chat model (random weights, the tool template) plays two-turn episodes against an environment
that answers every first turn and scores the second by its length's parity (so groups differ and every
step trains). In-flight weight updates with staleness 1: episodes are in flight when the driver is
killed (SIGKILL to its whole process group, as a node loss would); ``tandem train --resume`` finishes
the run from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli import main
from tests.runs import read_metrics
from tests.test_real_recovery import assert_nothing_left, final_state, trained_ids, wait_for_steps

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "configs" / "examples" / "tools.yaml"
ENV = """
from actors.environments import Environment, StepResult

class TwoTurns(Environment):
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action_text):
        if not hasattr(self, "seen"):
            self.seen = True
            return StepResult("go on")
        return StepResult(reward=float(len(action_text) % 2), done=True)
"""


def test_a_killed_multi_turn_run_resumes_and_trains_every_episode_once(tmp_path):
    from actors.lookup_task import TOOLS_CHAT_TEMPLATE
    from actors.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "chat", chat=True, chat_template=TOOLS_CHAT_TEMPLATE)
    (tmp_path / "env.py").write_text(ENV)
    out = tmp_path / "runs"
    overrides = [
        f"model.path={model}",
        f"run.output_dir={out}",
        f"rollout.episode.environment={tmp_path / 'env.py'}:TwoTurns",
        "rollout.episode.turn_max_tokens=12",
        "rollout.max_tokens=120",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.weight_update=inflight",
        "algorithm.filtering.groups=none",
        "eval.every=0",
        "run.steps=6",
        "run.checkpoint_every=2",
        "run.log_samples=2",
        "run.max_staleness=1",
    ]
    args = [sys.executable, "-m", "launch.cli", "train", "--config", str(TOOLS), *overrides]
    log = (tmp_path / "driver.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    root = wait_for_steps(out, 3, proc, timeout=300)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert main(["train", "--resume", str(root)]) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(6))
    ids, ledger = trained_ids(out), final_state(root)["ledger"]
    assert len(ids) == 6 * 4 and len(set(ids)) == len(ids)  # no episode trained twice
    assert set(ids) | set(ledger["pending"]) == set(range(ledger["next_id"]))  # none lost
    assert all(m["episode/turns_mean"] == 2.0 for m in metrics), [m["episode/turns_mean"] for m in metrics]
    samples = [json.loads(x) for x in (root / "samples.jsonl").read_text().splitlines()]
    assert samples and all([t["role"] for t in s["turns"]] == ["model", "environment", "model"] for s in samples)
    assert_nothing_left(root)
