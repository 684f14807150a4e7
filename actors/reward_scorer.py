"""The actor's side of rewards: each group's parts from the worker pool and the reward model, summed
with their weights.

``reward = sum_i weight_i * part_i``: every part's raw value is kept per completion (``reward_parts``
of a trajectory, logged per step as ``reward/<name>``). A part that fails on a completion counts 0.0
in the sum and the completion is counted as a reward error; with one part that is a reward of 0.0.
Under process supervision the one part may return step rewards; they are scaled by its weight.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from actors.config import RewardConfig
from actors.reward_model import RewardModelClient
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
    """Scores groups: the function parts with a ``RewardPool``, the reward model's part with a
    ``RewardModelClient`` (``pool``, ``model``: already built ones, for tests)."""

    def __init__(
        self,
        cfg: RewardConfig,
        steps: bool = False,
        pool: RewardPool | None = None,
        model: RewardModelClient | None = None,
        model_actors: tuple[str, ...] = (),
    ):
        parts = cfg.parts
        self.names = [p.part_name for p in parts]
        self.weights = [p.weight for p in parts]
        self.function_index = [  # pool order -> part index
            i for i, p in enumerate(parts) if not p.is_model and not p.is_environment
        ]
        self.model_index = next((i for i, p in enumerate(parts) if p.is_model), None)
        self.environment_index = next((i for i, p in enumerate(parts) if p.is_environment), None)
        self.pool = pool or (RewardPool(cfg, steps) if self.function_index else None)
        if model is None and self.model_index is not None:
            model = RewardModelClient(list(model_actors), cfg.timeout_s)
        self.model = model

    def wait_ready(self) -> None:
        if self.pool is not None:
            self.pool.wait_ready()

    def score_groups(self, calls: list[tuple[list[str], list[str], list[dict]]]) -> list[list[Scored]]:
        """``calls``: ``(prompts, completions, rows)`` of each group; its completions' rewards. The reward
        model gets all groups in one call, while the workers score them."""
        sizes = [len(c[1]) for c in calls]
        ref = None
        if self.model is not None:  # started first: it runs beside the workers
            ref = self.model.submit([p for c in calls for p in c[0]], [x for c in calls for x in c[1]])
        pooled = self.pool.score_many(calls) if self.pool is not None else [None] * len(calls)
        model = self.model.result(ref, sum(sizes)) if ref is not None else None
        out, start = [], 0
        for scores, n in zip(pooled, sizes, strict=True):
            values = model[start : start + n] if isinstance(model, list) else model
            out.append(self._combine(scores, values, n))
            start += n
        return out

    async def score_group_async(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[Scored]:
        async def nothing():
            return None

        pooled, model = await asyncio.gather(
            self.pool.score_async(prompts, completions, rows) if self.pool is not None else nothing(),
            self.model.score_async(prompts, completions) if self.model is not None else nothing(),
        )
        return self._combine(pooled, model, len(completions))

    def _combine(self, scores: list[SampleScore] | None, model: list[float] | str | None, n: int) -> list[Scored]:
        """``scores``: the workers' (None without function parts); ``model``: the reward model's values,
        its error, or None without a model part."""
        out = []
        for i in range(n):
            values, error, steps = [0.0] * len(self.names), None, None
            if scores is not None:
                for index, value in zip(self.function_index, scores[i].parts, strict=True):
                    values[index] = value
                error, steps = scores[i].error, scores[i].steps
            if isinstance(model, str):
                error = error or model
            elif model is not None:
                values[self.model_index] = float(model[i])
            reward = sum(w * v for w, v in zip(self.weights, values))
            steps = None if steps is None else [self.weights[0] * v for v in steps]
            out.append(Scored(reward, dict(zip(self.names, values)), steps, error))
        return out

    def with_environment(self, scored: Scored, episode: dict | None) -> Scored:
        """``scored`` with the ``environment`` part's value: the episode's summed turn rewards (its steps,
        under process supervision, are the turns' rewards)."""
        if self.environment_index is None or episode is None:
            return scored
        i, value = self.environment_index, float(episode["environment_reward"])
        parts = dict(scored.parts)
        parts[self.names[i]] = value
        steps = [self.weights[i] * r for r in episode["turn_rewards"]]
        return Scored(scored.reward + self.weights[i] * value, parts, steps, scored.error)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
