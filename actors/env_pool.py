"""Environment worker processes: episodes' environments run here, off the engine, each step with a deadline.

An environment is user code that may be slow, hang, crash or print anything: like a reward function it
must not run in the actor's process (the engine, the event loop). ``EnvironmentPool`` starts
``rollout.episode.workers`` processes (``spawn``: nothing of the engine is inherited); each loads the
environment class once and holds the environments of the episodes given to it, one instance per
episode, answering one ``reset`` or ``step`` at a time. An episode stays on its worker (its state lives
there); episodes are spread over the workers by how many each holds.

Every wait has a deadline (``rollout.episode``): a worker must start within ``import_timeout_s``; a
``reset`` or ``step`` must be answered within ``step_timeout_s``, else that worker (and its process
group) is killed and replaced: the episode that waited ends with reason ``timeout``, the other episodes
it held end at their next step with reason ``lost``. An environment that raises or answers something
that is not a ``StepResult`` (a reward that is not a finite number, info that is not a dict, messages
that are not ``{role, content}`` strings) ends its episode with reason ``error``. No failure of an
environment's code reaches the run.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from actors.config import EpisodeConfig
from actors.user_files import import_user_file
from actors.worker_process import KILL_GRACE_S, become_worker, kill_group


class EnvironmentSpecError(ValueError):
    """``rollout.episode.environment`` names no environment that can be loaded."""


def load_environment_class(spec: str) -> type:
    """``'path/to/file.py:ClassName'`` or ``'builtin:<name>'`` to the class."""
    if spec.startswith("builtin:"):
        from actors.lookup_task import BUILTIN_ENVIRONMENTS

        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_ENVIRONMENTS:
            raise EnvironmentSpecError(
                f"rollout.episode.environment {spec!r}: no built-in environment {name!r}; built-in: "
                f"{', '.join(sorted(BUILTIN_ENVIRONMENTS))}"
            )
        return BUILTIN_ENVIRONMENTS[name]
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise EnvironmentSpecError(
            f"rollout.episode.environment {spec!r} must be 'path/to/file.py:ClassName' or 'builtin:<name>'"
        )
    module = import_user_file(path_text, "tandem_env", "rollout.episode.environment", EnvironmentSpecError)
    path = Path(module.__file__)
    cls = getattr(module, name, None)
    if (
        not isinstance(cls, type)
        or not callable(getattr(cls, "reset", None))
        or not callable(getattr(cls, "step", None))
    ):
        raise EnvironmentSpecError(f"{path} has no class {name!r} with reset(row) and step(action_text) methods")
    return cls


@dataclass
class EnvironmentCheck:
    """What the start-up check learned from the environment (``check_environment``)."""

    tools: list[dict] = field(default_factory=list)  # its tools' JSON schemas (tool_schema), as the template gets them
    # per row given, in order: (reset's messages, None), or (None, why reset failed); rows after a reset that
    # hung or killed its process are not tried
    resets: list[tuple[list[dict] | None, str | None]] = field(default_factory=list)


def _check_main(conn, spec: str, args: dict) -> None:
    """Load the class, build one instance, send ``("ready", tool schemas)``; then answer each row sent with
    ``("ok", reset's messages)`` or ``("error", why)`` (a fresh instance per row, as per episode)."""
    from actors.environments import tool_schema

    os.setsid()
    try:
        cls = load_environment_class(spec)
        try:
            env = cls(**args)
        except Exception as exc:
            raise EnvironmentSpecError(
                f"rollout.episode.environment {spec!r} could not be built with rollout.episode.args {args}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        tools = [tool_schema(fn) for fn in getattr(env, "tools", None) or []]
    except EnvironmentSpecError as exc:
        conn.send(("failed", str(exc)))
        return
    except Exception as exc:  # e.g. a tool whose schema cannot be built
        conn.send(("failed", f"rollout.episode.environment {spec!r}: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", tools))
    while (row := conn.recv()) is not None:
        try:
            conn.send(("ok", _messages(cls(**args).reset(row), "reset()")))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"))


def check_environment(cfg: EpisodeConfig, rows: list[dict] = ()) -> EnvironmentCheck:
    """Raise ``EnvironmentSpecError`` (one line) unless ``rollout.episode.environment`` loads and one
    instance can be built from ``rollout.episode.args``: in a child process, within ``import_timeout_s``,
    so a file that hangs or exits at import cannot take the caller with it (checked before a run starts).
    Returns its tools' schemas and ``reset(row)`` of each of ``rows`` (each within ``step_timeout_s``)."""
    if cfg.environment is None:
        return EnvironmentCheck()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_check_main, args=(child, cfg.environment, cfg.args), name="tandem-env-check")
    proc.start()
    child.close()
    error, check = None, EnvironmentCheck()
    try:
        if not parent.poll(cfg.import_timeout_s):
            raise EnvironmentSpecError(
                f"rollout.episode.environment {cfg.environment!r} did not finish importing within "
                f"{cfg.import_timeout_s:g} s (rollout.episode.import_timeout_s); move slow work out of the file's "
                "top level"
            )
        kind, value = parent.recv()
        if kind == "failed":
            error = value
        else:
            check.tools = value
            _resets(parent, proc, rows, cfg.step_timeout_s, check.resets)
    except EOFError:
        proc.join(KILL_GRACE_S)
        error = (
            f"rollout.episode.environment {cfg.environment!r}: the file exited while being imported (code "
            f"{proc.exitcode}); put such code under `if __name__ == '__main__':`"
        )
    finally:
        kill_group(proc)  # an import that started processes leaves none behind
        parent.close()
    if error:
        raise EnvironmentSpecError(error)
    return check


def _resets(conn, proc, rows: list[dict], timeout_s: float, out: list) -> None:
    """``reset(row)`` of each row in the check's child, until one hangs past ``timeout_s`` or kills it."""
    for row in rows:
        try:
            conn.send(row)
            if not conn.poll(timeout_s):
                out.append((None, f"reset() did not return within rollout.episode.step_timeout_s = {timeout_s:g} s"))
                return
            kind, value = conn.recv()
        except (EOFError, OSError):
            died = _exit_text(proc, KILL_GRACE_S) or "its pipe closed"
            out.append((None, f"the environment's process died during reset() ({died})"))
            return
        out.append((value, None) if kind == "ok" else (None, value))


def worker_main(conn, cfg: EpisodeConfig, parent_pid: int) -> None:
    """Load the environment class, then answer ``(op, episode, payload)`` until told to stop (``None``)."""
    from actors.environments import tool_schema

    become_worker(parent_pid)  # its own process group: a kill on a timeout takes what the environment started
    try:
        cls = load_environment_class(cfg.environment)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    episodes: dict[int, Any] = {}
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return
        if call is None:
            return
        op, episode, payload = call
        try:
            if op == "reset":
                env = cls(**cfg.args)
                if hasattr(env, "tool_format"):
                    env.tool_format = cfg.tool_format
                episodes[episode] = env
                messages = _messages(env.reset(payload), "reset()")
                tools = [tool_schema(fn) for fn in getattr(env, "tools", None) or []]
                conn.send(("ok", (messages, tools)))
            elif op == "step":
                conn.send(("ok", asdict(_checked(episodes[episode].step(payload)))))
            else:  # close
                episodes.pop(episode, None)
                conn.send(("ok", None))
        except Exception as exc:
            episodes.pop(episode, None)
            conn.send(("error", f"{type(exc).__name__}: {str(exc)[:300]}"))


def _messages(value, where: str) -> list[dict]:
    """Chat messages, or a ``TypeError`` naming what ``where`` returned instead."""
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        raise TypeError(f"{where} must give a list of {{'role': str, 'content': str}} messages, not {value!r:.120}")
    return value


def _checked(result):
    """A ``StepResult`` whose fields are what the actor reads (reward a finite number, done a bool, info a
    dict, the observation text or messages), or a ``TypeError`` that ends the episode."""
    from actors.environments import StepResult

    if not isinstance(result, StepResult):
        raise TypeError(f"step() returned {type(result).__name__}, not a StepResult")
    try:
        reward = float(result.reward)
    except (TypeError, ValueError):
        raise TypeError(f"step() gave the reward {result.reward!r}, not a number") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise TypeError(f"step() gave the reward {reward}, not a finite number")
    if not isinstance(result.info, dict):
        raise TypeError(f"step() gave info {result.info!r:.80}, not a dict")
    if not isinstance(result.observation, str):
        _messages(result.observation, "step()'s observation")
    return StepResult(result.observation, reward, bool(result.done), result.info)


class EpisodeEnded(Exception):
    """The environment cannot go on: ``reason`` is ``timeout``, ``error`` or ``lost``; ``detail`` says why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class _Worker:
    def __init__(self, ctx, cfg: EpisodeConfig):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, cfg, os.getpid()), name="tandem-env-worker")
        self.proc.start()
        child.close()
        self.lock = asyncio.Lock()  # one request at a time on the pipe
        self.episodes: set[int] = set()
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            raise RuntimeError(
                f"an environment worker did not start within {timeout_s:g} s (rollout.episode.import_timeout_s)"
            )
        kind, payload = self.conn.recv()
        if kind == "failed":
            raise RuntimeError(f"an environment worker could not load the environment: {payload}")
        self.ready = True

    def request(self, call: tuple, timeout_s: float, import_timeout_s: float):
        """The answer, or None when none came within ``timeout_s`` (the worker must then be killed)."""
        self.wait_ready(import_timeout_s)  # a replacement worker answers its first request once loaded
        self.conn.send(call)
        if not self.conn.poll(timeout_s):
            return None
        return self.conn.recv()

    def kill(self) -> None:
        kill_group(self.proc)  # the worker and whatever it started
        self.conn.close()


def _exit_text(proc, wait_s: float = 1.0) -> str | None:
    """How a dead worker process ended: "exit code 3" or "killed by SIGKILL" (None while it runs)."""
    import signal

    proc.join(wait_s)
    code = proc.exitcode
    if code is None:
        return None
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class EnvironmentPool:
    """``cfg.workers`` environment workers shared by the episodes of one generation actor."""

    def __init__(self, cfg: EpisodeConfig):
        self.cfg = cfg
        self._ctx = multiprocessing.get_context("spawn")
        self.workers = [_Worker(self._ctx, cfg) for _ in range(cfg.workers)]
        self._where: dict[int, _Worker] = {}
        self._ids = itertools.count()
        self.replaced = 0
        self._closed = False
        atexit.register(self.close)  # non-daemon workers would otherwise hold the interpreter's exit

    def wait_ready(self) -> None:
        for worker in self.workers:
            try:
                worker.wait_ready(self.cfg.import_timeout_s)
            except (EOFError, OSError) as exc:
                self.close()
                raise RuntimeError(f"an environment worker died while starting ({exc})") from None
            except RuntimeError:
                self.close()
                raise

    async def reset(self, row: dict) -> tuple[int, list[dict], list[dict]]:
        """A new episode: its id, its first messages and its tools' schemas."""
        episode = next(self._ids)
        worker = min(self.workers, key=lambda w: len(w.episodes))
        worker.episodes.add(episode)
        self._where[episode] = worker
        try:
            messages, tools = await self._call(episode, "reset", row)
        except EpisodeEnded:
            self._where.pop(episode, None)
            worker.episodes.discard(episode)
            raise
        return episode, messages, tools

    async def step(self, episode: int, action_text: str):
        from actors.environments import StepResult

        return StepResult(**await self._call(episode, "step", action_text))

    async def close_episode(self, episode: int) -> None:
        worker = self._where.pop(episode, None)
        if worker is None or worker not in self.workers:
            return
        worker.episodes.discard(episode)
        try:
            await self._call_on(worker, episode, "close", None)
        except EpisodeEnded:
            pass

    async def _call(self, episode: int, op: str, payload):
        return await self._call_on(self._where.get(episode), episode, op, payload)

    async def _call_on(self, worker: _Worker | None, episode: int, op: str, payload):
        if worker is None:
            raise EpisodeEnded("lost", f"episode {episode} is not held by any environment worker")
        async with worker.lock:
            if worker not in self.workers:
                raise EpisodeEnded("lost", "its environment worker was replaced after another episode's step timed out")
            try:
                answer = await asyncio.to_thread(
                    worker.request, (op, episode, payload), self.cfg.step_timeout_s, self.cfg.import_timeout_s
                )
            except RuntimeError as exc:
                self._replace(worker)
                raise EpisodeEnded("error", str(exc)) from None
            except (EOFError, OSError) as exc:
                died = _exit_text(worker.proc) or type(exc).__name__
                self._replace(worker)
                raise EpisodeEnded("error", f"the environment worker died during {op} ({died})") from None
            if answer is None:
                self._replace(worker)
                raise EpisodeEnded(
                    "timeout", f"{op} took longer than rollout.episode.step_timeout_s = {self.cfg.step_timeout_s:g} s"
                )
        kind, value = answer
        if kind == "error":
            raise EpisodeEnded("error", value)
        return value

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        index = self.workers.index(worker)
        self.workers[index] = _Worker(self._ctx, self.cfg)  # ready when it answers its first request
        self.replaced += 1
        print(f"[environment] a worker was replaced ({self.replaced} so far)", flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self.workers:
            worker.proc.join(1.0)
            worker.kill()
