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


def utf8_lines(path: Path, label: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a text file (a byte-order mark on line 1 is dropped); the first line
    that is not UTF-8 raises a one-line ``DatasetError`` beginning with ``label``."""
    with path.open("rb") as f:  # bytes, so a decoding error is pinned to its line
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{label} line {lineno} is not UTF-8 text (byte {exc.object[exc.start]:#04x} cannot be decoded); "
                    "save the file as UTF-8 (for example: iconv -f latin1 -t utf-8 OLD > NEW)"
                ) from None


def read_jsonl_rows(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"prompt file {p} does not exist; set data.prompts to a JSONL file or 'builtin:<task>'")
    rows = []
    for lineno, row in json_objects(p):
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            problem = (
                "has no 'prompt' field" if "prompt" not in row else "has a 'prompt' that is not a non-empty string"
            )
            raise DatasetError(f'{p} line {lineno} {problem}; every row needs {{"prompt": "...", "answer": ...}}')
        rows.append(row)
    if not rows:
        raise DatasetError(f"prompt file {p} has no rows")
    return rows


def json_objects(path: Path):
    """``(line number, object)`` of each non-blank line of a JSONL file; a ``DatasetError`` naming the first
    line that is not valid JSON, or not an object."""
    for lineno, line in utf8_lines(path, str(path)):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path} line {lineno} is not valid JSON ({exc.msg}); fix or remove that line") from None
        if not isinstance(row, dict):
            raise DatasetError(
                f'{path} line {lineno} is a {type(row).__name__}, not an object like {{"prompt": ..., "answer": ...}}'
            )
        yield lineno, row


class PromptStream:
    """Endless rows: each epoch is a fresh seeded shuffle (or the file order). Position ``i`` of
    the stream (a prompt id) is always the same row for the same rows, seed and ``shuffle``."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool = True):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # two epochs at most
            self._orders[epoch] = order
        return self._orders[epoch]

    def row(self, position: int) -> dict[str, Any]:
        epoch, index = divmod(position, len(self.rows))
        return self.rows[self._order(epoch)[index]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        position = 0
        while True:
            yield self.row(position)
            position += 1
