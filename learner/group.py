"""The learner group: the driver's handle on all data-parallel learner ranks.

One training step over a batch of scored trajectory groups:
  1. split the sequences into minibatches (one optimizer step each), each balanced over
     the ranks by tokens and packed into equal numbers of micro-batches per rank, with its
     global normalisers;
  2. if the method needs them, ask every rank for the old-policy log-probs, reference
     log-probs and critic values of its sequences (``score``); separately placed critic
     ranks and reference actors score the same shards at the same time;
  3. compute advantages over the WHOLE batch here (group baselines need whole groups,
     whitening needs the whole batch): ``learner/returns.py``;
  4. every rank trains on its shard (separate critic ranks train on theirs concurrently);
     rank 0 then exports the weights.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from learner.algorithms import adaptive_kl_beta, get_kl_estimator
from learner.batch import LearnerShard, MiniBatch, TrainSequence, pad_rows
from learner.methods import get_method
from learner.packing import plan_micro_batches
from learner.returns import RewardStats, ScoredBatch, compute_advantages, shape_sequence_rewards
from queues.messages import TrajectoryGroup


def build_train_sequences(groups: list[TrajectoryGroup]) -> list[TrainSequence]:
    """One ``TrainSequence`` per trajectory, in group order; advantages are filled in later."""
    return [
        TrainSequence(
            prompt_token_ids=t.prompt_token_ids,
            completion_token_ids=t.completion_token_ids,
            completion_mask=t.completion_mask,
            advantages=[0.0] * len(t.completion_token_ids),
            sampler_logprobs=t.sampler_logprobs,
            policy_versions=t.policy_versions,
        )
        for g in groups
        for t in g.trajectories
    ]


def scored_batch(
    groups: list[TrajectoryGroup], sequences: list[TrainSequence], kl_estimator: str | None
) -> ScoredBatch:
    """Tensors for the advantage step from the groups and their scored sequences."""
    trajs = [t for g in groups for t in g.trajectories]
    T = max(len(t.completion_token_ids) for t in trajs)
    mask = pad_rows([t.completion_mask for t in trajs], T)
    batch = ScoredBatch(
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float),
        mask=mask,
        truncated=torch.tensor([t.finish_reason == "length" for t in trajs]),
        group_size=len(groups[0].trajectories),
    )
    if sequences[0].old_values is not None:
        batch.values = pad_rows([s.old_values for s in sequences], T)
    if kl_estimator and sequences[0].ref_logprobs is not None:
        old, ref = pad_rows([s.old_logprobs for s in sequences], T), pad_rows([s.ref_logprobs for s in sequences], T)
        batch.kl = get_kl_estimator(kl_estimator)(old, ref, mask)
    if trajs[0].step_rewards is not None:
        batch.step_rewards, batch.step_end = torch.zeros((len(trajs), T)), torch.zeros((len(trajs), T))
        for i, t in enumerate(trajs):
            for end, reward in zip(t.step_end_tokens, t.step_rewards):
                batch.step_rewards[i, end] = reward
                batch.step_end[i, end] = 1.0
    return batch


def shard_sequences(
    sequences: list[TrainSequence], ranks: int, token_budget: int, minibatches: int = 1
) -> list[LearnerShard]:
    """Split a batch into ``minibatches`` optimizer steps (contiguous ranges), each balanced
    over ``ranks`` by tokens and packed into micro-batches of at most ``token_budget`` tokens,
    the same number on every rank; normalisers are global per minibatch."""
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in sequences]
    plan = plan_micro_batches(lengths, ranks, token_budget, minibatches)  # [rank][minibatch][micro] -> indices
    shards = [LearnerShard(minibatches=[]) for _ in range(ranks)]
    for m in range(minibatches):
        in_step = [i for micro in (p for rank_plan in plan for p in rank_plan[m]) for i in micro]
        chunk = [sequences[i] for i in sorted(in_step)]
        num_tokens = float(sum(sum(s.completion_mask) for s in chunk))
        max_len = max(len(s.completion_token_ids) for s in chunk)
        for r, shard in enumerate(shards):
            micro = [[sequences[i] for i in indices] for indices in plan[r][m]]
            shard.minibatches.append(MiniBatch(micro, num_tokens, float(len(chunk)), max_len))
    return shards


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Loss shares add up to the global loss; other metrics are token-weighted means."""
    tokens = sum(m["tokens"] for m in per_rank)
    merged = {"loss": sum(m["loss"] for m in per_rank), "tokens": tokens}
    merged["learner_seconds"] = max(m["seconds"] for m in per_rank)
    for key in per_rank[0]:
        if key in merged or key == "seconds":
            continue
        if key == "grad_norm":
            merged[key] = per_rank[0][key]  # already global
        elif key.endswith("_max"):
            merged[key] = max(m[key] for m in per_rank)
        elif key.endswith("_min"):
            merged[key] = min(m[key] for m in per_rank)
        else:
            merged[key] = sum(m[key] * m["tokens"] for m in per_rank) / max(tokens, 1)
    return merged


