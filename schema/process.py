"""What every process of a run but the driver does when it starts: neutral ground, importable from every
part of Tandem (queue actors, generation actors, learner ranks, the weight store)."""

from __future__ import annotations

import os
import sys

RAY_WORKER_MAIN = os.path.join("ray", "_private", "workers", "default_worker.py")


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker (an actor's process): Ray runs them from its ``default_worker.py``."""
    return (getattr(sys.modules.get("__main__"), "__file__", None) or "").endswith(RAY_WORKER_MAIN)


def ignore_sigterm() -> None:
    """This process takes no action on SIGTERM from now on, whatever thread calls this (a handler is the
    process's; ``signal.signal`` works in the main thread only, and an async actor's constructor runs in
    another). A Ray worker takes SIGTERM as the start of a graceful exit that waits for its running calls, a
    generation actor's loop among them: it stops answering and never ends. Only the driver acts on SIGTERM
    (``runtime/stopping.py``); it ends its actors itself, SIGKILL included.

    The handler is a C function that does nothing (libc's ``getpid``, async-signal-safe), not ``SIG_IGN``:
    an ignored signal stays ignored in every program the process starts, so a user's
    ``subprocess.terminate()`` or ``multiprocessing.Pool`` there would never end, while a handler is reset to
    the default at ``exec``. Outside a Ray worker (an actor built in a test's own process) nothing changes."""
    import ctypes
    import signal

    if not in_ray_worker():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(int(signal.SIGTERM), ctypes.cast(libc.getpid, ctypes.c_void_p).value)
