"""One writer per run directory (issue 26, item 3): a second start of a run that is running fails at
once, in one line naming the holder, and touches nothing; a holder killed with -9 leaves no stale lock;
two runs created in the same second get two directories."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cli import main
from observe.run_dir import RunLog
from runtime.run_lock import RunDirBusy, RunLock

ROOT = Path(__file__).resolve().parents[1]

HOLD = """
import sys, time
from pathlib import Path
from runtime.run_lock import RunLock
lock = RunLock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def hold(root: Path) -> subprocess.Popen:
    """Another process (another tandem train) holding ``root``'s lock."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_start_of_a_running_run_stops_in_one_line_and_touches_nothing(tmp_path, capsys):
    root = tmp_path / "demo-20261204-101010"
    root.mkdir()
    (root / "config.yaml").write_text("run:\n  steps: 3\n")
    (root / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    holder = hold(root)
    try:
        started = time.monotonic()
        assert main(["train", "--resume", str(root)]) == 2
        assert time.monotonic() - started < 10
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"tandem: error: run directory {root} is in use by tandem (pid {holder.pid} on ")
        assert socket.gethostname() in err[0] and "wait for that run to end or stop it" in err[0]
        assert (root / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'  # nothing rewritten
        assert (root / "config.yaml").read_text() == "run:\n  steps: 3\n"
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_killed_with_sigkill_leaves_no_stale_lock(tmp_path):
    holder = hold(tmp_path)
    with pytest.raises(RunDirBusy):
        RunLock.acquire(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    lock = RunLock.acquire(tmp_path)  # the kernel dropped the lock with the process
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    RunLock.acquire(tmp_path).release()  # released, it can be taken again


def test_runs_created_in_the_same_second_get_directories_of_their_own(tmp_path, monkeypatch):
    # the old create checked root.exists() and then made it: another process in between made both
    # runs share one directory (or crash). Pretend every check comes too early.
    monkeypatch.setattr(Path, "exists", lambda self: False)
    runs = [RunLog.create(str(tmp_path), "demo", {"run": {"live": "off"}}, 1) for _ in range(3)]
    roots = [run.root for run in runs]
    for run in runs:
        run.close(None)
    assert len(set(roots)) == 3 and all(r.is_dir() for r in roots)


def test_a_filesystem_without_locks_is_a_warning_not_a_traceback(tmp_path, monkeypatch, capsys):
    # NFS without lockd, some FUSE or Lustre mounts (found by the review)
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = RunLock.acquire(tmp_path)
    lock.release()
    assert "does not support locks (No locks available)" in capsys.readouterr().err
