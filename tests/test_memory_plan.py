"""The memory plan (``cluster/memory.py``, ``launch/plan.py``): its arithmetic against the same tensors
measured on the CPU, the recipes at 80 GiB, and the one-line refusals of ``tandem plan`` and ``tandem train``.

Parameters, AdamW's states and LoRA's adapters are counted on meta tensors of the real shapes (0.5B, 7B):
exact. Activations are counted on a tiny real Qwen2 (a shape other than the one the coefficients were
read from) as the unique storages autograd saves (``saved_tensors_hooks``), on the CPU's sdpa: within 2%
without a mask (the coefficients are per element; what is left is the few scalars autograd also saves), and
exactly with a packed block mask (k and v repeated to every head, the mask's per-layer copy). A GPU's
flash-attention saves the same tensors as the unmasked case (q, k, v, out, lse); that is not measured here.
A whole forward and backward of the learner's path (chunked log-probs) peaks under the plan and within 35%.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.memory import (
    GIB,
    KNOWN_SHAPES,
    MemoryPlanError,
    ModelShape,
    activation_bytes,
    chunk_bytes,
    known_shape,
    layer_activation_bytes,
    logits_bytes,
    mask_bytes,
    shape_of,
    training_state,
)
from launch.cli import main
from launch.config import load_config
from launch.plan import check_memory, dense_attention, memory_plan, model_shape
from launch.preflight import PreflightError, check_gpu_memory

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))


def _hf_config(s: ModelShape):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
        tie_word_embeddings=s.tied,
    )  # fmt: skip


def _meta_model(s: ModelShape):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_hf_config(s), dtype=torch.float32)


@pytest.mark.parametrize("size", ["0.5B", "7B"])
def test_parameters_and_adamw_states_are_the_meta_models_bytes(size):
    s = KNOWN_SHAPES[size]
    model = _meta_model(s)
    phi = sum(p.numel() for p in model.parameters())
    assert s.params == phi == {"0.5B": 494_032_768, "7B": 7_615_616_512}[size]  # Qwen2.5's published counts
    assert shape_of(_hf_config(s)) == s
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()  # creates exp_avg and exp_avg_sq, fp32 like the master weights they update
    moments = sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values() if v.ndim)
    master = sum(p.numel() * p.element_size() for p in model.parameters())  # DeepSpeed's fp32 copy
    one = training_state(phi, phi, zero=1, ranks=1, b=2)
    assert one["optimizer"] == master + moments == 12 * phi
    assert one["weights"] == one["gradients"] == 2 * phi  # the bf16 module and its gradients
    # ZeRO-2 over 4 ranks: 0.5B -> 12 x 494,032,768 / 4 = 1,482,098,304 bytes of optimizer per rank
    if size == "0.5B":
        assert training_state(phi, phi, zero=2, ranks=4, b=2)["optimizer"] == 1_482_098_304
        assert training_state(phi, phi, zero=2, ranks=4, b=2)["gradients"] == 2 * phi // 4


def test_lora_adapters_are_the_peft_models_trained_parameters():
    from peft import LoraConfig, get_peft_model

    s = KNOWN_SHAPES["0.5B"]
    peft = get_peft_model(_meta_model(s), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    trained = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert s.lora_params(16, "all-linear") == trained
    # q and v only: 24 layers x 16 x ((896 + 896) + (896 + 128)) = 1,081,344
    assert s.lora_params(16, ["q_proj", "v_proj"]) == 1_081_344


def _saved_bytes(s: ModelShape, tokens: int, dtype: torch.dtype, checkpointing: bool) -> int:
    """Bytes of the unique storages autograd saves in a forward of the model's body (not its parameters)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(s), dtype=dtype, attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, s.vocab, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, position_ids=torch.arange(tokens)[None], use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_what_autograd_saves_in_a_tiny_qwen2(dtype, checkpointing):
    s = ModelShape(vocab=300, hidden=96, layers=3, heads=6, kv_heads=2, head_dim=16, intermediate=224, tied=True)
    b = 2 if dtype == torch.bfloat16 else 4
    measured = _saved_bytes(s, 320, dtype, checkpointing)
    predicted = activation_bytes(s, 320, b, checkpointing)
    if checkpointing:  # the forward keeps each layer's input; the one layer recomputed is the backward's, and the
        # RoPE cos/sin reach the checkpointed layers as inputs (held, but not through autograd's hooks)
        predicted -= 320 * (layer_activation_bytes(s, b) + 2 * b * s.head_dim)
    assert abs(measured - predicted) <= 0.02 * predicted, (measured, predicted)


