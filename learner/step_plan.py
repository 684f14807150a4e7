"""The driver's plan of one step: which rank trains which sequences, in which micro-batches.

Sequences are numbered ``0 .. N-1`` in group order (the G completions of a prompt are
consecutive: the layout group baselines need). The plan gives each rank its sequences in its
own local order (minibatch by minibatch, micro-batch by micro-batch) and translates per-sequence
tensors between the two numberings: ``gather`` puts the ranks' ``[n_r]`` arrays into one ``[N]``
tensor, ``scatter`` hands each rank its slice of an ``[N]`` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner.packing import plan_micro_batches
from learner.shard import Normaliser, RankShard, TokenShard
from queues.messages import Trajectory


@dataclass
class StepPlan:
    order: list[np.ndarray]  # per rank: the global index of each of its sequences, in its local order
    shards: list[RankShard]  # what each rank receives
    group_size: int = 0  # samples per prompt: the estimator's groups are this many consecutive sequences

    @property
    def num_sequences(self) -> int:
        return sum(len(o) for o in self.order)

    def gather(self, per_rank: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """Rank-local ``{name: [n_r]}`` -> global ``{name: [N]}`` in group order."""
        names = per_rank[0].keys() if per_rank else ()
        out = {}
        for name in names:
            values = np.zeros(self.num_sequences, dtype=np.float64)
            for order, local in zip(self.order, per_rank, strict=True):
                values[order] = local[name]
            out[name] = torch.from_numpy(values).float()
        return out

    def scatter(self, per_sequence: dict[str, torch.Tensor]) -> list[dict[str, np.ndarray]]:
        """Global ``{name: [N]}`` -> each rank's ``{name: [n_r]}``."""
        arrays = {name: t.detach().cpu().numpy().astype(np.float32) for name, t in per_sequence.items()}
        return [{name: a[order] for name, a in arrays.items()} for order in self.order]


def plan_step(
    trajectories: list[Trajectory],
    rewards: torch.Tensor,
    trained: torch.Tensor,
    ranks: int,
    token_budget: int,
    minibatches: int = 1,
    epochs: int = 1,
    steps: bool = False,
) -> StepPlan:
    """Split the batch into ``minibatches`` optimizer steps (contiguous index ranges), each balanced
    over ``ranks`` by tokens and packed into micro-batches of at most ``token_budget`` tokens, the
    same number on every rank (``learner.packing.plan_micro_batches``); normalisers are global per
    minibatch. ``rewards`` ``[N]``: shaped sequence rewards; ``trained`` ``[N]``: each sequence's
    trained tokens; ``steps``: ship process step rewards."""
    lengths = [len(t.prompt_token_ids) + len(t.completion_token_ids) for t in trajectories]
    trained = trained.detach().cpu().numpy().astype(np.int64)
    plan = plan_micro_batches(lengths, ranks, token_budget, minibatches)  # [rank][minibatch][micro] -> indices
    normalisers = []
    for m in range(minibatches):
        in_step = [i for rank_plan in plan for micro in rank_plan[m] for i in micro]
        # at least 1: a minibatch with no trained token (all masked) has zero loss, not 0 / 0
        normalisers.append(Normaliser(max(float(trained[in_step].sum()), 1.0), float(len(in_step))))
    rewards_np = rewards.detach().cpu().numpy()
    order, shards = [], []
    for rank_plan in plan:
        local = np.array([i for mb in rank_plan for micro in mb for i in micro], dtype=np.int64)
        tokens = TokenShard.from_trajectories([trajectories[i] for i in local], rewards_np[local], steps=steps)
        sizes = [[len(micro) for micro in mb] for mb in rank_plan]
        order.append(local)
        shards.append(RankShard(tokens, sizes, normalisers, epochs))
    return StepPlan(order, shards)
