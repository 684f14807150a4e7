"""The schedule (``run.schedule``): when the actors generate and when the learner trains.

``overlapped`` (the default): actors and learner ranks have devices of their own. The rollout loop
admits prompts whenever ``max_staleness`` allows, so the actors generate step n+1's batch (with
policy n, or older up to ``max_staleness`` versions) while the learner trains step n; every step's
weights are published as soon as they exist.

``colocated``: the actors live on the learner ranks' devices (``launch/plan.py``) and the two take
turns, each phase using all of them. A generation phase lets the admitted prompts out, for the next
``max_staleness + 1`` steps at once (all with the policy just published), and waits until their
batches are back; then admission closes and the learner trains those steps one after another, with
no generation beside them. Only the phase's last version is published (an earlier one would reach
no actor before the next phase), unless a held-out round needs it. ``max_staleness`` keeps its
meaning: the phase's last step trains on tokens ``max_staleness`` versions old. Between phases the
engines sleep and wake (``runtime/turns.py``): an actor starts no generation during training, so a
held-out round due then, or a prompt admitted late in a phase, waits for the next generation phase.
"""

from __future__ import annotations

import collections
import contextlib
from contextlib import asynccontextmanager

from runtime.admission import Admission
from runtime.collector import Batch
from runtime.turns import NoTurns


class Overlapped:
    """Generation and training overlap: one batch per collect, every version published. ``turns``: what
    the processes sharing devices do between phases (``runtime/turns.py``; colocated only)."""

    def __init__(self, admission: Admission, max_staleness: int, turns=None):
        self.admission, self.max_staleness = admission, max_staleness
        self.turns = turns or NoTurns()
        self.ready: collections.deque[Batch] = collections.deque()  # batches generated, not yet trained
        self.last_published = admission.pace.version  # the newest version on the weight channel

    def phase_steps(self, step: int, steps: int) -> int:
        """How many steps' batches the generation phase starting at ``step`` collects."""
        return 1

    @asynccontextmanager
    async def generation(self, steps: int, prompts_per_step: int):
        """The generation phase of ``steps`` steps' batches: here, always on."""
        yield

    def publishes(self) -> bool:
        """Whether the version just trained goes to the actors now."""
        return True

    def published(self, version: int) -> None:
        """``version`` is on the weight channel: the actors can load it."""
        self.last_published = version

    @asynccontextmanager
    async def rest(self):
        """The last held-out rounds come back inside: the actors may generate (then the final save)."""
        yield

    async def end(self) -> None:
        """The run is over (before the queues close)."""


class Colocated(Overlapped):
    """Generation and training take turns on shared devices; a phase is ``max_staleness + 1`` steps."""

    def __init__(self, admission: Admission, max_staleness: int, turns=None):
        super().__init__(admission, max_staleness, turns)
        admission.pause()  # nothing generates before the first generation phase

    def phase_steps(self, step: int, steps: int) -> int:
        return min(self.max_staleness + 1, steps - step)

    @asynccontextmanager
    async def generation(self, steps: int, prompts_per_step: int):
        await self.turns.generation(self.last_published)  # the learner's states out, the engines in
        self.admission.resume(budget=steps * prompts_per_step)  # the phase's prompts, none for later steps
        try:
            yield
        except BaseException as exc:
            self.admission.pause()
            await self._settle(exc)
            raise
        self.admission.pause()
        await self.turns.training()  # the engines out, the learner's states in

    async def _settle(self, exc: BaseException) -> None:
        """After an error inside a phase: the learner's states back for the checkpoint (the turns have their
        deadlines); the run's own error matters more than one of these turns (and a cancelled run just ends)."""
        if isinstance(exc, Exception):
            with contextlib.suppress(Exception):
                await self.turns.training()

    def publishes(self) -> bool:
        return not self.ready  # the phase's last step: the next phase generates with this version

    @asynccontextmanager
    async def rest(self):
        await self.turns.generation(self.last_published)  # (a run stopped mid-phase published no later one)
        try:
            yield
        except BaseException as exc:
            await self._settle(exc)
            raise
        await self.turns.training()  # the learner's states back for the final save

    async def end(self) -> None:
        await self.turns.end()  # an actor asleep with prompts it took would wait for a wake that never comes


SCHEDULES = {"overlapped": Overlapped, "colocated": Colocated}
