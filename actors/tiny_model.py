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
MARKER = "tiny-model.json"  # written last; its presence means the directory is complete


def tiny_vocab() -> dict[str, int]:
    """Token -> id: the four special tokens first, then one id per character."""
    tokens = [PAD, BOS, EOS, UNK, *CHARACTERS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (WordLevel over single characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=tiny_vocab(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # newlines too
    core.decoder = decoders.Fuse()  # join characters back without spaces
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
) -> Path:
    """Write a randomly initialised Qwen2 model and its tokenizer to ``out_dir``.

    ``hidden_size / num_heads`` is the attention head dimension; vLLM's CPU attention
    accepts 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 or 512. Returns the directory.
    Re-running with the same arguments and no ``overwrite`` reuses a complete directory.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

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
    )
    marker = out / MARKER
    if marker.exists() and not overwrite and json.loads(marker.read_text()) == spec:
        return out
    head_dim = hidden_size // num_heads
    if head_dim * num_heads != hidden_size or head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
        raise ValueError(
            f"tiny model: hidden_size/num_heads = {hidden_size}/{num_heads} gives head_dim {head_dim}, "
            "which vLLM's CPU attention does not support; choose e.g. hidden_size=128, num_heads=4"
        )
    tokenizer = build_tokenizer()
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
    # A chat-free model: vLLM and the learner tokenise raw prompt text.
    marker.write_text(json.dumps(spec))
    return out
