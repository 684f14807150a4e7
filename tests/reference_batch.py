"""Test-side reference layouts: sequences as Python lists, the padded (unpacked) batch the packed
path is checked against, and builders of the product's flat shards and rank batches from them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner.packing import PackedInputs
from learner.rank_batch import CompletionView, RankBatch
from learner.shard import Normaliser, RankShard, TokenShard

OPTIONAL = ("advantages", "old_logprobs", "ref_logprobs", "returns", "old_values")


@dataclass
class TrainSequence:
    """One trajectory as a test writes it down."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_mask: list[int]
    advantages: list[float]
    sampler_logprobs: list[float]
    policy_versions: list[int]
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    returns: list[float] | None = None
    old_values: list[float] | None = None


def token_shard(seqs: list[TrainSequence], rewards: list[float] | None = None) -> TokenShard:
    """The product's flat layout of ``seqs``."""

    def offsets(lists):
        return np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)

    def flat(lists, dtype):
        return np.array([v for x in lists for v in x], dtype=dtype)

    return TokenShard(
        prompt_ids=flat([s.prompt_token_ids for s in seqs], np.int32),
        prompt_offsets=offsets([s.prompt_token_ids for s in seqs]),
        completion_ids=flat([s.completion_token_ids for s in seqs], np.int32),
        completion_offsets=offsets([s.completion_token_ids for s in seqs]),
        completion_mask=flat([s.completion_mask for s in seqs], np.uint8),
        sampler_logprobs=flat([s.sampler_logprobs for s in seqs], np.float32),
        rewards=np.array(rewards if rewards is not None else [0.0] * len(seqs), dtype=np.float32),
    )


def rank_batch(
    seqs: list[TrainSequence], pad_id: int = 0, mask_dtype=torch.float32, row_tokens: int | None = 0, sizes=None
) -> RankBatch:
    """A rank's batch of ``seqs`` in micro-batches of ``sizes`` (default: one), with every optional
    per-token field the sequences carry imported into its table."""
    shard = RankShard(token_shard(seqs), [sizes or [len(seqs)]], [Normaliser(1.0, 1.0)])
    batch = RankBatch(shard, pad_id, "cpu", mask_dtype, row_tokens)
    for name in OPTIONAL:
        if seqs and getattr(seqs[0], name) is not None:
            batch.import_flat(name, np.array([v for s in seqs for v in getattr(s, name)], dtype=np.float32))
    return batch


def packed(seqs: list[TrainSequence], pad_id: int = 0, **kwargs) -> tuple[PackedInputs, CompletionView]:
    """One micro-batch of all ``seqs`` (the dummy when empty) and its completion tensors."""
    batch = rank_batch(seqs, pad_id, **kwargs)
    micro = batch.pack(batch.minibatches[0][0])
    return micro, batch.view(micro)


# --- the padded reference -------------------------------------------------------------------
@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # [b, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [b, L] 1 on real tokens
    completion_index: torch.Tensor  # [b, T] position in input_ids of each completion token
    completion_ids: torch.Tensor  # [b, T] completion tokens (0 in padding)
    completion_mask: torch.Tensor  # [b, T] float, 1 on trained tokens
    advantages: torch.Tensor  # [b, T]
    sampler_logprobs: torch.Tensor  # [b, T]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None


def pad_rows(rows: list[list[float]], T: int) -> torch.Tensor:
    """Right-pad ragged per-token rows with zeros: ``[b, T]``."""
    out = torch.zeros((len(rows), T))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float)
    return out


def pad_sequences(seqs: list[TrainSequence], pad_id: int) -> PaddedBatch:
    """Right-pad prompt+completion rows; completion tensors are aligned from each completion's start."""
    b = len(seqs)
    L = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in seqs)
    T = max(len(s.completion_token_ids) for s in seqs)
    input_ids = torch.full((b, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, L), dtype=torch.long)
    index = torch.zeros((b, T), dtype=torch.long)
    comp_ids = torch.zeros((b, T), dtype=torch.long)
    for i, s in enumerate(seqs):
        p, c = len(s.prompt_token_ids), len(s.completion_token_ids)
        input_ids[i, : p + c] = torch.tensor(s.prompt_token_ids + s.completion_token_ids)
        attention_mask[i, : p + c] = 1
        index[i, :c] = torch.arange(p, p + c)
        comp_ids[i, :c] = torch.tensor(s.completion_token_ids)
    fields = [pad_rows([getattr(s, n) for s in seqs], T) for n in ("completion_mask", "advantages", "sampler_logprobs")]
    optional = [
        pad_rows([getattr(s, n) for s in seqs], T) if getattr(seqs[0], n) is not None else None
        for n in ("old_logprobs", "ref_logprobs", "returns", "old_values")
    ]
    return PaddedBatch(input_ids, attention_mask, index, comp_ids, *fields, *optional)


def at_completion(per_position: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """Outputs predicting each completion token: ``[b, L, ...] -> [b, T, ...]`` (position p - 1)."""
    prev = (batch.completion_index - 1).clamp(min=0)  # [b, T]
    if per_position.dim() == 2:
        return torch.gather(per_position, 1, prev)
    return torch.gather(per_position, 1, prev.unsqueeze(-1).expand(-1, -1, per_position.size(-1)))


def completion_logprobs(logits: torch.Tensor, batch: PaddedBatch, with_entropy: bool = False):
    """log pi(token) for every completion token, ``[b, L, V] -> [b, T]`` (and the entropy)."""
    logp = torch.log_softmax(at_completion(logits, batch).float(), dim=-1)  # [b, T, V]
    out = torch.gather(logp, 2, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * batch.completion_mask  # [b, T]
    if not with_entropy:
        return out
    entropy = -(logp.exp() * logp).sum(-1) * batch.completion_mask  # H = -sum_v p log p, [b, T]
    return out, entropy.detach()
