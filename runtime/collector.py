"""Batch collection: groups from the results queue until a step's batch is complete.

Each group that arrives is routed: an evaluation group to the evaluator, a duplicate ignored, a
group too stale to train (its oldest token more than ``max_staleness`` versions behind the step)
back to admission, a group without a learning signal left out (dynamic sampling), the rest into the
batch. A dead actor's loop is handed to the actor pool (``runtime/supervise.py``), which replaces
it or raises; every wait has a deadline (``run.data_timeout_s``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from queues.bounded import QueueClosed
from queues.messages import TrajectoryGroup
from runtime.supervise import ActorWatch


class DataTimeout(TimeoutError):
    """The learner waited longer than run.data_timeout_s for a batch."""


@dataclass
class Batch:
    groups: list[TrajectoryGroup]
    step: int
    dropped: int  # groups thrown away as too stale while collecting this batch
    wait_s: float  # time the learner waited for data
    duplicates: int = 0  # groups ignored: their prompt was trained already, or is in this batch
    filtered: int = 0  # groups left out by dynamic sampling (all rewards equal), trained on by no step
    zero_variance: int = 0  # groups with all rewards equal among those collected (filtered or not)
    filtered_ids: list[int] = field(default_factory=list)
    oversample_reached: bool = False  # the filter's limit was reached: zero-variance groups filled the batch
    staleness: collections.Counter = field(default_factory=collections.Counter)  # per-token histogram
    # prompts given up after their groups were too stale at every try: (prompt id, age in steps, mean length)
    starved: list[tuple[int, int, float]] = field(default_factory=list)


def settled(future: asyncio.Future, say: Callable[[str], None] | None = None, what: str = "") -> asyncio.Future:
    """``future``, its outcome marked as seen: a get or send abandoned as the run stops, which then fails
    because its queue closed, is not printed as "Task exception was never retrieved". Any other
    error is said (``say``), not swallowed."""

    def seen(done: asyncio.Future) -> None:
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None and not isinstance(exc, QueueClosed) and say is not None:
            say(f"{what or 'a background task'} failed: {type(exc).__name__}: {exc}")

    future.add_done_callback(seen)
    return future


WAIT_NOTICE_S = 30.0  # a step that waits this long for its batch says so, again every as long


class BatchCollector:
    """Pulls groups from the results queue until a step's batch is complete. ``actors``: the actor
    pool (or an ``ActorWatch``, or a dict of each actor's ``run`` reference by name), told of a loop that
    ended. ``admission`` (``runtime/admission.py``) says whether a group is new and takes back a group
    too stale to train or without a signal (None: nothing is trained here, as in ``tandem eval``: every group
    counts as new and none is too stale; ``max_filtered`` needs an admission);
    evaluation groups go to ``evaluator`` (``runtime/evaluation.py``); the actors' timeline spans that
    ride on the groups go to ``run``'s timeline."""

    def __init__(
        self,
        results_queue,
        actors,
        run,
        timeout: float,
        admission=None,
        evaluator=None,
        max_filtered: int | None = None,
        outcomes: Callable[[TrajectoryGroup], list[float]] = lambda group: [t.reward for t in group.trajectories],
    ):
        self.queue, self.run, self.timeout = results_queue, run, timeout
        self.admission, self.evaluator = admission, evaluator
        self.actors = actors if isinstance(actors, ActorWatch) else ActorWatch(actors, run)
        # dynamic sampling: up to ``max_filtered`` zero-variance groups a step are left out (None: off)
        self.max_filtered = max_filtered
        self.outcomes = outcomes  # a group's rewards as trained (with the per-sequence penalties): its signal
        self.last_from: dict[str, float] = {}  # actor name -> when its latest group arrived
        self.longest_gap = 0.0  # the longest wait between two groups of one actor so far
        self.started = time.monotonic()

    def _arrived(self, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        spans = [span for group in groups for span in group.spans]
        if spans and self.run is not None:
            self.run.timeline(spans)
        now = time.monotonic()
        for group in groups:
            group.spans = []
            if group.actor_name in self.last_from:
                self.longest_gap = max(self.longest_gap, now - self.last_from[group.actor_name])
            self.last_from[group.actor_name] = now
        return groups

    def quiet_actors(self, now: float) -> list[tuple[str, float]]:
        """Actors that have sent no group for longer than ``WAIT_NOTICE_S`` and than twice the longest gap
        seen between two groups of one actor (long generations are not a stall), with how long."""
        limit = max(WAIT_NOTICE_S, 2 * self.longest_gap)
        silent = ((name, now - self.last_from.get(name, self.started)) for name in sorted(self.actors.refs))
        return [(name, quiet) for name, quiet in silent if quiet >= limit]

    def waiting_notice(self, step: int, have: int, want: int, waited: float, quiet: list[tuple[str, float]]) -> str:
        """What the console says while a step waits long for its batch and some actors are silent
        (frozen, or stuck in a slow reward or generation): which, for how long, and their logs."""
        who = ", ".join(f"{name} ({s:.0f}s; its log: {self.run.log_path(name)})" for name, s in quiet)
        return (
            f"step {step + 1}: waiting {waited:.0f}s for prompt groups ({have} of {want} so far; the run stops "
            f"after run.data_timeout_s = {self.timeout:.0f}s); nothing for that long from {who}"
        )

    async def collect(self, num_groups: int, step: int, max_staleness: int) -> Batch:
        start = time.monotonic()
        deadline = start + self.timeout
        batch = Batch(groups=[], step=step, dropped=0, wait_s=0.0)
        seen: set[int] = set()
        got = None  # the pending get: never abandoned (what it takes from the queue must not be lost)
        notice_at = start + WAIT_NOTICE_S
        while len(batch.groups) < num_groups:
            if time.monotonic() >= notice_at:  # a silent actor is said, not waited on without a word
                now = time.monotonic()
                quiet = self.quiet_actors(now)
                if quiet:
                    self.run.say(self.waiting_notice(step, len(batch.groups), num_groups, now - start, quiet))
                notice_at = now + WAIT_NOTICE_S
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataTimeout(
                    f"step {step}: only {len(batch.groups)} of {num_groups} prompt groups arrived in "
                    f"{self.timeout:.0f}s (run.data_timeout_s); see the actor logs in {self.run.logs}"
                )
            if got is None:
                got = settled(asyncio.ensure_future(self.queue.get_batch_async(num_groups - len(batch.groups), left)))
            wake = max(0.0, min(left, notice_at - time.monotonic()))
            await asyncio.wait({got, *self.actors.loops}, timeout=wake, return_when=asyncio.FIRST_COMPLETED)
            for loop in [loop for loop in self.actors.loops if loop.done()]:
                await self.actors.ended(loop)  # raises, or replaces the actor
            if not got.done():
                continue
            groups, got = self._arrived(got.result()), None
            for group in groups:
                if group.purpose == "eval":
                    self._evaluate(group)
                elif group.prompt_id in seen or (self.admission is not None and not self.admission.is_new(group)):
                    batch.duplicates += 1  # e.g. a dead actor's late result of a prompt generated again
                elif self.admission is not None and (age := step - group.oldest_version) > max_staleness:
                    batch.dropped += 1  # never trained on: counted and generated again (or given up)
                    if await self.admission.too_stale(group):
                        lengths = [len(t.completion_token_ids) for t in group.trajectories]
                        batch.starved.append((group.prompt_id, age, sum(lengths) / max(len(lengths), 1)))
                elif self._filter_out(batch, group):
                    batch.filtered += 1  # no learning signal: left out, and one more prompt admitted
                    batch.filtered_ids.append(group.prompt_id)
                    await self.admission.no_signal(group)
                else:
                    batch.groups.append(group)
                    seen.add(group.prompt_id)
                    if self.admission is not None:
                        self.admission.in_batch(group)
        batch.groups.sort(key=lambda g: g.prompt_id)  # arrival order must not change the result
        for group in batch.groups:
            for traj in group.trajectories:
                ages, counts = np.unique(step - traj.policy_versions.astype(np.int64), return_counts=True)
                batch.staleness.update(dict(zip(ages.tolist(), counts.tolist())))
        batch.wait_s = time.monotonic() - start
        return batch

    async def drain_eval(self, pending: Callable[[], bool], timeout: float) -> None:
        """After the last step: route evaluation groups until ``pending()`` is False or ``timeout`` passes.
        Training groups that still arrive are left untrained (their prompts stay outstanding)."""
        deadline = time.monotonic() + timeout
        while pending() and (left := deadline - time.monotonic()) > 0:
            got = settled(asyncio.ensure_future(self.queue.get_batch_async(64, timeout=min(left, 5.0))))
            await asyncio.wait({got, *self.actors.loops}, return_when=asyncio.FIRST_COMPLETED)
            for loop in [loop for loop in self.actors.loops if loop.done()]:
                await self.actors.ended(loop)
            for group in self._arrived(await got):
                if group.purpose == "eval":
                    self._evaluate(group)

    def _evaluate(self, group: TrajectoryGroup) -> None:
        """An evaluation group: scored for the held-out metrics, never trained on."""
        if self.evaluator is not None:
            self.evaluator.add(group)

    def _filter_out(self, batch: Batch, group: TrajectoryGroup) -> bool:
        rewards = self.outcomes(group)
        if max(rewards) != min(rewards):
            return False
        batch.zero_variance += 1
        if self.max_filtered is None:
            return False
        if batch.filtered >= self.max_filtered:
            batch.oversample_reached = True
            return False
        return True

    def close(self) -> None:
        self.actors.close()
