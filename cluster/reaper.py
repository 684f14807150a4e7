"""A watchdog that ends a local Ray session when its driver dies, even by SIGKILL.

Ray's processes stop with the driver only when the driver stops them (``ray.shutdown``); killed,
it leaves some of them running (the dashboard and runtime-env agents, ~200 MB, with nobody to
stop them). So ``start_ray`` marks the session and starts this watchdog, a separate process in its
own session:

- what belongs to the session: ``ray.init`` runs with ``TANDEM_RAY_SESSION=<token>`` in the
  environment, which every process Ray starts, and everything those start, inherits; a process's
  environment as it started is in ``/proc/<pid>/environ``. Ray's agents overwrite that memory when
  they rename themselves (``ray::DashboardAgent``), so a process that holds a file under the
  session directory open for writing (Ray's logs) belongs too, and so do the descendants of both.
  A reader of those logs (``tail -f``) does not; processes of other sessions carry another token
  and write under another directory.
- the wait: on the driver's pidfd (``os.pidfd_open``, Linux 5.3+), no polling; a 1 s check of the
  parent pid where pidfds are missing. The watchdog also waits on the GCS: when it ends while the
  driver lives (``ray.shutdown``, or a long process that starts Ray again), the session has ended
  normally and the watchdog exits without touching anything.
- the reaping: SIGTERM to the session's processes, 2 s grace, SIGKILL to what is left. Signals go
  through pidfds, so a pid recycled since the scan is never hit.

The watchdog half runs as ``python -I -S reaper.py``: standard library only, no site-packages.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

MARK = "TANDEM_RAY_SESSION"
GRACE_S = 2.0

_watchdogs: list[subprocess.Popen] = []  # kept so they are waited for, never reported as leaked


# ---- the driver's half


@contextmanager
def marked_environment(token: str, **variables: str) -> Iterator[None]:
    """``MARK=token`` (and ``variables``) in this process's environment for the duration (the
    processes Ray starts meanwhile inherit them); the previous values are restored after."""
    # not cluster/process_env.py: this file also runs alone as the watchdog (python -I -S reaper.py),
    # which imports nothing but the standard library
    variables[MARK] = token
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_watchdog(
    token: str, session_dir: str, gcs_pid: int | None, raylet_pid: int | None = None
) -> subprocess.Popen:
    """Start the watchdog of this process's Ray session; it writes what it did to
    ``<session_dir>/logs/tandem_reaper.err``."""
    _watchdogs[:] = [w for w in _watchdogs if w.poll() is None]
    argv = [str(os.getpid()), token, session_dir, str(gcs_pid or 0), str(raylet_pid or 0)]
    env = {k: v for k, v in os.environ.items() if k != MARK}
    with open(os.path.join(session_dir, "logs", "tandem_reaper.err"), "ab") as log:
        watchdog = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            start_new_session=True,  # a signal to the driver's process group does not reach it
        )
    _watchdogs.append(watchdog)
    return watchdog


# ---- the watchdog's half


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> list[bytes]:
    """``/proc/<pid>/stat`` after the name (which may hold spaces): [state, ppid, ...]; [] if gone."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(b")", 1)[1].split() if stat else []


