"""Built-in synthetic tasks with verifiable rewards, for the demo and the tests.

The demo trains a *randomly initialised* 2-layer Qwen2 (``actors/tiny_model.py``,
one token per character) with reinforcement learning alone, so the built-in task has
to be learnable from scratch by GRPO within ~100-150 optimizer steps on CPU. The
default task, ``successor``, is::

    prompt "next 4:"  ->  answer "5"        (digits wrap: "next 9:" -> "0")

Why this is learnable from scratch:

* **The answer is one token.** The random model's next-token distribution is close to
  uniform over its 64 logits, so the right digit is sampled with probability about
  1/64 per position. With 8 samples per prompt and 32 prompts per step, several
  completions per step already contain the right digit in first place, so groups
  have non-zero reward variance (a GRPO learning signal) from step 0.
* **The reward is dense.** :func:`match_reward` gives credit per matching position and
  divides by the length of the longer string: ``"5"`` scores 1.0, ``"5x"`` 0.5,
  ``"5xyz"`` 0.25 and ``"x5"`` 0. A completion with the right first character is
  rewarded even before the model has learned to stop, and each extra character
  after it lowers the reward, which teaches the model to emit EOS. With
  ``max_tokens`` larger than the answer, a completion equal to the answer must have
  stopped by itself, so the text alone tells whether the model stopped.
* **The mapping is small and fixed.** Ten prompts, ten answers, one fixed prompt
  template: the model only has to route one prompt position (the digit) to the
  output, a lookup that a 2-layer transformer picks up within tens of steps.

One trap, and its fix: a prompt whose right digit the model has not found yet can
collapse to stopping at once (EOS first, empty completion, reward 0 for all samples,
so zero group variance and no signal ever again). It happened in 2 of 5 seeds, each
time for one prompt out of ten, leaving the mean reward at ~0.89 instead of ~0.99.
Sampling with ``min_tokens=1`` (vLLM ``SamplingParams(min_tokens=1)``: EOS is not
allowed as the first token) removes it: 5/5 seeds reached >= 0.995.

Multi-character copying ("123>" -> "123"), two-operand addition and mixed +1/-1 prompts
were measured too and learn far more slowly (see :data:`BUILTIN_TASKS`).

Each task is a pair of plain-Python functions (no torch): ``make_rows(n, seed)``, which
returns ``n`` rows ``{"prompt", "answer", "task"}`` deterministically from ``seed``, and
``reward(prompt, completion, row) -> float`` in [0, 1], the signature Tandem uses for
user reward functions (``completion`` is the decoded text, special tokens skipped).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from actors.arith_task import arith_reward, arith_rows
from actors.lookup_task import lookup_reward, lookup_rows

DIGITS = "0123456789"

__all__ = [
    "BUILTIN_TASKS",
    "DEFAULT_TASK",
    "Task",
    "echo_reward",
    "echo_rows",
    "get_task",
    "make_rows",
    "match_reward",
    "successor_reward",
    "successor_rows",
    "write_jsonl",
]


# ---------------------------------------------------------------------------------
# Shared scoring


def match_reward(answer: str, completion: str) -> float:
    """Positional character match, normalised by the longer of the two strings.

    ``sum(answer[i] == completion[i]) / max(len(answer), len(completion))``, so an
    exact match scores 1.0, every missing or extra character costs credit and an
    empty completion scores 0.0. No stripping: a trailing space is an extra character.
    """
    longest = max(len(answer), len(completion))
    if longest == 0:
        return 1.0
    matches = sum(1 for a, c in zip(answer, completion) if a == c)
    return matches / longest


def _balanced_digits(n: int, seed: int) -> list[str]:
    """``n`` digits in shuffled blocks of ten, so every digit is equally frequent and
    any 10 consecutive rows starting at a multiple of 10 hold each digit once."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        block = list(DIGITS)
        rng.shuffle(block)
        out.extend(block)
    return out[:n]


def _digit_after(prefix: str, prompt: str) -> str | None:
    """The digit in ``prompt`` right after ``prefix`` (``"next 4:"`` -> ``"4"``)."""
    if prompt.startswith(prefix) and len(prompt) > len(prefix) and prompt[len(prefix)] in DIGITS:
        return prompt[len(prefix)]
    return None


# ---------------------------------------------------------------------------------
# successor: "next 4:" -> "5"

SUCCESSOR_PREFIX = "next "


def successor_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows ``{"prompt": "next d:", "answer": str((d + 1) % 10), "task": "successor"}``."""
    return [
        {
            "prompt": f"{SUCCESSOR_PREFIX}{d}:",
            "answer": DIGITS[(int(d) + 1) % 10],
            "task": "successor",
        }
        for d in _balanced_digits(n, seed)
    ]


def successor_reward(prompt: str, completion: str, row: dict | None = None) -> float:
    """:func:`match_reward` of ``completion`` against the successor of the prompt's digit.

    The answer comes from ``row["answer"]`` when given, else from the prompt.
    """
    answer = (row or {}).get("answer")
    if answer is None:
        d = _digit_after(SUCCESSOR_PREFIX, prompt)
        if d is None:
            raise ValueError(f"successor: prompt {prompt!r} is not of the form 'next <digit>:'")
        answer = DIGITS[(int(d) + 1) % 10]
    return match_reward(answer, completion)


# ---------------------------------------------------------------------------------
# echo: "copy 7:" -> "7"

ECHO_PREFIX = "copy "


def echo_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows ``{"prompt": "copy d:", "answer": "d", "task": "echo"}``."""
    return [{"prompt": f"{ECHO_PREFIX}{d}:", "answer": d, "task": "echo"} for d in _balanced_digits(n, seed)]


