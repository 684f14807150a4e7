"""The run's prompt rows: the training set and the held-out evaluation set, read before anything starts.

``data.prompts`` is a built-in task (``actors/tasks.py``) or anything ``queues/sources.py`` reads;
``eval.prompts`` takes the same forms, with the same column mapping (``eval.prompt_field`` /
``eval.answer_field`` may be dotted paths too), or ``eval.fraction`` holds a seeded share of the
training rows out. Rows dropped as unusable are counted and named here, and a ``by_source`` entry
that no row's ``data_source`` matches (a misspelt source silently scores with the default) is said.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.config import SOURCE_FIELD
from launch.config import TandemConfig
from queues.config import DataConfig
from queues.prompts import DatasetError
from queues.sources import Fields, read_rows, split_holdout

Rows = list[dict[str, Any]]
NAMED_SOURCES = 10  # data_sources named when a by_source entry matches none


def fields_of(data: DataConfig) -> Fields:
    return Fields(prompt=data.prompt_field, answer=data.answer_field, messages=data.messages_field)


def read_source(
    source: str,
    data: DataConfig,
    seed: int,
    split: str,
    subset: str | None,
    what: str,
    say: Callable[[str], None],
    fields: Fields | None = None,
) -> Rows:
    """Rows of a ``builtin:<task>`` or of a file / directory / dataset name."""
    if source.startswith("builtin:"):
        from actors.tasks import get_task

        try:
            task = get_task(source.removeprefix("builtin:"))
        except KeyError as exc:
            raise DatasetError(f"{what} {source!r}: {exc.args[0]}") from None
        return task.make_rows(data.num_rows, seed)
    return read_rows(source, fields or fields_of(data), split, subset, what, say).rows


def load_prompt_rows(data: DataConfig, seed: int, say: Callable[[str], None] = lambda line: None) -> Rows:
    """The rows of ``data.prompts``."""
    return read_source(data.prompts, data, seed, data.split, data.subset, "data.prompts", say)


def load_run_rows(cfg: TandemConfig, say: Callable[[str], None]) -> tuple[Rows, Rows]:
    """``(train rows, eval rows)``; the eval rows are empty when there is no held-out set."""
    rows = load_prompt_rows(cfg.data, cfg.run.seed, say)
    ev = cfg.eval
    if ev.prompts:
        # a built-in eval task draws its rows from another seed: prompts not generated for training
        own = fields_of(cfg.data)
        fields = Fields(ev.prompt_field or own.prompt, ev.answer_field or own.answer, own.messages)
        subset = ev.subset or cfg.data.subset
        held = read_source(ev.prompts, cfg.data, cfg.run.seed + 1, ev.split, subset, "eval.prompts", say, fields)
    else:
        rows, held = split_holdout(rows, ev.fraction, cfg.run.seed)
    if ev.max_prompts is not None:
        held = held[: ev.max_prompts]
    if cfg.rollout.max_tokens_field:  # a bad budget is said now, naming the row, not by an actor mid-run
        check_budgets(cfg, rows, held)
    line = unmatched_sources(cfg, rows + held)
    if line:
        say(line)
    return rows, held


def check_budgets(cfg: TandemConfig, rows: Rows, held: Rows) -> None:
    """Every row's ``rollout.max_tokens_field`` is a budget or empty, and some row has one (a misspelt column
    would otherwise leave every row at ``rollout.max_tokens`` without a word)."""
    from actors.spec import row_budget
    from queues.sources import field_value

    field = cfg.rollout.max_tokens_field
    for source, part in (("data.prompts", rows), ("eval.prompts", held)):
        for i, row in enumerate(part):
            try:
                row_budget(cfg.rollout, row)
            except ValueError as err:
                prompt = str(row.get("prompt", ""))[:60]  # the index is after the held-out split: the text says which
                raise DatasetError(f"{source} row {i} (prompt {prompt!r}): {err}") from None
    if rows and all(field_value(row, field) is None for row in rows):
        columns = ", ".join(sorted(rows[0])) or "none"
        raise DatasetError(
            f"rollout.max_tokens_field: no row of data.prompts has a value in {field!r} (the rows' columns: "
            f"{columns}); name the column that holds each prompt's budget, or set rollout.max_tokens_field=null"
        )


def unmatched_sources(cfg: TandemConfig, rows: Rows) -> str | None:
    """One line naming the ``by_source`` data_sources that no row has, with the ones the rows do have."""
    listed = {source for part in cfg.reward.parts for source in (part.by_source or {})}
    found = {source for row in rows if isinstance(source := row.get(SOURCE_FIELD), str)}
    missing = sorted(listed - found)
    if not missing:
        return None
    shown = sorted(found)[:NAMED_SOURCES]
    have = ", ".join(shown) + (", ..." if len(found) > len(shown) else "") if found else "none (no data_source)"
    return (
        f"by_source of the reward lists data_source {', '.join(map(repr, missing))}, which no row has (check the "
        f"spelling: a row whose source is not listed scores with the default function); the rows have: {have}"
    )
