"""The bytes of one weight push: tensors of any dtype laid out in raw-byte buckets.

Whole tensors, in order, each at an ``ALIGN``-ed offset inside a bucket; a tensor larger than
a bucket gets one of its own and is sent straight from its own memory. A ``PushHeader`` (JSON)
tells a receiver every tensor's name, dtype, shape, bucket and offset, so it can allocate the
buckets and view the tensors in them without copying. Round trips are bit-exact.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from cluster.weights import NamedTensors

ALIGN = 64  # byte alignment of every tensor inside a bucket (any dtype can view it)
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class TensorSlot:
    """Where one tensor's bytes sit in the push."""

    name: str  # Hugging Face parameter name
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: list[int]  # the tensor's shape
    bucket: int  # index of the bucket holding its bytes
    offset: int  # byte offset inside that bucket (a multiple of ALIGN)
    nbytes: int  # numel * element size


@dataclass
class PushHeader:
    """Sent through the store before the buckets, so receivers can allocate and unpack them."""

    version: int  # policy version of these weights
    bucket_bytes: list[int]  # size of each broadcast bucket, in broadcast order
    slots: list[TensorSlot]  # one per tensor, in the publisher's order
    closed: bool = False  # True: the publisher closed the channel; no buckets follow

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> PushHeader:
        raw = json.loads(text)
        raw["slots"] = [TensorSlot(**s) for s in raw["slots"]]
        return PushHeader(**raw)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight push header names an unknown dtype {name!r}")
    return dtype


def plan_buckets(named: NamedTensors, bucket_bytes: int) -> tuple[list[int], list[TensorSlot]]:
    """Whole tensors, in order, each at an ALIGN-ed offset; a bucket closes when the next tensor
    would overflow it, so a tensor larger than ``bucket_bytes`` gets a bucket of its own."""
    sizes: list[int] = []
    slots = []
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        offset = -(-sizes[-1] // ALIGN) * ALIGN if sizes else 0  # round up to ALIGN
        if not sizes or (sizes[-1] > 0 and offset + nbytes > bucket_bytes):
            sizes.append(0)
            offset = 0
        slots.append(
            TensorSlot(name, str(t.dtype).removeprefix("torch."), list(t.shape), len(sizes) - 1, offset, nbytes)
        )
        sizes[-1] = offset + nbytes
    return sizes, slots


def pack_bucket(
    named: NamedTensors, header: PushHeader, bucket: int, device: str = "cpu", out: torch.Tensor | None = None
) -> torch.Tensor:
    """The bytes of one bucket (uint8), packed into the front of ``out`` when it is large enough (a
    pack buffer reused across buckets of different sizes). A bucket holding one contiguous tensor
    on ``device`` is that tensor's own memory, not a copy."""
    lone = lone_tensor(named, header, bucket, device)
    if lone is not None:
        return lone
    size = header.bucket_bytes[bucket]
    reuse = out is not None and out.numel() >= size and out.device.type == device
    flat = out.narrow(0, 0, size) if reuse else torch.empty(size, dtype=torch.uint8, device=device)
    for slot, (_, t) in zip(header.slots, named, strict=True):
        if slot.bucket != bucket:
            continue
        flat.narrow(0, slot.offset, slot.nbytes).copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return flat


def lone_tensor(named: NamedTensors, header: PushHeader, bucket: int, device: str) -> torch.Tensor | None:
    """The bytes of the bucket's only tensor, when it can be sent from where it lies."""
    inside = [t for slot, (_, t) in zip(header.slots, named, strict=True) if slot.bucket == bucket]
    if len(inside) == 1 and inside[0].is_contiguous() and inside[0].device.type == device:
        return inside[0].reshape(-1).view(torch.uint8)
    return None


def unpack(header: PushHeader, buckets: list[torch.Tensor]) -> NamedTensors:
    """(name, tensor) views into the received buckets, with the publisher's dtypes and shapes."""
    return [
        (s.name, buckets[s.bucket][s.offset : s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape))
        for s in header.slots
    ]
