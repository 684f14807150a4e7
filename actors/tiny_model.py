"""Build a tiny causal LM and a character-level tokenizer locally, with no model hub.

The demo and the tests train this model: a 2-layer Qwen2 (the architecture of real
Qwen2/Qwen2.5 checkpoints, so vLLM, transformers and DeepSpeed treat it exactly like
a real model) with random weights from a fixed seed, and a tokenizer that maps each
character to one token. The result is an ordinary Hugging Face directory
(``config.json``, ``model.safetensors``, ``tokenizer.json``) that any code taking a
model id or path loads unchanged.

The demo's tokenizer knows only the 64 characters its tasks use (a capital or a quote is lost).
``chat=True`` builds the same model with a tokenizer shaped like a real chat model's instead
(``tandem tiny-model --chat``): one token per byte, so any text round-trips, Qwen's special tokens
and a ChatML chat template that renders tools in the hermes format (as Qwen2.5's does), and ``<|im_end|>``
as EOS, so a completion ends where the template's assistant turn ends. Use it to try a real data set's
prompts, or an environment's tools, end to end on the CPU.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Every character a built-in task or a test prompt can use; one token each.
# The last seven (after "#") fill the 64-entry table: chat markup and ``\boxed{}`` answers.
CHARACTERS = string.digits + string.ascii_lowercase + " +-*=:>?,.!()[]#<{}/\\|\n"
MARKER = "tiny-model.json"  # written last; its presence means the directory is complete
# A chat template in the tiny vocabulary (the math example): "<s>system\n<u>question\n<a>" + answer.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
# The chat tokenizer's special tokens, named as in Qwen2.5's: the end of text (also the padding) and
# the two markers of a ChatML turn. <|im_end|> ends a turn, so it is the chat model's EOS.
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML as Qwen2.5's template writes it, without its default system message (the tiny model's
# context is short): every turn is "<|im_start|>role\ncontent<|im_end|>\n"; a generation prompt opens
# the assistant's turn. Tools are rendered in the hermes format Qwen2.5 uses (what actors/tool_calls.py
# parses), compactly: one system turn (the system message's text, then the tools' JSON schemas inside
# <tools></tools> and how to call one), a tool's result as a user turn inside <tool_response>, an assistant
# turn's tool_calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Each tool result is its own
# turn, so appending a message never rewrites the ones before it (what an episode needs).
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools you may call:\\n<tools>' }}"
    "{%- for tool in tools %}{%- set schema = tool.function if tool.function is defined else tool %}"
    "{{- '\\n' + (schema | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"  # rendered with the tools above
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls %}{%- set f = call.function if call.function is defined else call %}"
    "{{- ('\\n' if message['content'] or not loop.first else '') + '<tool_call>{\"name\": ' + (f.name | tojson)"
    " + ', \"arguments\": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_level(char: str) -> str:
    """The symbol byte-level BPE uses for a one-byte character (printable ASCII is itself; ' ' is 'Ġ')."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()[ord(char)]


def tiny_vocab() -> dict[str, int]:
    """Token -> id: the four special tokens first, then one id per character (as its byte-level symbol)."""
    tokens = [PAD, BOS, EOS, UNK, *(_byte_level(c) for c in CHARACTERS)]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: byte-level BPE with no merges, so every character is
    one token. Built this way because transformers loads a Qwen2 model's tokenizer as ``Qwen2Tokenizer``
    whatever its file says, and that class rebuilds a byte-level BPE from the vocabulary: a plain
    WordLevel tokenizer would silently lose its spaces and newlines when reloaded (vLLM loads it so too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab=tiny_vocab(), merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


def byte_vocab() -> dict[str, int]:
    """Token -> id of the chat tokenizer: the 256 byte-level symbols (ids 0-255, by byte value), then
    the special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = [bytes_to_unicode()[b] for b in range(256)]
    return {tok: i for i, tok in enumerate([*symbols, END_OF_TEXT, IM_START, IM_END])}


def build_chat_tokenizer():
    """A byte-level ``PreTrainedTokenizerFast`` that round-trips any text (every UTF-8 byte is a token;
    BPE with no merges), with ChatML's special tokens, ``<|im_end|>`` as EOS and ``<|endoftext|>`` as
    padding (as Qwen2.5-Instruct has them) and ``CHATML_TEMPLATE`` as its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab=byte_vocab(), merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (END_OF_TEXT, IM_START, IM_END)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=END_OF_TEXT, clean_up_tokenization_spaces=False
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_positions: int = 512,
    seed: int = 0,
    overwrite: bool = False,
    chat_template: str | None = None,
    chat: bool = False,
) -> Path:
    """Write a randomly initialised Qwen2 model and its tokenizer to ``out_dir``.

    ``hidden_size / num_heads`` is the attention head dimension; vLLM's CPU attention
    accepts 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 or 512. Returns the directory.
    Re-running with the same arguments and no ``overwrite`` reuses a complete directory.
    ``chat``: the byte-level chat tokenizer (``build_chat_tokenizer``; ``chat_template`` replaces its
    ChatML template when given) instead of the demo's character-level one.
    """
    out = Path(out_dir)
    spec = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_positions=max_positions,
        seed=seed,
        characters=CHARACTERS,  # a directory built with an older tokenizer is rebuilt
        chat_template=chat_template,
    )
    if chat:  # only then: a demo model built before ``chat`` existed is still reused
        spec["chat"] = True
        if chat_template is None:  # a chat directory built before its template rendered tools is rebuilt
            spec["tools"] = "hermes"
    marker = out / MARKER
    if marker.exists() and not overwrite and json.loads(marker.read_text()) == spec:
        return out  # before the imports below: they cost seconds of every run's start-up
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    head_dim = hidden_size // num_heads
    if head_dim * num_heads != hidden_size or head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
        raise ValueError(
            f"tiny model: hidden_size/num_heads = {hidden_size}/{num_heads} gives head_dim {head_dim}, "
            "which vLLM's CPU attention does not support; choose e.g. hidden_size=128, num_heads=4"
        )
    if chat:
        tokenizer, vocab = build_chat_tokenizer(), byte_vocab()
        tokenizer.chat_template = chat_template or CHATML_TEMPLATE
        bos, eos, pad = vocab[END_OF_TEXT], vocab[IM_END], vocab[END_OF_TEXT]  # bos as in Qwen2.5's config
    else:
        tokenizer, vocab = build_tokenizer(), tiny_vocab()
        tokenizer.chat_template = chat_template
        bos, eos, pad = vocab[BOS], vocab[EOS], vocab[PAD]
    config = Qwen2Config(
        vocab_size=64 * ((len(vocab) + 63) // 64),  # pad the table to a multiple of 64
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,  # save_pretrained copies these into generation_config.json, which vLLM reads
        pad_token_id=pad,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Without a chat template (the default) prompts go to the model as raw text.
    marker.write_text(json.dumps(spec))
    return out
