"""Tests for the built-in tasks: hand-computed rewards, deterministic rows, JSONL I/O."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from actors import tasks
from actors.tasks import (
    BUILTIN_TASKS,
    DEFAULT_TASK,
    echo_reward,
    get_task,
    make_rows,
    match_reward,
    successor_reward,
    write_jsonl,
)
from queues.prompts import read_jsonl_rows

# --- match_reward ------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, completion, expected",
    [
        ("5", "5", 1.0),  # exact: the model stopped after the answer
        ("5", "5x", 0.5),  # one extra character
        ("5", "5xyz", 0.25),  # never stopped within max_tokens=4
        ("5", "x5", 0.0),  # right digit, wrong position
        ("5", "4", 0.0),
        ("5", "", 0.0),  # stopped at once
        ("5", "5 ", 0.5),  # no stripping: a trailing space is an extra character
        ("381", "381", 1.0),
        ("381", "38", 2 / 3),
        ("381", "391", 2 / 3),
        ("381", "3810", 0.75),
        ("381", "183", 1 / 3),
        ("", "", 1.0),
        ("", "a", 0.0),
    ],
)
def test_match_reward_hand_computed(answer, completion, expected):
    assert match_reward(answer, completion) == pytest.approx(expected, abs=1e-12)


# --- successor ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, completion, expected",
    [
        ("next 4:", "5", 1.0),
        ("next 4:", "4", 0.0),
        ("next 4:", "56", 0.5),
        ("next 4:", "5ab", 1 / 3),
        ("next 9:", "0", 1.0),  # wraps around
        ("next 9:", "10", 0.0),
        ("next 0:", "1", 1.0),
        ("next 0:", "", 0.0),
    ],
)
def test_successor_reward_hand_computed(prompt, completion, expected):
    row = {"prompt": prompt, "answer": str((int(prompt[5]) + 1) % 10)}
    assert successor_reward(prompt, completion, row) == pytest.approx(expected, abs=1e-12)
    # The answer can also be derived from the prompt when no row is given.
    assert successor_reward(prompt, completion, {}) == pytest.approx(expected, abs=1e-12)
    assert successor_reward(prompt, completion, None) == pytest.approx(expected, abs=1e-12)


def test_successor_reward_uses_row_answer():
    # The row is authoritative: a dataset edited by hand is scored against its answer.
    assert successor_reward("next 4:", "7", {"answer": "7"}) == 1.0


def test_successor_reward_rejects_foreign_prompt_without_answer():
    with pytest.raises(ValueError):
        successor_reward("what?", "1", {})


# --- echo -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, completion, expected",
    [
        ("copy 7:", "7", 1.0),
        ("copy 7:", "77", 0.5),
        ("copy 7:", "8", 0.0),
        ("copy 7:", "7!!!", 0.25),
    ],
)
def test_echo_reward_hand_computed(prompt, completion, expected):
    assert echo_reward(prompt, completion, {"answer": "7"}) == pytest.approx(expected, abs=1e-12)
    assert echo_reward(prompt, completion, {}) == pytest.approx(expected, abs=1e-12)


# --- rows -------------------------------------------------------------------------------


SCALAR_TASKS = sorted(n for n in BUILTIN_TASKS if not n.endswith("_steps"))


@pytest.mark.parametrize("name", SCALAR_TASKS)
def test_rows_are_deterministic_and_well_formed(name):
    rows = make_rows(name, 57, seed=3)
    assert rows == make_rows(name, 57, seed=3)
    assert rows != make_rows(name, 57, seed=4)
    assert len(rows) == 57
    make_rows_fn, reward_fn = BUILTIN_TASKS[name]
    for row in rows:
        assert isinstance(row["prompt"], str) and row["prompt"]
        assert isinstance(row["answer"], str) and row["answer"]
        assert row["task"] == name
        # The answer earns full reward, any other single digit earns none.
        assert reward_fn(row["prompt"], row["answer"], row) == 1.0
        wrong = str((int(row["answer"]) + 5) % 10)
        assert reward_fn(row["prompt"], wrong, row) == 0.0
    # Prefixes are stable: asking for more rows extends the list.
    assert make_rows(name, 80, seed=3)[:57] == rows
    assert make_rows_fn(57, 3) == rows


def test_successor_rows_content():
    rows = make_rows("successor", 20, seed=0)
    for row in rows:
        d = int(row["prompt"][len("next ")])
        assert row["prompt"] == f"next {d}:"
        assert row["answer"] == str((d + 1) % 10)
    # Balanced: every block of ten rows holds each digit once.
    for start in (0, 10):
        assert sorted(r["prompt"][5] for r in rows[start : start + 10]) == list("0123456789")


def test_rows_are_balanced_over_digits():
    counts = Counter(r["answer"] for r in make_rows("echo", 1000, seed=1))
    assert set(counts.values()) == {100}


def test_prompts_use_only_tiny_model_characters():
    from actors.tiny_model import CHARACTERS

    for name in BUILTIN_TASKS:
        for row in make_rows(name, 30, seed=0):
            assert set(row["prompt"]) <= set(CHARACTERS)
            assert set(row["answer"]) <= set(CHARACTERS)


def test_unknown_task_and_bad_n():
    with pytest.raises(KeyError, match="successor"):
        get_task("nope")
    with pytest.raises(ValueError):
        make_rows("successor", -1)
    assert make_rows("successor", 0) == []


def test_registry():
    assert DEFAULT_TASK in BUILTIN_TASKS
    for name, task in BUILTIN_TASKS.items():
        assert task.name == name
        assert task.doc
        assert task.recommended["max_tokens"] > max(len(r["answer"]) for r in task.make_rows(50, 0))
    assert tasks.__doc__ and "learnable" in tasks.__doc__


# --- JSONL ------------------------------------------------------------------------------


def test_write_and_read_jsonl(tmp_path):
    rows = make_rows("successor", 12, seed=7)
    path = write_jsonl(rows, tmp_path / "sub" / "train.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 12
    assert json.loads(lines[0]) == rows[0]
    assert read_jsonl_rows(path) == rows  # what Tandem's prompt loader reads back


def test_successor_steps_scores_every_character():
    from actors.tasks import successor_step_rewards

    row = {"prompt": "next 4:", "answer": "5"}
    assert successor_step_rewards(row["prompt"], "5", row) == [1.0]
    assert successor_step_rewards(row["prompt"], "5x", row) == [1.0, -0.25]  # an extra character costs 0.25
    assert successor_step_rewards(row["prompt"], "x5", row) == [0.0, -0.25]
    assert successor_step_rewards(row["prompt"], "", row) == []
    assert successor_step_rewards("next 9:", "0", {}) == [1.0]  # answer from the prompt, wrapping 9 -> 0
