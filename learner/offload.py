"""A learner rank's states out of device memory and back (the colocated schedule on GPUs).

DeepSpeed's ``engine.offload_states`` moves a ZeRO engine's optimizer states, fp32 master weights,
model weights and gradient buffers to host memory, and ``reload_states`` brings them back. Three
things around it:

- under ZeRO-3 DeepSpeed refuses the master weights and the optimizer states of any optimizer but its
  own ``FusedAdam`` (a CUDA extension), and the learner's optimizer is torch's ``AdamW``: this module
  lets DeepSpeed move the rest and moves those two itself, the way DeepSpeed would (each tensor's
  ``.data`` is replaced, so the optimizer keeps its references);
- DeepSpeed's reload puts every optimizer-state tensor on the device, AdamW's ``step`` counters too,
  which torch keeps on the host: each goes back where it was before the offload;
- at ZeRO-1/2 DeepSpeed moves the trained parameters only (its ``bit16_groups`` hold those that
  require a gradient): with LoRA the frozen base, most of the model, would stay on the device, so
  this module moves the frozen parameters itself;
- ZeRO-0 has no ``offload_states`` (the config refuses the colocated schedule on GPUs there), and
  neither does DeepSpeed's ZeRO-3 with frozen parameters (LoRA, refused too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

OWN = ("hp_params", "optim_states")  # what DeepSpeed's ZeRO-3 offload leaves to a non-FusedAdam optimizer


@dataclass
class Offloaded:
    """What ``reload`` puts back: tensors this module moved, and where every optimizer-state tensor was."""

    moved: list[tuple[torch.Tensor, torch.device]] = field(default_factory=list)
    state_devices: list[tuple[dict, str, torch.device]] = field(default_factory=list)


def _inner(engine):
    return engine.optimizer.optimizer  # the torch optimizer inside DeepSpeed's ZeRO optimizer


def _needs_own_moves(engine) -> bool:
    if not hasattr(engine.optimizer, "fp32_partitioned_groups_flat"):  # not ZeRO-3: DeepSpeed moves everything
        return False
    from deepspeed.ops.adam import FusedAdam

    return not isinstance(_inner(engine), FusedAdam)


def _to_host(tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    return torch.empty_like(tensor, device="cpu", pin_memory=pin_memory).copy_(tensor)  # one copy


def offload(engine, pin_memory: bool) -> Offloaded:
    """Move ``engine``'s states to host memory."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    states = _inner(engine).state.values()
    out = Offloaded(state_devices=[(st, k, v.device) for st in states for k, v in st.items() if torch.is_tensor(v)])
    if not _needs_own_moves(engine):
        engine.offload_states(pin_memory=pin_memory)
        _move_to_host([p for p in engine.module.parameters() if not p.requires_grad], out, pin_memory)
        return out
    engine.offload_states(include=[s for s in OffloadStateTypeEnum if s.value not in OWN], pin_memory=pin_memory)
    tensors = list(engine.optimizer.fp32_partitioned_groups_flat) + [
        t for st, k, _ in out.state_devices for t in [st[k]]
    ]
    _move_to_host(tensors, out, pin_memory)
    return out


def _move_to_host(tensors: list[torch.Tensor], out: Offloaded, pin_memory: bool) -> None:
    """Each tensor's ``.data`` to host memory (its references stay valid), recorded for ``reload``."""
    for tensor in tensors:
        out.moved.append((tensor, tensor.device))
        tensor.data = _to_host(tensor.data, pin_memory)


def reload(engine, offloaded: Offloaded) -> None:
    """Everything ``offload`` moved, back where it was."""
    engine.reload_states()
    for tensor, device in offloaded.moved:
        tensor.data = tensor.data.to(device)
    for state, key, device in offloaded.state_devices:  # AdamW's step counters stay on the host
        if state[key].device != device:
            state[key] = state[key].to(device)
