"""Every way a run is stopped from outside, on the real stack, and Ray's own processes dying under it.

A stop by signal finishes or abandons the step, checkpoints, writes model/ and summary.json, exits 143
and leaves no process; every prompt admitted so far is either trained or pending in the checkpoint's
ledger (a resume generates those again: ``tests/test_real_recovery.py`` resumes one). Where the signal
goes is what differs:
  - ``driver``: the driver alone (``kill PID``);
  - ``group``: the driver's process group (``kill -- -PGID``, a pod stop under ``tini -g``), which holds
    Ray's GCS server and raylet and, through them, every worker; ``group-twice`` sends it twice, as
    schedulers do;
  - ``every``: every process of the run, one by one (what ``scancel`` and systemd do: the whole job's
    cgroup). Before Ray's processes held SIGTERM blocked, this ended a colocated run in its generation
    phase with ``actor 0 could not sleep: ActorUnavailableError``, no checkpoint and no model.
The cases cover each schedule (overlapped, colocated), each weight update (between requests, in
flight), LoRA and episodes at least once; the overlapped in-flight run under ``group`` and Ctrl-C is
``tests/test_real_recovery.py``'s.

Ray's own processes killed (SIGKILL) mid-run: the GCS server, or the raylet of the driver's node. Each
is one line naming it, a checkpoint of the learner's state, model/, summary.json ``failed``, exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import test_real_recovery
from tests.runs import read_metrics
from tests.test_real_episode_run import ENV  # the two-turn environment of the episode resume test
from tests.test_real_recovery import (
    _alive,
    assert_nothing_left,
    final_state,
    spawn,
    trained_ids,
    wait_for_steps,
)

pytestmark = pytest.mark.slow
slow_reward = test_real_recovery.slow_reward  # the fixture: a reward that sleeps 20 ms per call

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "configs" / "examples" / "tools.yaml"
BASE = ["rollout.prompts_per_step=8", "run.steps=10", "run.checkpoint_every=4", "run.log_samples=2"]
LORA = ["learner.lora.rank=8", "learner.lora.alpha=16"]

# case: (overrides, where the SIGTERM goes, episodes)
CASES = {
    "colocated-between-every": (["run.schedule=colocated", "run.max_staleness=1"], "every", False),
    "colocated-inflight-group-twice": (
        ["run.schedule=colocated", "run.max_staleness=1", "rollout.weight_update=inflight"],
        "group-twice",
        False,
    ),
    "overlapped-between-lora-every": (["run.max_staleness=1", *LORA], "every", False),
    "overlapped-inflight-episodes-driver": (["run.max_staleness=1", "rollout.weight_update=inflight"], "driver", True),
}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    from actors.lookup_task import TOOLS_CHAT_TEMPLATE
    from actors.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("chat") / "chat", chat=True, chat_template=TOOLS_CHAT_TEMPLATE))


def spawn_episodes(tmp_path: Path, out: Path, model: str, *overrides: str) -> subprocess.Popen:
    """A two-turn episode run of the tools example's config, as a separate driver process."""
    (tmp_path / "env.py").write_text(ENV)
    args = [sys.executable, "-m", "launch.cli", "train", "--config", str(TOOLS), f"model.path={model}"]
    args += [f"run.output_dir={out}", f"rollout.episode.environment={tmp_path / 'env.py'}:TwoTurns"]
    args += ["rollout.episode.turn_max_tokens=12", "rollout.max_tokens=120", "rollout.prompts_per_step=4"]
    args += ["rollout.group_size=4", "algorithm.filtering.groups=none", "eval.every=0", "run.steps=10"]
    args += ["run.checkpoint_every=4", "run.log_samples=2", *overrides]
    log = (out.parent / f"{out.name}-driver.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (its children, theirs, ...): Ray's processes and the run's workers."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def send_sigterm(proc: subprocess.Popen, where: str) -> int:
    """SIGTERM to the run as ``where`` says; how many processes it went to."""
    if where == "driver":
        proc.send_signal(signal.SIGTERM)
        return 1
    if where.startswith("group"):
        os.killpg(proc.pid, signal.SIGTERM)  # the driver leads its own group here (start_new_session)
        if where == "group-twice":
            time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGTERM)
        return len(descendants(proc.pid)) + 1
    targets = [proc.pid, *descendants(proc.pid)]
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return len(targets)


def assert_gone_when_it_returns(root: Path) -> None:
    """No actor or learner rank of the run outlives the command (they had by up to 5 s)."""
    pids = {name: p["pid"] for name, p in json.loads((root / "processes.json").read_text()).items()}
    assert not [name for name, pid in pids.items() if _alive(pid)]


def driver_log(out: Path) -> str:
    return (out.parent / f"{out.name}-driver.log").read_text()