def _writes_under(pid: int, directory: str) -> bool:
    """``pid`` holds a file under ``directory`` open for writing."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(directory):
            for line in _read(f"/proc/{pid}/fdinfo/{fd}").splitlines():
                if line.startswith(b"flags:") and int(line.split()[1], 8) & (os.O_WRONLY | os.O_RDWR):
                    return True
    return False


def _belongs(pid: int, token: str, session_dir: str) -> bool:
    marked = f"\0{MARK}={token}\0".encode() in b"\0" + _read(f"/proc/{pid}/environ")
    return marked or _writes_under(pid, session_dir.rstrip("/") + "/")


def session_pids(token: str, session_dir: str) -> set[int]:
    """Live processes of the session (see the module docstring), and all their descendants."""
    pids = {int(p) for p in os.listdir("/proc") if p.isdigit()} - {os.getpid()}
    parent = {pid: int(stat[1]) for pid in pids if (stat := _stat(pid)) and stat[0] != b"Z"}
    found = {pid for pid in parent if _belongs(pid, token, session_dir)}
    while more := {pid for pid, ppid in parent.items() if ppid in found and pid not in found}:
        found |= more
    return found


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid``, or None where pidfds are unsupported; ProcessLookupError when it is gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):
        return None


def _exited(pid: int, fd: int | None) -> bool:
    if fd is not None:
        return bool(select.select([fd], [], [], 0)[0])  # a pidfd turns readable when its process exits
    stat = _stat(pid)
    return not stat or stat[0] == b"Z"


def _signal(pid: int, fd: int | None, sig: int) -> None:
    try:
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
    except OSError:
        pass  # already gone


def reap(token: str, session_dir: str, grace_s: float = GRACE_S) -> tuple[int, int]:
    """SIGTERM the session's processes, SIGKILL those alive after ``grace_s`` (and any found only
    then); returns how many were sent SIGTERM and how many SIGKILL."""
    targets: dict[int, int | None] = {}  # pid -> its pidfd

    def collect() -> None:
        opened = {}
        for pid in session_pids(token, session_dir) - targets.keys():
            try:
                opened[pid] = _pidfd(pid)
            except ProcessLookupError:
                pass
        # a pid may have been recycled between the scan and its pidfd: look again, now that they are open
        again = session_pids(token, session_dir)
        for pid, fd in opened.items():
            if pid in again:
                targets[pid] = fd
            elif fd is not None:
                os.close(fd)

    collect()
    for pid, fd in targets.items():
        _signal(pid, fd, signal.SIGTERM)
    terminated = len(targets)
    deadline = time.monotonic() + grace_s
    while (alive := [fd for pid, fd in targets.items() if not _exited(pid, fd)]) and (
        left := deadline - time.monotonic()
    ) > 0:
        if None in alive:
            time.sleep(min(0.1, left))
        else:
            select.select(alive, [], [], left)  # wakes as soon as one of them exits
    collect()  # what the dying processes started meanwhile
    killed = 0
    for pid, fd in targets.items():
        if not _exited(pid, fd):
            _signal(pid, fd, signal.SIGKILL)
            killed += 1
        if fd is not None:
            os.close(fd)
    return terminated, killed


def wait_for_driver(driver: int, gcs: int | None, raylet: int | None = None) -> bool:
    """Block until the driver or the session's GCS ends: True when the driver has died. A GCS that ends
    while the raylet lives is not the session's end (Ray's GCS server killed: the driver goes on to
    checkpoint, its workers with it): then the wait goes on until the driver or the raylet ends."""
    try:
        driver_fd = _pidfd(driver)
    except ProcessLookupError:
        return True
    if os.getppid() != driver:  # reparented: the driver died before its pidfd was open
        return True
    if driver_fd is None:  # no pidfds: look once a second
        while os.getppid() == driver and not (gcs and _exited(gcs, None)):
            time.sleep(1.0)
        return os.getppid() != driver
    try:
        gcs_fd = _pidfd(gcs) if gcs else None
    except ProcessLookupError:
        gcs_fd = None
    ready = select.select([fd for fd in (driver_fd, gcs_fd) if fd is not None], [], [])[0]
    if driver_fd in ready:
        return True
    try:
        raylet_fd = _pidfd(raylet) if raylet else None
    except ProcessLookupError:
        raylet_fd = None
    if raylet_fd is not None and not _exited(raylet, raylet_fd):  # the GCS alone died: wait for the rest
        ready = select.select([driver_fd, raylet_fd], [], [])[0]
        if driver_fd in ready:
            return True
    # the GCS ended first: ray.shutdown, unless the driver is dying with it (a killed process group)
    return bool(select.select([driver_fd], [], [], 1.0)[0])


def main(argv: list[str]) -> int:
    driver, token, session_dir, gcs = int(argv[0]), argv[1], argv[2], int(argv[3]) or None
    raylet = int(argv[4]) or None if len(argv) > 4 else None
    if not wait_for_driver(driver, gcs, raylet):
        return 0
    terminated, killed = reap(token, session_dir)
    if terminated or killed:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{stamp} driver {driver} died: SIGTERM to {terminated} processes, SIGKILL to {killed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
