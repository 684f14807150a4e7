"""Build a tiny causal LM and a character-level tokenizer locally, with no model hub.

The demo and the tests train this model: a 2-layer Qwen2 (the architecture of real
Qwen2/Qwen2.5 checkpoints, so vLLM, transformers and DeepSpeed treat it exactly like
a real model) with random weights from a fixed seed, and a tokenizer that maps each
character to one token. The result is an ordinary Hugging Face directory
(``config.json``, ``model.safetensors``, ``tokenizer.json``) that any code taking a
model id or path loads unchanged.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Every character a built-in task or a test prompt can use; one token each.
# The last seven (after "#") fill the 64-entry table: chat markup and ``\boxed{}`` answers.
CHARACTERS = string.digits + string.ascii_lowercase + " +-*=:>?,.!()[]#<{}/\\|\n"
MARKER = "tiny-model.json"
# A chat template in the tiny vocabulary (the math example): "<s>system\n<u>question\n<a>" + answer.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)  # written last; its presence means the directory is complete


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
) -> Path:
    """Write a randomly initialised Qwen2 model and its tokenizer to ``out_dir``.

    ``hidden_size / num_heads`` is the attention head dimension; vLLM's CPU attention
    accepts 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 or 512. Returns the directory.
    Re-running with the same arguments and no ``overwrite`` reuses a complete directory.
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
    tokenizer = build_tokenizer()
    tokenizer.chat_template = chat_template
    vocab = tiny_vocab()
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
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[PAD],
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
