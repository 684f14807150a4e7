"""The tiny chat model (``tandem tiny-model --chat``): its tokenizer gives any text back unchanged, its
chat template is ChatML with a system message and a generation prompt (exactly plain ChatML without tools;
with tools, the hermes format the tool-call parser reads, appending turns as an episode needs), and it
stops where the template's assistant turn ends (EOS = <|im_end|> in the tokenizer, config and generation
config)."""

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


# The chat template before it rendered tools (plain ChatML): without tools the template must render exactly so,
# since models built and trained with it (and their prompts' token ids) depend on it.
PLAIN_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LOOKUP_SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The code of a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "code of k7?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "lookup", "arguments": {"key": "k7"}}}]},
    {"role": "tool", "content": "512"},
    {"role": "assistant", "content": "Two more.", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": '{"key": "k8"}'}},  # OpenAI: a JSON string
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "k9"}}},
    ]},
    {"role": "tool", "content": "Error: no key 'k8'"},
    {"role": "tool", "content": "003"},
    {"role": "assistant", "content": "512"},
]  # fmt: skip


def test_without_tools_the_chat_template_renders_plain_chatml(chat_model):
    from transformers import AutoTokenizer

    from actors.tiny_model import build_chat_tokenizer

    new, old = AutoTokenizer.from_pretrained(chat_model), build_chat_tokenizer()
    old.chat_template = PLAIN_CHATML
    conversations = [
        [{"role": "user", "content": TEXT}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
        [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": ""}],
    ]
    for chat in conversations:
        for generation_prompt in (True, False):
            kwargs = dict(add_generation_prompt=generation_prompt, tokenize=False)
            assert new.apply_chat_template(chat, **kwargs) == old.apply_chat_template(chat, **kwargs)
            assert new.apply_chat_template(chat, tools=[], **kwargs) == old.apply_chat_template(chat, **kwargs)


def test_the_chat_template_renders_tools_in_the_hermes_format_the_parser_reads(chat_model):
    from transformers import AutoTokenizer

    from actors.tool_calls import parse_hermes

    tok = AutoTokenizer.from_pretrained(chat_model)
    text = tok.apply_chat_template(TOOL_CONVERSATION, tools=[LOOKUP_SCHEMA], tokenize=False)
    schema = json.dumps(LOOKUP_SCHEMA["function"])
    assert text.startswith(
        f"<|im_start|>system\nBe brief.\n\nTools you may call:\n<tools>\n{schema}\n</tools>\n"
        'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
        "<|im_start|>user\ncode of k7?<|im_end|>\n"
    )
    assert text.count("<|im_start|>system") == 1  # the system message is rendered once, with the tools
    turns = text.split("<|im_start|>")[1:]
    assert turns[2] == 'assistant\n<tool_call>{"name": "lookup", "arguments": {"key": "k7"}}</tool_call><|im_end|>\n'
    assert turns[3] == "user\n<tool_response>512</tool_response><|im_end|>\n"
    # what the model is shown as its own calls is what actors/tool_calls.py reads back from a turn
    assert parse_hermes(turns[4]) == ([("lookup", {"key": "k8"}), ("lookup", {"key": "k9"})], None)
    assert turns[4].startswith("assistant\nTwo more.\n<tool_call>")
    assert turns[5:] == [
        "user\n<tool_response>Error: no key 'k8'</tool_response><|im_end|>\n",  # each result its own turn
        "user\n<tool_response>003</tool_response><|im_end|>\n",
        "assistant\n512<|im_end|>\n",
    ]
    # Without a system message the tools get a system turn of their own.
    alone = tok.apply_chat_template(TOOL_CONVERSATION[1:2], tools=[LOOKUP_SCHEMA], tokenize=False)
    assert alone.startswith("<|im_start|>system\nTools you may call:\n<tools>\n")


def test_the_chat_template_with_tools_appends_turns_as_an_episode_needs(chat_model):
    from transformers import AutoTokenizer

    from actors.episode import TurnRenderer
    from actors.episode_prompt import tools_problem

    tok = AutoTokenizer.from_pretrained(chat_model)
    for n in range(1, len(TOOL_CONVERSATION)):  # rendering one more message never rewrites the ones before
        before = tok.apply_chat_template(TOOL_CONVERSATION[:n], tools=[LOOKUP_SCHEMA], tokenize=False)
        after = tok.apply_chat_template(TOOL_CONVERSATION[: n + 1], tools=[LOOKUP_SCHEMA], tokenize=False)
        assert after.startswith(before), n
    # the actor's start-up probe (MultiTurn.start) and an episode's delta, with the tools given
    renderer = TurnRenderer(tok, [LOOKUP_SCHEMA])
    delta = renderer.delta([tok.eos_token_id], [{"role": "tool", "content": "512"}])
    opening = "<|im_start|>assistant\n"
    assert tok.decode(delta) == f"\n<|im_start|>user\n<tool_response>512</tool_response><|im_end|>\n{opening}"
    assert tools_problem(tok, [LOOKUP_SCHEMA], "builtin:lookup", "the template") is None  # it shows them
