"""A rank's batch between scoring and training: packed micro-batches and one completion table.

Built once per step from the rank's ``RankShard`` and kept until the step ends, so nothing
per-token goes back to the driver. Every per-token quantity lives in one ``[n, T]`` table over the
rank's sequences (T = its longest completion), in host memory: the mask and sampler log-probs the
actors sent, then what scoring adds (old and reference log-probs, the critic's values), then
advantages and critic targets. Micro-batch k covers the table's rows ``rows_k`` and first ``T_k``
columns; ``view`` hands those to the loss on the rank's device.

The micro-batches themselves are only planned here (``MicroBatch``: a range of sequences). Each is
packed onto the device when a pass reaches it (``packed``), and released before the next is packed:
a dense block mask is ``[R, 1, Lr, Lr]`` (held together, the ~48 of a rank in the DAPO recipe come
to ~16 GB by the outside review's arithmetic), so the rank holds one at a time. Packing is a pure
function of the shard, so a micro-batch packed again (every scoring and training pass) is the same
tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from learner.packing import PackedInputs, pack_range
from learner.shard import RankShard


@dataclass
class CompletionView:
    """The completion-side tensors of one micro-batch, ``[n, T]`` (zero on padding)."""

    completion_mask: Tensor  # float, 1 on trained tokens
    sampler_logprobs: Tensor  # log pi_sampler (the actor's engine)
    advantages: Tensor | None = None
    old_logprobs: Tensor | None = None  # log pi_old: the learner before this batch's first update
    ref_logprobs: Tensor | None = None  # log pi_ref: the frozen reference
    old_values: Tensor | None = None  # V_old: the critic before this batch's first update
    returns: Tensor | None = None  # critic targets V_old + A
    exact_kl: Tensor | None = None  # kl.estimator exact: KL(pi || pi_ref) over the vocabulary, computed in the update


FIELDS = tuple(f.name for f in fields(CompletionView))


@dataclass(frozen=True)
class MicroBatch:
    """A planned micro-batch: the shard's sequences ``rows`` (a contiguous range), not yet packed."""

    rows: slice  # its rows in the completion table; empty: the zero-weight dummy
    width: int  # T_k: the table columns it covers (its longest completion)

    @property
    def is_dummy(self) -> bool:
        return self.rows.start == self.rows.stop


