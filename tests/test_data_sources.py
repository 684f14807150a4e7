"""Prompt data in every form a user brings it (read with ``datasets``), mapped to Tandem rows; chat
templates rendered to the token ids the sampler gets; the held-out set. Fast: files made here."""

from __future__ import annotations

import json

import pytest

from launch.config import load_config
from launch.data import load_run_rows
from queues.prompts import DatasetError
from queues.sources import Fields, read_rows, split_holdout
from queues.templates import PromptRenderer

GSM8K_LIKE = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Half of 18?", "answer": "18 / 2 = 9\n#### 9"},
    {"question": "5 times 6?", "answer": "#### 30"},
]
GSM8K = Fields(prompt="question", answer="answer")


def write_all_forms(tmp_path, records):
    import datasets

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "d.json").write_text(json.dumps(records))
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "saved"))
    return ["d.jsonl", "d.json", "d.parquet", "d.csv", "saved"]


def test_every_form_reads_to_the_same_rows(tmp_path):
    for name in write_all_forms(tmp_path, GSM8K_LIKE):
        loaded = read_rows(str(tmp_path / name), GSM8K)
        assert [r["prompt"] for r in loaded.rows] == [r["question"] for r in GSM8K_LIKE], name
        assert [r["answer"] for r in loaded.rows] == [r["answer"] for r in GSM8K_LIKE], name
        assert loaded.rows[0]["question"] == GSM8K_LIKE[0]["question"]  # every column rides along
    test = read_rows(str(tmp_path / "saved"), GSM8K, split="test")
    assert [r["prompt"] for r in test.rows] == [GSM8K_LIKE[0]["question"]]
    with pytest.raises(DatasetError, match="has no split 'validation'; its splits are: train, test"):
        read_rows(str(tmp_path / "saved"), GSM8K, split="validation")


def test_a_dataset_folder_of_data_files_loads_by_split(tmp_path):
    folder = tmp_path / "repo" / "data"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_LIKE))
    (folder / "test.jsonl").write_text(json.dumps(GSM8K_LIKE[2]) + "\n")
    assert len(read_rows(str(tmp_path / "repo"), GSM8K).rows) == 3
    assert read_rows(str(tmp_path / "repo"), GSM8K, split="test").rows[0]["prompt"] == "5 times 6?"


def test_chat_rows_keep_their_conversation_and_drop_a_final_answer(tmp_path):
    records = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": "4"},
        {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}], "answer": "6"},
    ]
    rows = read_rows(str(tmp_path / write_all_forms(tmp_path, records)[2]), Fields()).rows
    assert rows[0]["prompt"] == "2+2?" and len(rows[0]["messages"]) == 2
    assert rows[1]["messages"] == [{"role": "user", "content": "3+3?"}]  # the prompt is what comes before it


def test_unusable_rows_are_counted_and_named_at_load(tmp_path):
    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(8)]
    records[2] = {"prompt": "", "answer": "2"}
    records[5] = {"prompt": None, "answer": "5"}
    records[6] = {"messages": "not a list", "answer": "6"}
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    said = []
    loaded = read_rows(str(tmp_path / "p.jsonl"), Fields(), say=said.append)
    assert [r["answer"] for r in loaded.rows] == ["0", "1", "3", "4", "7"]
    (line,) = said
    assert line.startswith("data.prompts: skipped 3 of 8 rows: ")
    assert "1 rows whose 'prompt' is not a non-empty string (rows 2)" in line
    assert "rows without a 'prompt' field (rows 5)" in line
    assert "1 rows with a 'messages' value that is not a non-empty list (rows 6)" in line


def test_a_wrong_column_mapping_names_the_columns(tmp_path):
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_LIKE))
    with pytest.raises(DatasetError, match="no 'prompt' or 'messages' column; its columns are: question, answer"):
        read_rows(str(tmp_path / "g.jsonl"), Fields())
    with pytest.raises(DatasetError, match="no 'solution' column"):
        read_rows(str(tmp_path / "g.jsonl"), Fields(prompt="question", answer="solution"))


def test_missing_files_unknown_suffixes_and_unreachable_names_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(str(tmp_path / "nope.parquet"), Fields())
    (tmp_path / "p.txt").write_text("hello")
    with pytest.raises(DatasetError, match="suffix '.txt'"):
        read_rows(str(tmp_path / "p.txt"), Fields())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the libraries read those variables when first imported: set what they read, or the lookup waits
    # out its network retries (24 s here) before failing the same way
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(DatasetError) as err:
        read_rows("openai/gsm8k", Fields(prompt="question"), subset="main")
    message = str(err.value)
    assert "\n" not in message and "data.prompts openai/gsm8k could not be loaded" in message
    assert "local path" in message


