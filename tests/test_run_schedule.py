"""The colocated schedule: placement in shared bundles, and generation and training taking turns.

The turn-taking runs the training loop's own ``collect`` and ``publish`` (``launch/train.py``) with
the real admission, pace, ledger and batch collector against simulated actors that record when they
generate; the learner's update is a recorded sleep. Checked: no prompt is generated while the
learner trains, each phase generates ``max_staleness + 1`` steps' prompts with the version just
published, only the phase's last version is pushed, and staleness stays within ``max_staleness``.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import numpy as np
import pytest

from actors.sleep import Turns
from cluster.placement import (
    PlacementError,
    check_fits,
    describe_plan,
    plan_bundles,
    ray_options,
    required_resources,
    shared_bundles,
)
from cluster.timeline import Spans
from launch.config import load_config
from launch.plan import build_plan
from launch.train import collect, publish
from queues.bounded import LocalQueue
from queues.messages import TrajectoryGroup
from queues.prompts import PromptStream
from runtime.admission import Admission, Pace
from runtime.collector import BatchCollector
from runtime.ledger import PromptLedger
from runtime.schedule import SCHEDULES
from runtime.stopping import StopRequest
from runtime.turns import DeviceTurns
from tests.fakes import AsyncRemote, make_trajectory

REQUIRED = ["model.path=m", "data.prompts=builtin:successor", "reward.function=builtin:successor"]
COLOCATED = ["run.schedule=colocated", "resources.actors.count=2", "resources.learner.num_cpus=2"]


def kinds(*overrides: str) -> list:
    return build_plan(load_config(None, REQUIRED + list(overrides))).kinds


def test_colocated_actors_go_into_the_learner_ranks_bundles_and_count_once():
    plan = kinds(*COLOCATED)
    assert [name for name, _ in plan_bundles(plan)] == ["learner-0"]
    assert shared_bundles(plan) == {"actor-0": "learner-0", "actor-1": "learner-0"}
    assert required_resources(plan)["CPU"] == 2  # the learner's two cores, shared: not 2 + 2
    check_fits(plan, {"CPU": 2})
    # each process of the shared bundle asks a third: together they fit in it
    asks = [ray_options(k, {})["num_cpus"] * k.count for k in plan]
    assert sum(asks) <= 2 + 1e-9
    assert "in learner-0's bundle" in describe_plan(plan, "PACK")
    # the default stays one bundle per process
    assert [name for name, _ in plan_bundles(kinds())] == ["actor-0", "learner-0"]


def test_colocated_actors_spread_over_the_ranks_and_must_fit_one_rank_bundle():
    plan = kinds(*COLOCATED, "resources.actors.count=3", "resources.learner.ranks=2")
    assert shared_bundles(plan) == {"actor-0": "learner-0", "actor-1": "learner-1", "actor-2": "learner-0"}
    with pytest.raises(PlacementError, match="resources.actors.num_cpus or raise resources.learner.num_cpus"):
        check_fits(kinds(*COLOCATED, "resources.actors.num_cpus=4"), {"CPU": 8})


class Recorder:
    """What happened when: generation per actor, updates and pushes of the learner."""

    def __init__(self):
        self.training = False
        self.generating = 0
        self.overlaps = 0  # generation work done while the learner trained
        self.generated: list[tuple[int, int]] = []  # (prompt id, version it was generated with)
        self.pushed: list[int] = []
        self.events: list = []  # the phase changes (turns) and the steps trained, in order


async def actor(
    prompts: LocalQueue, results: LocalQueue, rec: Recorder, version: dict, rng: random.Random, turns: Turns
):
    while True:
        got = await prompts.get_batch_async(2, timeout=0.01)
        if not got:
            continue
        async with turns.turn():  # as the engines do: prompts taken while asleep wait for the wake
            await generate(got, results, rec, version, rng)


async def generate(got: list, results: LocalQueue, rec: Recorder, version: dict, rng: random.Random):
    for req in got:
        assert version["v"] >= req.min_version
        rec.generating += 1
        for _ in range(rng.choice([1, 2, 5])):
            rec.overlaps += rec.training
            await asyncio.sleep(rng.uniform(0, 0.002))
        rec.generating -= 1
        rec.generated.append((req.prompt_id, version["v"]))
        traj = make_trajectory([1], [2, 3], rng.random())
        traj.policy_versions = np.full(2, version["v"], dtype=np.int32)
        await results.put_many_async([TrajectoryGroup(req.prompt_id, {}, [traj], "a")], timeout=5)


class SimulatedActor:
    """The driver's handle on a simulated actor: ``sleep`` and ``wake`` as the engines do them."""

    def __init__(self, turns: Turns, rec: Recorder):
        async def sleep():
            async with turns.asleep():
                rec.events.append("sleep")

        async def wake(version: int):
            rec.events.append(("wake", version))
            turns.awake.set()

        self.sleep, self.wake = AsyncRemote(sleep), AsyncRemote(wake)