def echo_reward(prompt: str, completion: str, row: dict | None = None) -> float:
    """:func:`match_reward` of ``completion`` against the prompt's digit."""
    answer = (row or {}).get("answer")
    if answer is None:
        answer = _digit_after(ECHO_PREFIX, prompt)
        if answer is None:
            raise ValueError(f"echo: prompt {prompt!r} is not of the form 'copy <digit>:'")
    return match_reward(answer, completion)


# ---------------------------------------------------------------------------------
# successor_steps: the successor task with one reward per character (process supervision)


def successor_step_rewards(prompt: str, completion: str, row: dict | None = None) -> list[float]:
    """One reward per character of the completion, for GRPO process supervision
    (``algorithm.estimator.step_delimiter: ''`` makes every character a step).

    The first character earns 1.0 when it is the answer, else 0.0; every further
    character costs -0.25 (the answer is one character, so the model should stop).
    ``"5"`` -> [1.0]; ``"5x"`` -> [1.0, -0.25]; ``"x5"`` -> [0.0, -0.25].
    """
    answer = (row or {}).get("answer") or DIGITS[(int(_digit_after(SUCCESSOR_PREFIX, prompt) or 0) + 1) % 10]
    return [float(ch == answer) if i == 0 else -0.25 for i, ch in enumerate(completion)]


# ---------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class Task:
    """A built-in task: row generator, reward function and the settings it was tuned with."""

    name: str
    make_rows: Callable[[int, int], list[dict]]
    reward: Callable[[str, str, dict], float]
    doc: str
    # Settings under which a random-init tiny model learns the task with GRPO (measured
    # in a pure-torch simulation; see the module docstring and the tests).
    recommended: dict = field(default_factory=dict)

    def __iter__(self):  # allows ``make_rows, reward = BUILTIN_TASKS[name]``
        return iter((self.make_rows, self.reward))


RECOMMENDED = {
    "prompts_per_step": 32,
    "group_size": 8,
    "max_tokens": 4,
    "temperature": 1.0,
    "min_tokens": 1,  # forbid an empty completion; optional, see the module docstring
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "weight_decay": 0.0,
    "steps": 150,
}

BUILTIN_TASKS: dict[str, Task] = {
    "successor": Task(
        name="successor",
        make_rows=successor_rows,
        reward=successor_reward,
        doc=(
            "Successor of a digit, mod 10: 'next 4:' -> '5', 'next 9:' -> '0'. "
            "Reward: positional match over the longer string ('5' = 1.0, '5x' = 0.5). "
            "Default demo task: a random-init tiny model goes from ~0.015 to ~0.99 mean "
            "reward in 150 GRPO steps (5/5 seeds with min_tokens=1; without it 3/5 "
            "reach ~0.99 and 2/5 stop at ~0.89)."
        ),
        recommended=dict(RECOMMENDED),
    ),
    "echo": Task(
        name="echo",
        make_rows=echo_rows,
        reward=echo_reward,
        doc=(
            "Repeat a digit: 'copy 7:' -> '7'. Same reward as successor. The easiest "
            "built-in task; a fallback when successor is too slow for a setup."
        ),
        recommended=dict(RECOMMENDED),
    ),
    "successor_steps": Task(
        name="successor_steps",
        make_rows=successor_rows,
        reward=successor_step_rewards,
        doc=(
            "The successor task scored per character (process supervision): 1.0 for a right first "
            "character, -0.25 for each further one. Use with algorithm.estimator.step_delimiter=''."
        ),
        recommended=dict(RECOMMENDED),
    ),
    "arith": Task(
        name="arith",
        make_rows=arith_rows,
        reward=arith_reward,
        doc=(
            "Multi-step addition answered in \\boxed{} ('7+4+3' -> '7+4=11\\n11+3=14\\n\\boxed{14}'), for a "
            "supervised warm-start then GRPO with builtin:math (the math example, actors/arith_task.py)."
        ),
        recommended=dict(RECOMMENDED, max_tokens=160, prompts_per_step=16, steps=60),
    ),
    "lookup": Task(
        name="lookup",
        make_rows=lookup_rows,
        reward=lookup_reward,
        doc=(
            "The code of a key, known only by calling the lookup tool ('code of k37?' -> a tool call -> '512'): "
            "multi-turn episodes with rollout.episode.environment=builtin:lookup (the tools example, "
            "actors/lookup_task.py)."
        ),
        recommended=dict(RECOMMENDED, max_tokens=160, prompts_per_step=16, steps=60),
    ),
}

DEFAULT_TASK = "successor"


def get_task(name: str) -> Task:
    """The built-in task ``name``; ``KeyError`` naming the choices otherwise."""
    try:
        return BUILTIN_TASKS[name]
    except KeyError:
        raise KeyError(f"unknown built-in task {name!r}; choose one of {sorted(BUILTIN_TASKS)}") from None


def make_rows(task: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of built-in task ``task``, the same for the same ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return get_task(task).make_rows(n, seed)


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write ``rows`` one JSON object per line (UTF-8); creates parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
