"""Colocated on GPUs, the engines start before the learner (issue 37 item 3).

vLLM sizes its KV cache from the free memory of the whole device (``MemorySnapshot.measure``:
total - free), so a learner rank allocating on the shared GPU while an engine profiles is charged to
the engine's cache: a size that varies from run to run, or vLLM's start-up error. Elsewhere the two
start side by side.
"""

from __future__ import annotations

import asyncio

import pytest

from launch.assemble import start_processes
from launch.build import colocated_on_gpus, engine_waves
from launch.config import load_config

REQUIRED = ["model.path=m", "data.prompts=builtin:successor", "reward.function=builtin:successor"]
GPUS = ["resources.learner.num_gpus=1", "resources.actors.num_gpus=1", "learner.zero_stage=1"]


async def _built(name: str, log: list, seconds: float):
    log.append(f"{name} starts")
    await asyncio.sleep(seconds)
    log.append(f"{name} ready")
    return name


@pytest.mark.parametrize(
    "overrides, in_turn",
    [
        (GPUS + ["run.schedule=colocated"], True),
        (GPUS + ["run.schedule=overlapped"], False),
        (["run.schedule=colocated"], False),  # CPUs: vLLM's CPU engine takes a fixed KV space
    ],
)
def test_colocated_engines_on_gpus_are_ready_before_the_learner_starts(overrides, in_turn):
    cfg = load_config(None, REQUIRED + overrides)
    assert colocated_on_gpus(cfg) == in_turn
    log: list[str] = []

    async def go():
        return await start_processes(_built("actors", log, 0.05), _built("learner", log, 0.01), in_turn)

    assert asyncio.run(go()) == ("actors", "learner")
    if in_turn:
        assert log == ["actors starts", "actors ready", "learner starts", "learner ready"]
    else:  # side by side: the learner starts while the engines are still starting
        assert log.index("learner starts") < log.index("actors ready")


def test_engines_sharing_a_gpu_start_one_at_a_time_one_per_gpu_together():
    """Colocated, actor i is on learner rank i's GPU modulo the ranks: 5 actors on 2 ranks start in waves
    whose engines are each on a GPU of their own (two engines profiling one GPU at once would each be
    charged the other's allocations)."""
    assert engine_waves(5, 2) == [[0, 1], [2, 3], [4]]
    assert [sorted(i % 2 for i in wave) for wave in engine_waves(4, 2)] == [[0, 1], [0, 1]]
    assert engine_waves(3, 3) == [[0, 1, 2]]  # not colocated on GPUs: all together
