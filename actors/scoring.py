"""Turning sampled completions into scored ``TrajectoryGroup``s (shared by both actors).

A ``Sample`` is one completion as the engine produced it; ``GroupBuilder`` scores the
G samples of a prompt with the reward function (per-step rewards for process
supervision are placed on the tokens that end their steps) and packs them into the
typed message the results queue carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from actors.rewards import RewardFn, score, score_steps, step_end_tokens
from queues.messages import PromptRequest, Trajectory, TrajectoryGroup


@dataclass
class Sample:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens
    logprobs: list[float]  # sampler log-prob of each generated token
    versions: list[int]  # policy version that produced each token
    finish_reason: str  # "stop" | "length"
    text: str  # decoded completion, special tokens skipped


class GroupBuilder:
    def __init__(
        self,
        actor_name: str,
        reward_fn: RewardFn,
        decode: Callable[[list[int]], str],
        step_delimiter: str | None = None,
    ):
        self.actor_name, self.reward_fn, self.decode = actor_name, reward_fn, decode
        self.step_delimiter = step_delimiter

    def group(
        self, request: PromptRequest, samples: list[Sample], elapsed: float, weight_wait_s: float = 0.0
    ) -> TrajectoryGroup:
        """The scored group of ``request``; ``weight_wait_s``: the actor's weight time since its
        previous group (it rides to the learner's step metrics)."""
        trajectories, errors, first_error = [], 0, None
        for s in samples:
            reward, steps, ends, error = self.score(request, s.text, s.token_ids)
            if error is not None:
                errors += 1
                first_error = first_error or error
            trajectories.append(
                Trajectory(
                    prompt_token_ids=np.asarray(s.prompt_token_ids, dtype=np.int32),
                    completion_token_ids=np.asarray(s.token_ids, dtype=np.int32),
                    completion_mask=np.ones(len(s.token_ids), dtype=np.uint8),
                    sampler_logprobs=np.asarray(s.logprobs, dtype=np.float32),
                    policy_versions=np.asarray(s.versions, dtype=np.int32),
                    reward=reward,
                    finish_reason=s.finish_reason,
                    completion_text=s.text,
                    step_rewards=None if steps is None else np.asarray(steps, dtype=np.float32),
                    step_end_tokens=None if ends is None else np.asarray(ends, dtype=np.int32),
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
        )

    def score(self, request: PromptRequest, text: str, ids: list[int]):
        """``(reward, step_rewards, step_end_tokens, error)``; steps only for process supervision."""
        prompt, row = request.row["prompt"], request.row
        if self.step_delimiter is None:
            reward, error = score(self.reward_fn, prompt, text, row)
            return reward, None, None, error
        reward, steps, error = score_steps(self.reward_fn, prompt, text, row)
        if error is None and steps is None:  # a single score: one step, ending at the last token
            return reward, [reward], [len(ids) - 1], None
        ends = step_end_tokens(ids, self.decode, self.step_delimiter) if ids else []
        if error is None and len(steps) != len(ends):
            error = f"ValueError: reward function gave {len(steps)} step rewards for {len(ends)} steps"
        if error is not None or not ids:
            return 0.0, [], [], error
        return reward, steps, ends, None