class RecordingLearner:
    def __init__(self, rec: Recorder):
        self.rec = rec

    async def offload_states(self):
        self.rec.events.append("offload")

    async def reload_states(self):
        self.rec.events.append("reload")


async def run_loop(
    schedule: str, k: int, steps: int, P: int = 4, seed: int = 0, turns: bool = False
) -> tuple[Recorder, list]:
    """``turns``: the actors sleep and wake between phases, the learner offloads (``runtime/turns.py``)."""
    rng, rec, version = random.Random(seed), Recorder(), {"v": 0}
    engines = [Turns(0) for _ in range(2)]
    device_turns = DeviceTurns(lambda: [SimulatedActor(t, rec) for t in engines], RecordingLearner(rec), True, 5)
    prompts, results = LocalQueue("prompt", P * (k + 1)), LocalQueue("results", P * (k + 2))
    ledger = PromptLedger(PromptStream([{"prompt": str(i)} for i in range(64)], seed=0))
    admission = Admission(ledger, Pace(P, k), prompts, lambda row: [1], put_timeout_s=5)

    async def publish_weights(v: int):
        rec.pushed.append(v)
        version["v"] = v
        return []

    parts = SimpleNamespace(
        schedule=SCHEDULES[schedule](admission, k, turns=device_turns if turns else None),
        collector=BatchCollector(results, {}, None, 10, admission=admission),
        driver_spans=Spans("driver"),
        health=SimpleNamespace(oversample_reached=lambda *a: None),
        learner=SimpleNamespace(publish_weights=publish_weights),
        evaluator=SimpleNamespace(due=lambda done, total: False),
        admission=admission,
    )
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(prompts_per_step=P), run=SimpleNamespace(steps=steps, max_staleness=k)
    )
    run = SimpleNamespace(timeline=lambda spans: None)
    tasks = [asyncio.create_task(admission.feed())] + [
        asyncio.create_task(actor(prompts, results, rec, version, rng, engine)) for engine in engines
    ]
    staleness = []
    try:
        for step in range(steps):
            batch = await collect(cfg, run, parts, StopRequest(print), step)
            staleness += [step - int(v) for g in batch.groups for t in g.trajectories for v in t.policy_versions]
            admission.trained(batch.groups)
            rec.training = True  # the update: the learner uses every core
            rec.events.append(("train", step))
            await asyncio.sleep(rng.uniform(0.001, 0.004))
            rec.training = False
            await publish(run, parts, step + 1, steps)
    finally:
        for t in tasks:
            t.cancel()
    return rec, staleness


@pytest.mark.parametrize("k", [0, 1, 2])
def test_colocated_generation_and_training_take_turns(k):
    steps, P = 7, 4
    rec, staleness = asyncio.run(run_loop("colocated", k, steps, P))
    assert rec.overlaps == 0  # nothing generated while the learner trained
    # each phase: (k + 1) steps' prompts, all with the version published before it
    phases = [range(start, min(start + k + 1, steps)) for start in range(0, steps, k + 1)]
    by_version = {}
    for prompt_id, v in rec.generated:
        by_version.setdefault(v, []).append(prompt_id)
    assert sorted(by_version) == [p.start for p in phases]
    assert [len(by_version[p.start]) for p in phases] == [len(p) * P for p in phases]
    # only each phase's last version reaches the actors (the last step's too)
    assert rec.pushed == [p.stop for p in phases]
    assert max(staleness) == min(k, steps - 1) and min(staleness) == 0


def test_between_colocated_phases_the_actors_sleep_and_wake_with_the_version_just_published():
    k, steps = 1, 5
    rec, staleness = asyncio.run(run_loop("colocated", k, steps, turns=True))
    assert rec.overlaps == 0 and max(staleness) == k
    expected = []
    for start in range(0, steps, k + 1):  # two actors
        expected += ["offload", ("wake", start), ("wake", start), "sleep", "sleep", "reload"]
        expected += [("train", s) for s in range(start, min(start + k + 1, steps))]
    assert rec.events == expected  # the learner's states out before the engines wake, back after they sleep


def test_overlapped_generates_beside_training_and_publishes_every_version():
    rec, staleness = asyncio.run(run_loop("overlapped", 1, 7))
    assert rec.overlaps > 0
    assert rec.pushed == list(range(1, 8))
    assert max(staleness) <= 1


