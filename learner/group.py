"""The learner group: the driver's handle on all data-parallel learner ranks.

One training step over a batch of trajectory groups, as four calls the training loop names; the
batch goes to the ranks once and stays there, and only per-sequence values and sums come back:

  1. ``shape_rewards``: the sequence rewards shaped over the whole batch, and the step planned
     (``learner/step_plan.py``): minibatches balanced over the ranks by tokens, micro-batches,
     global normalisers;
  2. ``score``: every rank packs its shard and scores what must precede the update (old and
     reference log-probs, critic values); separately placed critic ranks and reference actors
     score the same shards at the same time, and hand their results to the policy rank of
     each shard directly (Ray object references the driver never fetches);
  3. ``advantages``: each rank's per-sequence summary for the estimator, reduced by the driver over
     the whole batch (group baselines need whole groups), expanded by each rank into per-token
     advantages, whose moments come back for batch-wide whitening;
  4. ``update``: every rank trains on its shard (separate critic ranks train on theirs at the
     same time, on targets the policy ranks computed).
Then ``publish_weights``: every rank exports, rank 0 publishes. ``train_step`` chains 1-4 for tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from learner.algorithms import adaptive_kl_beta
from learner.config import AlgorithmConfig
from learner.returns import RewardStats, penalised_rewards, shape_sequence_rewards
from learner.step_plan import StepPlan, plan_step
from queues.messages import Trajectory, TrajectoryGroup


@dataclass
class Scores:
    """A step after ``score``: its plan, and per policy rank the Ray references of what a separate critic
    and reference scored on its shard (none when they are colocated)."""

    plan: StepPlan
    imports: list[list]


@dataclass
class Advantages:
    """A step after ``advantages``: its plan, each rank's summary (KL sums, token counts), the value targets
    each policy rank computed for a separate critic (Ray references), and the batch's advantage moments
    when advantages are whitened."""

    plan: StepPlan
    summaries: list
    targets: list
    whitening: np.ndarray | None
    importance: tuple[list[float], float] | None = None  # tis.normalize: per-minibatch means, the batch's


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Loss shares add up to the global loss; other metrics are token-weighted means."""
    tokens = sum(m["tokens"] for m in per_rank)
    merged = {"loss": sum(m["loss"] for m in per_rank), "tokens": tokens}
    merged["learner_seconds"] = max(m["seconds"] for m in per_rank)
    for key in dict.fromkeys(k for m in per_rank for k in m):  # a rank with no tokens has no extremes
        if key in merged or key == "seconds":
            continue
        having = [m for m in per_rank if key in m]
        if key in ("grad_norm", "nonfinite_updates", "updates"):
            merged[key] = having[0][key]  # already global: every rank agreed on them
        elif key.startswith("time_"):  # the phases of the slowest rank (a fast one's wait for it is no phase)
            merged[key] = max(per_rank, key=lambda m: m["seconds"]).get(key, 0.0)
        elif key.endswith("_max"):
            merged[key] = max(m[key] for m in having)
        elif key.endswith("_min"):
            merged[key] = min(m[key] for m in having)
        else:
            merged[key] = sum(m[key] * m["tokens"] for m in having) / max(tokens, 1)
    return merged


def sequence_rewards(trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N]`` task rewards, truncated flags and completion lengths of ``trajs``, read from the
    trajectories themselves: a completion that trains no token keeps its length (and so its
    overlong penalty)."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float)
    truncated = torch.tensor([t.finish_reason == "length" for t in trajs])
    lengths = torch.tensor([len(t.completion_token_ids) for t in trajs], dtype=torch.float)
    return rewards, truncated, lengths


def outcome_rewards(trajs: list[Trajectory], algorithm: AlgorithmConfig, max_tokens: int) -> list[float]:
    """Each trajectory's reward after its own penalties (truncation, soft overlong): a group whose raw
    rewards are all equal can still carry a signal once a cut completion is penalised."""
    return penalised_rewards(*sequence_rewards(trajs), algorithm, max_tokens).tolist()


def trained_tokens(trajs: list[Trajectory]) -> torch.Tensor:
    """``[N]`` tokens each trajectory trains on (its loss mask's sum): the loss normalisers."""
    return torch.tensor([int(np.sum(t.completion_mask)) for t in trajs], dtype=torch.float)


def without_tokens(traj: Trajectory) -> Trajectory:
    """The same trajectory with no token trained on (its mask all zero)."""
    return dataclasses.replace(traj, completion_mask=np.zeros_like(traj.completion_mask))


MIN_IS_MEAN = 0.1  # tis.normalize divides by at least this: at most 10x on the tokens that remain


