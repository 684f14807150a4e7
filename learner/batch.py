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


@dataclass
class LearnerShard:
    """A data-parallel rank's share of one optimizer step."""

    micro_batches: list[list[TrainSequence]]  # same count on every rank (collectives must match)
    num_tokens: float  # global count of trained tokens in the step (all ranks)
    num_sequences: float  # global count of sequences in the step
    max_len: int  # global longest completion (fixed-length aggregation)


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # [b, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [b, L] 1 on real tokens
    completion_index: torch.Tensor  # [b, T] position in input_ids of each completion token
    completion_ids: torch.Tensor  # [b, T] completion tokens (0 in padding)
    completion_mask: torch.Tensor  # [b, T] float, 1 on trained tokens
    advantages: torch.Tensor  # [b, T]
    sampler_logprobs: torch.Tensor  # [b, T]


def pad_sequences(seqs: list[TrainSequence], pad_id: int, device: torch.device | str = "cpu") -> PaddedBatch:
    """Right-pad prompt+completion rows; completion tensors are aligned from each completion's start."""
    b = len(seqs)
    L = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in seqs)
    T = max(len(s.completion_token_ids) for s in seqs)
    input_ids = torch.full((b, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, L), dtype=torch.long)
    index = torch.zeros((b, T), dtype=torch.long)
    comp_ids = torch.zeros((b, T), dtype=torch.long)
    mask = torch.zeros((b, T))
    adv = torch.zeros((b, T))
    sampler = torch.zeros((b, T))
    for i, s in enumerate(seqs):
        p, c = len(s.prompt_token_ids), len(s.completion_token_ids)
        input_ids[i, : p + c] = torch.tensor(s.prompt_token_ids + s.completion_token_ids)
        attention_mask[i, : p + c] = 1
        index[i, :c] = torch.arange(p, p + c)
        comp_ids[i, :c] = torch.tensor(s.completion_token_ids)
        mask[i, :c] = torch.tensor(s.completion_mask, dtype=torch.float)
        adv[i, :c] = torch.tensor(s.advantages)
        sampler[i, :c] = torch.tensor(s.sampler_logprobs)
    tensors = (input_ids, attention_mask, index, comp_ids, mask, adv, sampler)
    return PaddedBatch(*(t.to(device) for t in tensors))


def completion_logprobs(logits: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """log pi(token) for every completion token. ``logits [b, L, V] -> [b, T]``.

    The logit at position j predicts the token at j + 1, so token at position p is scored
    by ``logits[:, p - 1]``.
    """
    prev = (batch.completion_index - 1).clamp(min=0)  # [b, T]
    picked = torch.gather(logits, 1, prev.unsqueeze(-1).expand(-1, -1, logits.size(-1)))  # [b, T, V]
    logp = torch.log_softmax(picked.float(), dim=-1)  # [b, T, V]
    out = torch.gather(logp, 2, batch.completion_ids.unsqueeze(-1)).squeeze(-1)  # [b, T]
    return out * batch.completion_mask
