"""Small builders of typed messages for tests."""

from __future__ import annotations

import random

from learner.batch import TrainSequence
from queues.messages import Trajectory, TrajectoryGroup


def make_sequence(rng: random.Random, prompt_len: int, completion_len: int, vocab: int = 56) -> TrainSequence:
    return TrainSequence(
        prompt_token_ids=[rng.randrange(4, vocab) for _ in range(prompt_len)],
        completion_token_ids=[rng.randrange(4, vocab) for _ in range(completion_len)],
        completion_mask=[1] * completion_len,
        advantages=[rng.uniform(-1, 1)] * completion_len,
        sampler_logprobs=[-1.0] * completion_len,
        policy_versions=[0] * completion_len,
    )


def make_group(
    prompt_id: int, rewards: list[float], version: int = 0, completion_len: int = 3, seed: int = 0
) -> TrajectoryGroup:
    """A scored group; each completion has its own random tokens (identical ones would cancel)."""
    rng = random.Random(seed * 1000 + prompt_id)
    trajs = [
        Trajectory(
            prompt_token_ids=[5, 6],
            completion_token_ids=[rng.randrange(4, 56) for _ in range(completion_len)],
            completion_mask=[1] * completion_len,
            sampler_logprobs=[-0.5] * completion_len,
            policy_versions=[version] * completion_len,
            reward=r,
            finish_reason="stop",
            completion_text="x" * completion_len,
        )
        for r in rewards
    ]
    return TrajectoryGroup(prompt_id=prompt_id, row={"prompt": "12"}, trajectories=trajs, actor_name="test")
