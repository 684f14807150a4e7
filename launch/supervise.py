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
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

from launch.ledger import PromptLedger
from launch.stepping import ActorFailed, ActorWatch, loop_cause


class ActorPool(ActorWatch):
    def __init__(
        self,
        actors: list,
        names: list[str],
        start_loop: Callable[[object, int], object],
        start_actor: Callable[[int], Awaitable[object]],
        run,
        ledger: PromptLedger,
        queues: tuple,
        on_requeue: Callable[[int], Awaitable],
        max_restarts: int,
        cannot_restart: str | None = None,
        restarts: dict[str, int] | None = None,
    ):
        """``start_loop(actor, index)``: the actor's ``run`` call; ``start_actor(index)``: a new,
        ready actor; ``queues``: (prompt queue, results queue); ``on_requeue(n)``: n prompts are
        generated again; ``cannot_restart``: why no actor can be replaced, or None."""
        self.actors, self.names = list(actors), names
        self.start_loop, self.start_actor = start_loop, start_actor
        self.ledger, self.queues, self.on_requeue = ledger, queues, on_requeue
        self.max_restarts, self.cannot_restart = max_restarts, cannot_restart
        self.restarts = collections.Counter(restarts or {})
        super().__init__({start_loop(a, i): n for i, (a, n) in enumerate(zip(actors, names, strict=True))}, run)

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    async def ended(self, loop: asyncio.Future) -> None:
        name = self.loops.pop(loop)
        cause, log = loop_cause(loop), self.run.log_path(name)
        if loop.cancelled():  # the run is stopping
            return
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
        self.ledger.again(held)
        await self.on_requeue(len(held))
        self.actors[index] = await self.start_actor(index)
        self.watch(self.start_loop(self.actors[index], index), name)

    async def _held_by(self, name: str) -> list[int]:
        prompt_queue, results_queue = self.queues
        taken = await prompt_queue.taken_by(name)
        waiting = set(await results_queue.prompt_ids())
        return sorted(i for i in set(taken) if self.ledger.is_outstanding(i) and i not in waiting)


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass
