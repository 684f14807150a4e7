"""How the in-flight actor hands new weights to its vLLM engine (``engine.weight_transfer``).

The async engine's core runs in a process of its own; ``collective_rpc`` arguments reach it
msgpack-encoded, so tensors cannot pass as they are. Two ways across, chosen per update:

- ``bytes``: the whole model as safetensors bytes, copied into the message every update. Any
  machine; the default on the CPU, where the engine's process may have little shared memory.
- ``shared``: handles to the tensors' memory, a few hundred bytes per tensor
  (``torch.multiprocessing``'s reductions): CUDA IPC for tensors on a GPU (the engine reads the
  actor's memory; nothing is copied), shared memory for tensors on the CPU (one copy into
  ``/dev/shm``, none through the message). The default with a GPU, for each update whose host
  tensors fit ``/dev/shm`` twice over (a container's is 64 MB unless it is given more).

The engine's worker (``actors/vllm_worker.py``) rebuilds the tensors and loads them in place; the
actor keeps its tensors alive until that call has returned.
"""

from __future__ import annotations

import os
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

    def for_weights(self, named_tensors: list) -> EngineTransfer:
        """The transfer of this update (a fixed one: itself)."""
        return self


ENGINE_TRANSFERS = {
    "bytes": EngineTransfer(weights_to_bytes, "load_weights_blob"),
    "shared": EngineTransfer(weights_to_handles, "load_weights_shared"),
}
SHM = "/dev/shm"
SHM_MARGIN = 2  # free /dev/shm an update of host tensors needs, in updates (Ray's object store lives there too)


def shm_shortfall(named_tensors: list, free: Callable[[], int]) -> str | None:
    """Why handles would not fit, or None: host tensors are copied into ``/dev/shm`` files (a
    container's is 64 MB by default: SIGBUS or 'unable to write' mid-update); GPU tensors are not."""
    need = sum(t.numel() * t.element_size() for _, t in named_tensors if not t.is_cuda)
    have = free() if need else 0
    if need * SHM_MARGIN <= have:
        return None
    return (
        f"{SHM} has {have / 2**30:.2f} GiB free and an update of host tensors writes {need / 2**30:.2f} GiB there "
        f"(x{SHM_MARGIN} needed); give the container more shared memory (docker run --shm-size, a Kubernetes "
        "emptyDir with medium: Memory)"
    )


def shm_free() -> int:
    import shutil

    return shutil.disk_usage(SHM).free if os.path.isdir(SHM) else 0


@dataclass
class SharedIfRoom:
    """Handles, unless the update's host tensors (the Ray channel's) do not fit ``/dev/shm``: then,
    for ``auto`` with a GPU, bytes, said once (``say``); for ``shared`` asked for by name (``strict``),
    one line that stops the actor instead of its dying of SIGBUS in the middle of a copy."""

    say: Callable[[str], None]
    free: Callable[[], int] = shm_free
    strict: bool = False
    said: bool = False

    def for_weights(self, named_tensors: list) -> EngineTransfer:
        short = shm_shortfall(named_tensors, self.free)
        if short is None:
            return ENGINE_TRANSFERS["shared"]
        if self.strict:
            raise RuntimeError(f"engine.weight_transfer = shared: {short}, or set engine.weight_transfer=bytes")
        if not self.said:
            self.said = True
            self.say(f"weights reach the engine as bytes (a copy per update, slower): {short}")
        return ENGINE_TRANSFERS["bytes"]


def engine_transfer(setting: str, cuda: bool, say: Callable[[str], None] = print):
    """The transfer for ``engine.weight_transfer`` (``auto``: shared with a GPU when ``/dev/shm``
    has room for the update's host tensors, bytes without a GPU); ``for_weights`` picks each update's."""
    if setting == "auto":
        return SharedIfRoom(say) if cuda else ENGINE_TRANSFERS["bytes"]
    return SharedIfRoom(say, strict=True) if setting == "shared" else ENGINE_TRANSFERS[setting]