def assert_every_prompt_trained_or_pending(out: Path, root: Path) -> None:
    """No prompt trained twice; every prompt admitted is trained or pending in the newest checkpoint."""
    ids, ledger = trained_ids(out), final_state(root)["ledger"]
    assert len(ids) == len(set(ids))
    assert set(ids) | set(ledger["pending"]) == set(range(ledger["next_id"]))
    assert not set(ids) & set(ledger["pending"])


@pytest.mark.parametrize("case", list(CASES))
def test_a_sigterm_stops_every_schedule_with_a_checkpoint_and_leaves_nothing(
    tmp_path, tiny_model_dir, chat_model, slow_reward, case
):
    overrides, where, episodes = CASES[case]
    out = tmp_path / "runs"
    if episodes:
        proc = spawn_episodes(tmp_path, out, chat_model, *overrides)
    else:
        proc = spawn(out, tiny_model_dir, *BASE, slow_reward, *overrides)
    root = wait_for_steps(out, 2, proc)
    time.sleep(0.3)  # colocated: the next generation phase has begun
    reached = send_sigterm(proc, where)
    assert proc.wait(timeout=150) == 143, driver_log(out)[-3000:]
    assert where == "driver" or reached > 4  # the signal reached Ray's processes and the workers too
    summary = json.loads((root / "summary.json").read_text())
    done = len(read_metrics(out))
    assert summary["status"] == "stopped (SIGTERM)" and summary["steps"] == done < 10
    assert (root / "checkpoints" / f"step-{done}" / "manifest.json").is_file()
    assert (root / "model" / "config.json").is_file()
    assert_gone_when_it_returns(root)
    assert_every_prompt_trained_or_pending(out, root)
    assert_nothing_left(root)
    assert "Traceback" not in driver_log(out)


@pytest.mark.parametrize("process", ["gcs_server", "raylet"])
def test_ray_s_own_process_killed_is_one_line_with_a_checkpoint(tmp_path, tiny_model_dir, slow_reward, process):
    out = tmp_path / "runs"
    proc = spawn(out, tiny_model_dir, *BASE, slow_reward, "run.max_staleness=1")
    root = wait_for_steps(out, 2, proc)
    children = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(proc.pid)], capture_output=True, text=True)
    pid = next(int(line.split()[0]) for line in children.stdout.splitlines() if line.split()[1:] == [process])
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=150) == 2, driver_log(out)[-3000:]
    log = driver_log(out)
    errors = [line for line in log.splitlines() if line.startswith("tandem: error:")]
    what = "Ray's GCS server" if process == "gcs_server" else "the raylet of the driver's node"
    assert len(errors) == 1 and f"{what} (pid {pid}) was killed by SIGKILL" in errors[0], log[-3000:]
    assert "resume with: tandem train --resume" in errors[0]
    assert "state-dump" not in log and "Traceback" not in log  # Ray's dump of the raylet's log stays out
    summary = json.loads((root / "summary.json").read_text())
    done = len(read_metrics(out))
    assert summary["status"] == "failed" and summary["error"] == errors[0].removeprefix("tandem: error: ")
    assert summary["last_checkpoint"].endswith(f"step-{done}")  # the learner's state after the last step
    assert (root / "model" / "config.json").is_file()
    assert_every_prompt_trained_or_pending(out, root)
    assert_nothing_left(root)


def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, tiny_model_dir):
    """The run directory on a 6 MB filesystem (a tmpfs in a mount namespace of its own): the step-2
    checkpoint (3.8 MB) fits, step-4's does not."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (a private mount namespace) is not allowed here")
    mount, kept = tmp_path / "small", tmp_path / "kept"
    mount.mkdir()
    train = [sys.executable, "-m", "launch.cli", "train", "--config", str(ROOT / "configs" / "demo.yaml")]
    train += [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.output_dir={mount}/runs"]
    train += ["run.steps=8", "run.checkpoint_every=2", "run.log_samples=2"]
    script = 'mount -t tmpfs -o size=6m tmpfs "$1" && shift 2 && "$@"; rc=$?; cp -r "$0/runs" "$KEPT"; exit $rc'
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KEPT": str(kept)}
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, str(mount), str(mount), "--", *train],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    console = done.stdout + done.stderr
    assert done.returncode == 2, console[-3000:]
    errors = [line for line in console.splitlines() if line.startswith("tandem: error:")]
    assert len(errors) == 1 and "Traceback" not in console, console[-3000:]
    assert errors[0].startswith("tandem: error: disk full: checkpoint step-4 could not be written to ")
    assert "free on that filesystem; it needs about 3." in errors[0]  # the step-2 checkpoint's size, MB
    root = next(kept.glob("*"))
    summary = json.loads((root / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == errors[0].removeprefix("tandem: error: ")
    assert summary["last_checkpoint"].endswith("step-2") and summary["steps"] == 4
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step-2"]  # no half-written step-4
    assert "disk full" in (root / "logs" / "driver.log").read_text()
