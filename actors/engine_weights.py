"""How the in-flight actor hands new weights to its vLLM engine (``engine.weight_transfer``).

The async engine's core runs in a process of its own; ``collective_rpc`` arguments reach it
msgpack-encoded, so tensors cannot pass as they are. Two ways across, chosen once per actor:

- ``bytes``: the whole model as safetensors bytes, copied into the message every update. Any
  machine; the default on the CPU, where the engine's process may have little shared memory.
- ``shared``: handles to the tensors' memory, a few hundred bytes per tensor
  (``torch.multiprocessing``'s reductions): CUDA IPC for tensors on a GPU (the engine reads the
  actor's memory; nothing is copied), shared memory for tensors on the CPU (one copy into
  ``/dev/shm``, none through the message). The default with a GPU.

The engine's worker (``actors/vllm_worker.py``) rebuilds the tensors and loads them in place; the
actor keeps its tensors alive until that call has returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def weights_to_bytes(named_tensors: list) -> tuple[bytes, list]:
    """Safetensors bytes of ``(name, tensor)`` pairs (nothing to keep alive)."""
    from safetensors.torch import save

    return save({name: t.contiguous() for name, t in named_tensors}), []


def weights_to_handles(named_tensors: list) -> tuple[bytes, list]:
    """``(name, tensor)`` pairs pickled as handles to their memory: a CUDA tensor as its CUDA IPC
    handle, a CPU tensor moved into shared memory (by file name: the engine is no child of ours,
    so file descriptors cannot be passed to it) and sent as that name. Also returns the tensors the
    handles point at: the caller keeps them until the engine has loaded them."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    shared = []
    for name, tensor in named_tensors:
        tensor = tensor.detach().contiguous()
        shared.append((name, tensor if tensor.is_cuda else tensor.share_memory_()))
    return bytes(ForkingPickler.dumps(shared)), shared


@dataclass(frozen=True)
class EngineTransfer:
    """``pack`` turns ``(name, tensor)`` pairs into the argument of the worker's ``method`` and
    what must stay alive until that call returns."""

    pack: Callable[[list], tuple[bytes, list]]
    method: str


ENGINE_TRANSFERS = {
    "bytes": EngineTransfer(weights_to_bytes, "load_weights_blob"),
    "shared": EngineTransfer(weights_to_handles, "load_weights_shared"),
}


def engine_transfer(setting: str, cuda: bool) -> EngineTransfer:
    """The transfer for ``engine.weight_transfer`` (``auto``: shared with a GPU, bytes without)."""
    return ENGINE_TRANSFERS[("shared" if cuda else "bytes") if setting == "auto" else setting]
