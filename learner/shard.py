"""What a learner rank receives for a step: its sequences as flat arrays, and the step's layout.

Token data crosses process boundaries as a few flat numpy arrays per rank (Ray moves numpy
buffers out of band), never as per-token Python objects. Sequence ``i`` of a ``TokenShard`` is
``prompt_ids[prompt_offsets[i]:prompt_offsets[i + 1]]`` followed by its completion, sliced the
same way from ``completion_ids``; every per-completion-token array is sliced like the completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from queues.messages import Trajectory


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)  # [n + 1]


def _flat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype=dtype)


@dataclass
class TokenShard:
    """n sequences back to back in flat arrays."""

    prompt_ids: np.ndarray  # int32 [sum_i p_i] every sequence's prompt tokens
    prompt_offsets: np.ndarray  # int64 [n + 1]
    completion_ids: np.ndarray  # int32 [sum_i c_i] the sampled tokens
    completion_offsets: np.ndarray  # int64 [n + 1]
    completion_mask: np.ndarray  # uint8 [sum_i c_i], 1 = the token is trained on
    sampler_logprobs: np.ndarray  # float32 [sum_i c_i], log pi_sampler of each sampled token
    rewards: np.ndarray  # float32 [n], the shaped sequence rewards
    step_rewards: np.ndarray | None = None  # float32 [sum_i s_i], process supervision: one per step
    step_ends: np.ndarray | None = None  # int32 [sum_i s_i], completion index of the token ending each step
    step_offsets: np.ndarray | None = None  # int64 [n + 1]
    model_mask: np.ndarray | None = None  # uint8 [sum_i c_i] 1 on the model's tokens (episodes); None: all

    @property
    def n(self) -> int:
        return len(self.prompt_offsets) - 1

    @property
    def completion_lengths(self) -> np.ndarray:
        return np.diff(self.completion_offsets)  # [n]

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], rewards: np.ndarray, steps: bool = False) -> TokenShard:
        """The trajectories in this order, with ``rewards`` ``[n]`` (after shaping); ``steps``:
        carry the process-supervision step rewards too."""
        comp = [t.completion_token_ids for t in trajectories]
        shard = cls(
            prompt_ids=_flat([t.prompt_token_ids for t in trajectories], np.int32),
            prompt_offsets=_offsets([len(t.prompt_token_ids) for t in trajectories]),
            completion_ids=_flat(comp, np.int32),
            completion_offsets=_offsets([len(c) for c in comp]),
            completion_mask=_flat([t.completion_mask for t in trajectories], np.uint8),
            sampler_logprobs=_flat([t.sampler_logprobs for t in trajectories], np.float32),
            rewards=np.asarray(rewards, dtype=np.float32),
        )
        if any(t.model_mask is not None for t in trajectories):  # an episode: environment tokens are not steps
            shard.model_mask = _flat(
                [
                    t.model_mask if t.model_mask is not None else np.ones(len(t.completion_token_ids))
                    for t in trajectories
                ],
                np.uint8,
            )
        if steps:
            step_rewards = [t.step_rewards if t.step_rewards is not None else [] for t in trajectories]
            shard.step_rewards = _flat(step_rewards, np.float32)
            shard.step_ends = _flat(
                [t.step_end_tokens if t.step_end_tokens is not None else [] for t in trajectories], np.int32
            )
            shard.step_offsets = _offsets([len(s) for s in step_rewards])
        return shard


@dataclass
class Normaliser:
    """Global counts of one optimizer step (all ranks, all micro-batches): the loss denominators."""

    num_tokens: float  # trained completion tokens
    num_sequences: float
    is_mean: float = 1.0  # tis.normalize: the step's mean importance weight (known after scoring)


@dataclass
class RankShard:
    """A data-parallel rank's share of one batch, and how it is split into optimizer steps."""

    tokens: TokenShard  # the rank's sequences, minibatch by minibatch, micro-batch by micro-batch
    micro_sizes: list[
        list[int]
    ]  # [minibatch][micro] sequences in each micro-batch (0: a dummy); same shape on every rank
    normalisers: list[Normaliser]  # one per minibatch
    epochs: int = 1  # passes over the minibatches


@dataclass
class RankSummary:
    """What a rank sends back after scoring: per-sequence scalars, never per-token values."""

    per_sequence: dict[str, np.ndarray]  # the estimator's summary, [n] each, in the rank's order
    kl_sum: float  # sum over trained tokens of KL_t(old || ref) (0 without a KL)
    tokens: float  # trained tokens on this rank
    is_sums: list[tuple[float, float]] | None = None  # tis.normalize: (sum, count) of the weights per minibatch


@dataclass
class RankAdvantages:
    """What a rank sends back after computing its advantages: sums for batch-wide statistics."""

    moments: np.ndarray  # float64 [3]: count, sum and sum of squares of the advantages over trained tokens


@dataclass
class Exports:
    """What one process of a shard hands another process of the same shard: per-token values in the
    shard's flat order (``RankBatch.export_flat``). A separate reference sends its log-probs and a
    separate critic its values to the policy rank; the policy rank sends its value targets to the critic."""

    ref_logprobs: np.ndarray | None = None  # log pi_ref of every token
    old_values: np.ndarray | None = None  # V_old of every token
    returns: np.ndarray | None = None  # the critic's targets

    def columns(self) -> list[tuple[str, np.ndarray]]:
        """``(column, values)`` of what is set."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]
