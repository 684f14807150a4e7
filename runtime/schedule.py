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
meaning: the phase's last step trains on tokens ``max_staleness`` versions old. What may still run
beside training: a held-out round (its prompts go out at once, as in ``overlapped``) and a prompt
admitted in place of one dynamic sampling left out late in a phase.
"""

from __future__ import annotations

import collections
from contextlib import asynccontextmanager

from runtime.admission import Admission
from runtime.collector import Batch


class Overlapped:
    """Generation and training overlap: one batch per collect, every version published."""

    def __init__(self, admission: Admission, max_staleness: int):
        self.admission, self.max_staleness = admission, max_staleness
        self.ready: collections.deque[Batch] = collections.deque()  # batches generated, not yet trained

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


class Colocated(Overlapped):
    """Generation and training take turns on shared devices; a phase is ``max_staleness + 1`` steps."""

    def __init__(self, admission: Admission, max_staleness: int):
        super().__init__(admission, max_staleness)
        admission.pause()  # nothing generates before the first generation phase

    def phase_steps(self, step: int, steps: int) -> int:
        return min(self.max_staleness + 1, steps - step)

    @asynccontextmanager
    async def generation(self, steps: int, prompts_per_step: int):
        self.admission.resume(budget=steps * prompts_per_step)  # the phase's prompts, none for later steps
        try:
            yield
        finally:
            self.admission.pause()

    def publishes(self) -> bool:
        return not self.ready  # the phase's last step: the next phase generates with this version


SCHEDULES = {"overlapped": Overlapped, "colocated": Colocated}