def _group(prompt_id: int) -> TrajectoryGroup:
    trajectories = [make_trajectory([1], [2, 3], float(j)) for j in range(2)]  # rewards 0, 1: a signal
    for t in trajectories:
        t.policy_versions = np.zeros(2, dtype=np.int32)
    return TrajectoryGroup(prompt_id, {}, trajectories, "a")


def test_an_actor_dying_mid_phase_does_not_regenerate_what_a_collected_batch_holds():
    """A phase of 2 batches: actor a0 returns the first batch, then dies before the second is complete. Its
    prompts sit in a collected (untrained) batch: they are not held any more, not generated again, and a
    late group of them is no longer new; a1's prompts fill the second batch."""

    async def phase():
        k, P = 1, 4
        prompts, results = LocalQueue("prompt", 1000), LocalQueue("results", 1000)
        ledger = PromptLedger(PromptStream([{"prompt": str(i)} for i in range(64)], seed=0))
        admission = Admission(ledger, Pace(P, k), prompts, lambda row: [1], put_timeout_s=5)
        parts = SimpleNamespace(
            schedule=SCHEDULES["colocated"](admission, k),
            collector=BatchCollector(results, {}, None, 5.0, admission=admission),
            driver_spans=Spans("driver"),
            health=SimpleNamespace(oversample_reached=lambda *a: None),
        )
        cfg = SimpleNamespace(
            rollout=SimpleNamespace(prompts_per_step=P), run=SimpleNamespace(steps=4, max_staleness=k)
        )
        feed = asyncio.create_task(admission.feed())
        collecting = asyncio.create_task(collect(cfg, None, parts, StopRequest(print), 0))
        await asyncio.sleep(0.05)
        a0, a1 = prompts.get_batch(4, 1, "a0"), prompts.get_batch(4, 1, "a1")
        await results.put_many_async([_group(r.prompt_id) for r in a0], 1)
        await asyncio.sleep(0.1)  # batch 0 is collected; batch 1 waits
        held = [i for i in prompts._state.taken_by("a0") if admission.outstanding(i)]
        assert held == []  # in a collected batch: nothing of a0's is lost with it
        assert not admission.is_new(_group(a0[0].prompt_id))  # a late copy would be a duplicate
        await results.put_many_async([_group(r.prompt_id) for r in a1], 1)
        first = await asyncio.wait_for(collecting, 2)
        feed.cancel()
        return first, parts.schedule.ready[0], a0, a1

    first, second, a0, a1 = asyncio.run(phase())
    assert [g.prompt_id for g in first.groups] == sorted(r.prompt_id for r in a0)
    assert [g.prompt_id for g in second.groups] == sorted(r.prompt_id for r in a1)


class RecordedTurns:
    def __init__(self, log: list, fail_training: bool = False):
        self.log, self.fail_training = log, fail_training

    async def generation(self, version: int):
        self.log.append(("generation", version))

    async def training(self):
        self.log.append("training")
        if self.fail_training:
            raise TimeoutError("an actor did not sleep")


def _colocated(turns) -> object:
    prompts = LocalQueue("prompt", 100)
    ledger = PromptLedger(PromptStream([{"prompt": str(i)} for i in range(64)], seed=0))
    admission = Admission(ledger, Pace(4, 1), prompts, lambda row: [1], put_timeout_s=5)
    return SCHEDULES["colocated"](admission, 1, turns=turns)


def test_the_runs_end_wakes_the_actors_with_the_last_published_version_and_puts_the_learner_back():
    """A stop mid-phase: step 3 was trained (the pace advanced) but only version 2 was pushed; the held-out
    rounds still out are generated with version 2, then the learner's states come back for the final save."""

    async def go():
        log = []
        schedule = _colocated(RecordedTurns(log))
        schedule.published(2)
        await schedule.admission.published(3)
        async with schedule.rest():
            log.append("drain")
        return log

    assert asyncio.run(go()) == [("generation", 2), "drain", "training"]


def test_an_error_inside_a_phase_puts_the_learner_back_and_is_the_error_raised():
    async def go(log, fail_training):
        schedule = _colocated(RecordedTurns(log, fail_training))
        async with schedule.generation(2, 4):
            raise RuntimeError("data timeout")

    for fail_training in (False, True):  # a failing turn does not hide the run's own error
        log = []
        with pytest.raises(RuntimeError, match="data timeout"):
            asyncio.run(go(log, fail_training))
        assert log == [("generation", 0), "training"]
