"""The tiny chat model (``tandem tiny-model --chat``): its tokenizer gives any text back unchanged, its
chat template is ChatML with a system message and a generation prompt, and it stops where the
template's assistant turn ends (EOS = <|im_end|> in the tokenizer, config and generation config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.tiny_model import CHARACTERS, IM_END, MARKER, build_tiny_model

TEXT = 'Tom said "Hi!" — 3 × 4 = 12 ünïcode'


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat", chat=True)


def test_any_text_round_trips_through_the_chat_tokenizer(chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT.encode())  # one token per UTF-8 byte: "—" is 3 bytes, "×" and "ü" 2
    assert tok.decode(ids) == TEXT
    # Every byte, control characters and a tab included, comes back too.
    every = bytes(range(256)).decode("latin-1") + "\t\n  two spaces\r\n"
    assert tok.decode(tok(every, add_special_tokens=False)["input_ids"]) == every


def test_the_demo_tokenizer_is_unchanged_and_still_loses_capitals(tiny_model_dir):
    # The reason --chat exists: the demo's 64-character vocabulary has no capitals or quotes.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.decode(tok("Tom")["input_ids"], skip_special_tokens=True) == "om"
    assert "T" not in CHARACTERS and '"' not in CHARACTERS
    # A demo directory built before --chat existed keeps its marker, so it is reused, not rebuilt.
    assert "chat" not in json.loads((Path(tiny_model_dir) / MARKER).read_text())


def test_the_chat_template_renders_system_user_and_a_generation_prompt(chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    # The special tokens are one token each, never split into bytes.
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(tok.eos_token_id) == 2


def test_eos_is_the_templates_end_of_turn_everywhere(chat_model):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(chat_model)
    end = tok.convert_tokens_to_ids(IM_END)
    assert tok.eos_token == IM_END and tok.eos_token_id == end
    assert AutoConfig.from_pretrained(chat_model).eos_token_id == end
    assert GenerationConfig.from_pretrained(chat_model).eos_token_id == end
    # An assistant turn the template closes ends with that id (then its newline).
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    ids = tok.apply_chat_template(chat, tokenize=True)["input_ids"]
    assert ids[-2:] == [end, tok.convert_tokens_to_ids("Ċ")]
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id != end


def test_the_learner_bans_the_tokens_the_engine_stops_on(tmp_path):
    # vLLM bans its stop tokens before rollout.min_tokens: the tokenizer's EOS and the generation
    # config's eos_token_id(s); the learner must ban the same ones (learner/worker.py stop_token_ids)
    from transformers import AutoTokenizer, GenerationConfig

    from learner.worker import stop_token_ids

    path = build_tiny_model(tmp_path / "chat", chat=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert stop_token_ids(str(path), tokenizer) == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    config = GenerationConfig.from_pretrained(path)
    config.eos_token_id = [config.eos_token_id, 0]  # a model that stops on two tokens
    config.save_pretrained(path)
    assert stop_token_ids(str(path), tokenizer) == tuple(sorted({0, tokenizer.eos_token_id}))
