"""The data layouts of the field, as a user's first run meets them: GSM8K's {question, answer "#### n"},
verl / DAPO parquet (a chat message list as the prompt, the answer nested in reward_model.ground_truth,
the data_source naming the reward), loaded with only field names set; and reward.by_source through the
real reward-parts code and worker processes. Fast: the parquet files are written here."""

from __future__ import annotations

import json
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.config import RewardConfig
from actors.reward_parts import load_parts, score_call
from actors.reward_pool import RewardPool
from actors.rewards import RewardSpecError, check_rewards, load_reward_function
from launch.config import ConfigError, load_config
from launch.data import load_run_rows, unmatched_sources
from queues.prompts import DatasetError

NATALIA = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?"
GSM8K_ROWS = [
    {"question": NATALIA, "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn all 48+24 = 72.\n#### 72"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?", "answer": "12/60 = 0.2 per minute.\n#### 10"},
]


def verl_row(index: int, source: str, messages: list[dict], truth: str | None) -> dict:
    """One row as verl's data preprocessing writes it (gsm8k.py, DAPO-Math-17k)."""
    reward_model = {"style": "rule", "ground_truth": truth}
    return {
        "data_source": source,
        "prompt": messages,
        "ability": "math",
        "reward_model": reward_model,
        "extra_info": {"split": "train", "index": index},
    }


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


VERL_ROWS = [
    verl_row(0, "openai/gsm8k", user(NATALIA), "72"),
    verl_row(1, "math_dapo", [{"role": "system", "content": "Reason step by step."}, *user("1 + 1?")], "2"),
    verl_row(2, "openai/gsm8k", [*user("3 x 3?"), {"role": "assistant", "content": "9"}], "9"),  # ends in its answer
    verl_row(3, "math_dapo", [{"role": "system", "content": "Be brief."}], "4"),  # malformed: no user message
    verl_row(4, "openai/gsm8k", user("2 + 2?"), None),  # malformed: no ground truth
    verl_row(5, "openai/gsm8k", user("5 - 1?"), "4"),
]


def write_parquet(path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def config(prompts: str, *overrides: str):
    return load_config(None, ["model.path=m", f"data.prompts={prompts}", "reward.function=builtin:math", *overrides])


def test_gsm8k_parquet_loads_with_the_prompt_field_alone_and_its_gold_reaches_builtin_math(tmp_path):
    cfg = config(write_parquet(tmp_path / "gsm8k.parquet", GSM8K_ROWS), "data.prompt_field=question")
    said = []
    rows, held = load_run_rows(cfg, said.append)
    assert [r["prompt"] for r in rows] == [r["question"] for r in GSM8K_ROWS] and held == [] and said == []
    assert [r["answer"] for r in rows] == [r["answer"] for r in GSM8K_ROWS]  # the whole solution, "#### n" last
    fn = load_reward_function(cfg.reward.function, cfg.reward)
    # 72 == 72 -> 1; 70 != 72 -> 0; the gold "... #### 10" read by what follows ####: 10 -> 1
    assert fn(["p"] * 3, ["so 72.\n#### 72", "#### 70", "#### 10"], [rows[0], rows[0], rows[1]]) == [1.0, 0.0, 1.0]


def test_verl_parquet_loads_the_prompt_message_list_and_a_dotted_answer_field(tmp_path):
    cfg = config(write_parquet(tmp_path / "verl.parquet", VERL_ROWS), "data.answer_field=reward_model.ground_truth")
    said = []
    rows, _ = load_run_rows(cfg, said.append)
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 5]  # rows 3 and 4 dropped, and named:
    assert said == [
        "data.prompts: skipped 2 of 6 rows: 1 rows with no user message (rows 3); "
        "1 rows without a 'reward_model.ground_truth' value (rows 4)"
    ]
    assert [r["prompt"] for r in rows] == [NATALIA, "1 + 1?", "3 x 3?", "5 - 1?"]  # the last user message
    assert [r["answer"] for r in rows] == ["72", "2", "9", "4"]
    assert rows[1]["messages"] == VERL_ROWS[1]["prompt"]  # the system message is kept for the chat template
    assert rows[2]["messages"] == user("3 x 3?")  # the final assistant answer is not part of the prompt
    for row, raw in zip(rows, [VERL_ROWS[i] for i in (0, 1, 2, 5)], strict=True):  # every other column rides along
        assert {k: row[k] for k in ("data_source", "ability", "reward_model", "extra_info")} == {
            k: raw[k] for k in ("data_source", "ability", "reward_model", "extra_info")
        }


def test_dotted_fields_reach_nested_prompts_and_the_eval_set(tmp_path):
    nested = [{"extra_info": {"question": f"q{i}"}, "reward_model": {"ground_truth": str(i)}} for i in range(4)]
    cfg = config(
        write_parquet(tmp_path / "nested.parquet", nested),
        "data.prompt_field=extra_info.question",
        "data.answer_field=reward_model.ground_truth",
        f"eval.prompts={write_parquet(tmp_path / 'verl.parquet', VERL_ROWS)}",
        "eval.prompt_field=prompt",
        "eval.answer_field=reward_model.ground_truth",
    )
    rows, held = load_run_rows(cfg, lambda line: None)
    assert [(r["prompt"], r["answer"]) for r in rows] == [("q0", "0"), ("q1", "1"), ("q2", "2"), ("q3", "3")]
    assert [r["answer"] for r in held] == ["72", "2", "9", "4"]


def test_a_dotted_path_missing_in_most_rows_is_one_line_naming_the_keys_found(tmp_path):
    path = write_parquet(tmp_path / "verl.parquet", VERL_ROWS)
    with pytest.raises(DatasetError) as err:
        load_run_rows(config(path, "data.answer_field=reward_model.answer"), print)
    message = str(err.value)
    assert "\n" not in message
    assert "'reward_model.answer' (data.answer_field) is missing in 6 of 6 rows" in message
    assert "'reward_model' holds the keys: ground_truth, style" in message
    with pytest.raises(DatasetError, match=r"no 'rm.ground_truth' column \(eval.answer_field\); its columns are: da"):
        load_run_rows(config(path, f"eval.prompts={path}", "eval.answer_field=rm.ground_truth"), print)
    with pytest.raises(DatasetError, match=r"'extra_info.split.name' \(data.prompt_field\) is missing in 6 of 6"):
        load_run_rows(config(path, "data.prompt_field=extra_info.split.name"), print)


REWARDS = """
def exact(prompt, completion, row):
    return 1.0 if completion.strip() == str(row["answer"]) else 0.0

def length(prompts, completions, rows):
    return [float(len(c)) for c in completions]

length.batched = True
"""


@pytest.fixture
def rewards_file(tmp_path) -> str:
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return str(path)


def by_source_config(rewards_file: str, **kw) -> RewardConfig:
    return RewardConfig(
        function=f"{rewards_file}:length",  # the default: sources not listed, rows without a data_source
        by_source={"openai/gsm8k": "builtin:math", "my_code": f"{rewards_file}:exact"},
        **kw,
    )


BY_SOURCE_ROWS = [
    {"data_source": "openai/gsm8k", "answer": "6"},
    {"data_source": "my_code", "answer": "print"},
    {"data_source": "math_dapo", "answer": "6"},  # not listed: the default
    {"answer": "6"},  # no data_source: the default
    {"data_source": "openai/gsm8k", "answer": "6"},
]
# what each row's function gives "#### 6": math 1.0; exact "#### 6" != "print" 0.0; length 6.0 (twice); math 1.0
BY_SOURCE_EXPECTED = [1.0, 0.0, 6.0, 6.0, 1.0]


def test_by_source_chooses_each_rows_function_and_unlisted_sources_use_the_default(rewards_file):
    (part,) = load_parts(by_source_config(rewards_file))
    assert part.name == "by_source"  # no one function's name is true of the part's value
    scores = score_call([part], ["p"] * 5, ["#### 6"] * 5, BY_SOURCE_ROWS)
    assert [s.parts for s in scores] == [[v] for v in BY_SOURCE_EXPECTED]
    assert all(s.error is None for s in scores)
    (math_only,) = load_parts(RewardConfig(function="builtin:math"))  # the same rows without by_source: all math
    all_math = [s.parts[0] for s in score_call([math_only], ["p"] * 5, ["#### 6"] * 5, BY_SOURCE_ROWS)]
    assert all_math == [1.0, 0.0, 1.0, 1.0, 1.0]  # 6 == 6, but math cannot read the answer "print": 0


def test_by_source_on_a_weighted_part_leaves_the_other_parts_alone(rewards_file):
    cfg = RewardConfig(
        functions=[
            {"function": "builtin:math", "by_source": {"my_code": f"{rewards_file}:exact"}, "name": "correct"},
            {"function": f"{rewards_file}:length", "weight": 0.1},
        ]
    )
    parts = load_parts(cfg)
    assert [(p.name, p.weight) for p in parts] == [("correct", 1.0), ("length", 0.1)]
    rows = [{"data_source": "my_code", "answer": "6"}, {"data_source": "openai/gsm8k", "answer": "7"}]
    scores = score_call(parts, ["p"] * 2, ["6", "#### 7"], rows)
    # row 0: exact "6" == "6" -> 1, length 1;  row 1: math 7 == 7 -> 1, length 6
    assert [s.parts for s in scores] == [[1.0, 1.0], [1.0, 6.0]]


def test_by_source_scores_in_the_reward_worker_processes(rewards_file):
    pool = RewardPool(by_source_config(rewards_file, timeout_s=60))
    try:
        pool.wait_ready()
        scores = pool.score(["p"] * 5, ["#### 6"] * 5, BY_SOURCE_ROWS)
    finally:
        pool.close()
    assert [s.parts for s in scores] == [[v] for v in BY_SOURCE_EXPECTED] and all(s.error is None for s in scores)


def test_by_source_is_checked_before_the_run(rewards_file):
    check_rewards(by_source_config(rewards_file))
    bad = RewardConfig(function="builtin:math", by_source={"my_code": f"{rewards_file}:missing"})
    with pytest.raises(RewardSpecError, match="has no function 'missing'; functions defined there: exact, length"):
        check_rewards(bad)
    with pytest.raises(RewardSpecError, match="unknown built-in task 'maths'"):
        check_rewards(RewardConfig(function="builtin:math", by_source={"a": "builtin:maths"}))
    base = ["model.path=m", "data.prompts=p.jsonl"]
    with pytest.raises(ConfigError, match="with reward.functions put by_source on the entry it applies to"):
        load_config(None, base + ["reward.functions=[{function: builtin:math}]", "reward.by_source={a: b.py:f}"])
    with pytest.raises(ConfigError, match="by_source of 'builtin:math' is empty"):
        load_config(None, base + ["reward.function=builtin:math", "reward.by_source={}"])
    with pytest.raises(ConfigError, match="the reward model .* cannot be chosen by data_source"):
        load_config(None, base + ["reward.function=builtin:math", "reward.by_source={a: model}"])


def test_a_by_source_entry_no_row_has_is_said_at_load(tmp_path):
    path = write_parquet(tmp_path / "verl.parquet", VERL_ROWS)
    cfg = config(path, "data.answer_field=reward_model.ground_truth", "reward.by_source={openai/gsm8k: builtin:math}")
    said = []
    load_run_rows(cfg, said.append)
    assert not any("by_source" in line for line in said)
    cfg = config(path, "data.answer_field=reward_model.ground_truth", "reward.by_source={gsm8k: builtin:math}")
    line = unmatched_sources(cfg, load_run_rows(cfg, lambda line: None)[0])
    assert line.startswith("by_source of the reward lists data_source 'gsm8k', which no row has")
    assert line.endswith("the rows have: math_dapo, openai/gsm8k")


@pytest.mark.parametrize("suffix,body,line", [
    (".jsonl", b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n', 2),
    (".csv", b"prompt,answer\ncaf\xe9,2\n", 2),
])  # fmt: skip
def test_a_file_that_is_not_utf8_is_one_line_naming_its_line(tmp_path, suffix, body, line):
    # pyarrow read the bad bytes and failed later in a 42-line traceback (issue 26, item 9)
    from queues.sources import load_table

    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(body)
    with pytest.raises(DatasetError) as err:
        load_table(str(path), "train", None)
    assert str(err.value) == (
        f"data.prompts {path} line {line} is not UTF-8 text (byte 0xe9 cannot be decoded); save the file as UTF-8 "
        "(for example: iconv -f latin1 -t utf-8 OLD > NEW)"
    )


def test_a_broken_line_of_a_gsm8k_file_is_named_in_one_line_whatever_the_prompt_field(tmp_path, capfd):
    # with data.prompt_field=question the fallback reader stopped at line 1 ("has no 'prompt' field")
    # and the datasets library printed its own "Failed to load JSON" line before ours
    from queues.prompts import DatasetError
    from queues.sources import load_table

    lines = [json.dumps({"question": f"What is {i}+1?", "answer": f"#### {i + 1}"}) for i in range(12)]
    lines[9] = '{"question": "broken", "answer" "#### 3"}'
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"gsm.jsonl line 10 is not valid JSON .*; fix or remove that line$"):
        load_table(str(path), "train", None)
    out, err = capfd.readouterr()
    assert "Failed to load JSON" not in out + err
