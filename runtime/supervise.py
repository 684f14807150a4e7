"""Generation actors that die are replaced, and the prompts they held are generated again.

When an actor's ``run`` loop ends during a run (its process was killed, its engine crashed),
``ActorPool.ended``:
  1. asks the prompt queue which prompts that actor took (``taken_by``), keeps those still
     outstanding in the prompt ledger and not waiting in the results queue, and has them
     generated again (each frees its admission place, ``Pace.drop``);
  2. starts a new actor under the same name and log file, which loads the newest weights before
     it generates (every request names the version it needs), and starts its loop;
  3. counts the restart. Past ``resources.actors.max_restarts`` per actor, or on a weight channel
     that cannot take a new member (the distributed one is one process group), it raises
     ``ActorFailed`` and the run checkpoints and stops.
A result of the dead actor that still arrives is trained once: the ledger ignores duplicates.

Every death is written at the end of the dead actor's log (Ray hands the exception to the driver,
not to that log) and quoted in one line (``describe_death``). An actor that dies with the same
error (type and message, numbers aside) as an earlier death in the pool is not replaced: a new one
would fail the same way, so ``ActorKeepsFailing`` stops the run at once, naming the error.
A process that died without raising (kill -9, the OOM killer, a crash, a lost node) is quoted from
the last error line of its log, if any, and replaced as before: a line there may be an error that
was handled (a reward's), so it is no proof of the cause.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import traceback
from dataclasses import dataclass
from typing import Protocol

from cluster.logs import DEATH_MARK, append_log, exception_lines, last_error_line
from runtime.admission import Admission

LINE_CHARS = 300  # a death's one line is cut to this


class ActorFailed(RuntimeError):
    """A generation actor's loop ended with an error."""


class ActorWatch:
    """The generation actors' ``run`` loops, by actor name; one that ends during a run failed.
    (``runtime/supervise.py`` replaces such an actor instead.)"""

    def __init__(self, actor_loops: dict, run):
        self.run = run
        self.refs = {name: ref for ref, name in actor_loops.items()}  # each actor's current loop
        # an awaitable per actor loop, created once: waiting on them is how a dead actor is noticed
        self.loops = {asyncio.ensure_future(ref): name for ref, name in actor_loops.items()}

    def watch(self, ref, name: str) -> None:
        self.refs[name] = ref
        self.loops[asyncio.ensure_future(ref)] = name

    async def ended(self, loop: asyncio.Future) -> None:
        """``loop`` has ended: raise ``ActorFailed``."""
        raise ActorFailed(
            f"{self.loops[loop]} stopped: {loop_cause(loop)}; full log: {self.run.log_path(self.loops[loop])}"
        )

    def close(self) -> None:
        """Stop watching (the run is ending): a loop that ended with an error has been reported,
        or the run failed for another reason first."""
        for loop in self.loops:
            if loop.done() and not loop.cancelled():
                loop.exception()  # retrieved: not logged again as "never retrieved"
            else:
                loop.cancel()


def ray_death(text: str) -> str:
    """What Ray's text about a dead actor says happened, in words, in place of its paragraph of
    possible causes (repeated at every death). The exit type Ray records tells them apart."""
    pid = re.search(r"\bpid[:=]\s*(\d+)", text)
    process = f"its process (pid {pid.group(1)})" if pid else "its process"
    if "NODE_OUT_OF_MEMORY" in text or "running low on memory" in text:
        return f"Ray's memory monitor killed {process}: its node ran low on memory"
    if "node has died" in text or "NODE_DIED" in text or "node was terminated" in text:
        return f"{process} was lost with its node (the machine stopped or left the cluster)"
    if "is unavailable" in text:
        return f"{process} cannot be reached: its node left the cluster, or the process hangs"
    if "INTENDED_USER_EXIT" in text or "INTENDED_SYSTEM_EXIT" in text:
        return f"{process} was stopped on purpose (ray stop, or its job ended)"
    if "SYSTEM_ERROR" in text or "connection error" in text or "died unexpectedly" in text:
        return (
            f"{process} ended without raising an error: a signal killed it (kill -9, or the kernel's OOM "
            "killer: see dmesg) or it crashed"
        )
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0][:200] if lines else "it died"


def loop_cause(loop: asyncio.Future) -> str:
    if loop.cancelled():
        return "its loop was cancelled"
    if loop.exception() is None:
        return "its loop returned early"
    text = str(loop.exception()).strip()
    return text.splitlines()[-1] if text else type(loop.exception()).__name__


class ActorKeepsFailing(ActorFailed):
    """An actor died with the same error as an earlier one: replacing it again would not help."""


