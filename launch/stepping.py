"""The two loops' bookkeeping: admission control, batch collection, per-step metrics.

Staleness of a token = the learner's policy version when it trains on it (the step
index) minus the version that generated it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def advance(self, version: int) -> None:
        self.version = version
        asyncio.get_running_loop().create_task(self._notify())

    def drop(self) -> None:
        self.dropped += 1
        asyncio.get_running_loop().create_task(self._notify())


@dataclass
class Batch:
    groups: list[TrajectoryGroup]
    step: int
    dropped: int  # groups thrown away as too stale while collecting this batch
    wait_s: float  # time the learner waited for data
    staleness: collections.Counter = field(default_factory=collections.Counter)  # per-token histogram


class BatchCollector:
    """Pulls groups from the results queue until a step's batch is complete."""

    def __init__(self, results_queue, actor_loops: dict, run, timeout: float, on_drop: Callable[[], None]):
        self.queue, self.actor_loops, self.run = results_queue, actor_loops, run
        self.timeout, self.on_drop = timeout, on_drop

    async def collect(self, num_groups: int, step: int, max_staleness: int) -> Batch:
        start = time.monotonic()
        batch = Batch(groups=[], step=step, dropped=0, wait_s=0.0)
        while len(batch.groups) < num_groups:
            got = await self.queue.get_batch_async(num_groups - len(batch.groups), timeout=1.0)
            for group in got:
                if step - group.oldest_version > max_staleness:
                    batch.dropped += 1  # never trained on: counted and replaced
                    self.on_drop()
                    continue
                batch.groups.append(group)
            if not got:
                self.check_actors()
                if time.monotonic() - start > self.timeout:
                    raise DataTimeout(
                        f"step {step}: only {len(batch.groups)} of {num_groups} prompt groups arrived in "
                        f"{self.timeout:.0f}s (run.data_timeout_s); see the actor logs in {self.run.logs}"
                    )
        batch.groups.sort(key=lambda g: g.prompt_id)  # arrival order must not change the result
        for group in batch.groups:
            for traj in group.trajectories:
                batch.staleness.update(step - v for v in traj.policy_versions)
        batch.wait_s = time.monotonic() - start
        return batch

    def check_actors(self) -> None:
        """An actor loop only returns after shutdown; one that has ended now has failed."""
        if not self.actor_loops:
            return
        import ray

        done, _ = ray.wait(list(self.actor_loops), num_returns=len(self.actor_loops), timeout=0)
        for ref in done:
            name = self.actor_loops[ref]
            try:
                ray.get(ref)
                cause = "its loop returned early"
            except Exception as exc:
                text = str(exc).strip()
                cause = text.splitlines()[-1] if text else type(exc).__name__
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
