"""Where prompts come from: rows read from a JSONL file (or made by a built-in task, which the
launcher resolves), streamed in seeded epochs.

Rows are ``{"prompt": str, "answer": ..., <anything else>}``; the whole row travels
with the prompt and reaches the reward function. A bad row stops the run before
anything starts, with the file, the line and the fix in one line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """The prompt data cannot be used; the message names the file, line and fix."""


def read_jsonl_rows(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"prompt file {p} does not exist; set data.prompts to a JSONL file or 'builtin:<task>'")
    rows = []
    with p.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{p} line {lineno} is not valid JSON ({exc.msg}); fix or remove that line"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f'{p} line {lineno} is a {type(row).__name__}, not an object like {{"prompt": ..., "answer": ...}}'
                )
            if not isinstance(row.get("prompt"), str) or not row["prompt"]:
                problem = (
                    "has no 'prompt' field" if "prompt" not in row else "has a 'prompt' that is not a non-empty string"
                )
                raise DatasetError(f'{p} line {lineno} {problem}; every row needs {{"prompt": "...", "answer": ...}}')
            rows.append(row)
    if not rows:
        raise DatasetError(f"prompt file {p} has no rows")
    return rows


class PromptStream:
    """Endless rows: each epoch is a fresh seeded shuffle (or the file order)."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool = True):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch = 0
        while True:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 7919 + epoch).shuffle(order)
            for i in order:
                yield self.rows[i]
            epoch += 1
