"""A local Ray leaves nothing behind and is reachable from this machine only.

A child Python process plays the driver: it calls ``launch.ray_session.start_ray`` and starts one trivial
actor. The test finds the session's processes on its own, from the process table (a process
belongs to the session when its command line names the session directory, or it holds a file
open there, or its parent does: Ray renames its workers, so the command line alone misses them),
then SIGKILLs the driver and expects every one of them gone; an unrelated ``sleep`` survives.
The second test reads the listening TCP sockets of the same processes from ``/proc/net``.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

DRIVER = """
import os, sys, time
import ray
from launch.ray_session import start_ray
from launch.config import load_config
from launch.plan import build_plan

cfg = load_config(None, ["model.path=x", "data.prompts=x", "reward.function=x", "resources.local_num_cpus=4"])
start_ray(cfg, build_plan(cfg))

@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        return os.getpid()

probe = Probe.remote()
actor_pid = ray.get(probe.pid.remote())
print(ray._private.worker._global_node.get_session_dir_path(), actor_pid, flush=True)
print("ready", flush=True)
time.sleep(600)
"""


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def _parent(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else None


def _open_files(pid: int) -> list[str]:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    links = []
    for fd in names:
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return links


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def session_processes(session_dir: str) -> set[int]:
    """Live processes of the Ray session whose directory is ``session_dir``, and their descendants."""
    inside = session_dir.encode() + b"/"
    pids = _pids() - {os.getpid()}
    found = set()
    for pid in pids:
        args = _read(f"/proc/{pid}/cmdline").split(b"\0")
        if any(a.endswith(session_dir.encode()) or inside in a for a in args):
            found.add(pid)
        elif any(link.startswith(session_dir + "/") for link in _open_files(pid)):
            found.add(pid)
    parents = {pid: _parent(pid) for pid in pids}
    while True:
        more = {pid for pid, parent in parents.items() if parent in found and pid not in found}
        if not more:
            break
        found |= more
    return {pid for pid in found if _alive(pid)}


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6 prints the address as four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening_sockets(pids: set[int]) -> list[tuple[str, int, int]]:
    """``(address, port, pid)`` of every listening TCP socket the processes ``pids`` hold."""
    owner = {}
    for pid in pids:
        for link in _open_files(pid):
            if link.startswith("socket:["):
                owner[link[len("socket:[") : -1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _read(table).decode().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owner:  # 0A: TCP_LISTEN
                ip, port = fields[1].split(":")
                found.append((_address(ip), int(port, 16), owner[fields[9]]))
    return found


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


@pytest.fixture
def driver(tmp_path):
    """A running driver with a local Ray and one actor: ``(process, session_dir, actor_pid)``.
    Whatever of the session is still alive afterwards is killed, so a failure leaks nothing."""
    err = open(tmp_path / "driver.err", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout], daemon=True).start()
    try:
        first = lines.get(timeout=120)
        assert lines.get(timeout=30) == "ready"
    except queue.Empty:
        proc.kill()
        pytest.fail(f"the driver did not start within the deadline: {(tmp_path / 'driver.err').read_text()[-3000:]}")
    session_dir, actor_pid = first.rsplit(" ", 1)
    try:
        yield proc, session_dir, int(actor_pid)
    finally:
        proc.kill()
        proc.wait()
        for pid in session_processes(session_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        err.close()


def test_killing_the_driver_leaves_no_process_of_its_session(driver):
    proc, session_dir, actor_pid = driver
    # outside the session: an unrelated process, and one that only reads the session's log
    bystanders = [
        subprocess.Popen(["sleep", "60"]),
        subprocess.Popen(["tail", "-f", f"{session_dir}/logs/raylet.out"], stdout=subprocess.DEVNULL),
    ]
    outside = {b.pid for b in bystanders}
    try:
        before = session_processes(session_dir) - outside
        assert actor_pid in before, (actor_pid, before)
        assert len(before) >= 4  # at least the GCS, the raylet, the actor and the driver itself
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while (left := session_processes(session_dir) - outside) and time.monotonic() < deadline:
            time.sleep(0.25)
        names = {pid: _read(f"/proc/{pid}/cmdline")[:80] for pid in left}
        assert not left, f"still running 20 s after the driver was killed: {names}"
        assert [b.poll() for b in bystanders] == [None, None], "a process outside the session was killed"
    finally:
        for b in bystanders:
            b.kill()
            b.wait()


def test_a_local_ray_listens_on_loopback_only(driver):
    proc, session_dir, _ = driver
    sockets = listening_sockets(session_processes(session_dir) | {proc.pid})
    assert len(sockets) >= 3, sockets  # the GCS, the raylet and every worker serve gRPC
    exposed = [(addr, port, _read(f"/proc/{pid}/cmdline")[:60]) for addr, port, pid in sockets if not _loopback(addr)]
    assert not exposed, f"listening beyond this machine: {exposed}"