class LearnerGroup:
    """Drives the ranks (Ray actor handles of ``LearnerWorker``): the policy ranks ``workers``,
    and when placed separately ``critics`` (one per policy rank) and ``references`` (any number)."""

    def __init__(
        self,
        workers: list,
        algorithm: dict[str, Any],
        token_budget: int,
        max_tokens: int,
        critics: list | None = None,
        references: list | None = None,
    ):
        self.workers = workers
        self.critics, self.references = critics or [], references or []
        self.algorithm = algorithm
        self.method = get_method(algorithm["name"])
        self.token_budget = token_budget
        self.max_tokens = max_tokens
        self.reward_stats = RewardStats()
        self.kl_beta = algorithm["kl"]["beta"] if algorithm["kl"]["placement"] != "none" else 0.0
        self.needs_scoring = (
            self.method.needs_critic
            or algorithm["kl"]["placement"] != "none"
            or algorithm["epochs"] * algorithm["minibatches"] > 1
        )

    async def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        algo = self.algorithm
        sequences = build_train_sequences(groups)
        shards = shard_sequences(sequences, len(self.workers), self.token_budget, algo["minibatches"])
        if self.needs_scoring:
            await self._score(shards)
        kl_name = algo["kl"]["estimator"] if algo["kl"]["placement"] != "none" else None
        batch = scored_batch(groups, sequences, kl_name)
        rewards = shape_sequence_rewards(batch, algo, self.max_tokens, self.reward_stats)
        advantages, returns = compute_advantages(self.method.advantage, batch, algo, rewards, self.kl_beta)
        for i, seq in enumerate(sequences):
            n = len(seq.completion_token_ids)
            seq.advantages = advantages[i, :n].tolist()
            if returns is not None:
                seq.returns = returns[i, :n].tolist()
        for shard in shards:
            shard.epochs, shard.kl_beta = algo["epochs"], self.kl_beta
        calls = [w.train_step.remote(s) for w, s in zip(self.workers, shards)]
        calls += [c.train_step.remote(s) for c, s in zip(self.critics, shards)]
        results = await asyncio.gather(*calls)
        metrics = merge_rank_metrics(list(results[: len(self.workers)]))
        if self.critics:  # the critic's own metrics; its ranks trained the same tokens
            critic = merge_rank_metrics(list(results[len(self.workers) :]))
            metrics.update({k: v for k, v in critic.items() if k.startswith(("critic_", "value_"))})
            metrics["critic_seconds"] = critic["learner_seconds"]
        metrics["advantage_abs_mean"] = float((advantages.abs() * batch.mask).sum() / batch.mask.sum())
        if batch.kl is not None:
            kl_mean = float((batch.kl * batch.mask).sum() / batch.mask.sum())
            metrics.update(kl_ref_mean=kl_mean, kl_beta=self.kl_beta)
            if algo["kl"]["adaptive"]:
                self.kl_beta = adaptive_kl_beta(
                    self.kl_beta, kl_mean, algo["kl"]["target"], len(sequences), algo["kl"]["horizon"]
                )
        return metrics

    async def _score(self, shards: list[LearnerShard]) -> None:
        """Fill each sequence's old log-probs, reference log-probs and old values, asking every
        process that holds one of those models, all at once."""
        calls = [w.score.remote(s) for w, s in zip(self.workers, shards)]
        calls += [c.score.remote(s) for c, s in zip(self.critics, shards)]
        for i, s in enumerate(shards if self.references else []):  # shards spread over the reference actors
            calls.append(self.references[i % len(self.references)].score.remote(s))
        results = await asyncio.gather(*calls)  # each kind of process answered for every shard, in order
        per_shard = [{} for _ in shards]  # shard index -> field -> per-sequence lists
        for i, per_seq in enumerate(results):
            for field in per_seq[0] if per_seq else ():
                per_shard[i % len(shards)][field] = [fields[field] for fields in per_seq]
        for shard, fields in zip(shards, per_shard):
            for j, seq in enumerate(shard.sequences()):
                seq.old_logprobs = fields["old_logprobs"][j]
                seq.ref_logprobs = fields["ref_logprobs"][j] if "ref_logprobs" in fields else None
                seq.old_values = fields["values"][j] if "values" in fields else None

    async def open_weight_channel(self, receivers: int, weights: dict[str, Any], connect_timeout_s: float):
        """The distributed weight path: rank 0 publishes to ``receivers`` actors; returns the spec
        actors join with (``spec.handle(rank, name)``)."""
        return await self.workers[0].open_weight_publisher.remote(receivers, weights, connect_timeout_s)

    async def publish_weights(self, version: int) -> None:
        await asyncio.gather(*[w.publish_weights.remote(version) for w in self.workers])

    async def close_weight_channel(self) -> None:
        await self.workers[0].close_weight_publisher.remote()

    async def export_weights(self):
        """Every rank takes part (ZeRO-3 gathers); returns the ObjectRef of rank 0's weights as
        ``cluster.weights.FlatWeights``."""
        import ray

        refs = [w.export_flat_weights.remote() for w in self.workers]
        # Wait without pulling the weights into the driver: actors fetch them from the object store.
        await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), fetch_local=False)
        for ref in refs[1:]:
            await ref  # None, but raises if that rank failed
        return refs[0]