def importance_means(summaries: list) -> tuple[list[float], float] | None:
    """``tis.normalize``: each minibatch's mean importance weight over every rank's trained units
    (``sum / count`` of the ranks' sums), floored at ``MIN_IS_MEAN`` (a step whose weights nearly all
    vanished would otherwise blow up the few left); and the whole batch's mean, unfloored (logged)."""
    if not summaries or summaries[0].is_sums is None:
        return None
    sums = np.sum([s.is_sums for s in summaries], axis=0)  # [minibatches, 2]: sum, count
    means = [max(float(total / count), MIN_IS_MEAN) if count > 0 else 1.0 for total, count in sums]
    total, count = sums.sum(axis=0)
    return means, float(total / count) if count > 0 else 1.0


class LearnerGroup:
    """Drives the ranks (Ray actor handles of ``LearnerWorker``): the policy ranks ``workers``,
    and when placed separately ``critics`` (one per policy rank) and ``references`` (any number)."""

    def __init__(
        self,
        workers: list,
        algorithm: AlgorithmConfig,
        token_budget: int,
        max_tokens: int,
        critics: list | None = None,
        references: list | None = None,
        process_names: dict[str, str] | None = None,
    ):
        self.workers = workers
        self.process_names = process_names or {}  # Ray actor id -> process name (learner-0, critic-1, ...)
        self.critics, self.references = critics or [], references or []
        self.algorithm = algorithm
        self.estimator = algorithm.method.estimator(algorithm)
        self.token_budget, self.max_tokens = token_budget, max_tokens
        self.reward_stats = RewardStats()
        self.kl_beta = algorithm.kl.beta if algorithm.kl.enabled else 0.0

    # --- one training step, in the order the training loop calls them -----------------------
    def shape_rewards(self, groups: list[TrajectoryGroup]) -> StepPlan:
        """Step 1: each sequence's shaped reward, and every rank's shard (sent once, kept by the rank)."""
        algo = self.algorithm
        trajs = [t for g in groups for t in g.trajectories]  # group order
        if algo.shaping.mask_truncated:  # overlong filtering: cut completions count in their group, train no token
            trajs = [without_tokens(t) if t.finish_reason == "length" else t for t in trajs]
        rewards, truncated, lengths = sequence_rewards(trajs)
        shaped = shape_sequence_rewards(rewards, truncated, lengths, algo, self.max_tokens, self.reward_stats)
        trained = trained_tokens(trajs)
        steps = algo.method.per_step_rewards
        ranks = len(self.workers)
        plan = plan_step(
            trajs, shaped, trained, ranks, self.token_budget, algo.loss.minibatches, algo.loss.epochs, steps
        )
        return dataclasses.replace(plan, group_size=len(groups[0].trajectories))

    async def score(self, plan: StepPlan) -> Scores:
        """Step 2: the log-probs of the policy that sampled (pi_old, when it must be scored) and of the
        reference, and critic values. The policy ranks keep what they score; a separate critic's and
        reference's results stay in Ray's object store until the policy rank of the shard takes them."""
        shards = plan.shards
        scored = [w.score.remote(s) for w, s in zip(self.workers, shards, strict=True)]
        critic_scores = [c.score.remote(s) for c, s in zip(self.critics, shards)]  # none, or one per shard
        refs = self.references
        ref_scores = [refs[i % len(refs)].score.remote(s) for i, s in enumerate(shards)] if refs else []
        await asyncio.gather(*scored)
        imports = [[*critic_scores[i : i + 1], *ref_scores[i : i + 1]] for i in range(len(shards))]
        return Scores(plan, imports)

    async def advantages(self, scores: Scores) -> Advantages:
        """Step 3: each rank summarises its sequences for the estimator; the driver reduces the summaries
        over the whole batch (group baselines need whole groups); each rank expands the reduction into
        per-token advantages, whose moments come back for batch-wide whitening."""
        plan, beta = scores.plan, self.kl_beta
        summaries = await asyncio.gather(
            *[w.summarise.remote(beta, *imp) for w, imp in zip(self.workers, scores.imports, strict=True)]
        )
        reduced = self.estimator.reduce(plan.gather([s.per_sequence for s in summaries]), plan.group_size)
        expanded = [
            w.expand.options(num_returns=2).remote(local)
            for w, local in zip(self.workers, plan.scatter(reduced), strict=True)
        ]
        stats = await asyncio.gather(*[stats_ref for stats_ref, _ in expanded])
        moments = np.sum([s.moments for s in stats], axis=0)  # [count, sum, sum of squares] of A over the batch
        whitening = moments if self.algorithm.estimator.whiten_advantages else None
        importance = importance_means(summaries)
        return Advantages(plan, summaries, [targets for _, targets in expanded], whitening, importance)

    async def update(self, advantages: Advantages) -> dict[str, float]:
        """Step 4: every rank trains on its shard (separate critic ranks on the targets the policy ranks
        computed, at the same time); the KL coefficient adapts. Returns the step's learner metrics."""
        algo, beta, summaries = self.algorithm, self.kl_beta, advantages.summaries
        is_means = advantages.importance[0] if advantages.importance else None
        calls = [w.train.remote(advantages.whitening, beta, is_means=is_means) for w in self.workers]
        calls += [c.train.remote(None, beta, targets) for c, targets in zip(self.critics, advantages.targets)]
        results = await asyncio.gather(*calls)
        metrics = merge_rank_metrics(list(results[: len(self.workers)]))
        if self.critics:  # the critic's own metrics; its ranks trained the same tokens
            critic = merge_rank_metrics(list(results[len(self.workers) :]))
            metrics.update({k: v for k, v in critic.items() if k.startswith(("critic_", "value_"))})
            metrics["critic_seconds"] = critic["learner_seconds"]
            metrics["time_critic_s"] = critic.get("time_critic_s", 0.0)
        if advantages.importance:  # before normalisation: how much truncation and rejection shrank the weights
            metrics["tis_batch_mean"] = advantages.importance[1]
        if algo.kl.enabled:
            kl_mean = sum(s.kl_sum for s in summaries) / max(sum(s.tokens for s in summaries), 1.0)
            metrics.update(kl_ref_mean=kl_mean, kl_beta=beta)
            if algo.kl.adaptive:
                n = advantages.plan.num_sequences
                self.kl_beta = adaptive_kl_beta(beta, kl_mean, algo.kl.target, n, algo.kl.horizon)
        return metrics

    async def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """Steps 1-4 in one call (for tests and benchmarks; the training loop names each)."""
        plan = self.shape_rewards(groups)
        return await self.update(await self.advantages(await self.score(plan)))

    # --- checkpoints ------------------------------------------------------------------------
    def _trained(self) -> list:
        return self.workers + self.critics  # references are frozen: nothing to save

    async def save_checkpoint(self, directory: str) -> None:
        """Every policy and critic rank writes its DeepSpeed state into ``directory``."""
        await asyncio.gather(*[w.save_checkpoint.remote(directory) for w in self._trained()])

    async def load_checkpoint(self, directory: str) -> None:
        await asyncio.gather(*[w.load_checkpoint.remote(directory) for w in self._trained()])

    async def save_model(self, directory: str) -> None:
        """The policy as a Hugging Face model directory (gathered over the ranks under ZeRO-3)."""
        await asyncio.gather(*[w.save_model.remote(directory) for w in self.workers])

    def state(self) -> dict[str, Any]:
        """The driver's own learning state: the running reward moments and the KL coefficient."""
        stats = self.reward_stats
        return {
            "kl_beta": self.kl_beta,
            "reward_stats": {"count": float(stats.count), "mean": float(stats.mean), "var": float(stats.var)},
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.kl_beta = float(state["kl_beta"])
        self.reward_stats = RewardStats(**{k: torch.tensor(float(v)) for k, v in state["reward_stats"].items()})

    # --- turns with the engines (run.schedule=colocated on GPUs, runtime/turns.py) -------------
    async def offload_states(self) -> None:
        """Every trained rank's optimizer states, master weights and gradients to host memory."""
        await asyncio.gather(*[w.offload_states.remote() for w in self._trained()])

    async def reload_states(self) -> None:
        await asyncio.gather(*[w.reload_states.remote() for w in self._trained()])

    # --- the weights ---------------------------------------------------------------------
    async def open_weight_channel(self, weights: Any, names: list[str], connect_timeout_s: float) -> list:
        """Rank 0 opens the weight channel (``weights``: the ``WeightsConfig``) to the actors
        ``names``; returns the receiver each actor fetches from, in order."""
        return await self.workers[0].open_weight_publisher.remote(weights, names, connect_timeout_s)

    async def publish_weights(self, version: int) -> list:
        """Every rank exports (ZeRO-3 gathers); rank 0 publishes ``version`` on the channel.
        Returns the step's timeline spans of every learner process (``cluster/timeline.py``)."""
        published = [w.publish_weights.remote(version) for w in self.workers]
        others = [p.take_spans.remote(version) for p in self.critics + self.references]  # idle by now
        per_process = await asyncio.gather(*published, *others)
        return [span for spans in per_process for span in spans or []]

    async def close_weight_channel(self) -> None:
        await self.workers[0].close_weight_publisher.remote()
