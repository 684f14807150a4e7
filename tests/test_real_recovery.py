"""Fault injection on the real stack: kill -9 of the driver, a generation actor or a learner rank,
and Ctrl-C, in real runs of the tiny model (Ray + vLLM + DeepSpeed).

What must hold: a resumed synchronous run is the same run (losses, prompts, final weights); with
k > 0 no prompt is trained twice and none is lost; a killed actor is replaced and the run finishes
every step; a killed learner rank is one line and the run resumes; a stop (Ctrl-C) leaves a
checkpoint, the model, summary.json and no process behind.

A reward function that sleeps 20 ms per call slows each step to about a second, so that a signal
lands mid-run; it does not change any reward.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.cli import main
from tests.runs import DEMO, read_metrics, run_dir, train

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BASE = ["rollout.prompts_per_step=8", "run.steps=8", "run.checkpoint_every=4", "run.log_samples=2"]


@pytest.fixture(scope="module")
def slow_reward(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "slow_reward.py"
    path.write_text(
        "import time\n"
        "from actors.rewards import load_reward_function\n"
        "task = load_reward_function('builtin:successor')\n"
        "def reward(prompt, completion, row):\n"
        "    time.sleep(0.02)\n"
        "    return task(prompt, completion, row)\n"
    )
    return f"reward.function={path}:reward"


def spawn(out: Path, model_dir: str, *overrides: str) -> subprocess.Popen:
    """``tandem train`` as a separate driver process (so that it can be killed)."""
    args = [sys.executable, "-m", "launch.cli", "train", "--config", str(DEMO), f"model.path={model_dir}"]
    args += ["model.build_tiny=false", f"run.output_dir={out}", *overrides]
    log = (out.parent / f"{out.name}-driver.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_steps(out: Path, steps: int, proc: subprocess.Popen | None = None, timeout: float = 240) -> Path:
    """Wait until the run under ``out`` has logged ``steps`` steps; its run directory."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = list(out.glob("*/metrics.jsonl"))
        if metrics and len(metrics[0].read_text().splitlines()) >= steps:
            return metrics[0].parent
        assert proc is None or proc.poll() is None, f"the run ended early: {proc.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"{steps} steps not logged within {timeout}s")


def kill_when(out: Path, steps: int, process: str, sig=signal.SIGKILL) -> threading.Thread:
    """In the background: once ``steps`` steps are logged, send ``sig`` to ``process`` of the run."""

    def go():
        root = wait_for_steps(out, steps)
        pid = json.loads((root / "processes.json").read_text())[process]["pid"]
        os.kill(pid, sig)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _holders(directory: Path) -> list[int]:
    """Live processes holding a file under ``directory`` open (the run's actors and ranks write
    their logs there)."""
    holders = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or not _alive(int(entry)):
            continue
        try:
            links = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:
            continue
        if any(link.startswith(str(directory)) for link in links):
            holders.append(int(entry))
    return holders


def assert_nothing_left(root: Path, timeout: float = 30) -> None:
    pids = [p["pid"] for p in json.loads((root / "processes.json").read_text()).values()]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and ([p for p in pids if _alive(p)] or _holders(root)):
        time.sleep(0.5)
    assert not [p for p in pids if _alive(p)] and not _holders(root), "processes of the run are left"


def trained_ids(out: Path) -> list[int]:
    return [i for m in read_metrics(out) for i in m["prompt_ids"]]


