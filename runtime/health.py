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
    steps in a row, when it was not uniform at the start, stops the run the same way.

  - episodes their environment failed (``EPISODE_FAILURES``: a step past its deadline, code that raised or
    answered wrongly, a lost worker): the first text of each kind is said with the step's counts (the
    progress line carries the counts of every step);
  - steps that trained no token (``untrained_cause``: every episode failed, every token rejected by
    ``tis.reject`` or masked): ``run.max_empty_steps`` in a row stop the run with the cause.

``SignalWatch`` only warns: ``NO_SIGNAL_STEPS`` steps in a row whose every group scored alike (no
gradient for group-relative advantages) are said once with the likely cause (failed episodes, rejected
tokens, a reward that never fires, a task too easy), as is every step that trained no token and the
first evaluation round whose reward calls failed; summary.json records the counts, the warnings, and
``learned: false`` when not one step had a signal or trained a token.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from queues.messages import EPISODE_FAILURES

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


NO_SIGNAL_STEPS = 5  # steps in a row without a learning signal before the console says so
MAX_FAILURE_TEXTS = 10  # distinct episode failure texts said in a run (samples.jsonl keeps the rest)
MOSTLY = 0.5  # a share of failed episodes or rejected tokens that explains a step without signal


def untrained_cause(metrics: dict[str, Any]) -> str | None:
    """None when the step trained a token (``trained_tokens`` > 0, ``step_metrics``), else why it did not:
    the rules of ``algorithm.tis`` took out every token, its environment failed every episode (or the rest
    were cut and masked), or every completion was cut and masked. A record without ``trained_tokens`` (an
    older run) trained."""
    if metrics.get("trained_tokens", 1.0) > 0:
        return None
    tokens = float(metrics.get("learner/tokens", 0.0))
    if tokens > 0:
        return _weighed_nothing(metrics, tokens)
    failed = sum(float(metrics.get(f"episode/end_{end}_frac", 0.0)) for end in EPISODE_FAILURES)
    if failed:
        ends = ", ".join(
            f"{end} {metrics[f'episode/end_{end}_frac']:.0%}"
            for end in EPISODE_FAILURES
            if metrics.get(f"episode/end_{end}_frac")
        )
        which = "every episode was" if failed >= 1.0 - 1e-9 else f"{failed:.0%} of the episodes were"
        rest = "" if failed >= 1.0 - 1e-9 else " (the rest were cut at rollout.max_tokens and masked)"
        return (
            f"{which} ended by its environment ({ends}), and such an episode trains no token{rest}; first: "
            f"{metrics.get('episode_failure', '?')}; fix the environment (each failure's text is in samples.jsonl "
            "and the actor logs; `tandem check-data` runs its reset())"
        )
    if float(metrics.get("truncated_frac", 0.0)) >= 1.0:
        return (
            "every completion was cut at rollout.max_tokens and algorithm.shaping.mask_truncated trains none of "
            "them; raise rollout.max_tokens (and engine.max_model_len)"
        )
    return "no completion token was left to train on (every token masked out)"


def _weighed_nothing(metrics: dict[str, Any], tokens: float) -> str:
    """Why a step's ``tokens`` trained tokens all got weight 0: the rejection rules, the weights' mode, or both."""
    rules = ", ".join(
        f"{k.removeprefix('learner/reject_').removesuffix('_frac')} {v:.0%}"
        for k, v in metrics.items()
        if k.startswith("learner/reject_") and k not in ("learner/reject_token_frac", "learner/reject_seq_frac")
    )
    rejected = float(metrics.get("learner/reject_token_frac", 0.0))
    masked = float(metrics.get("learner/tis_masked_frac", 0.0))
    if rejected >= 1.0:
        return (
            f"algorithm.tis.reject rejected all {tokens:.0f} tokens of the step (by rule: {rules}); widen the "
            "rules' low/high bounds or remove a rule (docs/offpolicy.md)"
        )
    if masked >= 1.0 or not rules:
        return (
            f"importance sampling's algorithm.tis.mode gave all {tokens:.0f} tokens of the step weight 0 (outside "
            "its bounds); widen algorithm.tis.cap (or low/high) or use tis.mode=truncate"
        )
    return (
        f"algorithm.tis.reject ({rejected:.0%} of tokens, by rule: {rules}) and algorithm.tis.mode ({masked:.0%} of "
        f"its units masked) together left none of the step's {tokens:.0f} tokens a weight; widen their bounds"
    )


