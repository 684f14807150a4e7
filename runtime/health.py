"""A run that cannot learn says so: reward functions that fail, losses that are not finite.

After every step ``RunHealth.check`` looks at what the step trained on and what the learner
reported:
  - reward errors: the first error's message is printed once, and the count rides on every
    progress line; a step where every reward call failed is said; ``reward.max_error_steps``
    such steps in a row stop the run (it would train on zeros);
  - non-finite updates: the learner skipped them (``learner/rank.py``: no rank applies an update
    whose loss or gradient is not finite, so nothing is published from it); each is said, and
    ``run.max_nonfinite_steps`` steps in a row whose every update was skipped stop the run with
    the likely cause;
  - a policy that became uniform: its mean entropy at ln V (the vocabulary's), with finite losses
    and no gradient left (a learning rate far too high does this), for ``run.max_nonfinite_steps``
    steps in a row, when it was not uniform at the start, stops the run the same way;
  - episodes their environment failed (``EPISODE_FAILURES``: a step past its deadline, code that raised or
    answered wrongly, a lost worker): the first text of each kind is said with the step's counts (the
    progress line carries the counts of every step);
  - steps that trained no token (``runtime/signals.py`` ``untrained_cause``: every episode failed, every
    token rejected by ``tis.reject`` or masked): ``run.max_empty_steps`` in a row stop the run with the cause
    (each is said by ``SignalWatch``, which only warns: ``runtime/signals.py``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

from queues.messages import EPISODE_FAILURES
from runtime.signals import MOSTLY, untrained_cause

MAX_FAILURE_TEXTS = 10  # distinct episode failure texts said in a run (samples.jsonl keeps the rest)

UNIFORM_TOLERANCE = 1e-5  # relative: a random-init model starts near ln V, but not this near
NEAR_UNIFORM = 0.9  # a first entropy above this share of ln V: an untrained model (a trained one is far below)


class RunCannotLearn(RuntimeError):
    """The run is not learning; the message names the likely cause and the fix."""


class RunHealth:
    def __init__(
        self,
        lr: float,
        max_error_steps: int,
        max_nonfinite_steps: int,
        say: Callable[[str], None],
        max_empty_steps: int = 5,
        lora: bool = False,
    ):
        self.lr, self.say, self.lora = lr, say, lora
        self.max_error_steps, self.max_nonfinite_steps = max_error_steps, max_nonfinite_steps
        self.max_empty_steps, self.empty_streak = max_empty_steps, 0
        self.said_failures: set[str] = set()  # episode failure texts said so far
        self.error_streak = self.nonfinite_streak = 0
        self.reported_error = False
        self.nonfinite_total = 0
        self.uniform_streak = 0
        self.started_uniform: bool | None = None  # the policy's first step was already uniform
        self.said_oversample = False

    def state(self) -> dict[str, Any]:
        return {"nonfinite_total": self.nonfinite_total, "started_uniform": self.started_uniform}

    def restore(self, state: dict[str, Any]) -> None:
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        self.started_uniform = state.get("started_uniform")

    def check(self, step: int, groups: list, metrics: dict[str, Any]) -> None:
        self._rewards(step, groups)
        self._episodes(step, groups)
        self._updates(step, groups, metrics)
        self._collapse(step, groups, metrics)

    def trained(self, step: int, metrics: dict[str, Any]) -> None:
        """After the step is logged (its ``step_metrics``): ``run.max_empty_steps`` steps in a row that
        trained no token stop the run with the cause (each is said by ``SignalWatch``)."""
        cause = untrained_cause(metrics)
        self.empty_streak = self.empty_streak + 1 if cause else 0
        if cause and self.empty_streak >= self.max_empty_steps:
            raise RunCannotLearn(
                f"no token was trained for {self.empty_streak} steps in a row (run.max_empty_steps): {cause}"
            )

    def _episodes(self, step: int, groups: list) -> None:
        """The first text of each episode failure is said once, with the step's counts by end."""
        trajs = [t for g in groups for t in g.trajectories if t.episode is not None]
        failures = [t.episode_failure for t in trajs if t.episode_failure]
        new = next((f for f in failures if f not in self.said_failures), None)
        if new is None or len(self.said_failures) >= MAX_FAILURE_TEXTS:
            return
        self.said_failures.add(new)
        ends = collections.Counter(f.split(":", 1)[0] for f in failures)
        counts = ", ".join(f"{end} {ends[end]}" for end in EPISODE_FAILURES if ends[end])
        self.say(
            f"step {step + 1}: {len(failures)} of {len(trajs)} episodes were ended by their environment ({counts}) "
            f"and train no token; {new}"
        )

    def oversample_reached(self, step: int, max_oversample: float, prompts_per_step: int, groups=()) -> None:
        """Dynamic sampling hit its limit: zero-variance groups filled the batch. Said once a run, with the
        likely reason: the batch's failed episodes when most of them failed, else the task's difficulty."""
        if self.said_oversample:
            return
        self.said_oversample = True
        episodes = [t for g in groups for t in g.trajectories if t.episode is not None]
        failed = [t.episode_failure for t in episodes if t.episode_failure]
        why = (
            f"{len(failed)} of the batch's {len(episodes)} episodes were ended by their environment (first: "
            f"{failed[0]})"
            if episodes and len(failed) >= MOSTLY * len(episodes)
            else "too easy or too hard a task?"
        )
        self.say(
            f"step {step + 1}: dynamic sampling reached algorithm.filtering.max_oversample ({max_oversample:g} x "
            f"{prompts_per_step} groups): zero-variance groups fill the batch; most groups have equal rewards "
            f"({why})"
        )

    def _collapse(self, step: int, groups: list, metrics: dict[str, Any]) -> None:
        entropy, top = metrics.get("entropy"), metrics.get("uniform_entropy")
        if entropy is None or not top or not math.isfinite(entropy):
            return
        uniform = entropy >= top * (1 - UNIFORM_TOLERANCE)
        if self.started_uniform is None:
            self.started_uniform = uniform
            if self.lora and entropy >= NEAR_UNIFORM * top:
                self.say(
                    f"warning: learner.lora on a policy that starts near uniform (entropy {entropy:.2f} of ln V = "
                    f"{top:.2f}), as a random-init model does: its output head and embeddings stay frozen, and "
                    "adapters on the linear layers alone may not express the task (docs/lora.md); warm-start the "
                    "model with supervised steps first (as the examples do) or train it fully (no learner.lora)"
                )
        self.uniform_streak = self.uniform_streak + 1 if uniform and not self.started_uniform else 0
        if self.uniform_streak == 1:
            self.say(f"step {step + 1}: the policy is uniform over its vocabulary (entropy {entropy:.4f} = ln V)")
        if self.uniform_streak >= self.max_nonfinite_steps:
            raise RunCannotLearn(
                f"the policy has been uniform over its vocabulary (entropy = ln V = {top:.4f}) for "
                f"{self.uniform_streak} steps in a row: the weights diverged; likely cause: {self._cause(groups)}"
            )

    def _rewards(self, step: int, groups: list) -> None:
        errors = sum(g.reward_errors for g in groups)
        samples = sum(len(g.trajectories) for g in groups)
        first = next((g.first_reward_error for g in groups if g.first_reward_error), None)
        if errors and not self.reported_error:
            self.reported_error = True
            self.say(f"step {step + 1}: {errors} of {samples} reward calls failed (scored 0); first error: {first}")
        self.error_streak = self.error_streak + 1 if samples and errors == samples else 0
        if self.error_streak:
            self.say(f"step {step + 1}: every reward call failed; first error: {first}")
        if self.error_streak >= self.max_error_steps:
            raise RunCannotLearn(
                f"every reward call failed for {self.error_streak} steps in a row (reward.max_error_steps); "
                f"first error: {first}; fix reward.function (its errors are in the actor logs)"
            )

    def _updates(self, step: int, groups: list, metrics: dict[str, Any]) -> None:
        skipped = int(metrics.get("nonfinite_updates", 0))
        updates = int(metrics.get("updates", 1))
        self.nonfinite_total += skipped
        if skipped:
            self.say(f"step {step + 1}: {skipped} of {updates} update(s) skipped: the loss or gradient was not finite")
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped and skipped == updates else 0
        if self.nonfinite_streak >= self.max_nonfinite_steps:
            raise RunCannotLearn(
                f"the loss or gradient was not finite for {self.nonfinite_streak} steps in a row "
                f"(run.max_nonfinite_steps); likely cause: {self._cause(groups)}"
            )

    def _cause(self, groups: list) -> str:
        rewards = [t.reward for g in groups for t in g.trajectories]
        biggest = max((abs(r) for r in rewards), default=0.0)
        if not all(math.isfinite(r) for r in rewards) or biggest > 1e6:
            return f"rewards too large (max |reward| {biggest:.3g}); scale reward.function's output to about [-10, 10]"
        if self.lr > 0.01:
            return f"learner.lr = {self.lr:g} is far too high; try 1e-6 to 1e-4 for a pretrained model"
        return "the weights diverged; lower learner.lr or set learner.grad_clip (and check the rewards)"
