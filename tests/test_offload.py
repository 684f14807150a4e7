"""The learner's states leave the device for a generation phase (colocated on GPUs), the frozen base
of a LoRA policy too (issue 37 item 9).

DeepSpeed's ZeRO-1/2 ``offload_states`` moves the parameters of its ``bit16_groups``, which hold only
those that require a gradient (``stage_1_and_2.py``: ``trainable_parameters``): under LoRA the frozen
base, most of the model, stayed on the GPU the engine was to wake on. Here DeepSpeed's engine is a
stand-in built from DeepSpeed's classes (``tests/standins.py``) whose offload moves nothing (as it moves no
frozen parameter); then a real LoRA learner at ZeRO-1 offloads and reloads and trains on as without.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import learner.offload as offload_module
from learner.offload import offload, reload
from tests import standins

ROOT = Path(__file__).resolve().parents[1]


def test_the_frozen_base_goes_to_the_host_with_the_trained_states_and_comes_back(monkeypatch):
    copied = []  # the tensors offload copies to the host itself
    monkeypatch.setattr(offload_module, "_to_host", lambda t, pin: copied.append(t.data_ptr()) or t.clone())
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    module[0].requires_grad_(False)  # the frozen base; module[1] stands for the adapter DeepSpeed moves
    base = [p.data_ptr() for p in module[0].parameters()]
    engine = standins.zero_engine(module)  # DeepSpeed's engine and ZeRO optimizer, moving no frozen parameter
    out = offload(engine, pin_memory=True)
    offloaded = ["offload_states", "optimizer.offload_states"]  # the engine hands the call to its ZeRO optimizer
    assert [c[0] for c in standins.calls(engine)] == offloaded and copied == base  # the base, by us
    assert [t for t, _ in out.moved] == list(module[0].parameters())
    reload(engine, out)
    assert [c[0] for c in standins.calls(engine)] == [*offloaded, "reload_states", "optimizer.reload_states"]
    assert all(p.device.type == "cpu" for p in module.parameters())  # back where each was


ROUND_TRIP = """
import asyncio, sys
import torch
from learner.attention import select_attention
from learner.config import AlgorithmConfig, LearnerConfig, LoraConfig
from learner.group import LearnerGroup
from learner.worker import LearnerWorker, RankSpec
from tests.fakes import LocalActor, make_group

learner = LearnerConfig(zero_stage=1, lr=0.05, lora=LoraConfig(rank=4))
algorithm = AlgorithmConfig()
worker = LearnerWorker(0, 1)
worker.join_alone(60)
worker.build(RankSpec(sys.argv[1], learner, algorithm, "float32", 0, max_tokens=8),
             select_attention("sdpa", False, False, "float32"))
group = LearnerGroup([LocalActor(worker)], algorithm, learner.token_budget, 8)
batch = [make_group(0, [1.0, 0.0, 1.0, 0.0], completion_len=4)]
asyncio.run(group.train_step(batch))
frozen = sum(1 for p in worker.policy.module.parameters() if not p.requires_grad)
before = {n: t.clone() for n, t in worker.export_weights()}
worker.offload_states()
moved = len(worker._offloaded["policy"].moved)
worker.reload_states()
asyncio.run(group.train_step(batch))
after = dict(worker.export_weights())
print("frozen", frozen, "moved", moved, "trained", sum(not torch.equal(before[n], after[n]) for n in before))
"""


@pytest.mark.slow  # a DeepSpeed learner in a child (~35 s)
def test_a_lora_learner_at_zero_1_offloads_its_frozen_base_and_trains_on(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", ROUND_TRIP, tiny_model_dir], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    frozen, moved, trained = (int(words[words.index(k) + 1]) for k in ("frozen", "moved", "trained"))
    assert frozen > 0 and moved == frozen  # every frozen base parameter moved (DeepSpeed moved the adapters)
    assert trained > 0  # the adapters train on after the reload
