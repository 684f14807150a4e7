"""Reward worker processes: reward functions run here, off the generation path, each call with a deadline.

A generation actor holds vLLM (and torch) state and, in in-flight mode, an asyncio event loop: a
reward function that is slow, hangs, or needs the main thread (math-verify's ``signal.alarm``
timeouts) must not run there. ``RewardPool`` starts ``reward.workers`` processes with the ``spawn``
start method (a fresh interpreter: nothing of the engine is inherited). Each loads the reward's parts
once and then answers one call per group of G completions, in its main thread.

Every wait has a deadline:
  - a worker must finish loading within ``reward.import_timeout_s``;
  - a call must be answered within ``reward.timeout_s``; past it the call is abandoned: the worker
    (and its process group) is killed and replaced, and every sample of the call scores 0.0 with the
    error "TimeoutError: ...", counted like any reward error;
  - a worker that dies mid-call is replaced the same way ("RewardWorkerDied: ...");
  - waiting for a free worker is bounded by the calls ahead of it times one call's longest time;
  - a reward that hangs on every call costs about one deadline per batch of calls (two with one
    worker), not one per call: once the last ``max(2, reward.workers)`` calls in a row have all timed
    out, a call that was waiting for a worker while that happened is not attempted ("TimeoutError: not
    attempted ...", scored 0.0); calls that arrive later (the next step's) are tried again. One hang
    alone, or one at a time, never stops a call behind it.
A worker ends itself when its actor's process goes away (even by SIGKILL), and ``close`` ends all.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from actors.config import RewardConfig
from actors.reward_parts import SampleScore, load_parts, score_call
from actors.worker_process import KILL_GRACE_S, become_worker, kill_group

CALL_TIMED_OUT = "TimeoutError: reward call took longer"  # how a call past reward.timeout_s is reported


def worker_main(conn, cfg: RewardConfig, steps: bool, parent_pid: int) -> None:
    """A reward worker: load the parts, then answer ``(prompts, completions, rows)`` calls until told to
    stop (``None``) or the actor's end of the pipe closes. Runs in the process's main thread."""
    become_worker(parent_pid)  # its own process group: killing it on a timeout takes what the reward started
    try:
        parts = load_parts(cfg)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return  # the actor is gone
        if call is None:
            return
        prompts, completions, rows = call
        conn.send(score_call(parts, prompts, completions, rows, steps))


class _Worker:
    """One worker process and the actor's end of its pipe; used by one call at a time."""

    def __init__(self, ctx, cfg: RewardConfig, steps: bool):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=worker_main, args=(child, cfg, steps, os.getpid()), name="tandem-reward-worker", daemon=False
        )
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self, timeout_s: float) -> str | None:
        """None once the worker has loaded the reward, else the error."""
        if self.ready:
            return None
        try:
            if not self.conn.poll(timeout_s):
                return (
                    f"TimeoutError: a reward worker did not load the reward functions within {timeout_s:g} s "
                    "(reward.import_timeout_s)"
                )
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            return self._died("while loading the reward functions")
        if kind == "failed":
            return f"RewardWorkerError: a reward worker could not load the reward: {payload}"
        self.ready = True
        return None

    def call(self, request: tuple, timeout_s: float, load_timeout_s: float) -> list[SampleScore] | str:
        """The worker's answer, or an error (then the worker must be replaced)."""
        error = self.wait_ready(load_timeout_s)
        if error is not None:
            return error
        try:
            self.conn.send(request)
            if not self.conn.poll(timeout_s):
                return f"{CALL_TIMED_OUT} than reward.timeout_s = {timeout_s:g} s (abandoned; its worker was replaced)"
            return self.conn.recv()
        except (EOFError, OSError):
            return self._died("while scoring")

    def _died(self, doing: str) -> str:
        self.proc.join(KILL_GRACE_S)
        code = self.proc.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code and code < 0 else f"exited with code {code}"
        return f"RewardWorkerDied: the reward worker (pid {self.proc.pid}) {how} {doing}"

    def stop(self) -> None:
        """Ask an idle worker to stop; kill it if it does not."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(KILL_GRACE_S)
        self.kill()

    def kill(self) -> None:
        kill_group(self.proc)  # the worker and anything it started
        self.conn.close()


def _stop_all(workers: set) -> None:
    for worker in list(workers):
        worker.kill()


class RewardPool:
    """``cfg.workers`` reward worker processes. ``steps``: process supervision (a part may return step
    rewards). ``score`` never raises: a failed call gives every sample 0.0 and the error."""

    def __init__(self, cfg: RewardConfig, steps: bool = False):
        self.cfg, self.steps = cfg, steps
        self._ctx = multiprocessing.get_context("spawn")  # the actor's engine and threads are not forked
        self._cond = threading.Condition()
        self._all: set[_Worker] = set()
        self._idle: list[_Worker] = []
        self._busy = self._waiting = 0
        self._closed = False
        self.replaced = 0  # workers replaced after a timeout or a death
        self._timeouts = 0  # calls that ran past reward.timeout_s, ever
        self._streak = 0  # ... in a row, up to the last call that was answered
        for _ in range(cfg.workers):
            self._idle.append(self._spawn())
        self._executor = ThreadPoolExecutor(cfg.workers, thread_name_prefix="reward-wait")  # async/batched waits
        self._finalizer = weakref.finalize(self, _stop_all, self._all)  # at exit, if never closed

    def _spawn(self) -> _Worker:
        worker = _Worker(self._ctx, self.cfg, self.steps)
        self._all.add(worker)
        return worker

    def wait_ready(self) -> None:
        """Wait until every worker has loaded the reward; raise ``RuntimeError`` with the first error."""
        for worker in list(self._idle):
            error = worker.wait_ready(self.cfg.import_timeout_s)
            if error is not None:
                self.close()
                raise RuntimeError(error)

    @property
    def call_deadline_s(self) -> float:
        """The longest one call can hold a worker: loading a fresh worker, the call, and a kill."""
        return self.cfg.import_timeout_s + self.cfg.timeout_s + KILL_GRACE_S

    def score(
        self, prompts: list[str], completions: list[str], rows: list[dict], asked_at: int | None = None
    ) -> list[SampleScore]:
        """Every part's value for each completion (one call, one worker). ``asked_at``: the pool's timeout
        count when the call was made (it may have waited for a thread before coming here)."""
        seen = self._timeouts if asked_at is None else asked_at
        worker = self._acquire()
        if isinstance(worker, str):
            return self._failed(worker, len(completions))
        if self._timeouts != seen and self._streak >= max(2, self.cfg.workers):  # it hangs on every call
            self._release(worker, healthy=True)
            return self._failed(
                f"TimeoutError: not attempted: the last {self._streak} reward calls each ran past reward.timeout_s "
                f"= {self.cfg.timeout_s:g} s while this one waited (the reward seems to hang on every call)",
                len(completions),
            )
        answer = worker.call((prompts, completions, rows), self.cfg.timeout_s, self.cfg.import_timeout_s)
        timed_out = isinstance(answer, str) and answer.startswith(CALL_TIMED_OUT)
        with self._cond:
            self._timeouts += timed_out
            self._streak = self._streak + 1 if timed_out else 0
        self._release(worker, healthy=not isinstance(answer, str))
        return self._failed(answer, len(completions)) if isinstance(answer, str) else answer

    def score_many(self, calls: list[tuple[list[str], list[str], list[dict]]]) -> list[list[SampleScore]]:
        """Several calls at once, spread over the workers."""
        if len(calls) == 1:
            return [self.score(*calls[0])]
        asked_at = self._timeouts
        return list(self._executor.map(lambda call: self.score(*call, asked_at), calls))

    async def score_async(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[SampleScore]:
        """``score`` without blocking the event loop (the wait runs on the pool's own threads)."""
        loop, asked_at = asyncio.get_running_loop(), self._timeouts
        return await loop.run_in_executor(self._executor, self.score, prompts, completions, rows, asked_at)

    def _failed(self, error: str, n: int) -> list[SampleScore]:
        return [SampleScore(parts=[0.0] * len(self.cfg.function_parts), error=error) for _ in range(n)]

    def _acquire(self) -> _Worker | str:
        with self._cond:
            ahead = self._busy + self._waiting
            limit = self.call_deadline_s * (ahead // self.cfg.workers + 1)
            deadline = time.monotonic() + limit
            self._waiting += 1
            try:
                while not self._idle and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return f"TimeoutError: no reward worker became free within {limit:g} s"
                    self._cond.wait(left)
                if self._closed:
                    return "RuntimeError: the reward pool is closed (the actor is stopping)"
                self._busy += 1
                return self._idle.pop()
            finally:
                self._waiting -= 1

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:
            worker.kill()
        with self._cond:
            self._busy -= 1
            if not healthy:
                self._all.discard(worker)
                if not self._closed:
                    self.replaced += 1
                    worker = self._spawn()
            if self._closed:
                self._all.discard(worker)
                worker.stop()
            else:
                self._idle.append(worker)
            self._cond.notify()

    def close(self) -> None:
        """End every worker: idle ones are told to stop, busy ones are killed (their calls fail at once)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, []
            busy = [w for w in self._all if w not in idle]
            self._cond.notify_all()
        for worker in busy:
            worker.proc.kill()  # its caller sees the pipe close and releases it
        for worker in idle:
            self._all.discard(worker)
            worker.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._finalizer.detach()
