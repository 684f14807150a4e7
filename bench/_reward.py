"""The reward the generation benchmark scores with: cheap, like a real exact-match check.

1.0 when the completion starts with the row's answer, else the fraction of the answer's
characters matched in place (so random completions get a spread of rewards).
"""

from __future__ import annotations


def reward(prompt: str, completion: str, row: dict) -> float:
    answer = str(row["answer"])
    if completion.startswith(answer):
        return 1.0
    return sum(a == c for a, c in zip(answer, completion, strict=False)) / len(answer)
