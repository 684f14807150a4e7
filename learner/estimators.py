"""Advantage estimators, split where the data lies: ranks hold the tokens, the driver holds the batch.

Group baselines need whole groups and batch baselines the whole batch, but every per-token
quantity lives on the data-parallel rank that holds the sequence. So each estimator comes in
three halves, and only ``[n]`` per-sequence tensors cross between them:

    summarise(tokens)              rank    {name: [n]}   the sequence scalars the reduction needs
    reduce(sums, group_size)       driver  {name: [N]}   over the whole batch, in group order
    expand(tokens, per_sequence)   rank    (A [n, T], returns [n, T] or None)

``tokens`` is a rank's ``TokenRewards``: per-token rewards ``r_t`` (the shaped sequence reward on
the last real token, ``- beta KL_t`` on every token when the KL is placed in the reward), the
completion mask, and the critic's ``V_old`` or the process rewards when the method uses them.
The whole-batch functions they call are in ``learner/algorithms/advantages.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from learner.algorithms import (
    accumulate_step_rewards,
    broadcast_to_tokens,
    gae,
    group_mean_std,
    normalise_step_rewards,
    reward_to_go,
    step_moments,
    turn_discounts,
)

PerSequence = dict[str, Tensor]  # name -> [n] (rank side) or [N] (driver side)


@dataclass
class TokenRewards:
    """What a rank's estimator halves see: ``[n, T]`` over its sequences' completion tokens."""

    rewards: Tensor  # r_t: shaped sequence reward on the last completion token, - beta KL_t with KL in the reward
    mask: Tensor  # 1 on trained tokens: where advantages may be non-zero
    values: Tensor | None = None  # V_old(s_t) from the critic (PPO)
    step_rewards: Tensor | None = None  # process supervision: each step's reward at its step-end token
    step_end: Tensor | None = None  # 1 at step-end tokens
    completion: Tensor | None = None  # 1 on every completion token, trained or not (None: same as mask)

    @property
    def sequence(self) -> Tensor:
        """The tokens a sequence's statistics are taken over: the whole completion. A completion that
        trains no token (``algorithm.shaping.mask_truncated``) still counts in its group's and the batch's
        baselines with its reward."""
        return self.mask if self.completion is None else self.completion


class AdvantageEstimator(Protocol):
    def summarise(self, tokens: TokenRewards) -> PerSequence: ...

    def reduce(self, sums: PerSequence, group_size: int) -> PerSequence: ...

    def expand(self, tokens: TokenRewards, per_sequence: PerSequence) -> tuple[Tensor, Tensor | None]: ...


@dataclass(frozen=True)
class GroupOutcome:
    """One reward per sequence, a group-relative advantage on every one of its tokens (GRPO,
    Dr. GRPO, RLOO): ``R_i = sum_t r_t``, ``A_i = baseline(R_group)_i``, ``A_{i,t} = A_i m_{i,t}``."""

    advantages: Callable[[Tensor, int], Tensor]  # ([N] sequence rewards, G) -> [N]

    def summarise(self, tokens: TokenRewards) -> PerSequence:
        return {"reward": (tokens.rewards * tokens.sequence).sum(-1)}  # R_i (KL-shaped when in the reward)

    def reduce(self, sums: PerSequence, group_size: int) -> PerSequence:
        return {"advantage": self.advantages(sums["reward"], group_size)}

    def expand(self, tokens: TokenRewards, per_sequence: PerSequence) -> tuple[Tensor, Tensor | None]:
        return broadcast_to_tokens(per_sequence["advantage"], tokens.mask), None


@dataclass(frozen=True)
class ReinforceBaseline:
    """REINFORCE with the batch-mean return as baseline: ``A_t = G_t - mean_i G_{i,0}``."""

    gamma: float
    per_turn: bool = False  # gamma discounts each turn of an episode, not each token

    def discounts(self, tokens: TokenRewards) -> float | Tensor:
        return turn_discounts(tokens.sequence, self.gamma) if self.per_turn else self.gamma

    def summarise(self, tokens: TokenRewards) -> PerSequence:
        return {"return": reward_to_go(tokens.rewards, tokens.sequence, self.discounts(tokens))[:, 0]}  # G_{i,0}

    def reduce(self, sums: PerSequence, group_size: int) -> PerSequence:
        returns = sums["return"]
        return {"baseline": returns.mean().expand_as(returns)}  # b = mean_i G_{i,0}, on every row

    def expand(self, tokens: TokenRewards, per_sequence: PerSequence) -> tuple[Tensor, Tensor | None]:
        to_go = reward_to_go(tokens.rewards, tokens.sequence, self.discounts(tokens))  # G_t over the completion
        return (to_go - per_sequence["baseline"].unsqueeze(-1)) * tokens.mask, None  # A_t = G_t - b, trained only


@dataclass(frozen=True)
class GeneralizedAdvantage:
    """GAE(gamma, lambda) with the critic's values: per sequence, nothing to reduce (PPO)."""

    gamma: float
    lam: float
    per_turn: bool = False  # gamma discounts each turn of an episode, not each token

    def summarise(self, tokens: TokenRewards) -> PerSequence:
        return {}

    def reduce(self, sums: PerSequence, group_size: int) -> PerSequence:
        return {}

    def expand(self, tokens: TokenRewards, per_sequence: PerSequence) -> tuple[Tensor, Tensor | None]:
        gamma = turn_discounts(tokens.sequence, self.gamma) if self.per_turn else self.gamma
        return gae(tokens.rewards, tokens.values, tokens.mask, gamma, self.lam)  # (A_t, R_t = V_t + A_t)


@dataclass(frozen=True)
class ProcessSteps:
    """GRPO process supervision: step rewards normalised over all steps of the group,
    ``r~ = (r - mean_g) / (std_g + eps)``, each token credited with the steps ending at or after it."""

    eps: float

    def summarise(self, tokens: TokenRewards) -> PerSequence:
        count, total, total_sq = step_moments(tokens.step_rewards, tokens.step_end, tokens.sequence)
        return {"steps": count, "step_sum": total, "step_sq": total_sq}

    def reduce(self, sums: PerSequence, group_size: int) -> PerSequence:
        mean, std = group_mean_std(sums["steps"], sums["step_sum"], sums["step_sq"], group_size)
        return {"step_mean": mean, "step_std": std}

    def expand(self, tokens: TokenRewards, per_sequence: PerSequence) -> tuple[Tensor, Tensor | None]:
        t = tokens
        normalised = normalise_step_rewards(
            t.step_rewards, t.step_end, t.sequence, per_sequence["step_mean"], per_sequence["step_std"], self.eps
        )
        return accumulate_step_rewards(normalised, t.step_end, t.sequence) * t.mask, None  # trained tokens only
