"""LoRA (``learner.lora``): the merge by hand and against PEFT, the adapter's way to the actors, the config.

The merge is ``W + (alpha / r) B A``; checked on a 2x3 weight by hand, then against PEFT's own
``merge_and_unload`` on the tiny model with non-zero adapters. The actors write each published adapter
as a PEFT directory (``actors/adapters.py``): PEFT loads it back to the same logits.
"""

from __future__ import annotations

import pytest
import torch

from actors.adapters import Adapters, AdapterSpec, published_targets
from launch.config import ConfigError, load_config
from learner.config import LoraConfig
from learner.lora import adapter_weights, is_lora_state, merge_lora, saved_name, with_lora
from tests.tolerance import reduction_rtol

REQUIRED = ["model.path=m", "data.prompts=builtin:successor", "reward.function=builtin:successor"]


def test_merge_by_hand():
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    a = torch.tensor([[1.0, 0.0, -1.0]])  # r = 1: [r, in]
    b = torch.tensor([[2.0], [0.5]])  # [out, r]
    state = {
        "base_model.model.layer.proj.base_layer.weight": w,
        "base_model.model.layer.proj.base_layer.bias": torch.tensor([7.0, 8.0]),
        "base_model.model.layer.proj.lora_A.default.weight": a,
        "base_model.model.layer.proj.lora_B.default.weight": b,
        "base_model.model.norm.weight": torch.tensor([1.0]),
    }
    merged = merge_lora(state, rank=1, alpha=4.0)  # scale 4
    # B A = [[2, 0, -2], [0.5, 0, -0.5]]; x 4 = [[8, 0, -8], [2, 0, -2]]
    assert torch.equal(merged["layer.proj.weight"], torch.tensor([[9.0, 2.0, -5.0], [6.0, 5.0, 4.0]]))
    assert torch.equal(merged["layer.proj.bias"], torch.tensor([7.0, 8.0]))
    assert set(merged) == {"layer.proj.weight", "layer.proj.bias", "norm.weight"}
    assert is_lora_state(state) and not is_lora_state(merged)


@pytest.fixture(scope="module")
def peft_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = with_lora(base, LoraConfig(rank=4, alpha=8.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3)  # PEFT starts B at 0: the adapter would change nothing
    return model


def test_only_the_adapters_train_and_travel(peft_model):
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    from peft import get_peft_model_state_dict

    published = dict(adapter_weights(list(peft_model.named_parameters())))
    assert set(published) == set(get_peft_model_state_dict(peft_model))  # the names PEFT saves, vLLM reads
    assert published_targets(list(published)) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert saved_name("x.q_proj.lora_A.default.weight") == "x.q_proj.lora_A.weight"


def test_merged_weights_equal_peft_merge_and_unload(peft_model, tiny_model_dir):
    import copy

    state = dict(peft_model.state_dict())
    merged = merge_lora(state, rank=4, alpha=8.0)
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    eps, scale = torch.finfo(torch.float32).eps, 8.0 / 4
    for name, tensor in reference.items():
        lora = f"base_model.model.{name.removesuffix('.weight')}.lora_"
        if f"{lora}A.default.weight" not in state:
            assert torch.equal(merged[name], tensor), name  # not adapted: copied as it is
            continue
        a, b = state[f"{lora}A.default.weight"], state[f"{lora}B.default.weight"]  # [r, in], [out, r]
        # W + s B A, ours and PEFT's: the r = 4-term products in another order (3 eps) and s applied before or
        # after them (eps), relative to s |B| |A|; then the sum with W, an ulp of the result
        bound = (reduction_rtol(torch.float32, 4) + eps) * scale * (b.abs() @ a.abs()) + eps * tensor.abs()
        assert ((merged[name] - tensor).abs() <= bound).all(), name
    # and the merge changed the adapted weights (B != 0)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])


def test_an_actor_writes_an_adapter_peft_loads_to_the_same_logits(peft_model, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapters = Adapters(AdapterSpec(rank=4, alpha=8.0, slots=2), tiny_model_dir, "actor-test")
    try:
        assert adapters.request() is None  # version 0: the base model
        adapters.add(3, adapter_weights(list(peft_model.named_parameters())))
        request = adapters.request()
        assert (request.lora_name, request.lora_int_id) == ("policy-v3", 4)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, request.lora_path)
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, peft_model(input_ids=ids).logits)
        # a newer version: the old one retires once no request uses it
        adapters.using(3)
        adapters.add(4, adapter_weights(list(peft_model.named_parameters())))
        assert adapters.retire() == []  # a request still generates with version 3
        adapters.using(3, -1)
        assert adapters.retire() == [4]  # version 3's LoRA id
        with pytest.raises(ValueError, match="not a LoRA adapter"):
            adapters.add(5, [("model.norm.weight", torch.ones(2))])
    finally:
        adapters.close()
    assert not adapters.root.exists()


