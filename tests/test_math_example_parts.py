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


def test_a_warm_start_to_a_target_runs_until_it_converges_and_fails_in_one_line_when_it_cannot(tmp_path):
    """With ``target_loss`` the step count is a limit: the rate stays up until the mean loss of the last
    50 steps is below the target, then decays over a settling tenth (at least 50 steps); a limit reached
    first raises with where the loss stopped. Progress is said every ``every`` steps."""
    import pytest

    from learner.sft import WarmStartFailed, warm_start

    model = build_tiny_model(tmp_path / "m")
    tok = build_tokenizer()
    pairs = [(tok("copy 7:")["input_ids"], tok("7")["input_ids"])] * 4  # one pair: learnt in a few dozen steps
    said = []
    result = warm_start(model, tmp_path / "sft", pairs, steps=500, batch_size=4, target_loss=0.05, every=25,
                        progress=lambda step, loss: said.append((step, loss)))  # fmt: skip
    assert result.converged_at is not None and result.steps == result.converged_at + 50  # settled 50 more
    assert result.steps < 500 and said[0][0] == 25 and said[-1][1] < 0.05
    assert (tmp_path / "sft" / "config.json").is_file()
    with pytest.raises(WarmStartFailed, match=r"did not converge: mean loss \d\.\d{3} after 60 steps, target 1e-09"):
        warm_start(model, tmp_path / "never", pairs, steps=60, batch_size=4, target_loss=1e-9)
    assert not (tmp_path / "never").exists()  # nothing half-trained is saved


def test_an_example_whose_warm_start_does_not_converge_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """`tandem example tools --sft-steps 60`: 60 steps cannot reach the target; one line, rc 2, no run."""
    from launch.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))  # the example's model cache is under ~/.cache/tandem
    assert main(["example", "tools", "--sft-steps", "60"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tandem: error: the warm-start did not converge: mean loss ")
    assert "after 60 steps, target 0.02; allow more steps (`tandem example NAME --sft-steps N`)" in err[-1]
    assert not any("Traceback" in line for line in err) and not (tmp_path / "runs").exists()
