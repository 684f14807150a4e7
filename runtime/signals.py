"""Whether a run's steps carry a learning signal, and why not: warnings, never a stop.

``SignalWatch`` looks at each step's metrics (``runtime/step_metrics.py``, so it can be replayed from
metrics.jsonl): ``NO_SIGNAL_STEPS`` steps in a row whose every group scored alike (no gradient for
group-relative advantages) are said once with the likely cause (``no_signal_cause``: failed episodes,
rejected tokens, completions cut at the length limit, a reward that never fires, a task too easy), as is
every step that trained no token (``untrained_cause``) and the first evaluation round whose reward calls
failed; summary.json records the counts, the warnings, and ``learned: false`` when not one step had a
signal or trained a token. Stopping a run is ``runtime/health.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from queues.messages import EPISODE_FAILURES

NO_SIGNAL_STEPS = 5  # steps in a row without a learning signal before the console says so
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
        self.starved = 0  # prompts given up: too stale at every try (Admission.too_stale)

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        """The warnings this step gives (one per line), or None."""
        self.steps += 1
        said = [self._starved(step, metrics), self._signal(step, metrics)]
        return "\n".join(text for text in said if text) or None

    def _signal(self, step: int, metrics: dict[str, Any]) -> str | None:
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

    def _starved(self, step: int, metrics: dict[str, Any]) -> str | None:
        """The first prompts given up as too stale at every try are said once, with what they mean: the run
        trains its short completions only."""
        count = int(metrics.get("starved_prompts", 0) or 0)
        self.starved += count
        if not count or self.starved > count:
            return None
        age, length = int(metrics["starved_age_max"]), float(metrics["starved_len_mean"])
        return self._warn(
            f"step {step + 1}: {count} prompt(s) given up, their groups too stale to train at every try (up to "
            f"{age} versions old, past run.max_staleness; their completions {length:.0f} tokens long against "
            f"{metrics.get('completion_len_mean', 0):.0f} trained): completions that take longer than "
            f"run.max_staleness steps to generate are never trained, so the run learns from its short ones; set "
            f"run.max_staleness >= {age} (TIS corrects the lag) or lower rollout.max_inflight_prompts"
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
        if self.starved:
            out["starved_prompts"] = self.starved
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
