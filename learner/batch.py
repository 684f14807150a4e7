"""Turning trajectories into learner tensors.

``TrainSequence`` is what the learner group sends to each rank (one per trajectory,
advantages already computed). ``pad_sequences`` lays a micro-batch out as right-padded
``[b, L]`` token rows; ``completion_logprobs`` reads each completion token's
log-probability out of the model's logits and returns ``[b, T]`` completion tensors
(``T`` = longest completion in the micro-batch) with their mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainSequence:
    """One trajectory as the learner trains on it."""

    prompt_token_ids: list[int]  # conditioning tokens, never trained on
    completion_token_ids: list[int]  # the sampled tokens
    completion_mask: list[int]  # 1 = token contributes to the loss
    advantages: list[float]  # one per completion token
    sampler_logprobs: list[float]  # log pi_sampler per completion token
    policy_versions: list[int]  # weight version that produced each token
    old_logprobs: list[float] | None = None  # log pi_old (learner, before this batch's updates)
    ref_logprobs: list[float] | None = None  # log pi_ref (frozen reference), when KL is used
    returns: list[float] | None = None  # critic targets V-hat = V_old + A (PPO)
    old_values: list[float] | None = None  # V_old at rollout (PPO)


@dataclass
class MiniBatch:
    """A rank's share of one optimizer step, with that step's global normalisers."""

    micro_batches: list[list[TrainSequence]]  # same count on every rank (collectives must match)
    num_tokens: float  # global count of trained tokens in the step (all ranks)
    num_sequences: float  # global count of sequences in the step
    max_len: int  # global longest completion (fixed-length aggregation)


@dataclass
class LearnerShard:
    """A data-parallel rank's share of one batch: its minibatches (one optimizer step each)."""

    minibatches: list[MiniBatch]
    epochs: int = 1  # passes over the minibatches
    kl_beta: float = 0.0  # KL coefficient for a KL loss term, set by the learner group each step

    def sequences(self) -> list[TrainSequence]:
        return [s for mb in self.minibatches for micro in mb.micro_batches for s in micro]


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # [b, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [b, L] 1 on real tokens
    completion_index: torch.Tensor  # [b, T] position in input_ids of each completion token
    completion_ids: torch.Tensor  # [b, T] completion tokens (0 in padding)
    completion_mask: torch.Tensor  # [b, T] float, 1 on trained tokens
    advantages: torch.Tensor  # [b, T]
    sampler_logprobs: torch.Tensor  # [b, T]
    old_logprobs: torch.Tensor | None = None  # [b, T]
    ref_logprobs: torch.Tensor | None = None  # [b, T]
    returns: torch.Tensor | None = None  # [b, T]
    old_values: torch.Tensor | None = None  # [b, T]


def pad_sequences(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu") -> PaddedBatch:
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
    mask = pad_rows([s.completion_mask for s in seqs], T)
    adv = pad_rows([s.advantages for s in seqs], T)
    sampler = pad_rows([s.sampler_logprobs for s in seqs], T)
    tensors = (input_ids, attention_mask, index, comp_ids, mask, adv, sampler)
    optional = [_pad_optional(seqs, name, T) for name in ("old_logprobs", "ref_logprobs", "returns", "old_values")]
    return PaddedBatch(*(t.to(device) for t in tensors), *(t.to(device) if t is not None else None for t in optional))


def pad_rows(rows: list[list[float]], T: int) -> torch.Tensor:
    """Right-pad ragged per-token rows with zeros: ``[b, T]``."""
    out = torch.zeros((len(rows), T))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float)
    return out


def _pad_optional(seqs: list[TrainSequence], name: str, T: int) -> torch.Tensor | None:
    """``[b, T]`` of an optional per-token field, or None when the sequences lack it."""
    if getattr(seqs[0], name) is None:
        return None
    return pad_rows([getattr(s, name) for s in seqs], T)


def at_completion(per_position: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """Pick the outputs that predict each completion token: ``[b, L, ...] -> [b, T, ...]``.

    The output at position j predicts the token at j + 1 (and is the state before it, for a
    critic), so the completion token at position p is read from position ``p - 1``.
    """
    prev = (batch.completion_index - 1).clamp(min=0)  # [b, T]
    if per_position.dim() == 2:
        return torch.gather(per_position, 1, prev)
    return torch.gather(per_position, 1, prev.unsqueeze(-1).expand(-1, -1, per_position.size(-1)))


def completion_logprobs(logits: torch.Tensor, batch: PaddedBatch, with_entropy: bool = False):
    """log pi(token) for every completion token. ``logits [b, L, V] -> [b, T]`` (and the
    entropy ``[b, T]`` of each predicting distribution when ``with_entropy``)."""
    logp = torch.log_softmax(at_completion(logits, batch).float(), dim=-1)  # [b, T, V]
    out = torch.gather(logp, 2, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * batch.completion_mask  # [b, T]
    if not with_entropy:
        return out
    entropy = -(logp.exp() * logp).sum(-1) * batch.completion_mask  # H = -sum_v p log p, [b, T]
    return out, entropy.detach()
