"""``tandem submit`` against a real Ray cluster: ``ray start --head`` with its job server, a short demo run
submitted as a Ray job from the repository, its logs followed until the job ends.

The cluster is this test's own: a fresh temp dir (short, as Ray's socket paths must be) and free ports, and
it is stopped by killing only the processes that name that temp dir, and their children. ``ray stop`` is
not used: it stops every Ray process on the machine, other tests' and sessions' included.

The cluster uses token auth, as ``ray start`` does on any machine where a Ray token exists; the submitting
process has the token but not ``RAY_AUTH_MODE``, the usual case on the head node.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the environment running the tests: its `ray`, its `python`
RAY_VARS = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
START_TIMEOUT_S = 120
SUBMIT_TIMEOUT_S = 300  # the job's own deadline (tandem submit --timeout); the subprocess gets a bit more


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports nothing listens on now (held open together so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE  # nobody may reap an orphan
    except psutil.Error:
        return False


def _stop_cluster(temp_dir: str, deadline_s: float = 10) -> None:
    """Stop this cluster only: every process whose command line names ``temp_dir`` (GCS, raylet, dashboard,
    monitors) and their descendants (workers, whose titles no longer name it, and the job's driver).

    SIGKILL, as ``ray stop --force`` sends: the GCS ignores SIGTERM for many seconds, and a throwaway cluster
    has nothing to save. Waits (bounded) until they are gone, so the temp dir can go too.
    """
    import psutil

    procs = set()
    for proc in psutil.process_iter(["cmdline"]):
        if any(arg.endswith(temp_dir) or f"{temp_dir}/" in arg for arg in proc.info["cmdline"] or ()):
            procs.add(proc)
            try:
                procs.update(proc.children(recursive=True))
            except psutil.Error:
                pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + deadline_s
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster with its job server; yields (dashboard URL, env for the submitting process)."""
    temp_dir = tempfile.mkdtemp(prefix="tnd-", dir="/tmp")
    token = Path(temp_dir) / "auth_token"
    token.write_text(secrets.token_hex(32))
    base = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
    # `python` on the PATH `ray start` ran with is what runs the job: start it as from an activated venv.
    ray_env = {
        **base,
        "PATH": f"{BIN}{os.pathsep}{base.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    gcs, dashboard, client, agent = _free_ports(4)
    try:
        started = subprocess.run(
            [str(BIN / "ray"), "start", "--head", f"--port={gcs}", f"--dashboard-port={dashboard}",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
             "--dashboard-host=127.0.0.1", "--num-cpus=2", "--include-dashboard=true", f"--temp-dir={temp_dir}",
             "--disable-usage-stats"],
            env=ray_env, capture_output=True, text=True, timeout=START_TIMEOUT_S,
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"http://127.0.0.1:{dashboard}", {**base, "RAY_AUTH_TOKEN_PATH": str(token)}
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(env: dict[str, str], address: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """``tandem submit`` as a user types it in the checkout: the default working dir ``.`` is uploaded."""
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "submit", "--config", "configs/demo.yaml", "--address", address,
         "--timeout", str(SUBMIT_TIMEOUT_S), *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S + 60,
    )  # fmt: skip


def test_submit_runs_the_demo_as_a_ray_job(ray_cluster, tmp_path, tiny_model_dir):
    address, env = ray_cluster
    out_dir = tmp_path / "runs"
    done = _submit(
        env,
        address,
        [f"model.path={tiny_model_dir}", "model.build_tiny=false", "run.steps=3", "rollout.prompts_per_step=8",
         f"run.output_dir={out_dir}"],
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    job_id = done.stdout.split("submitted job ", 1)[1].split()[0]
    assert job_id.startswith("raysubmit_"), log
    assert f"to {address}: python -m launch.cli train --config configs/demo.yaml resources.address=auto" in log
    assert "step    3/3 | reward" in log and "completed in" in log  # the job's own output, streamed back
    assert f"job {job_id}: SUCCEEDED" in log
    (run_dir,) = out_dir.iterdir()  # the absolute run.output_dir, written by the job's driver
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_a_job_that_fails_on_the_cluster_exits_nonzero(ray_cluster, tmp_path, tiny_model_dir):
    """Valid config, impossible plan: only the cluster knows it has 2 CPUs, so the job itself refuses."""
    address, env = ray_cluster
    done = _submit(
        env,
        address,
        [f"model.path={tiny_model_dir}", "model.build_tiny=false", "resources.actors.count=3",
         f"run.output_dir={tmp_path}"],
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert "4 CPUs asked (3 actors x 1 + " in log and "2 available" in log  # the job's own error, streamed
    assert ": FAILED" in log


def test_a_wrong_token_is_refused_in_one_line(ray_cluster):
    address, env = ray_cluster
    done = _submit({**env, "RAY_AUTH_TOKEN": "not-the-token"}, address, [])
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"tandem: error: the Ray job server at {address} refused the request" in done.stderr
    assert "Traceback" not in done.stderr and "submitted job" not in done.stdout
