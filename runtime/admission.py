"""Admission: which prompts go out to the actors, and when (the rollout loop).

A prompt leaves the prompt ledger (``runtime/ledger.py``) for the prompt queue only while it can
still be trained on within ``max_staleness`` policy versions (``Pace``). A group that comes back
unusable (too stale, left out by dynamic sampling, held by an actor that died) frees its place here,
and a stale or lost prompt is generated again.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from queues.messages import PromptRequest, TrajectoryGroup
from runtime.ledger import PromptLedger

STALE_TRIES = 2  # groups of one prompt found too stale before the prompt is given up (Admission.too_stale)


class Pace:
    """Admission control: the ``i``-th prompt handed out (counting from this process's first step,
    policy version ``v0``) may be generated once the learner's version ``v`` satisfies
    ``i < (v - v0 + k + 1) * P + dropped``, i.e. it is trained at a step <= v + k (in arrival
    order) and so has staleness <= k. A prompt that is dropped as too stale, or lost with its
    actor, frees its place (``drop``) for the prompt that is generated again."""

    def __init__(self, prompts_per_step: int, max_staleness: int, start_version: int = 0):
        self.P, self.k = prompts_per_step, max_staleness
        self.start = self.version = start_version
        self.dropped = 0
        self._changed = asyncio.Condition()

    def allowance(self) -> int:
        return (self.version - self.start + self.k + 1) * self.P + self.dropped

    async def admit(self, slot: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: slot < self.allowance())

    async def advance(self, version: int) -> None:
        """Version ``version`` is published: the allowance grows by ``P``."""
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def drop(self, count: int = 1) -> None:
        """Groups were dropped as too stale or lost: as many more prompts may be admitted."""
        async with self._changed:
            self.dropped += count
            self._changed.notify_all()


class Admission:
    """The rollout side of the loop. ``feed`` is the rollout loop: it puts every prompt the pace admits
    into ``prompt_queue`` (token ids rendered by ``render``); the other methods are what the batch
    collector, the actor pool and the training loop tell it about prompts that came back."""

    def __init__(
        self,
        ledger: PromptLedger,
        pace: Pace,
        prompt_queue,
        render: Callable[[dict], list[int]],
        put_timeout_s: float,
    ):
        self.ledger, self.pace, self.prompt_queue = ledger, pace, prompt_queue
        self.render, self.put_timeout_s = render, put_timeout_s
        self.batched: set[int] = set()  # prompts whose group is in a collected batch, not yet trained
        self.stale_tries: collections.Counter[int] = collections.Counter()  # prompt -> its groups found too stale
        self._paused = False  # the colocated schedule's training phase: nothing goes out
        self._budget: int | None = None  # prompts still to let out in this phase (None: as the pace allows)
        self._open = asyncio.Event()  # set while neither paused nor out of budget
        self._open.set()

    def pause(self) -> None:
        """Admit nothing until ``resume`` (the colocated schedule's training phase)."""
        self._paused = True
        self._update()

    def resume(self, budget: int | None = None) -> None:
        """Admit again: as the pace allows, and at most ``budget`` prompts when given (plus one for each
        that must be replaced meanwhile: too stale, left out, lost)."""
        self._paused, self._budget = False, budget
        self._update()

    def _replace(self, count: int) -> None:
        if self._budget is not None:
            self._budget += count
            self._update()

    def _update(self) -> None:
        if not self._paused and self._budget != 0:
            self._open.set()
        else:
            self._open.clear()

    async def feed(self) -> None:
        """The rollout loop: admit prompts as the pace allows, forever (the run cancels it)."""
        slot = 0
        while True:
            await self.pace.admit(slot)  # waits until this prompt can be trained on within k versions
            while not self._open.is_set():  # and until the schedule lets prompts out (checked again on waking:
                await self._open.wait()  # a pause may have come between the wake-up and this turn)
            # every prompt admissible now goes in one put (up to a step's): one queue call, not one
            # per prompt, and an actor waiting for prompts wakes to a full request, not to the first one
            count = min(self.pace.P, self.pace.allowance() - slot, self._budget or self.pace.P)
            if self._budget is not None:
                self._budget -= count
                self._update()
            requests = []
            for _ in range(count):
                prompt_id, row = self.ledger.take()
                requests.append(
                    PromptRequest(
                        prompt_id=prompt_id, row=row, min_version=self.pace.version, prompt_token_ids=self.render(row)
                    )
                )
            slot += count
            await self.prompt_queue.put_many_async(requests, timeout=self.put_timeout_s)

    def outstanding(self, prompt_id: int) -> bool:
        """Admitted, and neither trained nor in a batch waiting to be trained: a group of it is new (not a
        duplicate), and it is generated again if its actor dies."""
        return self.ledger.is_outstanding(prompt_id) and prompt_id not in self.batched

    def is_new(self, group: TrajectoryGroup) -> bool:
        return self.outstanding(group.prompt_id)

    def in_batch(self, group: TrajectoryGroup) -> None:
        """The collector put ``group`` in a batch (the colocated schedule collects a phase's batches before
        training them): until it is trained, no other group of its prompt is new."""
        self.batched.add(group.prompt_id)

    async def too_stale(self, group: TrajectoryGroup) -> bool:
        """A group too old to train: its prompt is generated again, in a place of its own; after
        ``STALE_TRIES`` such groups it is given up (done, trained by no step) and True is returned. A
        completion that takes longer than ``max_staleness`` steps to generate (in flight, its first tokens
        age while it runs) would be dropped at every try: the long tail would be generated forever and
        trained never, and the run would learn from its short completions only (``SignalWatch`` says so)."""
        prompt_id = group.prompt_id
        if not self.ledger.is_outstanding(prompt_id):
            return False
        self.stale_tries[prompt_id] += 1
        starved = self.stale_tries[prompt_id] >= STALE_TRIES
        if starved:
            self.ledger.trained(prompt_id)
            del self.stale_tries[prompt_id]
        else:
            self.ledger.again([prompt_id])
        self._replace(1)
        await self.pace.drop()
        return starved

    async def no_signal(self, group: TrajectoryGroup) -> None:
        """A group left out by dynamic sampling: its prompt is done (not generated again), and one
        more prompt may be admitted in its place."""
        self.ledger.trained(group.prompt_id)
        self.stale_tries.pop(group.prompt_id, None)
        self._replace(1)
        await self.pace.drop()

    async def again(self, prompt_ids: list[int]) -> None:
        """Prompts lost with an actor: generated again, each in a place of its own."""
        self.ledger.again(prompt_ids)
        self._replace(len(prompt_ids))
        await self.pace.drop(len(prompt_ids))

    def trained(self, groups: list[TrajectoryGroup]) -> None:
        for group in groups:
            self.ledger.trained(group.prompt_id)
            self.batched.discard(group.prompt_id)
            self.stale_tries.pop(group.prompt_id, None)

    async def published(self, version: int) -> None:
        """Policy ``version`` is on the weight channel: a step's more prompts may go out."""
        await self.pace.advance(version)
