"""``tandem export RUN_DIR [--step N] --out DIR``: a run's policy as a Hugging Face model directory.

From the checkpoint of step N (default: the newest intact one): its ``model/`` when it has one,
else the weights merged from its DeepSpeed state (``learner/saving.py``, every ZeRO stage; a LoRA
run's adapter merged into its base, ``learner/lora.py``) with the config and tokenizer stored beside
them. Runs in this process: no Ray, no GPU.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from runtime.checkpoints import CheckpointError, CheckpointStore, problem


def export_model(run_dir: str | Path, out: str | Path, step: int | None = None, say=print) -> Path:
    root, out = Path(run_dir), Path(out)
    if not root.is_dir():
        raise CheckpointError(f"run directory {root} does not exist")
    store = CheckpointStore(root, keep=1)
    if step is None:
        if not store.all() and (root / "model").is_dir():
            return _copy(root / "model", out)
        checkpoint, _ = store.newest(say)
    else:
        checkpoint = store.root / f"step-{step}"
        if not checkpoint.is_dir():
            steps = ", ".join(p.name.removeprefix("step-") for p in store.all()) or "none"
            raise CheckpointError(f"no checkpoint of step {step} in {store.root} (steps there: {steps})")
        bad = problem(checkpoint)
        if bad:
            raise CheckpointError(f"checkpoint {checkpoint} is unusable: {bad}")
    if (checkpoint / "model").is_dir():
        return _copy(checkpoint / "model", out)
    return _from_deepspeed(checkpoint, out)


def _copy(source: Path, out: Path) -> Path:
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"--out {out} exists and is not empty; give a new directory")
    shutil.copytree(source, out, dirs_exist_ok=True)
    return out


def _from_deepspeed(checkpoint: Path, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from learner.lora import adapter_shape, is_lora_state, merge_lora
    from learner.saving import fp32_state_dict

    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"--out {out} exists and is not empty; give a new directory")
    hf = checkpoint / "hf"
    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = fp32_state_dict(checkpoint)
    if is_lora_state(state):  # a learner.lora run: the base with the adapter merged in
        state = merge_lora(state, *adapter_shape(hf))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {checkpoint} does not fit its model config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(hf).save_pretrained(out)
    if (hf / "generation_config.json").is_file():
        shutil.copy(hf / "generation_config.json", out / "generation_config.json")
    return out
