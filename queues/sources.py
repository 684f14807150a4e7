"""Reading prompt rows with the ``datasets`` library: JSONL, JSON, parquet, CSV, a saved dataset
directory or a Hugging Face dataset name, mapped to Tandem's row form.

A Tandem row is ``{"prompt": str, "answer": ..., "messages": [...]?, <other columns>}``: the
prompt text (for a chat row, its last user message), the reference answer the reward function
checks, and for chat rows the conversation the chat template renders. Columns are mapped with
``prompt_field`` / ``answer_field`` / ``messages_field``, each a column name or a dotted path into
a nested column (``reward_model.ground_truth``, verl's layout); a prompt column that holds a chat
message list (verl, DAPO) is read as the conversation. Every other column rides along to the
reward function unchanged.

Rows that cannot be used (no prompt, an empty one, a malformed message list, no value for a mapped
answer field) are dropped at
load time, counted per reason and named by their 0-based index in one line, never discovered
mid-run. When most rows are unusable the mapping is wrong, and loading fails with the columns it
found instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from queues.prompts import DatasetError, json_objects, utf8_lines

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
NAMED = 5  # row indices named per reason


@dataclass(frozen=True)
class Fields:
    """Which columns hold the prompt, the answer and a chat conversation."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = "messages"


@dataclass
class LoadedRows:
    """Usable rows, and how many of each kind of unusable row were dropped (with their indices)."""

    rows: list[dict[str, Any]]
    dropped: dict[str, list[int]] = field(default_factory=dict)  # reason -> row indices (0-based)
    total: int = 0

    @property
    def dropped_count(self) -> int:
        return sum(len(v) for v in self.dropped.values())

    def reasons(self) -> str:
        """Each kind of dropped row: its count and its first row indices."""
        parts = []
        for reason, indices in self.dropped.items():
            shown = ", ".join(str(i) for i in indices[:NAMED]) + (", ..." if len(indices) > NAMED else "")
            parts.append(f"{len(indices)} {reason} (rows {shown})")
        return "; ".join(parts) or "none"

    def report(self, name: str) -> str | None:
        """One line naming what was dropped, or None when every row is usable."""
        if not self.dropped:
            return None
        return f"{name}: skipped {self.dropped_count} of {self.total} rows: {self.reasons()}"


def check_utf8(path: Path, what: str) -> None:
    """A one-line ``DatasetError`` naming the first line of a text file that is not UTF-8."""
    for _ in utf8_lines(path, f"{what} {path}"):
        pass


def load_table(source: str, split: str, subset: str | None, what: str = "data.prompts"):
    """A ``datasets.Dataset`` from a file, a directory (``save_to_disk`` output or a dataset folder) or a
    hub name; a one-line ``DatasetError`` naming ``what`` and the fix otherwise."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a file it cannot read is said here, in one line
    path = Path(source).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DatasetError(
                    f"{what} {path} has the suffix {path.suffix or '(none)'!r}; give a .jsonl, .json, .parquet, "
                    ".csv or .arrow file, a dataset directory or a Hugging Face dataset name"
                )
            if builder in ("json", "csv"):
                check_utf8(path, what)  # pyarrow reads bad bytes into its table and fails later, far away
            return _pick_split(datasets.load_dataset(builder, data_files=str(path)), "train", what, path)
        if path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                return _pick_split(datasets.load_from_disk(str(path)), split, what, path)
            return _pick_split(datasets.load_dataset(str(path), name=subset), split, what, path)
        if source.startswith((".", "/", "~")) or source.count("/") > 1:
            raise DatasetError(
                f"{what} {source} does not exist; give a data file, a dataset directory, a Hugging Face "
                "dataset name or 'builtin:<task>'"
            )
        return _pick_split(datasets.load_dataset(source, name=subset), split, what, source)
    except DatasetError:
        raise
    except Exception as exc:  # datasets raises many kinds; the first line of any of them says enough
        if path.is_file() and FILE_BUILDERS.get(path.suffix.lower()) == "json" and path.suffix.lower() == ".jsonl":
            for _ in json_objects(path):  # names the broken line, if one is
                pass
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        hint = (
            "check the file"
            if path.exists()
            else "check the name, data.subset and the network (or download it and give its local path)"
        )
        raise DatasetError(f"{what} {source} could not be loaded ({type(exc).__name__}: {first}); {hint}") from None


def _pick_split(loaded, split: str, what: str, where):
    """The ``split`` of a ``DatasetDict`` (a single-split one gives its only split), or the dataset itself."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split in loaded:
        return loaded[split]
    if len(loaded) == 1 and split == "train":
        return next(iter(loaded.values()))
    raise DatasetError(f"{what} {where} has no split {split!r}; its splits are: {', '.join(loaded)}; set the split")


def field_value(raw: Any, path: str) -> Any:
    """The value a field names in a record: a column (``question``), or a dotted path into nested
    columns (``reward_model.ground_truth``); None when a step of the path is missing. A column whose
    own name has a dot is found first."""
    if isinstance(raw, dict) and path in raw:
        return raw[path]
    value = raw
    for key in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)  # arrow fills a key missing from one row's struct with None: the same
    return value


def _messages_problem(messages: Any, name: str) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"with a '{name}' value that is not a non-empty list"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return "with a message that is not {role: str, content: str}"
    if not any(m["role"] == "user" for m in messages):
        return "with no user message"
    return None


