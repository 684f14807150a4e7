"""Built-in reward functions for reasoning: ``builtin:math`` and ``builtin:format``.

These are rewards only (no data task has their names); ``builtin:<task>`` of ``actors/tasks.py``
names a task's own reward. Each entry of ``BUILTIN_REWARDS`` builds its function once from the
``reward`` config section, so options such as ``reward.format_pattern`` are read at load time.

``builtin:math`` follows the usual verifiable-reward recipe (DeepSeek-R1, open-r1): the final answer
of the completion is compared *symbolically* with the row's ``answer`` by the ``math-verify`` library
(``parse`` then ``verify``), 1.0 if equal, else 0.0. The final answer is, in order: the last
``\\boxed{}``; else the number after the last ``####`` (GSM8K's form, as lm-evaluation-harness's
gsm8k "strict-match" reads it); else an anchored "the answer is ..."; and with
``reward.math_extraction = flexible`` else the last number of the text (its "flexible-extract").
A box wins over a later ``####``: a completion that boxes an answer has said which one it means.
math-verify times its own parsing and comparison with ``signal.alarm``, which works only in a
process's main thread: these functions run in the main thread of the reward workers
(``actors/reward_pool.py``), never on an actor's event loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from actors.config import RewardConfig

RewardFn = Callable[..., Any]

BOXED = "\\boxed"
THINK_END = "</think>"
GSM8K_MARK = "####"
# lm-evaluation-harness gsm8k strict-match, "#### (\-?[0-9\.\,]+)", also taking "####$6" and "####6"
STRICT_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9.,]+)")
# a number, thousands grouped or not: the flexible mode's candidates (the last one counts)
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


@lru_cache(maxsize=1)
def _answer_configs() -> list:
    """How a completion's answer is found: a ``\\boxed{}`` first, else an anchored final answer
    ("the answer is 4", "final answer: $x+1$"); never a bare number anywhere in the text."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = LatexExtractionConfig(
        boxed_match_priority=0,
        try_extract_without_anchor=False,
        normalization_config=NormalizationConfig(
            basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all", equations=False
        ),
    )
    return [latex, ExprExtractionConfig(try_extract_without_anchor=False)]


def gold_text(answer: Any) -> str:
    """The row's answer as text math-verify parses: a number or expression as it is, a GSM8K answer
    ("... #### 18") by what follows its last ``####``; plain text (no ``$``, no ``\\boxed``) is
    wrapped in ``$...$`` so LaTeX like ``\\frac{1}{2}`` or ``x+1`` is read as math."""
    text = str(answer).strip()
    if GSM8K_MARK in text:
        text = text.rsplit(GSM8K_MARK, 1)[1].strip()
    if "$" not in text and BOXED not in text:
        text = f"${text}$"
    return text


def final_answer_text(completion: str) -> str:
    """The part of a completion that holds its final answer: after the last ``</think>``, and from the
    last ``\\boxed`` on when there is one (so an earlier boxed guess does not count)."""
    text = completion.rsplit(THINK_END, 1)[-1]
    boxed = text.rfind(BOXED)
    return text[boxed:] if boxed != -1 else text


def parse_gold(answer: Any) -> list:
    from math_verify import parse

    gold = parse(gold_text(answer), extraction_mode="first_match")
    if not gold:
        raise ValueError(f"builtin:math could not parse the row's answer {answer!r} as math")
    return gold


def _number(text: str) -> str:
    """A matched number as math: thousands commas and a sentence's final period dropped ("1,234." -> 1234)."""
    return f"${text.replace(',', '').rstrip('.')}$"


def strict_answer(completion: str) -> list:
    """The completion's final answer parsed by math-verify: the last box, else the number after the last
    ``####``, else an anchored final answer; ``[]`` when there is none."""
    from math_verify import parse

    text = final_answer_text(completion)
    if BOXED not in text:
        marked = STRICT_ANSWER.findall(text)
        if marked:
            return parse(_number(marked[-1]), extraction_mode="first_match")
    return parse(text, extraction_config=_answer_configs())


def flexible_answer(completion: str) -> list:
    """``strict_answer``, else the last number after the thinking ("so she has 6 apples." -> 6)."""
    from math_verify import parse

    predicted = strict_answer(completion)
    if predicted:
        return predicted
    numbers = NUMBER.findall(completion.rsplit(THINK_END, 1)[-1])
    return parse(_number(numbers[-1]), extraction_mode="first_match") if numbers else []


# reward.math_extraction -> how a completion's final answer is found; chosen once, when the reward is built
MATH_EXTRACTIONS: dict[str, Callable[[str], list]] = {"strict": strict_answer, "flexible": flexible_answer}


def matches(gold: list, completion: str, extract: Callable[[str], list] = strict_answer) -> float:
    """1.0 when the completion's final answer (found by ``extract``) equals the parsed ``gold``
    symbolically, else 0.0."""
    from math_verify import verify

    predicted = extract(completion)
    return float(bool(predicted) and verify(gold, predicted))


def math_score(answer: Any, completion: str, extraction: str = "strict") -> float:
    """``builtin:math`` of one completion against ``answer``."""
    return matches(parse_gold(answer), completion, MATH_EXTRACTIONS[extraction])


def build_math(cfg: RewardConfig) -> RewardFn:
    extract = MATH_EXTRACTIONS[cfg.math_extraction]

    def math_reward(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
        """Batched: the G completions of a prompt share its row, so its answer is parsed once."""
        golds: dict[str, list] = {}
        out = []
        for completion, row in zip(completions, rows, strict=True):
            if "answer" not in row:
                raise KeyError("builtin:math needs an 'answer' in every row (map it with data.answer_field)")
            key = str(row["answer"])
            if key not in golds:
                golds[key] = parse_gold(row["answer"])
            out.append(matches(golds[key], completion, extract))
        return out

    math_reward.batched = True
    return math_reward


def build_format(cfg: RewardConfig) -> RewardFn:
    pattern = re.compile(cfg.format_pattern, re.DOTALL)

    def format_reward(prompt: str, completion: str, row: dict) -> float:
        return 1.0 if pattern.fullmatch(completion) else 0.0

    return format_reward


# name -> builder of the function from the reward section; chosen once, when the reward is loaded
BUILTIN_REWARDS: dict[str, Callable[[RewardConfig], RewardFn]] = {
    "math": build_math,
    "format": build_format,
}
