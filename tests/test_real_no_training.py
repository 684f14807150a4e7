"""Runs that train nothing say so and stop, on the real stack (Ray, vLLM, DeepSpeed).

Two ways a new user met a run that trained 0 tokens on every step and ended with rc 0: an environment
whose every episode fails (here its ``step`` raises), and a ``tis.reject`` rule that rejects every token.
Each run here must say on its console what failed (the environment's own error text; the rule), write it
to samples.jsonl and summary.json, and stop after ``run.max_empty_steps`` such steps with rc 2 (a run
that cannot learn).
"""

from __future__ import annotations

import json

import pytest

from tests.runs import DEMO, read_summary, run_dir, train

pytestmark = pytest.mark.slow

FAILING_ENV = """
from actors.environments import Environment, StepResult

class Broken(Environment):
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action_text):
        raise RuntimeError("the sandbox is gone")
"""
TOOLS = DEMO.parent / "examples" / "tools.yaml"


def test_episodes_that_all_fail_are_said_with_the_environments_error_and_stop_the_run(tmp_path):
    from actors.lookup_task import TOOLS_CHAT_TEMPLATE
    from actors.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "chat", chat=True, chat_template=TOOLS_CHAT_TEMPLATE)
    (tmp_path / "env.py").write_text(FAILING_ENV)
    out = tmp_path / "runs"
    code = train(
        TOOLS,
        str(model),
        out,
        f"rollout.episode.environment={tmp_path / 'env.py'}:Broken",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.episode.turn_max_tokens=8",
        "eval.prompts=null",  # no held-out rounds: the run is about its training steps
        "eval.every=0",
        "run.steps=6",
        "run.max_empty_steps=2",
    )
    assert code == 2  # a run that cannot learn is a user error: rc 2, one line
    root = run_dir(out)
    log = (root / "logs" / "driver.log").read_text()
    assert (
        "step 1: 4 of 4 episodes were ended by their environment (error 4) and train no token; "
        "error: RuntimeError: the sandbox is gone" in log
    ), log[-3000:]
    assert "step 1 trained 0 tokens: every episode was ended by its environment (error 100%)" in log
    assert "no token was trained for 2 steps in a row (run.max_empty_steps)" in log
    samples = [json.loads(x) for x in (root / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["end"] == "error" and "the sandbox is gone" in s["detail"] for s in samples)
    summary = read_summary(out)
    assert summary["status"] == "failed" and "the sandbox is gone" in summary["error"]


def test_a_rejection_rule_that_drops_every_token_is_said_and_stops_the_run(tmp_path, tiny_model_dir):
    out = tmp_path / "runs"
    code = train(
        DEMO,
        tiny_model_dir,
        out,
        "algorithm.tis.reject=[{level: token, divergence: k2, low: 1.0}]",  # keeps only k2 >= 1: nothing
        "rollout.prompts_per_step=8",
        "run.steps=6",
        "run.max_empty_steps=2",
        "run.checkpoint_every=1",
    )
    assert code == 2  # a run that cannot learn is a user error: rc 2, one line
    log = (run_dir(out) / "logs" / "driver.log").read_text()
    assert "step 1 trained 0 tokens: algorithm.tis.reject rejected all" in log, log[-3000:]
    assert "(by rule: token_k2 100%); widen the rules' low/high bounds or remove a rule" in log
    assert "no token was trained for 2 steps in a row (run.max_empty_steps)" in log
    summary = read_summary(out)
    assert summary["status"] == "failed"
    # a failed run's summary names the checkpoint a resume would start from (issue 38: it said null)
    newest = max((run_dir(out) / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert summary["last_checkpoint"] == str(newest)
    # what each process chose is on record (issue 37): the learner's kernel on the console, the engine's in
    # processes.json (the CPU's vLLM: async scheduling off, model runner V1, the configured 1 GiB of KV cache)
    assert "learner: sdpa attention (bool mask)" in log
    processes = json.loads((run_dir(out) / "processes.json").read_text())
    engine = processes["actor-0"]
    assert (engine["async_scheduling"], engine["model_runner"], engine["kv_cache_bytes"]) == (False, "V1", 1 << 30)
    assert processes["learner-0"]["attention"] == "sdpa attention (bool mask)"
