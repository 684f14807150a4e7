"""What the actors' worker processes share (reward workers, environment workers): each runs in its own
process group, ends itself when its actor goes away, and is killed together with whatever it started.
Like every process of a run but the driver, it takes no action on SIGTERM (``schema/process.py``): a SIGTERM
to every process of a job reaches it too, and only the driver decides how the run ends. What a user's reward
or environment starts from it (``subprocess``, ``multiprocessing.Pool``) ends on SIGTERM as usual."""

from __future__ import annotations

import os
import signal
import threading
import time

KILL_GRACE_S = 5.0  # a killed worker's exit, and a stopped one's
PARENT_CHECK_S = 1.0  # how often a worker checks that its actor is still alive


def become_worker(parent_pid: int) -> None:
    """In the worker: lead a process group of its own (a kill takes whatever it starts too) and exit once
    reparented (its actor died without closing the pool, even by SIGKILL)."""
    os.setsid()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, _not_here(os.getpid()))
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _not_here(worker: int):
    """A SIGTERM handler: nothing in the worker ``worker``; in a process forked from it (a user's
    ``multiprocessing.Pool``), the default action, so ``Pool.terminate()`` ends it."""

    def handler(signum, frame) -> None:
        if os.getpid() != worker:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    return handler


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def kill_group(proc) -> None:
    """SIGKILL to the worker's process group and wait for the worker: a group outlives a worker that
    crashed, so it is signalled whether the worker is alive or not."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.exitcode is None:
            proc.kill()
    proc.join(KILL_GRACE_S)