@dataclass
class Silent:
    """What a step without signal says of its likely cause (``no_signal_cause``)."""

    reward_mean: float
    reward_std: float
    truncated_frac: float = 0.0
    failed_frac: float = 0.0  # episodes ended by their environment
    rejected_frac: float = 0.0  # tokens rejected by tis.reject
    failure: str | None = None  # the first failed episode's "<end>: <detail>"

    @classmethod
    def of(cls, metrics: dict[str, Any]) -> Silent:
        episodes = sum(v for k, v in metrics.items() if k.startswith("episode/end_") and isinstance(v, float))
        failed = sum(float(metrics.get(f"episode/end_{end}_frac", 0.0)) for end in EPISODE_FAILURES)
        return cls(
            float(metrics.get("reward_mean", 0.0)),
            float(metrics.get("reward_std", 0.0)),
            float(metrics.get("truncated_frac", 0.0)),
            failed / episodes if episodes else 0.0,
            float(metrics.get("learner/reject_token_frac", 0.0)),
            metrics.get("episode_failure"),
        )


def no_signal(metrics: dict[str, Any]) -> bool:
    """A step whose every group scored alike (``zero_variance_frac`` 1): group-relative
    advantages are all zero, so the step has no gradient from the rewards."""
    return metrics.get("zero_variance_frac", 0.0) >= 1.0


def no_signal_cause(rewards: list[Silent | tuple[float, ...]]) -> str:
    """The likely cause, from each step without signal (``Silent``, or ``(reward_mean, reward_std[,
    truncated_frac])``): most episodes failed by their environment, or most tokens rejected by
    ``tis.reject``, before the rewards are blamed; then the same score everywhere (0 with most completions
    cut at the length limit: no room to answer; 0: the reward never fires; 1 or more: the task is too
    easy; else the reward ignores the completion), or a different score per prompt but one per group."""
    steps = [r if isinstance(r, Silent) else Silent(*r) for r in rewards]
    failed = sum(s.failed_frac for s in steps) / len(steps)
    if failed >= MOSTLY:
        first = next((s.failure for s in steps if s.failure), "?")
        return (
            f"{failed:.0%} of episodes were ended by their environment and train no token (first: {first}); fix "
            "the environment (each failure's text is in samples.jsonl and the actor logs)"
        )
    rejected = sum(s.rejected_frac for s in steps) / len(steps)
    if rejected >= MOSTLY:
        return (
            f"algorithm.tis.reject rejected {rejected:.0%} of the tokens; widen the rules' low/high bounds or "
            "remove a rule (docs/offpolicy.md)"
        )
    means = [s.reward_mean for s in steps]
    mean = sum(means) / len(means)
    cut = sum(s.truncated_frac for s in steps) / len(steps)
    rewards = [(s.reward_mean, s.reward_std) for s in steps]
    if mean <= 0 and cut >= 0.5 and max(means) == min(means):
        return (
            f"all rewards {mean:.2f} and {cut:.0%} of completions were cut at rollout.max_tokens: too short to "
            "reach an answer; raise rollout.max_tokens (and engine.max_model_len)"
        )
    if any(r[1] > 0 for r in rewards) or max(means) != min(means):
        return (
            f"mean reward {mean:.2f}, but each prompt's samples scored alike: they do not differ enough; "
            "raise rollout.temperature or rollout.group_size"
        )
    if mean <= 0:
        return (
            f"all rewards {mean:.2f}: the reward never fires; check the answers and the reward with `tandem check-data`"
        )
    if mean >= 1:
        return f"all rewards {mean:.2f}: the task is too easy for the model; use harder prompts"
    return f"all rewards {mean:.2f}: the reward does not depend on the completion; check reward.function"


