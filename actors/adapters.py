"""LoRA adapters on the engine side: one per policy version, served by vLLM beside the base model.

With ``learner.lora`` the learner publishes only the adapter's tensors (PEFT's names, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). An actor writes each version
as a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) in a folder of
its own (``/dev/shm`` where there is one: vLLM loads adapters from a path only) and generates with a
``LoRARequest`` naming it. The base weights are loaded once, at start. A request keeps the adapter it
started with to its end, so every token of it carries that version (in-flight updates included: a new
version serves the requests that start after it); the engine holds up to ``slots`` adapters at once
(``run.max_staleness + 1``: the versions that may still be generating), and an adapter no request
uses any more is removed from the engine and from disk.

Version 0 is the base model itself (PEFT starts B = 0): no adapter until the first one is published.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


@dataclass(frozen=True)
class AdapterSpec:
    """What an actor needs to serve the learner's LoRA adapters (from ``learner.lora``)."""

    rank: int
    alpha: float
    slots: int  # adapters the engine holds at once

    def engine_kwargs(self) -> dict:
        """vLLM engine arguments: LoRA on, room for ``slots`` adapters of this rank."""
        max_rank = next((r for r in VLLM_RANKS if r >= self.rank), None)
        if max_rank is None:
            raise ValueError(f"learner.lora.rank = {self.rank}: vLLM serves ranks up to {VLLM_RANKS[-1]}")
        return {"enable_lora": True, "max_loras": self.slots, "max_cpu_loras": self.slots, "max_lora_rank": max_rank}


def adapter_config(spec: AdapterSpec, base_model: str, target_modules: list[str]) -> dict:
    """A PEFT ``adapter_config.json`` for the published tensors."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def published_targets(names: list[str]) -> list[str]:
    """The module names the published tensors adapt (``...q_proj.lora_A.weight`` -> ``q_proj``)."""
    return sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names if ".lora_" in name})


class Adapters:
    """The adapters one engine serves, by policy version."""

    def __init__(self, spec: AdapterSpec, base_model: str, name: str):
        self.spec, self.base_model = spec, base_model
        shm = Path("/dev/shm")
        parent = shm if shm.is_dir() else None
        self.root = Path(tempfile.mkdtemp(prefix=f"tandem-{name}-lora-", dir=parent))
        self.requests: dict[int, object] = {}  # version -> its LoRARequest
        self.current: int = 0
        self.users: dict[int, int] = {}  # version -> requests generating with it

    def add(self, version: int, named: list) -> None:
        """Write ``version``'s adapter; requests made from now on use it."""
        self.activate(version, self.write(version, named))

    def write(self, version: int, named: list):
        """``version``'s adapter directory and its LoRARequest; changes nothing else (a thread may run it)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        directory = self.root / f"v{version}"
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named}
        if not tensors or not all(".lora_" in name for name in tensors):
            raise ValueError(
                f"policy version {version}: the published weights are not a LoRA adapter "
                f"({len(tensors)} tensors, e.g. {next(iter(tensors), 'none')!r}); the learner and the actors must "
                "agree on learner.lora"
            )
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        config = adapter_config(self.spec, self.base_model, published_targets(list(tensors)))
        (directory / "adapter_config.json").write_text(json.dumps(config))
        return LoRARequest(f"policy-v{version}", version + 1, str(directory))

    def activate(self, version: int, request) -> None:
        """Requests made from now on use ``version``'s adapter (``request``, from ``write``)."""
        self.requests[version] = request
        self.current = version

    def request(self, version: int | None = None):
        """The LoRARequest of ``version`` (default: the current one); None for version 0, the base model."""
        return self.requests.get(self.current if version is None else version)

    def using(self, version: int, count: int = 1) -> None:
        """``count`` requests started (or, negative, ended) with ``version``'s adapter."""
        self.users[version] = self.users.get(version, 0) + count

    def retire(self) -> list[int]:
        """Forget every adapter that is not current and has no request generating with it; their
        directories are deleted. Returns their LoRA ids, for the engine to remove."""
        gone = [v for v in list(self.requests) if v != self.current and self.users.get(v, 0) <= 0]
        ids = []
        for version in gone:
            ids.append(self.requests.pop(version).lora_int_id)
            self.users.pop(version, None)
            shutil.rmtree(self.root / f"v{version}", ignore_errors=True)
        return ids

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def lora_kwargs(request) -> dict:
    """A generate call's adapter argument: ``lora_request`` when there is an adapter, nothing otherwise."""
    return {"lora_request": request} if request is not None else {}