def test_the_logits_kv_and_chunk_terms_by_hand():
    s = KNOWN_SHAPES["1.5B"]
    assert s.kv_bytes_per_token(2) == 28_672  # 2 x 28 layers x 2 kv heads x 128 x 2 B: the DAPO recipe's "28 KB"
    assert KNOWN_SHAPES["7B"].kv_bytes_per_token(2, tensor_parallel=2) == 28_672  # 2 x 28 x 4 x 128 x 2 / 2
    assert logits_bytes(151_936, 32_768, 2) == 19_914_555_392  # 2 x 32768 x 151936 x 2 B: logits and gradient
    assert chunk_bytes(151_936, 1024) == 2_489_319_424  # 4 x 1024 x 151936 x 4 B
    assert known_shape("Qwen/Qwen2.5-1.5B-Instruct") == s and known_shape("gpt2") is None


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_fits_80_gib_gpus_with_or_without_flash_attn(recipe):
    """docs/clusters.md's "Memory plan" table: every recipe's GPUs fit 80 GiB, whichever kernel the rank runs."""
    cfg = load_config(recipe)
    shape = model_shape(cfg)
    assert shape == KNOWN_SHAPES["1.5B"]
    for flash in (False, True):
        check_memory(cfg, shape, 80 * GIB, dense_attention(cfg, flash_attn=flash))


def test_a_plan_over_the_device_names_its_largest_part_and_the_knob():
    cfg = load_config(ROOT / "configs/recipes/gsm8k-grpo-1node.yaml", ["learner.token_budget=32768"])
    # 32768 tokens x 28 layers x 103,480 B per token and layer (no checkpointing) = 88.4 GiB, + 0.3 outside the layers
    with pytest.raises(
        MemoryPlanError, match=r"activations \(32768 tokens\) \(88.7 GiB\): set learner.gradient_checkpointing=true"
    ):
        check_memory(cfg, KNOWN_SHAPES["1.5B"], 80 * GIB, dense_attention(cfg, flash_attn=True))
    on = load_config(
        ROOT / "configs/recipes/gsm8k-grpo-1node.yaml",
        ["learner.token_budget=32768", "learner.gradient_checkpointing=true"],
    )
    check_memory(on, KNOWN_SHAPES["1.5B"], 80 * GIB, dense_attention(on, flash_attn=False))  # the fix named fits


