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
    """This process ignores SIGTERM from now on, whatever thread calls this (a disposition is the
    process's; ``signal.signal`` works in the main thread only, an actor's constructor may run in
    another). A Ray worker takes SIGTERM as the start of a graceful exit that waits for its running
    calls, a generation actor's loop among them: it stops answering and never ends. Only the driver
    acts on SIGTERM (``runtime/stopping.py``); it ends its actors itself, SIGKILL included. Outside a Ray
    worker (an actor built in a test's own process) nothing changes."""
    import ctypes
    import signal
    import threading

    if not in_ray_worker():  # a test that builds an actor in its own process keeps its SIGTERM
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(int(signal.SIGTERM), 1)  # SIG_IGN
