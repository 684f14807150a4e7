"""A learner rank's states out of device memory and back (the colocated schedule on GPUs).

DeepSpeed's ``engine.offload_states`` moves a ZeRO engine's optimizer states, fp32 master weights,
model weights and gradient buffers to host memory, and ``reload_states`` brings them back. Under
ZeRO-3 it refuses the master weights and the optimizer states of any optimizer but its own
``FusedAdam`` (a CUDA extension); the learner's optimizer is torch's ``AdamW``. So under ZeRO-3 this
module lets DeepSpeed move the rest and moves those two itself, the way DeepSpeed would: each tensor's
``.data`` is replaced, so the optimizer keeps its references.
"""

from __future__ import annotations

import torch

OWN = ("hp_params", "optim_states")  # what DeepSpeed's ZeRO-3 offload leaves to a non-FusedAdam optimizer


def _needs_own_moves(engine) -> bool:
    optimizer = engine.optimizer
    if not hasattr(optimizer, "fp32_partitioned_groups_flat"):  # not ZeRO-3: DeepSpeed moves everything
        return False
    from deepspeed.ops.adam import FusedAdam

    return not isinstance(optimizer.optimizer, FusedAdam)


def _own_tensors(engine) -> list[torch.Tensor]:
    """ZeRO-3's fp32 master partitions and the inner optimizer's state tensors."""
    optimizer = engine.optimizer
    states = [v for state in optimizer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return list(optimizer.fp32_partitioned_groups_flat) + states


def offload(engine, pin_memory: bool) -> list[tuple[torch.Tensor, torch.device]]:
    """Move ``engine``'s states to host memory; returns what this module moved itself (for ``reload``)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    if not _needs_own_moves(engine):
        engine.offload_states(pin_memory=pin_memory)
        return []
    engine.offload_states(include=[s for s in OffloadStateTypeEnum if s.value not in OWN], pin_memory=pin_memory)
    moved = []
    for tensor in _own_tensors(engine):
        moved.append((tensor, tensor.device))
        host = tensor.data.to("cpu")
        tensor.data = host.pin_memory() if pin_memory else host
    return moved


def reload(engine, moved: list[tuple[torch.Tensor, torch.device]]) -> None:
    """Everything ``offload`` moved, back where it was."""
    engine.reload_states()
    for tensor, device in moved:
        tensor.data = tensor.data.to(device)