def test_vllm_ranks_and_config():
    assert AdapterSpec(4, 8.0, 2).engine_kwargs()["max_lora_rank"] == 8  # padded to what vLLM serves
    assert AdapterSpec(16, 8.0, 3).engine_kwargs() == {
        "enable_lora": True, "max_loras": 3, "max_cpu_loras": 3, "max_lora_rank": 16,
    }  # fmt: skip
    with pytest.raises(ValueError, match="up to 512"):
        AdapterSpec(600, 8.0, 2).engine_kwargs()
    cfg = load_config(None, [*REQUIRED, "learner.lora.rank=8", "learner.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.learner.lora.rank == 8 and cfg.learner.lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(None, REQUIRED).learner.lora is None
    with pytest.raises(ConfigError, match="learner.lora.rank"):
        load_config(None, [*REQUIRED, "learner.lora.rank=0"])


def test_modules_vllm_serves_no_adapter_on_are_refused():
    for bad in ("learner.lora.target_modules=[q_proj,lm_head]", "learner.lora.target_modules=embed_tokens"):
        with pytest.raises(ConfigError, match="vLLM serves no adapter on"):
            load_config(None, [*REQUIRED, bad])


LORA_CHECKPOINT = """
import asyncio, sys
from learner.attention import select_attention
from learner.config import AlgorithmConfig, LearnerConfig, LoraConfig
from learner.group import LearnerGroup
from learner.worker import LearnerWorker, RankSpec
from tests.fakes import LocalActor, make_group

model, zero, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
learner = LearnerConfig(zero_stage=zero, lora=LoraConfig(rank=4, alpha=8.0), lr=0.05)
algorithm = AlgorithmConfig()
worker = LearnerWorker(0, 1)
worker.join_alone(60)
spec = RankSpec(model, learner, algorithm, "float32", 0, max_tokens=8)
worker.build(spec, select_attention("sdpa", False, False, "float32"))
group = LearnerGroup([LocalActor(worker)], algorithm, learner.token_budget, 8)
for _ in range(2):  # B leaves 0: the merge changes the weights
    asyncio.run(group.train_step([make_group(0, [1.0, 0.0, 1.0, 0.0], completion_len=4)]))
worker.save_checkpoint(out + "/ckpt")
worker.save_model(out + "/model")
later = [make_group(1, [0.0, 1.0, 1.0, 0.0], completion_len=4)]
asyncio.run(group.train_step(later))
worker.save_model(out + "/after")
worker.load_checkpoint(out + "/ckpt")  # back to the checkpoint: the same step must give the same weights
asyncio.run(group.train_step(later))
worker.save_model(out + "/again")
"""


@pytest.mark.parametrize("zero", [1, 3])
def test_a_lora_checkpoint_resumes_exactly_and_exports_as_the_run_saves_its_model(zero, tiny_model_dir, tmp_path):
    """A learner rank trains LoRA adapters, checkpoints, trains a step, goes back to the checkpoint and trains
    that step again: the same weights, bit for bit (adapters, AdamW state, schedule restored). ZeRO-1 keeps no
    fp32 copy of frozen weights (the base), ZeRO-3 gathers them one at a time: the exported checkpoint and
    the saved model are the same merged weights either way."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from launch.tools.export import _from_deepspeed

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", LORA_CHECKPOINT, tiny_model_dir, str(zero), str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    exported = _from_deepspeed(tmp_path / "ckpt", tmp_path / "exported")
    a, b = load_file(exported / "model.safetensors"), load_file(tmp_path / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in b:  # the same merge on the same machine; W + s B A within 2.1e-7 in any order (as above)
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    assert (tmp_path / "model" / "adapter" / "adapter_config.json").is_file()
    after, again = (
        load_file(tmp_path / "after" / "model.safetensors"),
        load_file(tmp_path / "again" / "model.safetensors"),
    )
    assert all(torch.equal(after[k], again[k]) for k in after)
    assert not all(torch.equal(after[k], b[k]) for k in b)  # the step after the checkpoint changed them
