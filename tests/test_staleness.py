"""The staleness bound under randomised schedules: admission control itself, and the drop rule.

A simulated pool of actors with random generation times (some very long) runs against the
real ``Pace`` and ``BatchCollector``: actors load the newest published version before each
prompt and may swap weights mid-generation (per-token versions), the learner trains with
random step times. Two properties are checked separately, because the learner's drop rule
alone guarantees that no trained token is older than k:

* admission: no prompt is handed out beyond the allowance ``(v + k + 1) P + dropped`` at the
  moment it is handed out (checked against the formula, not against ``Pace`` itself), and the
  prompts handed out never exceed what the run can train plus what it dropped;
* the drop rule: no trained token is older than k versions.
A deliberately broken admission (one step too generous) must fail the first check.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from queues.bounded import LocalQueue
from queues.messages import PromptRequest, TrajectoryGroup
from runtime.admission import Pace
from runtime.collector import BatchCollector
from tests.fakes import RecordingAdmission, make_trajectory


class GenerousPace(Pace):
    """A broken admission: lets generation run one more version ahead than k allows."""

    def allowance(self) -> int:
        return super().allowance() + self.P


async def simulate(k: int, seed: int, pace: Pace, steps: int = 12, actors: int = 3, inflight: bool = False):
    rng = random.Random(seed)
    P = pace.P
    prompts, results = LocalQueue("prompt", P * (k + 2)), LocalQueue("results", 1000)
    published = {"version": 0}
    admitted: list[tuple[int, int, int]] = []  # (prompt id, learner version, drops so far) at hand-out
    stop = asyncio.Event()

    async def actor(i: int):
        while not stop.is_set():
            got = await prompts.get_batch_async(1, timeout=0.01)
            if not got:
                continue
            req: PromptRequest = got[0]
            assert published["version"] >= req.min_version  # what the real actor waits for
            versions = []
            for _ in range(rng.choice([1, 2, 3, 20])):  # long tail: some generations are long
                versions.append(published["version"] if inflight or not versions else versions[0])
                await asyncio.sleep(rng.uniform(0, 0.002))
            traj = make_trajectory([1], [2] * len(versions), 1.0)
            traj.policy_versions = np.array(versions, dtype=np.int32)
            await results.put_many_async([TrajectoryGroup(req.prompt_id, {}, [traj], f"a{i}")], timeout=5)

    async def rollout():
        pid = 0
        while True:
            await pace.admit(pid)
            admitted.append((pid, pace.version, pace.dropped))
            await prompts.put_many_async([PromptRequest(pid, {"prompt": "p"}, pace.version)], timeout=5)
            pid += 1

    tasks = [asyncio.create_task(actor(i)) for i in range(actors)] + [asyncio.create_task(rollout())]
    collector = BatchCollector(results, {}, None, 10, admission=RecordingAdmission(pace))
    trained, dropped = [], 0
    for step in range(steps):
        batch = await collector.collect(P, step=step, max_staleness=k)
        trained += [step - int(v) for g in batch.groups for t in g.trajectories for v in t.policy_versions]
        dropped += batch.dropped
        await asyncio.sleep(rng.uniform(0, 0.004))  # training time
        published["version"] = step + 1
        await pace.advance(step + 1)
    await asyncio.sleep(0.02)  # let the rollout loop admit whatever the last version allows
    stop.set()
    for t in tasks:
        t.cancel()
    return trained, dropped, admitted


def admission_violations(admitted: list[tuple[int, int, int]], P: int, k: int) -> list[str]:
    """Hand-outs beyond the allowance ``i < (v + k + 1) P + dropped``."""
    return [f"prompt {i} at version {v} with {d} drops" for i, v, d in admitted if not i < (v + k + 1) * P + d]


@pytest.mark.parametrize("k", [0, 1, 2, 4])
@pytest.mark.parametrize("inflight", [False, True])
def test_admission_stays_within_the_allowance_and_no_trained_token_is_older_than_k(k, inflight):
    P, steps = 4, 12
    for seed in range(3):
        staleness, dropped, admitted = asyncio.run(simulate(k, seed, Pace(P, k), steps, inflight=inflight))
        assert admission_violations(admitted, P, k) == []
        # never more handed out than the run can train (steps + k ahead) plus what it dropped
        assert len(admitted) <= (steps + k + 1) * P + dropped
        assert dropped <= steps * P // 2  # drops stay bounded: most of the work is trained
        assert staleness and max(staleness) <= k and min(staleness) >= 0
        if k == 0:
            assert set(staleness) == {0} and dropped == 0  # synchronous: everything on-policy


@pytest.mark.parametrize("k", [1, 2])
def test_a_too_generous_admission_is_caught(k):
    # The drop rule still keeps every trained token within k: only the admission check can fail.
    P = 4
    staleness, _, admitted = asyncio.run(simulate(k, 0, GenerousPace(P, k), steps=8, inflight=True))
    assert max(staleness) <= k
    assert admission_violations(admitted, P, k), "a broken admission went unnoticed"


def test_asynchrony_is_used_when_allowed():
    staleness, _, _ = asyncio.run(simulate(2, seed=0, pace=Pace(4, 2), steps=16))
    assert max(staleness) >= 1  # generation ran ahead of training