@dataclass
class Death:
    line: str  # the error in one line: "Type: message" (and its root cause), or what Ray said
    known: bool  # the loop raised this exception (not a process that died: its cause is a guess)
    text: str  # what goes into the actor's log: the traceback, or Ray's message

    @property
    def signature(self) -> str:
        """The line with numbers (pids, addresses, sizes) blanked: the same error in another process."""
        return re.sub(r"0x[0-9a-fA-F]+|\d+", "N", self.line)


def describe_death(loop: asyncio.Future, log_path: str) -> Death:
    """Why an actor's ``run`` loop ended, from what the driver holds: a ``RayTaskError`` (the
    loop raised: its text is the remote traceback), a dead process (``RayActorError``: the last
    error line in its log, if it wrote one), or any other exception."""
    exc = loop.exception()
    if exc is None:
        return Death(loop_cause(loop), False, loop_cause(loop))
    if isinstance(getattr(exc, "cause", None), BaseException):  # raised inside the actor
        return Death(_one_line(exception_lines(str(exc)), exc), True, str(exc))
    if _process_died(exc):
        said = str(exc).strip()
        last = last_error_line(log_path)
        if last:  # quoted, but not proof of the cause: a handled error (a reward's) is logged too
            return Death(_cut(f"{ray_death(said)}; the last error in its log: {last}"), False, said)
        return Death(_cut(ray_death(said)), False, said)
    text = "".join(traceback.format_exception(exc))
    return Death(_one_line(exception_lines(text), exc), True, text)


def _one_line(lines: list[str], exc: BaseException) -> str:
    """The outermost exception's line, with the root cause's when it differs (a wrapper such as
    vLLM's ``EngineDeadError`` names only itself)."""
    if not lines:
        said = str(exc).strip().splitlines()
        return _cut(f"{type(exc).__name__}: {said[-1]}" if said else type(exc).__name__)
    outer, root = lines[-1], lines[0]
    return _cut(outer if outer == root else f"{outer} (caused by {root})")


def _cut(line: str) -> str:
    return line if len(line) <= LINE_CHARS else line[: LINE_CHARS - 3] + "..."


def _process_died(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, RayActorError)


def record_death(name: str, death: Death, log_path: str) -> None:
    """Append the death to the actor's log, when the run's logs/ folder is there (every real run)."""
    if os.path.isdir(os.path.dirname(log_path)):
        append_log(log_path, f"--- {name} {DEATH_MARK} ---\n{death.text}")


def fix_for(line: str) -> str:
    """What to try for an error that repeats, by what it says."""
    if "out of memory" in line.lower() or "OutOfMemory" in line:
        return (
            "give the engine more memory or less to hold (engine.gpu_memory_utilization, engine.kv_cache_gib, "
            "engine.max_model_len)"
        )
    return "fix what it names (the traceback is at the end of the log), then resume"


class ActorStarter(Protocol):
    """How the pool starts an actor and its loop (``launch/assemble.py`` makes the real one)."""

    def name(self, index: int) -> str:
        """Actor ``index``'s name (one that joins the fleet gets the next index)."""

    async def start(self, index: int) -> object:
        """A new, ready generation actor ``index`` (on its placement bundle, placed again if its node is gone)."""

    def run_loop(self, actor: object, index: int) -> object:
        """Start ``actor``'s ``run`` loop; returns its Ray reference."""


