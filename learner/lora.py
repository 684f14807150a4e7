"""LoRA on the learner (``learner.lora``): PEFT adapters on the policy; only they train and travel.

The base weights are frozen: the optimizer holds the adapters' parameters alone, the actors get
only the adapter at each publish (``adapter_weights``, PEFT's names, what vLLM loads), and the saved
model is the base with every adapted weight merged in (``merge_lora``):

    W' = W + (alpha / r) B A        W: [out, in], A: [r, in], B: [out, r]

PEFT builds the adapted model (``with_lora``); the merge is computed here from the tensors, so it
reads the same from a live model, a gathered ZeRO-3 one or a DeepSpeed checkpoint (``tandem export``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from learner.config import LoraConfig

PEFT_PREFIX = "base_model.model."  # a PeftModelForCausalLM's parameters: base_model.model.<HF name>
ADAPTER = "default"  # PEFT's adapter name; published and saved names leave it out


def with_lora(model, lora: LoraConfig):
    """``model`` wrapped by PEFT with ``lora``'s adapters: the base frozen, B = 0 (the policy starts
    as the base model)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(model, config)


def lora_summary(model, dtype: str = "float32") -> dict[str, int]:
    """What a LoRA policy trains and sends: ``trainable`` and ``total`` parameters, and ``adapter_bytes``, the
    adapters' size as each publish carries them: in the training ``dtype`` (``model.dtype``; DeepSpeed casts
    the module to it after this is measured)."""
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    adapters = [p for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]
    return {
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total": sum(p.numel() for p in model.parameters()),
        "adapter_bytes": sum(p.numel() for p in adapters) * size,
    }


def describe_lora(lora: LoraConfig, summary: dict[str, int]) -> str:
    """The console's line for a LoRA run: what trains, what stays frozen, what each publish sends."""
    targets = lora.target_modules if isinstance(lora.target_modules, str) else ", ".join(lora.target_modules)
    share = summary["trainable"] / max(summary["total"], 1)
    return (
        f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {targets}: {summary['trainable'] / 1e6:.2f}M trainable of "
        f"{summary['total'] / 1e6:.2f}M parameters ({share:.2%}); the base, its output head and embeddings stay "
        f"frozen; each publish sends {summary['adapter_bytes'] / 1e6:.2f} MB of adapters"
    )


def is_peft(module) -> bool:
    return hasattr(module, "peft_config")


def saved_name(name: str) -> str:
    """A parameter's name as PEFT saves it (and vLLM reads it): without the adapter's name."""
    return name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def adapter_weights(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The adapter's ``(name, tensor)`` pairs out of a PEFT model's named parameters."""
    return [(saved_name(name), t) for name, t in named if ".lora_A." in name or ".lora_B." in name]


def merge_lora(state: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """A PEFT model's weights (``base_model.model.<name>.base_layer.weight``, ``...lora_A[.default].weight``,
    ``...lora_B[.default].weight``) as the base model's, each adapted weight merged:
    ``W + (alpha / rank) B A``. Names not under PEFT's prefix are kept as they are."""
    scale = alpha / rank
    flat = {saved_name(k): v for k, v in state.items()}
    out = {}
    for name, tensor in flat.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        hf = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        if ".base_layer." in name and name.endswith(".weight"):
            owner = name[: -len(".base_layer.weight")]
            a, b = flat[f"{owner}.lora_A.weight"], flat[f"{owner}.lora_B.weight"]
            tensor = (tensor.float() + scale * (b.float() @ a.float())).to(tensor.dtype)
        out[hf] = tensor
    return out


def is_lora_state(state: dict) -> bool:
    """Weights of a PEFT model (a LoRA run's checkpoint), not of the base model."""
    return any(".lora_A." in name for name in state)


def save_adapter(module, named: list[tuple[str, torch.Tensor]], directory: str | Path) -> None:
    """The adapter alone, as PEFT writes it: ``adapter_config.json`` + ``adapter_model.safetensors``
    (``PeftModel.from_pretrained(base, directory)`` loads it; so does vLLM)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module.peft_config[ADAPTER].save_pretrained(str(directory))
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named}
    save_file(tensors, str(directory / "adapter_model.safetensors"))


def adapter_shape(directory: str | Path) -> tuple[int, float]:
    """``(rank, alpha)`` from an ``adapter_config.json`` in ``directory``."""
    config = json.loads((Path(directory) / "adapter_config.json").read_text())
    return int(config["r"]), float(config["lora_alpha"])
