"""Turning sampled completions into scored ``TrajectoryGroup``s.

A ``Sample`` is one completion as the rollout produced it (``actors/rollout.py``); ``GroupBuilder`` scores the
G samples of a prompt with one call to the reward workers (``actors/reward_scorer.py``;
per-step rewards for process supervision are placed on the tokens that end their steps)
and packs them into the typed message the results queue carries.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from actors.reward_scorer import RewardScorer, Scored
from actors.rewards import step_end_tokens
from actors.rollout import Sample
from queues.messages import PromptRequest, Trajectory, TrajectoryGroup


class GroupBuilder:
    """Builds the scored groups of an actor; ``scorer`` computes the rewards (in its worker processes)."""

    def __init__(
        self,
        actor_name: str,
        scorer: RewardScorer,
        decode: Callable[[list[int]], str],
        step_delimiter: str | None = None,
    ):
        self.actor_name, self.scorer, self.decode = actor_name, scorer, decode
        self.step_delimiter = step_delimiter

    def group(
        self, request: PromptRequest, samples: list[Sample], elapsed: float, weight_wait_s: float = 0.0
    ) -> TrajectoryGroup:
        """The scored group of ``request`` (blocking while its rewards are computed)."""
        return self.groups([request], [samples], elapsed, [weight_wait_s])[0]

    def groups(
        self, requests: list[PromptRequest], samples: list[list[Sample]], elapsed: float, waits: list[float]
    ) -> list[TrajectoryGroup]:
        """The scored group of each request (one reward call per group, spread over the workers)."""
        scores = self.scorer.score_groups([_call(r, s) for r, s in zip(requests, samples, strict=True)])
        return [
            self.build(*args, elapsed, wait) for args, wait in zip(zip(requests, samples, scores), waits, strict=True)
        ]

    async def group_async(
        self, request: PromptRequest, samples: list[Sample], elapsed: float, weight_wait_s: float = 0.0
    ) -> TrajectoryGroup:
        """The scored group of ``request``, awaiting its rewards without blocking the event loop."""
        scores = await self.scorer.score_group_async(*_call(request, samples))
        return self.build(request, samples, scores, elapsed, weight_wait_s)

    def build(
        self,
        request: PromptRequest,
        samples: list[Sample],
        scores: list[Scored],
        elapsed: float,
        weight_wait_s: float = 0.0,
    ) -> TrajectoryGroup:
        """The group of ``request`` with its rewards; ``weight_wait_s``: the actor's weight time since its
        previous group (it rides to the learner's step metrics)."""
        trajectories, errors, first_error = [], 0, None
        for s, scored in zip(samples, scores, strict=True):
            scored = self.scorer.with_environment(scored, s.episode)
            reward, steps, ends, error = self._steps(scored, s.token_ids, s.episode)
            if error is not None:
                errors += 1
                first_error = first_error or error
            trajectories.append(
                Trajectory(
                    prompt_token_ids=np.asarray(s.prompt_token_ids, dtype=np.int32),
                    completion_token_ids=np.asarray(s.token_ids, dtype=np.int32),
                    completion_mask=np.asarray(s.mask, dtype=np.uint8),
                    sampler_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                    policy_versions=np.asarray(s.versions, dtype=np.int32),
                    reward=reward,
                    finish_reason=s.finish_reason,
                    completion_text=s.text,
                    step_rewards=None if steps is None else np.asarray(steps, dtype=np.float32),
                    step_end_tokens=None if ends is None else np.asarray(ends, dtype=np.int32),
                    reward_parts=scored.parts,
                    episode=s.episode,
                    model_mask=None if s.model_mask is None else np.asarray(s.model_mask, dtype=np.uint8),
                )
            )
        if first_error:
            print(
                f"[{self.actor_name}] reward function failed on prompt {request.prompt_id}: {first_error}", flush=True
            )
        return TrajectoryGroup(
            prompt_id=request.prompt_id,
            row=request.row,
            trajectories=trajectories,
            actor_name=self.actor_name,
            reward_errors=errors,
            first_reward_error=first_error,
            generate_seconds=elapsed,
            weight_wait_s=weight_wait_s,
            purpose=request.purpose,  # evaluation groups are routed out of the training batch
        )

    def _steps(self, scored: Scored, ids: list[int], episode: dict | None = None):
        """``(reward, step_rewards, step_end_tokens, error)``; steps only for process supervision (an
        episode's steps are its model turns, rewarded by the environment)."""
        if self.step_delimiter is None:
            return scored.reward, None, None, scored.error
        if episode is not None:
            return scored.reward, scored.steps or [], episode["turn_ends"], scored.error
        if scored.error is None and scored.steps is None:  # a single score: one step, ending at the last token
            return scored.reward, [scored.reward], [len(ids) - 1], None
        steps, error = scored.steps, scored.error
        ends = step_end_tokens(ids, self.decode, self.step_delimiter) if ids else []
        if error is None and len(steps) != len(ends):
            error = f"ValueError: reward function gave {len(steps)} step rewards for {len(ends)} steps"
        if error is not None or not ids:
            return 0.0, [], [], error
        return scored.reward, steps, ends, None

    def close(self) -> None:
        self.scorer.close()


def _call(request: PromptRequest, samples: list[Sample]) -> tuple[list[str], list[str], list[dict]]:
    """One reward call: the group's prompt and row, once per completion."""
    n = len(samples)
    return [request.row["prompt"]] * n, [s.text for s in samples], [request.row] * n