class ActorPool(ActorWatch):
    """The generation actors, by name: their loops are watched, and a dead one is replaced."""

    def __init__(
        self,
        actors: list,
        names: list[str],
        starter: ActorStarter,
        run,
        admission: Admission,
        queues: tuple,
        max_restarts: int,
        cannot_restart: str | None = None,
        restarts: dict[str, int] | None = None,
    ):
        """``queues``: (prompt queue, results queue); ``admission`` has the prompts a dead actor held
        generated again; ``cannot_restart``: why no actor can be replaced, or None."""
        self.actors, self.names, self.starter = list(actors), names, starter
        self.admission, self.queues = admission, queues
        self.max_restarts, self.cannot_restart = max_restarts, cannot_restart
        self.restarts = collections.Counter(restarts or {})
        self.deaths: dict[str, str] = {}  # a death's signature -> the actor that died so first
        self.on_replaced = None  # async (new actor) -> None: the colocated schedule puts it to sleep in training
        self.planned = len(names)  # the actors the run started with; later ones joined by `tandem scale`
        self.leaving: set[str] = set()  # actors stopped on purpose (`tandem scale`): their loops end, no restart
        self.starting: set[asyncio.Future] = set()  # joined actors being started again, beside the run
        super().__init__({starter.run_loop(a, i): n for i, (a, n) in enumerate(zip(actors, names, strict=True))}, run)

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    def close(self) -> None:
        for starting in self.starting:  # the run is ending: no joined actor is started again
            starting.cancel()
        super().close()

    @property
    def live(self) -> list[str]:
        """The actors in the fleet now, oldest first (not those that left)."""
        return [name for name in self.names if name not in self.leaving]

    async def resize(self, size: int) -> None:
        """Grow or shrink the fleet to ``size`` actors (``runtime/fleet.py``): new actors start on any node
        with room, the newest leave first and the prompts they held are generated again."""
        live = self.live
        if size == len(live):
            return
        self.run.say(f"fleet: {len(live)} -> {size} generation actors (tandem scale)")
        for name in reversed(live[size:]):
            await self._leave(name, "left the fleet")
        for _ in range(size - len(live)):
            if not await self._join():
                break
        self.run.say(f"fleet: {len(self.live)} generation actors ({', '.join(self.live)})")

    async def _join(self) -> bool:
        """One more actor, under the next free name; False when no node took it in time (said)."""
        index = len(self.names)
        name = self.starter.name(index)
        self.names.append(name)
        self.actors.append(None)
        try:
            self.actors[index] = await self.starter.start(index)
        except Exception as exc:  # no room within run.startup_timeout_s, or it failed to start: said, not fatal
            self.leaving.add(name)
            self.run.say(f"fleet: {name} did not join: {error_line(exc)}")
            return False
        self.watch(self.starter.run_loop(self.actors[index], index), name)
        return True

    async def _leave(self, name: str, why: str) -> None:
        """``name`` stops; its loop's end hands its prompts back (``ended``)."""
        self.leaving.add(name)
        _kill(self.actors[self.names.index(name)])
        self.run.say(f"{name} {why}; the prompts it held are generated again by the others")

    async def _hand_back(self, name: str) -> None:
        """A leaving actor's loop ended: the prompts it took and did not push go out again, once."""
        held = await self._held_by(name)
        await self.admission.again(held)
        self.refs.pop(name, None)  # not waited for at the end
        if held:
            self.run.say(f"{name}: {len(held)} prompt(s) it held are generated again")

    async def ended(self, loop: asyncio.Future) -> None:
        name = self.loops.pop(loop)
        if loop.cancelled():  # the run is stopping
            return
        if name in self.leaving:
            await self._hand_back(name)
            return
        log = self.run.log_path(name)
        death = describe_death(loop, log)
        record_death(name, death, log)
        cause = death.line
        if death.known and death.signature in self.deaths:
            raise ActorKeepsFailing(
                f"{name} stopped: {cause}; {self.deaths[death.signature]} died of the same error before, so a new "
                f"actor would too: {fix_for(cause)}; full log: {log}"
            )
        if death.known:
            self.deaths[death.signature] = name
        if self.cannot_restart:
            raise ActorFailed(f"{name} stopped: {cause}; {self.cannot_restart}; full log: {log}")
        if self.restarts[name] >= self.max_restarts:
            raise ActorFailed(
                f"{name} stopped: {cause}; it was replaced {self.restarts[name]} time(s) already "
                f"(resources.actors.max_restarts); full log: {log}"
            )
        held = await self._held_by(name)
        self.restarts[name] += 1
        self.run.say(
            f"{name} stopped: {cause}; starting a new one (restart {self.restarts[name]} of {self.max_restarts}), "
            f"{len(held)} prompt(s) it held are generated again; log: {log}"
        )
        index = self.names.index(name)
        _kill(self.actors[index])  # its resources (a placement bundle) go to the new one
        await self.admission.again(held)
        if index >= self.planned:  # one that joined: started again beside the run, which goes on meanwhile
            self.refs.pop(name, None)  # (watched again once it is up)
            starting = asyncio.ensure_future(self._start_again(name, index))
            self.starting.add(starting)
            starting.add_done_callback(self.starting.discard)
            return
        self.actors[index] = await self.starter.start(index)
        self.watch(self.starter.run_loop(self.actors[index], index), name)
        if self.on_replaced is not None:
            await self.on_replaced(self.actors[index])

    async def _start_again(self, name: str, index: int) -> None:
        """A joined actor, started again; where no node has room for it in time, it leaves the fleet (the
        actors the run started with keep their placement bundles: only they stop the run)."""
        try:
            self.actors[index] = await self.starter.start(index)
        except Exception as exc:
            self.leaving.add(name)
            n = len(self.live)
            self.run.say(f"fleet: {name} could not be started again ({error_line(exc)}); {n} actor(s) go on")
            return
        self.watch(self.starter.run_loop(self.actors[index], index), name)
        self.run.say(f"fleet: {name} is back ({len(self.live)} generation actors)")

    async def _held_by(self, name: str) -> list[int]:
        prompt_queue, results_queue = self.queues
        taken = await prompt_queue.taken_by(name)
        waiting = set(await results_queue.prompt_ids())
        return sorted(i for i in set(taken) if self.admission.outstanding(i) and i not in waiting)


def error_line(exc: BaseException) -> str:
    said = str(exc).strip().splitlines()
    return _cut(f"{type(exc).__name__}: {said[-1]}" if said else type(exc).__name__)


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass
