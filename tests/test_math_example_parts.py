"""The math example's parts, fast: the arith rows and their reward, the tiny tokenizer surviving a reload
(spaces and newlines), the chat template, and the supervised warm-start lowering its loss."""

from __future__ import annotations

from actors.arith_task import arith_reward, arith_rows
from actors.tiny_model import CHARACTERS, TINY_CHAT_TEMPLATE, build_tiny_model, build_tokenizer


def test_arith_rows_are_worked_sums_ending_in_a_box():
    rows = arith_rows(50, seed=3)
    assert rows == arith_rows(50, seed=3) and rows != arith_rows(50, seed=4)
    for row in rows:
        terms = [int(t) for t in row["prompt"].split("+")]
        assert 6 <= len(terms) <= 10 and row["answer"] == str(sum(terms))
        *lines, box = row["solution"].split("\n")
        assert box == f"\\boxed{{{sum(terms)}}}" and len(lines) == len(terms) - 1
        total = terms[0]
        for line, term in zip(lines, terms[1:]):
            assert line == f"{total}+{term}={total + term}"
            total += term
        assert set(row["solution"] + row["prompt"]) <= set(CHARACTERS)
        assert arith_reward(row["prompt"], row["solution"], row) == 1.0
        assert arith_reward(row["prompt"], "\\boxed{0}", row) == 0.0 and arith_reward("", "", row) == 0.0
        assert arith_reward("", f"\\boxed{{{row['answer']}}} then {row['answer']}1", row) == 1.0  # the box decides


def test_the_tiny_tokenizer_reloads_id_for_id(tmp_path):
    # transformers loads a qwen2 directory's tokenizer as Qwen2Tokenizer (byte-level BPE) whatever it is
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path / "m", chat_template=TINY_CHAT_TEMPLATE)
    text = "next 4: 7+4=11\n11+3=14\n\\boxed{14}"
    built, loaded = build_tokenizer(), AutoTokenizer.from_pretrained(model)
    assert loaded(text)["input_ids"] == built(text)["input_ids"] and len(built(text)["input_ids"]) == len(text)
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    chat = [{"role": "user", "content": "1+2"}]
    assert loaded.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == "<u>1+2\n<a>"


def test_warm_start_lowers_the_loss_and_saves_a_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from learner.sft import warm_start

    model = build_tiny_model(tmp_path / "m")
    tok = build_tokenizer()
    rows = arith_rows(64, seed=0)
    pairs = [(tok(r["prompt"])["input_ids"], tok(r["solution"])["input_ids"]) for r in rows]
    result = warm_start(model, tmp_path / "sft", pairs, steps=30, batch_size=8)
    assert result.steps == 30 and result.last_loss < result.first_loss - 1.0
    AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
