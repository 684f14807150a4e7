"""The actor's side of rewards: each group's parts from the worker pool, summed with their weights.

``reward = sum_i weight_i * part_i``: every part's raw value is kept per completion (``reward_parts``
of a trajectory, logged per step as ``reward/<name>``). A part that fails on a completion counts 0.0
in the sum and the completion is counted as a reward error; with one part that is a reward of 0.0.
Under process supervision the one part may return step rewards; they are scaled by its weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.config import RewardConfig
from actors.reward_parts import SampleScore
from actors.reward_pool import RewardPool


@dataclass
class Scored:
    """One completion's reward, as the group builder uses it."""

    reward: float  # sum_i weight_i * part_i
    parts: dict[str, float]  # raw value of each part by name
    steps: list[float] | None  # weighted step rewards (process supervision), when the part gave a list
    error: str | None  # the first failure on this completion, "ExceptionType: message"


class RewardScorer:
    """Scores groups with a ``RewardPool`` (``pool``: an already built one, for tests)."""

    def __init__(self, cfg: RewardConfig, steps: bool = False, pool: RewardPool | None = None):
        parts = cfg.parts
        self.names = [p.part_name for p in parts]
        self.weights = [p.weight for p in parts]
        self.pool = pool or RewardPool(cfg, steps)

    def wait_ready(self) -> None:
        self.pool.wait_ready()

    def score_groups(self, calls: list[tuple[list[str], list[str], list[dict]]]) -> list[list[Scored]]:
        """``calls``: ``(prompts, completions, rows)`` of each group; its completions' rewards."""
        return [self._combine(scores) for scores in self.pool.score_many(calls)]

    async def score_group_async(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[Scored]:
        return self._combine(await self.pool.score_async(prompts, completions, rows))

    def _combine(self, scores: list[SampleScore]) -> list[Scored]:
        out = []
        for s in scores:
            reward = sum(w * v for w, v in zip(self.weights, s.parts, strict=True))
            steps = None if s.steps is None else [self.weights[0] * v for v in s.steps]
            out.append(Scored(reward, dict(zip(self.names, s.parts)), steps, s.error))
        return out

    def close(self) -> None:
        self.pool.close()