class SignalWatch:
    """Says when a run learns nothing. ``step`` takes each step's metrics (``step_metrics``) and
    returns a warning when ``steps_in_a_row`` steps in a row had no signal (``no_signal``), once
    per such stretch; ``eval`` returns one for the first evaluation round whose reward calls
    failed. ``summary`` is what summary.json records."""

    def __init__(self, steps_in_a_row: int = NO_SIGNAL_STEPS):
        self.k = steps_in_a_row
        self.steps = 0
        self.no_signal_steps = 0
        self.streak: list[Silent] = []  # the current stretch of steps without signal
        self.silent: list[Silent] = []  # every step without signal
        self.empty_steps, self.empty_streak = 0, 0  # steps that trained no token (all, and in a row)
        self.empty_cause: str | None = None
        self.warnings: list[str] = []
        self.eval_errors = 0

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        self.steps += 1
        if cause := untrained_cause(metrics):
            return self._empty(step, cause)
        self.empty_streak = 0
        if not no_signal(metrics):
            self.streak = []
            return None
        silent = Silent.of(metrics)
        self.no_signal_steps += 1
        self.streak.append(silent)
        self.silent.append(silent)
        if len(self.streak) != self.k:
            return None
        return self._warn(
            f"steps {step + 2 - self.k}-{step + 1}: every group scored alike for {self.k} steps in a row, "
            f"so there is no learning signal ({no_signal_cause(self.streak)})"
        )

    def eval(self, step: int | None, metrics: dict[str, Any]) -> str | None:
        errors = int(metrics.get("eval/reward_errors", 0) or 0)
        self.eval_errors += errors
        if not errors or self.eval_errors > errors:  # said for the first round with errors only
            return None
        calls = int(metrics.get("eval/prompts", 0)) * int(metrics.get("eval/samples", 0))
        return self._warn(
            f"eval{'' if step is None else f' after step {step}'}: {errors} of {calls} reward calls failed "
            "(scored 0), so pass@k reads low; fix reward.function (its errors are in the actor logs)"
        )

    def _empty(self, step: int, cause: str) -> str:
        """A step that trained no token is said every time; the summary keeps the first of each stretch. It
        breaks a stretch without signal (it is a step of another kind)."""
        self.streak = []
        self.empty_steps += 1
        self.empty_streak += 1
        self.empty_cause = self.empty_cause or cause
        text = f"step {step + 1} trained 0 tokens: {cause}"
        if self.empty_streak == 1:
            self.warnings.append(text)
        return text

    def _warn(self, text: str) -> str:
        self.warnings.append(text)
        return text

    def summary(self) -> dict[str, Any]:
        """``no_signal_steps``, ``eval_reward_errors``, ``warnings``; and ``learned: false`` with
        ``learned_reason`` when not one step had a signal."""
        out: dict[str, Any] = {
            "no_signal_steps": self.no_signal_steps,
            "eval_reward_errors": self.eval_errors,
            "warnings": list(self.warnings),
        }
        if self.empty_steps:
            out["empty_steps"] = self.empty_steps
        if self.steps and self.empty_steps == self.steps:
            out["learned"] = False
            out["learned_reason"] = f"no step trained a token (all {self.steps}): {self.empty_cause}"
        elif self.steps and self.no_signal_steps + self.empty_steps == self.steps:
            out["learned"] = False
            which = f"all {self.steps} steps" if not self.empty_steps else f"{self.no_signal_steps} steps"
            rest = f"; {self.empty_steps} steps trained no token" if self.empty_steps else ""
            out["learned_reason"] = (
                f"no step had a learning signal (every group of {which} scored alike{rest}): "
                f"{no_signal_cause(self.silent)}"
            )
        return out
