"""The typed messages that travel between the rollout loop, the actors and the learner.

A prompt leaves the rollout loop as a ``PromptRequest``; a generation actor turns it
into a ``TrajectoryGroup`` (the G completions of one prompt, scored); the learner
trains on the groups. Every field that crosses a process boundary is declared here.
Per-token fields are numpy arrays: Ray moves their buffers without a Python object per
token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ``Trajectory.episode["end"]`` when the environment failed (a step past its deadline, code that raised or
# answered wrongly, a worker lost): the episode stays in its group and trains no token
EPISODE_FAILURES = ("timeout", "error", "lost")


@dataclass
class PromptRequest:
    """One prompt to be sampled ``group_size`` times."""

    prompt_id: int  # unique within a run, in dispatch order (evaluation prompts: negative)
    row: dict[str, Any]  # the dataset row: "prompt", "answer" and any extra fields
    min_version: int  # lowest policy version allowed to generate it (admission control)
    prompt_token_ids: list[int] | None = None  # the rendered prompt (chat template applied); None: row["prompt"]
    purpose: str = "train"  # "train" | "eval": evaluation groups skip the training batch
    samples: int | None = None  # completions to sample (None: rollout.group_size)
    temperature: float | None = None  # sampling temperature (None: rollout.temperature; 0: greedy)
    sample_seed: int | None = None  # seeds its samples (None: the prompt id); evaluation: the row's index

    @property
    def seed_offset(self) -> int:
        """What the actor adds to its seed for this prompt's samples (never negative)."""
        return self.prompt_id if self.sample_seed is None else self.sample_seed


@dataclass
class Trajectory:
    """One sampled completion of one prompt, with everything the learner needs."""

    prompt_token_ids: np.ndarray  # int32 [P] the prompt as the sampler saw it
    completion_token_ids: np.ndarray  # int32 [C] generated tokens, EOS included when sampled
    completion_mask: np.ndarray  # uint8 [C] 1 where the learner trains on the token, else 0
    sampler_logprobs: np.ndarray  # float32 [C] log pi_sampler(token) for every completion token
    policy_versions: np.ndarray  # int32 [C] weight version that produced each completion token
    reward: float  # task reward: sum of weight x part over the reward's parts (a failed part counts 0.0)
    finish_reason: str  # "stop" (EOS or stop string) or "length" (hit max_tokens)
    completion_text: str  # the decoded completion, special tokens removed
    step_rewards: np.ndarray | None = None  # float32 [S] process supervision: one reward per reasoning step
    step_end_tokens: np.ndarray | None = None  # int32 [S] completion index of the token that ends each step
    reward_parts: dict[str, float] | None = None  # raw value of each reward part by name (reward = weighted sum)
    episode: dict | None = None  # multi-turn: turns, end reason, tool calls/errors, environment time and rewards
    model_mask: np.ndarray | None = None  # uint8 [C] multi-turn: 1 on the model's tokens, 0 on the environment's
    # (kept when completion_mask is zeroed by overlong filtering; None: every token is the model's)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.completion_token_ids)

    @property
    def episode_failure(self) -> str | None:
        """``"<end>: <detail>"`` when its environment failed the episode (``EPISODE_FAILURES``), else None."""
        if self.episode is None or self.episode.get("end") not in EPISODE_FAILURES:
            return None
        return f"{self.episode['end']}: {self.episode.get('detail') or 'no detail'}"


@dataclass
class TrajectoryGroup:
    """The G completions of one prompt: the unit of group-relative advantages."""

    prompt_id: int
    row: dict[str, Any]
    trajectories: list[Trajectory]
    actor_name: str  # which generation actor produced it
    reward_errors: int = 0  # completions whose reward function raised (scored 0)
    first_reward_error: str | None = None  # "ExceptionType: message" of the first one
    generate_seconds: float = 0.0  # wall time of the generate call that produced it
    weight_wait_s: float = 0.0  # time its actor spent waiting for/loading weights since its previous group
    purpose: str = "train"  # copied from its request: "eval" groups are scored, never trained on
    spans: list = field(default_factory=list)  # its actor's spans since its previous push (cluster/timeline.py)

    @property
    def oldest_version(self) -> int:
        return min((int(np.min(t.policy_versions)) if len(t.policy_versions) else 0) for t in self.trajectories)


@dataclass
class ActorReport:
    """What a generation actor's loop returns when the queues close (the run's end)."""

    name: str  # the actor: actor-0, ...
    groups: int  # prompt groups it pushed to the results queue
    weight_loads: int  # policy versions it loaded
    spans: list = field(default_factory=list)  # its spans since its last push (cluster/timeline.py)

    def summary(self) -> dict[str, int | str]:
        """The report as ``summary.json`` lists it (the spans go to the timeline)."""
        return {"name": self.name, "groups": self.groups, "weight_loads": self.weight_loads}
