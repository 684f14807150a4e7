"""The two loops' bookkeeping: admission control, batch collection, per-step metrics.

Staleness of a token = the learner's policy version when it trains on it (the step
index) minus the version that generated it.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from queues.bounded import QueueClosed
from queues.messages import TrajectoryGroup


class DataTimeout(TimeoutError):
    """The learner waited longer than run.data_timeout_s for a batch."""


class ActorFailed(RuntimeError):
    """A generation actor's loop ended with an error."""


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


class BatchCollector:
    """Pulls groups from the results queue until a step's batch is complete. ``actors``: an
    ``ActorWatch`` (or a dict of each actor's ``run`` reference by name). ``on_drop(group)`` is
    awaited for a group too stale to train; ``accept(group)`` says whether a group is new (the
    prompt ledger's duplicate check)."""

    def __init__(
        self,
        results_queue,
        actors,
        run,
        timeout: float,
        on_drop: Callable[[TrajectoryGroup], Awaitable],
        accept: Callable[[TrajectoryGroup], bool] = lambda group: True,
        max_filtered: int | None = None,
        on_filter: Callable[[TrajectoryGroup], Awaitable] | None = None,
        on_eval: Callable[[TrajectoryGroup], None] = lambda group: None,
        on_spans: Callable[[list], None] = lambda spans: None,
        outcomes: Callable[[TrajectoryGroup], list[float]] = lambda group: [t.reward for t in group.trajectories],
    ):
        self.queue, self.run = results_queue, run
        self.timeout, self.on_drop, self.accept = timeout, on_drop, accept
        self.actors = actors if isinstance(actors, ActorWatch) else ActorWatch(actors, run)
        # dynamic sampling: up to ``max_filtered`` zero-variance groups a step are left out (None: off)
        self.max_filtered, self.on_filter = max_filtered, on_filter
        self.on_eval = on_eval  # an evaluation group: scored for the held-out metrics, never trained on
        self.on_spans = on_spans  # the actors' timeline spans that rode on the groups (RunLog.timeline)
        self.outcomes = outcomes  # a group's rewards as trained (with the per-sequence penalties): its signal
        self.last_from: dict[str, float] = {}  # actor name -> when its latest group arrived
        self.longest_gap = 0.0  # the longest wait between two groups of one actor so far
        self.started = time.monotonic()

    def _arrived(self, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        spans = [span for group in groups for span in group.spans]
        if spans:
            self.on_spans(spans)
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
                    self.on_eval(group)
                elif group.prompt_id in seen or not self.accept(group):
                    batch.duplicates += 1  # e.g. a dead actor's late result of a prompt generated again
                elif step - group.oldest_version > max_staleness:
                    batch.dropped += 1  # never trained on: counted and generated again
                    await self.on_drop(group)
                elif self._filter_out(batch, group):
                    batch.filtered += 1  # no learning signal: left out, and one more prompt admitted
                    batch.filtered_ids.append(group.prompt_id)
                    await self.on_filter(group)
                else:
                    batch.groups.append(group)
                    seen.add(group.prompt_id)
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
                    self.on_eval(group)

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
        **reward_part_means(trajs),
        "staleness_mean": sum(int(s) * c for s, c in batch.staleness.items()) / max(tokens, 1),
        "staleness_max": max(batch.staleness, default=0),
        "staleness_hist": hist,
        "dropped_stale": batch.dropped,
        "filtered_groups": batch.filtered,
        # the collapse signal: the share of collected groups whose rewards were all equal
        "zero_variance_frac": batch.zero_variance / max(len(batch.groups) + batch.filtered, 1),
        "learner_wait_s": batch.wait_s,
        "actor_weight_wait_s": sum(g.weight_wait_s for g in batch.groups),
        "step_seconds": step_seconds,
        "tokens_per_s": total_tokens / step_seconds if step_seconds > 0 else 0.0,
        **{f"learner/{k}": v for k, v in learner.items()},
    }


STALENESS_SAMPLE = 65536  # at most this many per-token staleness values a step reach the histograms


def step_distributions(batch: Batch) -> dict[str, np.ndarray]:
    """The step's distributions for the trackers' histograms: per-token staleness, each completion's
    reward and each completion's length in tokens."""
    trajs = [t for g in batch.groups for t in g.trajectories]
    return {
        "hist/staleness": staleness_sample(batch.staleness, STALENESS_SAMPLE),
        "hist/reward": np.array([t.reward for t in trajs], dtype=np.float64),
        "hist/completion_len": np.array([len(t.completion_token_ids) for t in trajs], dtype=np.int64),
    }


def staleness_sample(counts: collections.Counter, cap: int) -> np.ndarray:
    """Per-token staleness values from the ``{age: tokens}`` histogram: all of them up to ``cap``
    tokens, else ``cap`` in proportion (largest remainders), every age seen at least once so the
    maximum shows. {0: 3M, 1: 1M, 5: 10}, cap 1000 -> 750 x 0, 250 x 1, 1 x 5."""
    ages = np.array(sorted(counts), dtype=np.int64)
    tokens = np.array([counts[a] for a in ages.tolist()], dtype=np.int64)
    total = int(tokens.sum())
    if total > cap:
        share = tokens * cap / total
        kept = np.floor(share).astype(np.int64)
        kept[np.argsort(kept - share)[: cap - int(kept.sum())]] += 1  # the largest remainders round up
        tokens = np.maximum(kept, 1)
    return np.repeat(ages, tokens)


def reward_part_means(trajs: list) -> dict[str, float]:
    """``reward/<name>``: the mean raw value of each reward part over the step's completions."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for name, value in (t.reward_parts or {}).items():
            values.setdefault(name, []).append(value)
    return {f"reward/{name}": sum(v) / len(v) for name, v in values.items()}


def sample_records(batch: Batch, step: int, count: int) -> list[dict[str, Any]]:
    """Up to ``count`` completions of the step for ``samples.jsonl``: one from each group in turn."""
    groups, records = batch.groups, []
    for i in range(min(count, sum(len(g.trajectories) for g in groups))):
        group = groups[i % len(groups)]
        if i // len(groups) >= len(group.trajectories):
            continue
        traj = group.trajectories[i // len(groups)]
        version = int(np.min(traj.policy_versions)) if len(traj.policy_versions) else step
        records.append(
            {
                "step": step,
                "prompt_id": group.prompt_id,
                "prompt": group.row.get("prompt"),
                "completion": traj.completion_text,
                "reward": traj.reward,
                "policy_version": version,
                "staleness": step - version,
                "finish_reason": traj.finish_reason,
            }
        )
    return records
