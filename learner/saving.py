"""What a learner rank writes to disk and reads back: the policy as a Hugging Face model, and the
DeepSpeed state of the models it trains.

    <checkpoint>/deepspeed/policy/   the policy engine: weights, optimizer, schedule (every rank its part)
    <checkpoint>/deepspeed/critic/   the critic engine, when the run has one
    <checkpoint>/hf/                 the policy's config and tokenizer: enough to export the weights later
    <dir>/                           ``save_model``: safetensors + config + tokenizer, loadable by
                                     ``AutoModelForCausalLM.from_pretrained`` and by vLLM

Every rank of a group calls each function (DeepSpeed's save and load, and the ZeRO-3 gather, are
collectives); only rank 0 writes the files that are not per-rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TAGS = {"policy": "policy", "critic": "critic"}


def save_engines(engines: dict[str, Any], directory: str, client_state: dict[str, Any]) -> None:
    """``engines``: role -> DeepSpeed engine. Writes ``directory/deepspeed/<role>/``."""
    for role, engine in engines.items():
        engine.save_checkpoint(str(Path(directory) / "deepspeed"), tag=TAGS[role], client_state=client_state)


def load_engines(engines: dict[str, Any], directory: str) -> dict[str, Any]:
    """Restore every engine from ``directory/deepspeed/<role>/``; returns the policy's client state."""
    state: dict[str, Any] = {}
    for role, engine in engines.items():
        path, client = engine.load_checkpoint(
            str(Path(directory) / "deepspeed"),
            tag=TAGS[role],
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed {role} state in {directory}/deepspeed/{TAGS[role]}")
        state = state or dict(client or {})
    return state


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_hf_files(module, tokenizer_path: str, directory: str | Path) -> None:
    """The model's config (and generation config) and the tokenizer, without weights."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module.config.save_pretrained(directory)
    generation = getattr(module, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(directory)


def save_hf_model(module, named: list[tuple[str, torch.Tensor]], tokenizer_path: str, directory: str | Path) -> None:
    """Rank 0: the gathered ``(name, tensor)`` pairs as a Hugging Face model directory."""
    state = {name: t.detach().to("cpu").contiguous() for name, t in named}
    if getattr(module.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as the input embedding; written once
    module.save_pretrained(str(directory), state_dict=state, safe_serialization=True)  # weights + configs
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(directory)


def fp32_state_dict(checkpoint: str | Path, tag: str = TAGS["policy"]) -> dict[str, torch.Tensor]:
    """The policy's weights from a DeepSpeed checkpoint, in this process, for ``tandem export``."""
    root = Path(checkpoint) / "deepspeed"
    files = sorted((root / tag).glob("*mp_rank_*_model_states.pt"))  # ZeRO-3 prefixes zero_pp_rank_N_
    if not files:
        raise FileNotFoundError(f"no DeepSpeed model states in {root / tag}")
    if list((root / tag).glob("*optim_states.pt")) and list((root / tag).glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # ZeRO 1-3: the fp32 master weights, merged from every rank's partition; ZeRO-1 keeps none of frozen
        # parameters (a LoRA run's base), whose weights are then the model states' own
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
        states = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
        frozen = {k: v.float() for k, v in states["module"].items() if k not in fp32 and v.numel()}
        return {**frozen, **fp32}
    states = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)  # only "module" is read
    return {k: v.float() for k, v in states["module"].items()}  # ZeRO 0: the weights are the model states