def test_tandem_plan_prints_the_table_and_refuses_in_one_line(capsys):
    recipe = str(ROOT / "configs/recipes/math-grpo-1node.yaml")
    assert main(["plan", "--config", recipe]) == 0
    out = capsys.readouterr().out
    assert "GPU of learner rank 0, peak while training" in out and "vLLM KV cache" in out
    assert main(["plan", "--config", recipe, "--gpu-memory-gib", "40", "learner.attention=flash_attention_2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than the device's 40.0 GiB" in err[0] and "lower learner." in err[0]


def test_an_engine_share_without_room_for_one_sequence_is_refused():
    cfg = load_config(ROOT / "configs/recipes/math-grpo-1node.yaml", ["engine.gpu_memory_utilization=0.07"])
    # 0.07 x 80 GiB = 5.6 GiB less weights 2.88, profile 0.95 and graphs 1.0 leaves 0.77 GiB of KV cache, more
    # than one 4096-token sequence's 4096 x 28,672 B = 0.11 GiB; at 0.06 (4.8 GiB) nothing is left
    check_memory(cfg, KNOWN_SHAPES["1.5B"], 80 * GIB, False)
    cfg = load_config(ROOT / "configs/recipes/math-grpo-1node.yaml", ["engine.gpu_memory_utilization=0.06"])
    with pytest.raises(MemoryPlanError, match="raise engine.gpu_memory_utilization"):
        check_memory(cfg, KNOWN_SHAPES["1.5B"], 80 * GIB, False)


def test_colocated_gpus_hold_the_engines_with_what_the_learner_does_not_offload():
    cfg = load_config(ROOT / "configs/recipes/math-grpo-1node.yaml", [
        "run.schedule=colocated", "learner.zero_stage=1", "engine.gpu_memory_utilization=0.4", "learner.lora.rank=16",
        "learner.attention=flash_attention_2"])  # fmt: skip
    s = KNOWN_SHAPES["1.5B"]
    (gpu,), _ = memory_plan(cfg, s, 80 * GIB, dense=False)
    generating = {f"{t.process} {t.name}": t.bytes for t in gpu.phases["generating"]}
    # the learner's weights (a LoRA base too: learner/offload.py, review B7), gradients and states leave;
    # the colocated reference (1,543,714,304 x 2 B), DeepSpeed's 5e8 x 2 B bucket and the context stay
    assert s.lora_params(16, "all-linear") == 18_464_768
    assert generating["reference weights"] == 1_543_714_304 * 2
    assert generating["learner rank DeepSpeed buckets"] == 1_000_000_000
    assert not any(k.startswith("learner rank") and "weights" in k for k in generating)
    assert sum(v for k, v in generating.items() if k.startswith("actor vLLM")) == int(0.4 * 80 * GIB)
    assert "starting (the learner builds beside the awake engines)" in gpu.phases  # review B1


def test_train_stops_before_anything_starts_when_a_gpu_cannot_hold_the_plan(tmp_path):
    cfg = load_config(ROOT / "configs/recipes/math-grpo-1node.yaml", ["learner.attention=flash_attention_2"])
    with pytest.raises(PreflightError, match="more than the device's 40.0 GiB"):
        check_gpu_memory(cfg, "Qwen/Qwen2.5-1.5B-Instruct", device=40 * GIB)
    check_gpu_memory(cfg, "Qwen/Qwen2.5-1.5B-Instruct", device=80 * GIB)
    cpu = load_config(ROOT / "configs/demo.yaml")  # no GPUs: nothing to check, whatever the device
    check_gpu_memory(cpu, cpu.model.path, device=1)


def test_a_local_model_folder_gives_its_own_shape(tmp_path):
    (tmp_path / "config.json").write_text(_hf_config(KNOWN_SHAPES["0.5B"]).to_json_string())
    cfg = load_config(ROOT / "configs/recipes/math-grpo-1node.yaml", [f"model.path={tmp_path}"])
    assert model_shape(cfg) == KNOWN_SHAPES["0.5B"]
    assert model_shape(cfg, "7B") == KNOWN_SHAPES["7B"]


def test_the_mask_term_is_the_largest_one_micro_batch_carries():
    from launch.plan import policy_terms

    dapo = load_config(ROOT / "configs/recipes/math-dapo-1node.yaml")
    _, backward, _ = policy_terms(dapo.learner, KNOWN_SHAPES["1.5B"], 2, "bfloat16", 9216, dense=True)
    mask = next(t.bytes for t in backward if "mask" in t.name)
    # 32768 // 9216 = 3 sequences, one row each: 3 x 9216^2 bool, and (checkpointing) one layer's bf16 copy
    assert mask == 3 * 9216 * 9216 * (1 + 2)
    _, backward, _ = policy_terms(dapo.learner, KNOWN_SHAPES["1.5B"], 2, "bfloat16", 9216, dense=False)
    assert not any("mask" in t.name for t in backward)  # flash-attention's varlen kernel takes none


def test_preflight_stops_a_gpu_run_whose_plan_does_not_fit_this_machine(tmp_path, monkeypatch):
    import launch.preflight as pf

    monkeypatch.setattr(pf, "local_gpu_bytes", lambda: 40 * GIB)  # what nvidia-smi would say
    recipe = ROOT / "configs/recipes/math-grpo-1node.yaml"
    cfg = load_config(recipe, [f"run.output_dir={tmp_path}", "learner.attention=flash_attention_2"])
    with pytest.raises(PreflightError, match=r"while training, more than the device's 40.0 GiB"):
        pf.preflight(cfg, "Qwen/Qwen2.5-1.5B-Instruct", [{"problem": "1 + 1?", "solution": "\\boxed{2}"}])


def test_an_unknown_model_shape_option_is_refused_before_anything_prints(capsys):
    recipe = str(ROOT / "configs/recipes/math-grpo-1node.yaml")
    assert main(["plan", "--config", recipe, "--model-shape", "13B"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--model-shape 13B: neither a Qwen2.5 size" in err
    assert main(["plan", "--config", recipe, "--model-shape", "7B"]) == 2  # 7B on 4 ZeRO-2 ranks: 97 GiB
    assert "raise learner.zero_stage" in capsys.readouterr().err


def test_sdpa_saves_a_compute_dtype_copy_of_the_bool_mask_in_every_layer():
    """torch's sdpa turns a bool mask into the query's dtype at each call, and each layer keeps that copy for its
    backward: L x R Lr^2 x b beside the bool mask itself (the plan's mask term), here 3 x 512^2 x 2 B; and the
    rest of what autograd saves is the activations with k and v at every query head, exactly."""
    from transformers import AutoModelForCausalLM

    s = ModelShape(vocab=300, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128, tied=True)
    model = AutoModelForCausalLM.from_config(_hf_config(s), dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    seq = torch.arange(512) // 256  # two sequences of 256 tokens in one row: a block-diagonal causal mask
    mask = (seq[:, None] == seq[None, :]) & (torch.arange(512)[None, :] <= torch.arange(512)[:, None])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, everything = {}, {}

    def pack(t):
        ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if t.shape == (1, 1, 512, 512):
            saved[ptr] = nbytes
        if ptr not in params:
            everything[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        position = (torch.arange(512) % 256)[None]
        model.model(input_ids=torch.ones(1, 512, dtype=torch.long), position_ids=position,
                    attention_mask=mask[None, None], use_cache=False)  # fmt: skip
    copies = mask_bytes(512 * 512, 2, s.layers, checkpointing=False, sdpa=True) - 512 * 512  # less the bool input
    assert sum(saved.values()) == copies == 3 * 512 * 512 * 2
    # with a mask transformers repeats k and v to every query head before sdpa (use_gqa_in_sdpa): k' = a
    assert sum(everything.values()) == activation_bytes(s, 512, 2, False, dense_sdpa=True) + copies


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_real_forward_and_backward_peaks_under_the_plan_and_near_it(checkpointing):
    """The learner's path on a small Qwen2 (CPU, bf16): the LM head on the scored positions, the chunked log-probs
    and entropy (``learner/logprobs.py``), the backward; torch's MemTracker records the peak of every tensor. The
    plan sums the backward's transients (one layer's gradients, the chunk temporaries, every weight gradient) as
    if they were all alive at once, which they are not quite: it may be above the peak, by at most 35% here
    (measured 12% without checkpointing, 27% with it, where the layer inputs are small beside the rest)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    from learner.logprobs import token_entropy, token_logprobs

    s = ModelShape(vocab=8192, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=352, tied=True)
    tokens, chunk = 1024, 128
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(s), dtype=torch.bfloat16, attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, s.vocab, (1, tokens))
    tracker = MemTracker()
    tracker.track_external(model, ids)
    with tracker:
        kept = torch.arange(tokens - 1)  # every position but the last predicts a scored token
        logits = model(input_ids=ids, position_ids=torch.arange(tokens)[None], logits_to_keep=kept, use_cache=False)
        logits = logits.logits[0]  # [T - 1, V]
        token_entropy(logits.detach(), chunk)
        (-token_logprobs(logits, ids[0, 1:], chunk).sum()).backward()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    predicted = 2 * s.params * 2 + activation_bytes(s, tokens, 2, checkpointing)  # weights and their gradients
    predicted += tokens * layer_activation_bytes(s, 2) + logits_bytes(s.vocab, tokens, 2) + chunk_bytes(s.vocab, chunk)
    assert measured <= predicted <= 1.35 * measured, (measured, predicted)


def test_the_plan_counts_what_the_review_found_missing():
    """KV heads at tensor parallel above the model's KV heads (vLLM keeps one per GPU: config/model.py), the
    NCCL receiver's two sets of buffers, and eager attention's probabilities, by hand."""
    s = KNOWN_SHAPES["1.5B"]  # 28 layers, 2 KV heads of 128
    assert s.kv_bytes_per_token(2, 1) == 2 * 28 * 2 * 128 * 2 == 28672
    assert s.kv_bytes_per_token(2, 4) == 2 * 28 * 1 * 128 * 2 == 14336  # not 7168: one head on each of 4 GPUs
    eager = mask_bytes(4096, 2, layers=3, checkpointing=False, sdpa=False, heads=12)
    assert eager == 4096 * 2 + 3 * 12 * 4096 * (4 + 2)  # additive mask + fp32 softmax and its bf16 copy, per layer
    cfg = load_config(ROOT / "configs/recipes/math-grpo-1node.yaml",
                      ["weights.backend=distributed", "weights.process_group=nccl"])  # fmt: skip
    gpus, _ = memory_plan(cfg, s, 80 * GIB, dense=False)
    actor = next(g for g in gpus if g.label == "first GPU of actor 0")
    (receive,) = [t for t in actor.phases["generating"] if "receive buffers" in t.name]
    assert receive.bytes == 2 * s.params * 2 and receive.knob == "set weights.backend=ray"
