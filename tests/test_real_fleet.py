"""The elastic generation fleet on a real multi-node Ray cluster on this machine (``runtime/fleet.py``).

The head offers one ``gen`` slot (the resource every generation actor asks for) and room for the learner; a
run starts on it with one actor. Then, with the run going:
  1. ``tandem scale RUN --actors 2``: no node has a free ``gen`` slot, so actor-1 waits until a second node
     joins the cluster with one, and starts there without a restart;
  2. actor-1's process is killed: it is replaced (its prompts generated again);
  3. the second node is lost (its raylet and every process on it killed): actor-1 cannot start again
     anywhere, so it leaves the fleet, and the run goes on with actor-0;
  4. ``--actors 2`` again with no room: said, the run goes on; then it is stopped (SIGTERM).
Prompt ids: every prompt admitted is trained exactly once or pending in the final checkpoint.

The cluster is this test's own (temp dir, free ports, its own token under a temp HOME), stopped by killing its
processes only, as in ``tests/test_real_submit.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.runs import DEMO, read_metrics
from tests.test_real_cluster_auth import RAY_VARS, _ray_auth
from tests.test_real_recovery import final_state, trained_ids, wait_for_steps
from tests.test_real_submit import _free_ports, _stop_cluster

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"the run ended early ({proc.returncode}): {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{text!r} not said within {timeout:.0f}s: {log.read_text()[-3000:]}"
        time.sleep(0.3)


def _node_processes(resource: str) -> list[int]:
    """The raylet of the node that offers the custom ``resource`` and every process below it (its workers)."""
    raylets = [
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit() and "/raylet " in _cmdline(pid) and f",{resource},1" in _cmdline(pid)
    ]
    assert raylets, f"no raylet offers {resource}"
    found, todo = list(raylets), list(raylets)
    while todo:
        parent = todo.pop()
        for pid in os.listdir("/proc"):
            if pid.isdigit() and _ppid(pid) == parent:
                found.append(int(pid))
                todo.append(int(pid))
    return found


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_actors_join_and_leave_a_running_job_and_every_prompt_is_trained_once(tmp_path, tiny_model_dir):
    temp_dir = tempfile.mkdtemp(prefix="tnd-", dir="/tmp")  # short: Ray's socket paths have a length limit
    base = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
    base.update(RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    ray_auth = _ray_auth(tmp_path / "home", base)
    gcs, dashboard, client, agent = _free_ports(4)
    proc = None
    try:
        start = [*ray_auth, str(BIN / "ray"), "start", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        head = subprocess.run(
            [*start, "--head", f"--port={gcs}", "--num-cpus=4", '--resources={"gen": 1}',
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
             f"--dashboard-agent-listen-port={agent}"],
            env=base, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert head.returncode == 0, head.stdout + head.stderr
        import ray._private.services as services

        address = f"{services.get_node_ip_address()}:{gcs}"
        out = tmp_path / "runs"
        reward = tmp_path / "slow_reward.py"
        reward.write_text(
            "import time\nfrom actors.rewards import load_reward_function\n"
            "task = load_reward_function('builtin:successor')\n"
            "def reward(prompt, completion, row):\n    time.sleep(0.03)\n    return task(prompt, completion, row)\n"
        )
        train = [*ray_auth, sys.executable, "-m", "launch.cli", "train", "--config", str(DEMO)]
        train += [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"run.output_dir={out}"]
        train += [f"resources.address={address}", "resources.actors.custom={gen: 1}", "resources.actors.num_cpus=1"]
        train += ["rollout.prompts_per_step=8", "run.steps=100", "run.max_staleness=1", "run.checkpoint_every=10"]
        train += ["run.startup_timeout_s=45", "run.log_samples=0", f"reward.function={reward}:reward"]
        log = tmp_path / "driver.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(train, cwd=ROOT, env=base, stdout=sink, stderr=subprocess.STDOUT)
        root = wait_for_steps(out, 2, proc, timeout=240)

        def scale(n: int) -> None:
            done = subprocess.run(
                [sys.executable, "-m", "launch.cli", "scale", str(root), f"--actors={n}"],
                cwd=ROOT, env=base, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr

        # 1. a second actor is asked for; it starts once a node with room joins
        scale(2)
        _wait_for(log, "fleet: 1 -> 2 generation actors (tandem scale)", proc)
        time.sleep(3)
        assert "fleet: 2 generation actors" not in log.read_text()  # no room yet: it waits
        node = subprocess.run(
            [*start, f"--address={address}", "--num-cpus=2", '--resources={"gen": 1, "spot": 1}'],
            env=base, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert node.returncode == 0, node.stdout + node.stderr
        _wait_for(log, "fleet: 2 generation actors (actor-0, actor-1)", proc)
        placed = json.loads((root / "processes.json").read_text())
        assert placed["actor-1"]["node"] != placed["actor-0"]["node"]  # on the node that joined

        # 2. the joined actor is killed: replaced on its node
        os.kill(placed["actor-1"]["pid"], signal.SIGKILL)
        _wait_for(log, "actor-1 stopped:", proc)
        _wait_for(log, "restart 1 of", proc)
        deadline = time.monotonic() + 120
        while json.loads((root / "processes.json").read_text())["actor-1"]["pid"] == placed["actor-1"]["pid"]:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)  # the new one is up

        # 3. the node is lost: actor-1 has nowhere to go and leaves; the run goes on
        for pid in _node_processes("spot"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait_for(log, "fleet: actor-1 could not be started again", proc, timeout=240)

        # 4. asked for 2 again with no room: said, and the run goes on with actor-0 until it is stopped
        scale(2)
        _wait_for(log, "fleet: actor-2 did not join", proc, timeout=240)
        done = len(read_metrics(out))
        wait_for_steps(out, done + 2, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
        assert "Traceback" not in log.read_text()
        ids, ledger = trained_ids(out), final_state(root)["ledger"]
        assert len(ids) == len(set(ids)) == 8 * len(read_metrics(out))  # none twice
        assert set(ids) | set(ledger["pending"]) == set(range(ledger["next_id"]))  # none lost
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
