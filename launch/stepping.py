"""The two loops' bookkeeping: admission control, batch collection, per-step metrics.

Staleness of a token = the learner's policy version when it trains on it (the step
index) minus the version that generated it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from queues.messages import TrajectoryGroup


class DataTimeout(TimeoutError):
    """The learner waited longer than run.data_timeout_s for a batch."""


class ActorFailed(RuntimeError):
    """A generation actor's loop ended with an error."""


class Pace:
    """Admission control: prompt ``i`` may be generated once the learner's version ``v``
    satisfies ``i < (v + k + 1) * P + dropped``, i.e. it is trained at a step <= v + k
    (in arrival order) and so has staleness <= k. Dropped prompts are replaced."""

    def __init__(self, prompts_per_step: int, max_staleness: int):
        self.P, self.k = prompts_per_step, max_staleness
        self.version = 0
        self.dropped = 0
        self._changed = asyncio.Condition()

    def allowance(self) -> int:
        return (self.version + self.k + 1) * self.P + self.dropped

    async def admit(self, prompt_id: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: prompt_id < self.allowance())

    async def advance(self, version: int) -> None:
        """Version ``version`` is published: the allowance grows by ``P``."""
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def drop(self) -> None:
        """A group was dropped as too stale: one more prompt may be admitted in its place."""
        async with self._changed:
            self.dropped += 1
            self._changed.notify_all()


@dataclass
class Batch:
    groups: list[TrajectoryGroup]
    step: int
    dropped: int  # groups thrown away as too stale while collecting this batch
    wait_s: float  # time the learner waited for data
    staleness: collections.Counter = field(default_factory=collections.Counter)  # per-token histogram


class BatchCollector:
    """Pulls groups from the results queue until a step's batch is complete. ``actor_loops``:
    each generation actor's ``run`` reference by actor name; one that ends during a run failed."""

    def __init__(self, results_queue, actor_loops: dict, run, timeout: float, on_drop: Callable[[], Awaitable]):
        self.queue, self.run = results_queue, run
        self.timeout, self.on_drop = timeout, on_drop
        # an awaitable per actor loop, created once: waiting on them is how a dead actor is noticed
        self.loops = {asyncio.ensure_future(ref): name for ref, name in actor_loops.items()}

    async def collect(self, num_groups: int, step: int, max_staleness: int) -> Batch:
        start = time.monotonic()
        deadline = start + self.timeout
        batch = Batch(groups=[], step=step, dropped=0, wait_s=0.0)
        while len(batch.groups) < num_groups:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataTimeout(
                    f"step {step}: only {len(batch.groups)} of {num_groups} prompt groups arrived in "
                    f"{self.timeout:.0f}s (run.data_timeout_s); see the actor logs in {self.run.logs}"
                )
            got = asyncio.ensure_future(self.queue.get_batch_async(num_groups - len(batch.groups), timeout=left))
            await asyncio.wait({got, *self.loops}, return_when=asyncio.FIRST_COMPLETED)
            if not got.done():
                got.cancel()
                self.check_actors()
            for group in got.result():
                if step - group.oldest_version > max_staleness:
                    batch.dropped += 1  # never trained on: counted and replaced
                    await self.on_drop()
                    continue
                batch.groups.append(group)
        batch.groups.sort(key=lambda g: g.prompt_id)  # arrival order must not change the result
        for group in batch.groups:
            for traj in group.trajectories:
                ages, counts = np.unique(step - traj.policy_versions.astype(np.int64), return_counts=True)
                batch.staleness.update(dict(zip(ages.tolist(), counts.tolist())))
        batch.wait_s = time.monotonic() - start
        return batch

    def close(self) -> None:
        """Stop watching the actor loops (the run is ending): a loop that ended with an error has
        been reported, or the run failed for another reason first."""
        for loop in self.loops:
            if loop.done() and not loop.cancelled():
                loop.exception()  # retrieved: not logged again as "never retrieved"
            else:
                loop.cancel()

    def check_actors(self) -> None:
        """An actor loop only returns after shutdown; one that has ended now has failed."""
        for loop, name in self.loops.items():
            if not loop.done():
                continue
            if loop.exception() is None:
                cause = "its loop returned early"
            else:
                text = str(loop.exception()).strip()
                cause = text.splitlines()[-1] if text else type(loop.exception()).__name__
            raise ActorFailed(f"{name} stopped: {cause}; full log: {self.run.log_path(name)}")


def step_metrics(batch: Batch, learner: dict[str, float], step_seconds: float) -> dict[str, Any]:
    trajs = [t for g in batch.groups for t in g.trajectories]
    rewards = [t.reward for t in trajs]
    n = len(trajs)
    mean = sum(rewards) / n
    total_tokens = sum(t.num_tokens for t in trajs)
    hist = {str(s): c for s, c in sorted(batch.staleness.items())}
    tokens = sum(batch.staleness.values())
    return {
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "completion_len_mean": sum(len(t.completion_token_ids) for t in trajs) / n,
        "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / n,
        "reward_errors": sum(g.reward_errors for g in batch.groups),
        "staleness_mean": sum(int(s) * c for s, c in batch.staleness.items()) / max(tokens, 1),
        "staleness_max": max(batch.staleness, default=0),
        "staleness_hist": hist,
        "dropped_stale": batch.dropped,
        "learner_wait_s": batch.wait_s,
        "actor_weight_wait_s": sum(g.weight_wait_s for g in batch.groups),
        "step_seconds": step_seconds,
        "tokens_per_s": total_tokens / step_seconds if step_seconds > 0 else 0.0,
        **{f"learner/{k}": v for k, v in learner.items()},
    }
