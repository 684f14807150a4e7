"""A provoked non-finite loss on a real DeepSpeed engine: the update is skipped, counted, and
leaves nothing behind. After a step on a batch with a NaN reward and then a good step, the
weights equal those of an engine that only took the good step (ZeRO 0, 2 and 3: ZeRO-0 drops
the gradients itself, the ZeRO optimizers skip an update whose gradient norm is not finite).

Each stage runs in a child process: DeepSpeed's process group is once per process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import asyncio, importlib, os, socket, sys
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0", LOCAL_SIZE="1")
import deepspeed, torch
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")
from transformers import AutoModelForCausalLM
from launch.config import load_config
from learner.group import LearnerGroup
from learner.rank import Layout, Models, RankStep
from learner.worker import deepspeed_config
from tests.fakes import LocalActor, make_group

model_dir, stage = sys.argv[1], int(sys.argv[2])
cfg = load_config(None, ["model.path=x", "data.prompts=x", "reward.function=x", "rollout.max_tokens=12",
                         "learner.lr=0.05", f"learner.zero_stage={stage}"])
layout = Layout(pad_id=0, device=torch.device("cpu"), mask_dtype=torch.bool, row_tokens=None)

def group():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg.learner, "float32"))
    rank = LocalActor(RankStep(Models(engine), cfg.algorithm, layout, cfg.rollout.max_tokens, 1))
    return engine, LearnerGroup([rank], cfg.algorithm, cfg.learner.token_budget, cfg.rollout.max_tokens)

def weights(engine):
    if stage == 3:
        named = []
        for name, p in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                named.append((name, p.detach().clone()))
        return dict(named)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

good = [make_group(p, [1.0, 0.0, 1.0, 0.0], completion_len=4) for p in range(4)]
bad = [make_group(p, [float("nan"), 1.0, 0.0, 1.0], completion_len=4) for p in range(4)]
(a, skipping), (b, clean) = group(), group()
start = weights(a)
skipped = asyncio.run(skipping.train_step(bad))
assert skipped["nonfinite_updates"] == 1, skipped
assert all(torch.equal(start[n], p) for n, p in weights(a).items()), "a non-finite update was applied"
assert asyncio.run(skipping.train_step(good))["nonfinite_updates"] == 0
asyncio.run(clean.train_step(good))
wa, wb = weights(a), weights(b)
assert all(torch.isfinite(p).all() for p in wa.values())
assert all(torch.equal(wa[n], wb[n]) for n in wa), "the skipped update left something behind"
assert any(not torch.equal(start[n], wa[n]) for n in wa)
print("OK")
"""


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_non_finite_update_is_skipped_on_a_deepspeed_engine(tiny_model_dir, stage):
    done = subprocess.run(
        [sys.executable, "-c", CHILD, tiny_model_dir, str(stage)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout[-2000:] + done.stderr[-3000:]