def final_state(root: Path) -> dict:
    newest = max((root / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((newest / "state.json").read_text())


def weights(root: Path) -> dict[str, torch.Tensor]:
    return load_file(root / "model" / "model.safetensors")


def test_synchronous_resume_after_kill_9_of_the_driver_is_the_same_run(tmp_path, tiny_model_dir, slow_reward, capsys):
    # a warm-up then cosine schedule: the resumed run must pick up its position too
    common = [*BASE, "run.max_staleness=0", "learner.lr_schedule=cosine", "learner.warmup_steps=2", slow_reward]
    one_go = tmp_path / "one-go"
    assert train(DEMO, tiny_model_dir, one_go, *common) == 0

    killed = tmp_path / "killed"
    proc = spawn(killed, tiny_model_dir, *common)
    root = wait_for_steps(killed, 6, proc)  # steps 0-5 trained; the checkpoint is of step 4
    proc.kill()
    proc.wait(timeout=30)
    assert_nothing_left(root)
    capsys.readouterr()
    assert main(["train", "--resume", str(root)]) == 0
    assert f"resumed from {root / 'checkpoints' / 'step-4'} at step 4" in capsys.readouterr().out

    expected, got = read_metrics(one_go), read_metrics(killed)
    assert [m["step"] for m in got] == list(range(8))  # steps 4 and 5 were trained again, once each
    assert [m["prompt_ids"] for m in got] == [m["prompt_ids"] for m in expected]
    assert [m["learner/loss"] for m in got] == [m["learner/loss"] for m in expected]
    assert [m["learner/lr"] for m in got] == [m["learner/lr"] for m in expected]
    assert got[0]["learner/lr"] < got[1]["learner/lr"] > got[-1]["learner/lr"]  # warm-up, then decay
    assert [m["reward_mean"] for m in got] == [m["reward_mean"] for m in expected]
    a, b = weights(run_dir(one_go)), weights(root)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    samples = [json.loads(line) for line in (root / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [s // 2 for s in range(16)]  # two per step, none twice


# Ctrl-C, and SIGTERM to the driver's process group (kill -- -PGID; the driver is in it, as it is under a
# pod stop or scancel). Before Ray's own SIGTERM handler was undone, SIGTERM ended the run with rc -6.
STOPS = {"ctrl-c": (signal.SIGINT, False, 130), "sigterm-group": (signal.SIGTERM, True, 143)}


@pytest.mark.parametrize("stop", list(STOPS))
def test_a_stop_signal_to_an_asynchronous_run_checkpoints_leaves_no_process_and_resumes_every_prompt_once(
    tmp_path, tiny_model_dir, slow_reward, stop
):
    sig, group, code = STOPS[stop]
    out = tmp_path / "runs"
    proc = spawn(out, tiny_model_dir, *BASE, "run.max_staleness=2", "rollout.weight_update=inflight", slow_reward)
    root = wait_for_steps(out, 3, proc)
    if group:
        os.killpg(proc.pid, sig)  # the driver leads its own group here (spawn: start_new_session)
    else:
        proc.send_signal(sig)
    assert proc.wait(timeout=120) == code, (out.parent / f"{out.name}-driver.log").read_text()[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    done = len(read_metrics(out))
    assert summary["status"] == f"stopped ({sig.name})" and summary["steps"] == done < 8
    assert (root / "checkpoints" / f"step-{done}" / "manifest.json").is_file()
    assert (root / "model" / "model.safetensors").is_file()
    assert_nothing_left(root)
    if stop != "ctrl-c":
        return  # the stop left the same checkpoint; resuming it is the Ctrl-C case's (CI minutes)

    # prompts were in flight (k = 2) when it stopped: the resumed run trains each prompt once, loses none
    assert main(["train", "--resume", str(root)]) == 0
    ids, state = trained_ids(out), final_state(root)
    assert [m["step"] for m in read_metrics(out)] == list(range(8))
    assert len(ids) == 8 * 8 and len(set(ids)) == len(ids)  # none twice
    ledger = state["ledger"]
    assert set(ids) | set(ledger["pending"]) == set(range(ledger["next_id"]))  # none lost
    assert not set(ids) & set(ledger["pending"])


@pytest.mark.parametrize("weight_update", ["between_requests", "inflight"])
def test_a_killed_generation_actor_is_replaced_and_the_run_finishes(
    tmp_path, tiny_model_dir, slow_reward, weight_update, capsys
):
    out = tmp_path / "runs"
    overrides = [*BASE, "resources.actors.count=2", f"rollout.weight_update={weight_update}", slow_reward]
    killer = kill_when(out, 2, "actor-1")
    assert train(DEMO, tiny_model_dir, out, *overrides) == 0
    killer.join(timeout=5)
    captured = capsys.readouterr()
    said = captured.out
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(8))
    ids = trained_ids(out)
    assert len(set(ids)) == len(ids) == 64  # the prompts it held were generated again, once
    assert metrics[-1]["actor_restarts"] == 1
    assert "actor-1 stopped" in said and "restart 1 of 3" in said and "actor-1.log" in said
    assert "a signal killed it (kill -9, or the kernel's OOM killer" in said  # what happened, in words
    assert "A worker died or was killed" not in said + captured.err  # not Ray's paragraph, at every death


def test_a_dead_actor_on_the_distributed_channel_checkpoints_and_the_run_resumes_itself(
    tmp_path, tiny_model_dir, slow_reward, capsys
):
    out = tmp_path / "runs"
    killer = kill_when(out, 3, "actor-0")
    overrides = [*BASE, "weights.backend=distributed", "run.max_restarts=1", "run.max_staleness=0", slow_reward]
    assert train(DEMO, tiny_model_dir, out, *overrides) == 0
    killer.join(timeout=5)
    said = capsys.readouterr().out
    assert "resuming from" in said and "run.max_restarts: 1 of 1" in said
    ids = trained_ids(out)
    assert [m["step"] for m in read_metrics(out)] == list(range(8))
    assert len(set(ids)) == len(ids) == 64
    assert json.loads((run_dir(out) / "summary.json").read_text())["restarts"] == 1


def test_a_killed_learner_rank_is_one_line_and_the_run_resumes(tmp_path, tiny_model_dir, slow_reward, capsys):
    out = tmp_path / "runs"
    killer = kill_when(out, 3, "learner-0")
    assert train(DEMO, tiny_model_dir, out, *BASE, "run.checkpoint_every=2", slow_reward) == 2
    killer.join(timeout=5)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tandem: error:")]
    assert (
        len(errors) == 1
        and "learner-0 (node " in errors[0]
        and ") died: " in errors[0]
        and "logs/learner-0.log" in errors[0]
    )
    assert "ended without raising an error: a signal killed it" in errors[0]
    assert f"tandem train --resume {run_dir(out)}" in errors[0]
    assert main(["train", "--resume", str(run_dir(out))]) == 0
    assert [m["step"] for m in read_metrics(out)] == list(range(8))
    ids = trained_ids(out)
    assert len(set(ids)) == len(ids)
