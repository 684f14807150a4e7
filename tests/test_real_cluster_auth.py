"""The Ray cluster ``tandem slurm`` starts lets no one else in: a real two-node Ray cluster on this machine,
started as the SLURM script starts it (its token setup, run by bash with HOME in a temp dir, then the head's and a
worker's ``ray start`` under the script's ``ray_auth`` prefix), refuses a driver without the token or with a wrong
one, and takes one with it.

The cluster is this test's own (a fresh temp dir, free ports), stopped by killing only its processes, as in
``tests/test_real_submit.py``. No subprocess sees the real home directory, so the user's ``~/.ray/auth_token``
is never read or written.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch.deploy.slurm import TOKEN_SETUP
from tests.test_real_submit import _free_ports, _stop_cluster

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
RAY_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
CONNECT = "import sys, ray; ray.init(address=sys.argv[1]); print('alive nodes:', sum(n['Alive'] for n in ray.nodes()))"
REFUSED = "Authentication token is missing or incorrect"  # the GCS's answer, logged at the first try


def _ray_auth(home: Path, base: dict[str, str]) -> list[str]:
    """Run the script's token setup with HOME=``home``; the ``ray_auth`` command prefix it leaves."""
    done = subprocess.run(
        ["bash", "-c", f'set -euo pipefail\n{TOKEN_SETUP}\nprintf "%s\\n" "${{ray_auth[@]}}"'],
        env={**base, "HOME": str(home)}, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def _refused(env: dict[str, str], address: str, timeout_s: float = 60) -> str:
    """Start a driver that connects to ``address``; return its output once the GCS has refused it (Ray keeps
    retrying for a minute and more: the driver is ended as soon as the refusal is logged)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, "-c", CONNECT, address], env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                out.seek(0)
                if REFUSED in out.read():
                    break
                time.sleep(0.2)
        finally:
            proc.kill()
            proc.wait()
        out.seek(0)
        return out.read()


def test_the_sbatch_cluster_refuses_a_driver_without_its_token(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="tnd-", dir="/tmp")  # short: Ray's socket paths have a length limit
    home, stranger = tmp_path / "home", tmp_path / "stranger"
    stranger.mkdir()
    base = {k: v for k, v in os.environ.items() if k not in RAY_VARS}
    base.update(RAY_USAGE_STATS_ENABLED="0", HOME=str(home))
    ray_auth = _ray_auth(home, base)
    token = home / ".ray" / "auth_token"
    assert ray_auth == ["env", "-u", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN_PATH={token}"]
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    gcs, dashboard, client, agent = _free_ports(4)
    try:
        head = subprocess.run(
            [*ray_auth, str(BIN / "ray"), "start", "--head", f"--port={gcs}", "--num-cpus=1",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
             f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
            env=base, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert head.returncode == 0, head.stdout + head.stderr
        import ray._private.services as services

        address = f"{services.get_node_ip_address()}:{gcs}"  # the node's network address, as on a cluster
        worker = subprocess.run(
            [*ray_auth, str(BIN / "ray"), "start", f"--address={address}", "--num-cpus=1",
             f"--temp-dir={temp_dir}", "--disable-usage-stats"],
            env=base, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert worker.returncode == 0, worker.stdout + worker.stderr

        # a driver of someone else on the network: no RAY_AUTH_MODE, no token variable, no ~/.ray/auth_token
        no_token = {**base, "HOME": str(stranger)}
        said = _refused(no_token, address)
        assert REFUSED in said and "alive nodes" not in said, said[-2000:]
        wrong = {**no_token, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
        said = _refused(wrong, address)
        assert REFUSED in said and "alive nodes" not in said, said[-2000:]
        # the job's driver (tandem train in the script) has the token: it sees both nodes
        driver = subprocess.run(
            [*ray_auth, sys.executable, "-c", CONNECT, address], env=base, capture_output=True, text=True, timeout=120
        )
        assert driver.returncode == 0 and "alive nodes: 2" in driver.stdout, driver.stdout + driver.stderr
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