def test_broken_jsonl_still_names_the_line(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(DatasetError, match="line 2 is not valid JSON"):
        read_rows(str(tmp_path / "p.jsonl"), Fields())


def _cfg(tmp_path, *overrides):
    return load_config(
        None,
        [
            "model.path=m",
            f"data.prompts={tmp_path / 'g.jsonl'}",
            "data.prompt_field=question",
            "reward.function=builtin:echo",
            *overrides,
        ],
    )


def test_held_out_rows_by_fraction_or_file(tmp_path):
    records = [{"question": f"q{i}", "answer": str(i)} for i in range(40)]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "e.jsonl").write_text(json.dumps({"question": "held", "answer": "1"}) + "\n")
    train, held = load_run_rows(_cfg(tmp_path, "eval.fraction=0.25"), print)
    assert len(train) == 30 and len(held) == 10
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held})
    assert load_run_rows(_cfg(tmp_path, "eval.fraction=0.25"), print) == (train, held)  # seeded
    assert load_run_rows(_cfg(tmp_path, "eval.fraction=0.25", "run.seed=1"), print)[1] != held
    train, held = load_run_rows(_cfg(tmp_path, f"eval.prompts={tmp_path / 'e.jsonl'}"), print)
    assert len(train) == 40 and [r["prompt"] for r in held] == ["held"]
    assert load_run_rows(_cfg(tmp_path), print)[1] == []
    (tmp_path / "aime.jsonl").write_text(json.dumps({"problem": "p", "solution": "7"}) + "\n")  # its own columns
    own = ["eval.prompt_field=problem", "eval.answer_field=solution", f"eval.prompts={tmp_path / 'aime.jsonl'}"]
    assert [(r["prompt"], r["answer"]) for r in load_run_rows(_cfg(tmp_path, *own), print)[1]] == [("p", "7")]
    assert split_holdout([{"prompt": "a"}, {"prompt": "b"}], 0.9, 0)[0]  # at least one row stays to train on


TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>"
    "{% endif %}"
)


def tokenizer(template: str | None = TEMPLATE):
    from actors.tiny_model import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def test_auto_renders_with_the_template_and_token_ids_equal_apply_chat_template():
    tok = tokenizer()
    renderer = PromptRenderer(tok, "auto", system_prompt="be exact")
    row = {"prompt": "1+2", "answer": "3"}
    chat = [{"role": "system", "content": "be exact"}, {"role": "user", "content": "1+2"}]
    expected = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert renderer.uses_template and renderer.token_ids(row) == list(expected)
    assert renderer.text(row) == "<s>be exact<u>1+2<a>"
    assert tok.decode(renderer.token_ids(row)) == "<s>be exact<u>1+2<a>"
    rows = [row, {"prompt": "x", "messages": [{"role": "user", "content": "9-1"}]}]
    assert renderer.token_ids_many(rows)[1] == renderer.token_ids(rows[1])  # batched == one at a time


def test_none_and_no_template_send_the_raw_text_as_vllm_tokenises_it():
    for renderer in (PromptRenderer(tokenizer(), "none"), PromptRenderer(tokenizer(None), "auto")):
        assert not renderer.uses_template
        assert renderer.token_ids({"prompt": "next 4:"}) == renderer.tokenizer("next 4:")["input_ids"]
    with pytest.raises(DatasetError, match="row 1 is a chat .* data.chat_template is none"):
        PromptRenderer(tokenizer(), "none").token_ids_many([{"prompt": "a"}, {"prompt": "b", "messages": [{}]}])
    with pytest.raises(DatasetError, match="tokenizer has no chat template"):
        PromptRenderer(tokenizer(None), "auto").token_ids({"prompt": "b", "messages": [{}]})
    assert PromptRenderer(tokenizer(None), "auto", "sys").text({"prompt": "q"}) == "sys\n\nq"


def test_a_jinja_file_overrides_the_tokenizers_template(tmp_path):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert PromptRenderer(tokenizer(), str(tmp_path / "t.jinja")).text({"prompt": "7"}) == "[7]"
    with pytest.raises(DatasetError, match="not 'auto', 'none' or an existing .jinja file"):
        PromptRenderer(tokenizer(), str(tmp_path / "missing.jinja"))