class RankBatch:
    def __init__(
        self,
        shard: RankShard,
        pad_id: int,
        device: torch.device | str = "cpu",
        mask_dtype: torch.dtype | None = torch.float32,
        row_tokens: int | None = 0,
    ):
        self.tokens, self.device = shard.tokens, torch.device(device)
        lengths = torch.from_numpy(self.tokens.completion_lengths)  # [n]
        self.n = self.tokens.n
        width = max(int(lengths.max()) if self.n else 1, 1)
        self.valid = torch.arange(width)[None] < lengths[:, None]  # [n, T]; row-major order = flat order
        self.rewards = torch.from_numpy(self.tokens.rewards)  # [n] shaped sequence rewards
        self.table: dict[str, Tensor] = {
            "completion_mask": self.spread(self.tokens.completion_mask.astype(np.float32)),
            "sampler_logprobs": self.spread(self.tokens.sampler_logprobs),
            # every token the model sampled, trained or not (not an episode's environment tokens): where
            # the sequence's reward and its KL are counted, and the steps of its returns
            "completion_tokens": self.valid.float()
            if self.tokens.model_mask is None
            else self.spread(self.tokens.model_mask.astype(np.float32)),
        }
        self.normalisers, self.epochs = shard.normalisers, shard.epochs
        self.pad_id, self.mask_dtype, self.row_tokens = pad_id, mask_dtype, row_tokens
        self.minibatches: list[list[MicroBatch]] = []
        start = 0
        for sizes in shard.micro_sizes:
            micro = []
            for size in sizes:
                width = int(lengths[start : start + size].max()) if size else 1  # pack_range's T (the dummy's 1)
                micro.append(MicroBatch(slice(start, start + size), width))
                start += size
            self.minibatches.append(micro)
        if start != self.n:
            raise ValueError(f"rank shard lays out {start} sequences but carries {self.n}")

    def micro_batches(self) -> list[MicroBatch]:
        return [micro for mb in self.minibatches for micro in mb]

    def pack(self, micro: MicroBatch) -> PackedInputs:
        """``micro`` packed onto the rank's device (with its block mask, if the layout has one)."""
        start, stop = micro.rows.start, micro.rows.stop
        return pack_range(self.tokens, start, stop, self.pad_id, self.device, self.mask_dtype, self.row_tokens)

    def packed(self, micro_batches: Iterable[MicroBatch]) -> Iterator[PackedInputs]:
        """Each of ``micro_batches`` packed when the loop reaches it. The one before is released
        first (its mask dropped; using it again raises), so one packed micro-batch is held at a time
        even while the loop's variable still names the last one."""
        for micro in micro_batches:
            inputs = self.pack(micro)
            try:
                yield inputs
            finally:
                inputs.release()

    # --- the table --------------------------------------------------------------------------
    def spread(self, flat: np.ndarray | Tensor) -> Tensor:
        """Flat per-completion-token values (the shard's order) -> ``[n, T]``, zero on padding."""
        flat = torch.as_tensor(flat)
        out = torch.zeros(self.valid.shape, dtype=flat.dtype if flat.is_floating_point() else torch.float32)
        out[self.valid] = flat.to(out.dtype)
        return out

    def column(self, name: str) -> Tensor | None:
        """The ``[n, T]`` table of ``name`` (None if this step has none)."""
        return self.table.get(name)

    def add_column(self, name: str) -> None:
        """An all-zero ``name`` column, so it exists even on a rank that holds no sequences."""
        self.table.setdefault(name, torch.zeros(self.valid.shape))

    def set(self, name: str, values: Tensor) -> None:
        self.table[name] = values.detach().to("cpu", torch.float32) * self.table["completion_mask"]

    def write(self, name: str, micro: MicroBatch | PackedInputs, values: Tensor) -> None:
        """Store one micro-batch's ``[n_k, T_k]`` values of ``name`` (the dummy's are dropped)."""
        self.add_column(name)
        if not micro.is_dummy:
            self.table[name][micro.rows, : micro.width] = values.detach().to("cpu", torch.float32)

    def export_flat(self, name: str) -> np.ndarray:
        """``name`` as flat float32 values in the shard's order: what another process of the same
        shard (a separate critic or reference) imports."""
        return self.table[name][self.valid].numpy()

    def import_flat(self, name: str, flat: np.ndarray) -> None:
        self.table[name] = self.spread(flat.astype(np.float32))

    def part(self, name: str, micro: MicroBatch | PackedInputs) -> Tensor:
        """Micro-batch ``micro``'s slice of column ``name``, on the rank's device (the dummy gets
        zeros ``[1, 1]``: weight 0)."""
        part = torch.zeros((1, 1)) if micro.is_dummy else self.table[name][micro.rows, : micro.width]
        return part.to(self.device)

    def view(self, micro: MicroBatch | PackedInputs) -> CompletionView:
        """Micro-batch ``micro``'s slice of every column the table has."""
        return CompletionView(**{name: self.part(name, micro) for name in FIELDS if name in self.table})

    def step_rewards(self) -> tuple[Tensor, Tensor]:
        """Process supervision: ``[n, T]`` each step's reward at its step-end token, and 1 there."""
        t = self.tokens
        rewards, ends = torch.zeros(self.valid.shape), torch.zeros(self.valid.shape)
        seq = np.repeat(np.arange(self.n), np.diff(t.step_offsets))  # the sequence of every step
        index = (torch.from_numpy(seq), torch.from_numpy(t.step_ends.astype(np.int64)))
        rewards[index] = torch.from_numpy(t.step_rewards)  # as before: a later step ending at the same token wins
        ends[index] = 1.0
        return rewards, ends
