"""The staleness bound holds under randomised schedules (admission + the learner's drop rule).

A simulated pool of actors with random generation times (some very long) runs against
the real ``Pace`` and ``BatchCollector``: actors load the newest published version
before each prompt and may swap weights mid-generation (per-token versions), the
learner trains with random step times. No trained token may be older than k versions.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from launch.stepping import BatchCollector, Pace
from queues.bounded import LocalQueue
from queues.messages import PromptRequest, Trajectory, TrajectoryGroup


async def simulate(k: int, seed: int, steps: int = 12, P: int = 4, actors: int = 3, inflight: bool = False):
    rng = random.Random(seed)
    pace = Pace(P, k)
    prompts, results = LocalQueue("prompt", P * (k + 1)), LocalQueue("results", 1000)
    published = {"version": 0}
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
            traj = Trajectory(
                [1], [2] * len(versions), [1] * len(versions), [-1.0] * len(versions), versions, 1.0, "stop", "x"
            )
            await results.put_many_async([TrajectoryGroup(req.prompt_id, {}, [traj], f"a{i}")], timeout=5)

    async def rollout():
        pid = 0
        while True:
            await pace.admit(pid)
            await prompts.put_many_async([PromptRequest(pid, {"prompt": "p"}, pace.version)], timeout=5)
            pid += 1

    tasks = [asyncio.create_task(actor(i)) for i in range(actors)] + [asyncio.create_task(rollout())]
    collector = BatchCollector(results, {}, run=None, timeout=10, on_drop=pace.drop)
    trained, dropped = [], 0
    for step in range(steps):
        batch = await collector.collect(P, step=step, max_staleness=k)
        trained += [step - v for g in batch.groups for t in g.trajectories for v in t.policy_versions]
        dropped += batch.dropped
        await asyncio.sleep(rng.uniform(0, 0.004))  # training time
        published["version"] = step + 1
        pace.advance(step + 1)
    stop.set()
    for t in tasks:
        t.cancel()
    return trained, dropped


@pytest.mark.parametrize("k", [0, 1, 2, 4])
@pytest.mark.parametrize("inflight", [False, True])
def test_no_trained_token_is_older_than_k(k, inflight):
    for seed in range(3):
        staleness, dropped = asyncio.run(simulate(k, seed, inflight=inflight))
        assert staleness and max(staleness) <= k and min(staleness) >= 0
        if k == 0:
            assert set(staleness) == {0} and dropped == 0  # synchronous: everything on-policy


def test_asynchrony_is_used_when_allowed():
    staleness, _ = asyncio.run(simulate(2, seed=0, steps=16))
    assert max(staleness) >= 1  # generation ran ahead of training
