"""rollout.max_tokens_field: a prompt's own completion budget, read from its row (a length budget per problem)."""

from __future__ import annotations

import json

import pytest

from actors.config import RolloutConfig
from actors.spec import request_params, row_budget
from launch.config import load_config
from launch.data import load_run_rows
from queues.messages import PromptRequest
from tests.runs import actor_spec


def test_a_rows_budget_caps_its_completions_and_a_row_without_one_uses_max_tokens():
    rollout = RolloutConfig(max_tokens=64, min_tokens=64, max_tokens_field="budget")
    budgets = [
        row_budget(rollout, row) for row in ({"budget": 5}, {"budget": 5.0}, {"budget": "9"}, {"budget": 999}, {})
    ]
    assert budgets == [5, 5, 9, 64, 64]
    spec = actor_spec("fake", None, "builtin:echo", max_tokens=64, min_tokens=64, max_tokens_field="budget")
    params = request_params(spec, PromptRequest(0, {"prompt": "p", "budget": 7}, min_version=0), seed=1)
    # min_tokens = max_tokens forces a length: the row's budget is then that length exactly
    assert (params.max_tokens, params.min_tokens, params.n) == (7, 7, spec.rollout.group_size)
    assert request_params(spec, PromptRequest(0, {"prompt": "p"}, min_version=0), seed=1).max_tokens == 64


@pytest.mark.parametrize("value", ["12 tokens", 0, -3, 2.5, True, "\u00b2"])
def test_a_budget_that_is_not_a_positive_whole_number_is_named_with_its_row(tmp_path, value):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps(row) + "\n" for row in ({"prompt": "a", "budget": 3}, {"prompt": "b", "budget": value}))
    )
    cfg = load_config(
        "configs/demo.yaml",
        [f"data.prompts={rows}", "rollout.max_tokens_field=budget", "eval.fraction=0", "reward.function=builtin:echo"],
    )
    said = r"data.prompts row 1 \(prompt .b.\): rollout.max_tokens_field: column 'budget' holds"
    with pytest.raises(ValueError, match=said):
        load_run_rows(cfg, say=lambda line: None)


def test_a_per_row_budget_is_refused_for_episodes():
    with pytest.raises(ValueError, match="single-turn rollouts"):
        RolloutConfig(kind="multi_turn", max_tokens_field="budget", episode={"environment": "builtin:lookup"})


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_budget_that_is_not_finite_is_named_too(value):
    with pytest.raises(ValueError, match="not a positive whole number"):
        row_budget(RolloutConfig(max_tokens=64, max_tokens_field="budget"), {"budget": value})


def test_a_budget_in_a_nested_column_is_read_by_its_dotted_path():
    rollout = RolloutConfig(max_tokens=64, max_tokens_field="extra_info.budget")
    assert row_budget(rollout, {"extra_info": {"budget": 9}}) == 9 and row_budget(rollout, {"extra_info": {}}) == 64


def test_a_budget_column_no_row_has_is_named_with_the_columns_there_are(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "budget": 3}) + "\n" for p in "ab"))
    cfg = load_config(
        "configs/demo.yaml",
        [f"data.prompts={rows}", "rollout.max_tokens_field=budjet", "eval.fraction=0", "reward.function=builtin:echo"],
    )
    with pytest.raises(
        ValueError, match=r"no row of data.prompts has a value in 'budjet' \(the rows' columns: .*budget"
    ):
        load_run_rows(cfg, say=lambda line: None)