def _conversation(row: dict[str, Any], messages: Any, name: str) -> str | None:
    """Set the row's ``messages`` and ``prompt`` from a chat message list; the reason it is unusable otherwise."""
    problem = _messages_problem(messages, name)
    if problem:
        return f"rows {problem}"
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if messages[-1]["role"] == "assistant":  # a conversation ending with the answer: prompt with the rest
        messages = messages[:-1]
    row["messages"] = messages
    row["prompt"] = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return None


def to_row(raw: dict[str, Any], fields: Fields) -> tuple[dict[str, Any] | None, str | None]:
    """Tandem's row from a dataset record, or ``(None, reason)`` when it cannot be used. A mapped answer
    field (not the default ``answer``) must hold a value: a row the reward cannot check is dropped."""
    row = dict(raw)
    messages = field_value(raw, fields.messages)
    prompt = field_value(raw, fields.prompt)
    if messages is not None:
        problem = _conversation(row, messages, fields.messages)
    elif isinstance(prompt, list):  # verl / DAPO: the prompt column is the chat message list
        problem = _conversation(row, prompt, fields.prompt)
    elif prompt is None:
        problem = f"rows without a '{fields.prompt}' field"
    elif not isinstance(prompt, str) or not prompt.strip():
        problem = f"rows whose '{fields.prompt}' is not a non-empty string"
    else:
        problem = None
        row["prompt"] = prompt
    if problem:
        return None, problem
    if fields.answer != "answer":
        answer = field_value(raw, fields.answer)
        if answer is None:
            return None, f"rows without a '{fields.answer}' value"
        row["answer"] = answer
    return row, None


def _column(path: str, columns: list[str]) -> str:
    """The top-level column a field's path starts in."""
    return path if path in columns else path.split(".", 1)[0]


def _check_nested(table, path: str, option: str, what: str, source: str) -> None:
    """Fail in one line when a dotted ``path`` is missing in most rows, naming the keys found where it stops."""
    column = _column(path, list(table.column_names))
    if column == path:
        return
    rest = path[len(column) + 1 :]
    missing, keys, reached = 0, set(), column
    for value in table[column]:
        if field_value(value, rest) is not None:
            continue
        missing += 1
        node, where = value, column
        for key in rest.split("."):  # walk as far as the path goes, to name what is there instead
            if not isinstance(node, dict) or node.get(key) is None:
                break
            node, where = node[key], f"{where}.{key}"
        if isinstance(node, dict):
            keys.update(k for k, v in node.items() if v is not None)
            reached = where
    if missing * 2 > len(table):
        found = f"'{reached}' holds the keys: {', '.join(sorted(keys))}" if keys else f"'{column}' is not nested there"
        raise DatasetError(
            f"{what} {source}: '{path}' ({option}) is missing in {missing} of {len(table)} rows; {found}; "
            f"set {option} to the dotted path of the value"
        )


def read_rows(
    source: str,
    fields: Fields,
    split: str = "train",
    subset: str | None = None,
    what: str = "data.prompts",
    say: Callable[[str], None] | None = None,
) -> LoadedRows:
    """Every usable row of ``source``; the dropped ones are counted (and ``say``-ed in one line)."""
    table = load_table(source, split, subset, what)
    columns = list(table.column_names)
    section = what.partition(".")[0]  # data or eval: whose *_field options name the columns
    chat = _column(fields.messages, columns) in columns
    if not chat and _column(fields.prompt, columns) not in columns:
        raise DatasetError(
            f"{what} {source} has no '{fields.prompt}' or '{fields.messages}' column; its columns are: "
            f"{', '.join(columns)}; set {section}.prompt_field (e.g. {section}.prompt_field=question)"
        )
    if fields.answer != "answer" and _column(fields.answer, columns) not in columns:
        raise DatasetError(
            f"{what} {source} has no '{fields.answer}' column ({section}.answer_field); its columns are: "
            f"{', '.join(columns)}"
        )
    if chat:
        _check_nested(table, fields.messages, "data.messages_field", what, source)
    else:
        _check_nested(table, fields.prompt, f"{section}.prompt_field", what, source)
    if fields.answer != "answer":
        _check_nested(table, fields.answer, f"{section}.answer_field", what, source)
    loaded = LoadedRows(rows=[], total=len(table))
    for index, raw in enumerate(table):
        row, reason = to_row(raw, fields)
        if row is None:
            loaded.dropped.setdefault(reason, []).append(index)
        else:
            loaded.rows.append(row)
    if len(loaded.rows) * 2 < loaded.total or not loaded.rows:
        raise DatasetError(
            f"{what} {source}: only {len(loaded.rows)} of {loaded.total} rows are usable "
            f"({loaded.reasons()}); its columns are: "
            f"{', '.join(columns)}; check {section}.prompt_field / {section}.answer_field / data.messages_field"
        )
    line = loaded.report(what)
    if line and say is not None:
        say(line)
    return loaded


def split_holdout(rows: list[dict[str, Any]], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)``: a seeded ``fraction`` of the rows (at least one, and at least one left to train on)."""
    import random

    if fraction <= 0:
        return rows, []
    n = min(max(1, round(len(rows) * fraction)), len(rows) - 1)
    if n <= 0:
        raise DatasetError(f"eval.fraction = {fraction} leaves no rows to train on ({len(rows)} rows); lower it")
    order = list(range(len(rows)))
    random.Random(seed * 104729 + 17).shuffle(order)
    held = set(order[:n])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]
