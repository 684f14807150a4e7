"""The training objective, chosen once by name at setup.

An ``Algorithm`` pairs how rewards become advantages (computed by the learner group
over whole prompt groups) with the per-token loss each rank evaluates. The registry is
keyed by ``algorithm.name``; an unknown name fails when the config is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from learner.algorithms import grpo_advantages, ppo_clip_loss, token_weights


@dataclass(frozen=True)
class Algorithm:
    group_advantages: Callable[[torch.Tensor, int, dict[str, Any]], torch.Tensor]  # rewards [N] -> [N]
    aggregation: str  # how per-token losses are averaged (see learner/algorithms/aggregation.py)


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(
        group_advantages=lambda rewards, G, cfg: grpo_advantages(rewards, G, eps=cfg["advantage_eps"]),
        aggregation="token_mean",
    ),
}


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def build_objective(algorithm: dict[str, Any]):
    """``objective(learner_logprobs [b,T], batch, shard) -> (loss, metrics)`` for one micro-batch.

    One update per batch, so the old policy is the learner's own log-probs before the
    update (ratio = 1, the clip is inactive and the gradient is the policy gradient);
    the clipped form is kept so that several updates per batch stay correct.
    """
    algo = get_algorithm(algorithm["name"])

    def objective(learner_logprobs, batch, shard):
        weights = token_weights(
            batch.completion_mask,
            algo.aggregation,
            num_tokens=shard.num_tokens,
            num_sequences=shard.num_sequences,
            max_len=shard.max_len,
        )
        return ppo_clip_loss(
            learner_logprobs,
            learner_logprobs.detach(),
            batch.advantages,
            batch.completion_mask,
            weights,
            eps_low=algorithm["clip_eps_low"],
            eps_high=algorithm["clip_eps_high"],
        )

    return objective
