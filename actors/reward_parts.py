"""The reward's parts and one reward call: what a reward worker computes for the G completions of a prompt.

``reward.functions`` (or ``reward.function``, one part of weight 1) lists the parts; each is loaded
once into a ``RewardPart`` whose calling convention is chosen at load time: a function with an
attribute ``batched = True`` is called once per group as ``fn(prompts, completions, rows) ->
list[float]`` (the convention of TRL's reward functions), any other once per sample as
``fn(prompt, completion, row) -> float``. A part with ``by_source`` (``reward.by_source``, or on a
``reward.functions`` entry) loads each of its functions once and picks one per row by the row's
``data_source`` (verl's column) with a dict lookup; a source not listed uses the part's ``function``.
``score_call`` returns every part's raw value per sample; the weights are applied by the actor
(``actors/reward_scorer.py``), which also adds the reward model's part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actors.config import RewardConfig, RewardFunctionConfig
from actors.rewards import as_reward, load_reward_function, score, score_steps

# (reward, step rewards or None, error or None) of one sample under one part
PartResult = tuple[float, list[float] | None, str | None]
PartCall = Callable[[list[str], list[str], list[dict], bool], list[PartResult]]


@dataclass
class SampleScore:
    """One completion's scores, as a reward worker returns them (it crosses a process boundary)."""

    parts: list[float]  # raw (unweighted) value of each function part, in reward.functions order; 0.0 if failed
    steps: list[float] | None = None  # process supervision: the step rewards of the one part, if it gave a list
    error: str | None = None  # "ExceptionType: message" of the first part that failed on this completion


@dataclass(frozen=True)
class RewardPart:
    """A loaded part: its name, weight, and how to call it on a group (chosen once, at load)."""

    name: str
    weight: float
    call: PartCall


def _batched(fn) -> PartCall:
    def call(prompts: list[str], completions: list[str], rows: list[dict], steps: bool) -> list[PartResult]:
        n = len(completions)
        try:
            values = fn(prompts, completions, rows)
        except Exception as exc:  # a user's function may raise anything; the group scores 0
            return [(0.0, None, f"{type(exc).__name__}: {exc}")] * n
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(values)[:80]
            return [(0.0, None, f"ValueError: batched reward function returned {got} for {n} completions")] * n
        return [_checked(as_reward(v), steps) for v in values]

    return call


def _per_sample(fn) -> PartCall:
    def call(prompts: list[str], completions: list[str], rows: list[dict], steps: bool) -> list[PartResult]:
        if steps:
            return [score_steps(fn, p, c, r) for p, c, r in zip(prompts, completions, rows, strict=True)]
        out = []
        for p, c, r in zip(prompts, completions, rows, strict=True):
            reward, error = score(fn, p, c, r)
            out.append((reward, None, error))
        return out

    return call


def _checked(result: PartResult, steps: bool) -> PartResult:
    if result[1] is not None and not steps:
        return 0.0, None, "ValueError: reward function returned a list; a float was expected"
    return result


def _by_source(part: RewardFunctionConfig, loaded: dict[str, PartCall]) -> PartCall:
    """One part whose function is chosen per row by its ``data_source`` (``part.function_for``): the rows
    of each function are scored in one call (a batched function still sees a whole group of one source)."""

    def call(prompts: list[str], completions: list[str], rows: list[dict], steps: bool) -> list[PartResult]:
        chosen: dict[str, list[int]] = {}  # function -> the indices of its rows, in order
        for i, row in enumerate(rows):
            chosen.setdefault(part.function_for(row), []).append(i)
        out: list[PartResult] = [(0.0, None, None)] * len(completions)
        for spec, index in chosen.items():
            fn = loaded[spec]
            results = fn([prompts[i] for i in index], [completions[i] for i in index], [rows[i] for i in index], steps)
            for i, result in zip(index, results, strict=True):
                out[i] = result
        return out

    return call


def load_parts(cfg: RewardConfig) -> list[RewardPart]:
    """Every function part of ``cfg`` loaded (``RewardSpecError`` for one that does not load), each
    function once however many parts or sources name it; the reward model's part is not a function and
    is scored by its own actors."""
    loaded: dict[str, PartCall] = {}
    for spec in dict.fromkeys(spec for part in cfg.function_parts for spec in part.specs):
        fn = load_reward_function(spec, cfg)
        loaded[spec] = _batched(fn) if getattr(fn, "batched", False) is True else _per_sample(fn)
    out = []
    for part in cfg.function_parts:
        call = _by_source(part, loaded) if part.by_source else loaded[part.function]
        out.append(RewardPart(part.part_name, part.weight, call))
    return out


def score_call(
    parts: list[RewardPart], prompts: list[str], completions: list[str], rows: list[dict], steps: bool = False
) -> list[SampleScore]:
    """Every part on every completion. ``steps``: process supervision, where the (one) part may return a
    list of step rewards per completion."""
    results = [part.call(prompts, completions, rows, steps) for part in parts]  # [parts][G]
    out = []
    for i in range(len(completions)):
        values = [r[i][0] for r in results]
        error = next((r[i][2] for r in results if r[i][2] is not None), None)
        out.append(SampleScore(parts=values, steps=results[0][i][1] if steps else None, error=error))
    return out
