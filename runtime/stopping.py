"""A clean stop: SIGINT, SIGTERM or the time limit end the run at a step boundary.

The first signal asks the training loop to stop: the step being trained finishes, a step still
waiting for its batch is abandoned, then the run checkpoints, saves the model, writes
``summary.json`` and stops every process (exit 130 for SIGINT, 143 for SIGTERM). A failure of Ray's
own that leaves the learner's state good (``fail``) stops the same way, then fails. A second
Ctrl-C stops at once (a person asking twice). A second SIGTERM does not: schedulers send it more
than once for one event (``scancel`` signals every process of the job, and ``tandem slurm``'s batch
script passes its own on), and their SIGKILL follows anyway if they do not wait. ``run.time_limit``
(e.g. the SLURM allocation) stops the same way, before a next step and its checkpoint would no
longer fit in the time left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


def awaits(coro) -> list[str]:
    """Where a suspended coroutine waits, outermost first: each frame down the chain of what it awaits."""
    where = []
    while coro is not None and len(where) < 30:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return where


class StopRequest:
    def __init__(
        self,
        say: Callable[[str], None],
        time_limit_s: float | None = None,
        started: float | None = None,
        on_abort: Callable[[str], None] | None = None,
    ):
        self.say = say
        self.on_abort = on_abort  # the second signal: what must still be written before the process ends
        self.time_limit_s = time_limit_s
        self.started = time.monotonic() if started is None else started
        self.reason: str | None = None  # "SIGINT", "SIGTERM", "time_limit" or "failure"
        self.failure: str | None = None  # what the run cannot go on without ended (``fail``)
        self.event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.reason or "", 0)

    def install(self) -> None:
        """Take SIGINT and SIGTERM in the running event loop; SIGUSR1 says what the driver waits on."""
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._received, sig)
        self._loop.add_signal_handler(signal.SIGUSR1, self.say_waits)

    def uninstall(self) -> None:
        if self._loop is not None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                self._loop.remove_signal_handler(sig)
            self._loop = None
        threads_on_sigusr1()  # (removing the loop's handler put back SIGUSR1's default: the end of the process)

    def say_waits(self) -> None:
        """``kill -USR1 PID``: each of the driver's pending tasks and the line it waits at (a run that seems
        stuck; py-spy shows threads, not what coroutines await)."""
        lines = [
            f"  {task.get_name()}: {' -> '.join(awaits(task.get_coro())) or 'not started'}"
            for task in asyncio.all_tasks(self._loop)
        ]
        self.say("SIGUSR1: the driver waits on\n" + "\n".join(sorted(lines)))

    def _received(self, sig: signal.Signals) -> None:
        if self.reason in EXIT_CODES and sig == signal.SIGTERM:  # the same event again: already stopping
            self.say("SIGTERM again: already checkpointing and stopping (a Ctrl-C stops at once)")
            return
        if self.reason in EXIT_CODES:  # a second Ctrl-C: no checkpoint, no waiting
            self.say(f"{sig.name} after {self.reason}: stopping now, without a checkpoint")
            try:
                if self.on_abort is not None:
                    self.on_abort(f"{sig.name} after {self.reason}")
            finally:
                os._exit(EXIT_CODES[sig.name])  # Ray's processes go with the driver (cluster/reaper.py)
            return  # (not reached: os._exit does not return)
        self.request(sig.name)
        self.say(
            f"{sig.name}: finishing the current step, then checkpointing and stopping "
            "(a second Ctrl-C stops at once, without a checkpoint)"
        )

    def fail(self, cause: str) -> None:
        """Something the run cannot go on without has ended, while the learner still holds a good state
        (Ray's GCS server, ``cluster/ray_watch.py``): stop as for a signal, then fail with ``cause``."""
        if self.failure is None:
            self.failure = cause
            self.say(f"{cause}; finishing the current step, then checkpointing and stopping")
            self.request("failure")

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.event.set()

    def time_is_short(self, step_s: float, checkpoint_s: float) -> bool:
        """True when another step and a checkpoint (with a margin) may not fit in the time left."""
        if self.time_limit_s is None:
            return False
        left = self.time_limit_s - (time.monotonic() - self.started)
        if left < 1.5 * step_s + 2 * checkpoint_s + 10:
            self.request("time_limit")
            self.say(f"run.time_limit: {left:.0f}s left; checkpointing and stopping")
            return True
        return False


def threads_on_sigusr1() -> None:
    """Outside the training loop (loading data, preflight, the final save), ``kill -USR1`` prints every
    thread's stack to stderr instead of ending the process, SIGUSR1's default."""
    import faulthandler
    import sys

    try:
        faulthandler.unregister(signal.SIGUSR1)  # (registered before, and replaced by the loop's since: again)
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no stderr file to write to (a captured one): left as it is
        pass
