"""The learner group: the driver's handle on all data-parallel learner ranks.

It turns a batch of scored trajectory groups into per-rank shards (advantages are
group-relative, so they are computed here over whole groups before the batch is
split), computes the global loss normalisers once, runs one optimizer step on every
rank, and collects the exported weights from rank 0.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch

from learner.batch import LearnerShard, TrainSequence
from learner.objective import get_algorithm
from queues.messages import TrajectoryGroup


def build_train_sequences(groups: list[TrajectoryGroup], algorithm: dict[str, Any]) -> list[TrainSequence]:
    """Advantages for every trajectory, broadcast over its completion tokens."""
    algo = get_algorithm(algorithm["name"])
    G = len(groups[0].trajectories)
    rewards = torch.tensor([t.reward for g in groups for t in g.trajectories], dtype=torch.float32)  # [N]
    advantages = algo.group_advantages(rewards, G, algorithm).tolist()  # [N]
    sequences = []
    trajectories = [t for g in groups for t in g.trajectories]
    for traj, adv in zip(trajectories, advantages):
        sequences.append(
            TrainSequence(
                prompt_token_ids=traj.prompt_token_ids,
                completion_token_ids=traj.completion_token_ids,
                completion_mask=traj.completion_mask,
                advantages=[adv] * len(traj.completion_token_ids),
                sampler_logprobs=traj.sampler_logprobs,
                policy_versions=traj.policy_versions,
            )
        )
    return sequences


def shard_sequences(sequences: list[TrainSequence], ranks: int, micro_batch_size: int) -> list[LearnerShard]:
    """Split a step's sequences evenly over ranks, each into the same number of micro-batches."""
    if len(sequences) % ranks:
        raise ValueError(f"{len(sequences)} sequences do not split evenly over {ranks} learner ranks")
    per_rank = len(sequences) // ranks
    n_micro = math.ceil(per_rank / micro_batch_size)
    num_tokens = float(sum(sum(s.completion_mask) for s in sequences))
    max_len = max(len(s.completion_token_ids) for s in sequences)
    shards = []
    for r in range(ranks):
        mine = sequences[r * per_rank : (r + 1) * per_rank]
        size = math.ceil(per_rank / n_micro)
        micro = [mine[i : i + size] for i in range(0, per_rank, size)]
        shards.append(LearnerShard(micro, num_tokens=num_tokens, num_sequences=float(len(sequences)), max_len=max_len))
    return shards


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Loss shares add up to the global loss; other metrics are token-weighted means."""
    tokens = sum(m["tokens"] for m in per_rank)
    merged = {"loss": sum(m["loss"] for m in per_rank), "tokens": tokens}
    merged["learner_seconds"] = max(m["seconds"] for m in per_rank)
    for key in per_rank[0]:
        if key not in merged and key not in ("seconds",):
            if key == "grad_norm":
                merged[key] = per_rank[0][key]
            elif key.endswith("_max"):
                merged[key] = max(m[key] for m in per_rank)
            elif key.endswith("_min"):
                merged[key] = min(m[key] for m in per_rank)
            else:
                merged[key] = sum(m[key] * m["tokens"] for m in per_rank) / max(tokens, 1)
    return merged


class LearnerGroup:
    """Drives the ranks (Ray actor handles of ``LearnerWorker``)."""

    def __init__(self, workers: list, algorithm: dict[str, Any], micro_batch_size: int):
        self.workers = workers
        self.algorithm = algorithm
        self.micro_batch_size = micro_batch_size

    async def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        sequences = build_train_sequences(groups, self.algorithm)
        shards = shard_sequences(sequences, len(self.workers), self.micro_batch_size)
        results = [w.train_step.remote(s) for w, s in zip(self.workers, shards)]
        return merge_rank_metrics([await r for r in results])

    async def export_weights(self):
        """Every rank takes part (ZeRO-3 gathers); returns the ObjectRef of rank 0's weights."""
        import ray

        refs = [w.export_weights.remote() for w in self.workers]
        # Wait without pulling the weights into the driver: actors fetch them from the object store.
        await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), fetch_local=False)
        for ref in refs[1:]:
            await ref  # None, but raises if that rank failed
        return refs[0]
