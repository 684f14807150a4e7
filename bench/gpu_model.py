"""A random-init model of Qwen2.5-0.5B's shape, built locally (no model hub), for ``bench/gpu_smoke.sh``.

The architecture and every size are Qwen2.5-0.5B's (24 layers, hidden 896, 14 heads / 2 KV heads,
head_dim 64, intermediate 4864, vocabulary 151,936, tied embeddings, 32K positions, rope theta 1e6),
so vLLM, transformers and DeepSpeed do the work a real 0.5B checkpoint costs; the weights are random
(fixed seed). The tokenizer is Tandem's character-level one (``actors/tiny_model.py``): it covers the
first ids of the table only, as Qwen's own tokenizer (151,665 tokens) covers part of its 151,936 rows.
A sampled id past the tokenizer decodes to nothing (vLLM and transformers skip it), so a random model
writes mostly empty text and runs to ``rollout.max_tokens``: steady, full-length generation.

    python bench/gpu_model.py /tmp/qwen05-shape                 # the 0.5B shape (bfloat16)
    python bench/gpu_model.py /tmp/small --tiny-shape --dtype float32   # 2 layers, hidden 128: CPU checks
    python bench/gpu_model.py --describe [--layers 4]          # the shape as JSON; builds nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

MARKER = "gpu-model.json"  # written last: a complete directory with this spec is reused


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Qwen2 decoder (the fields of ``transformers.Qwen2Config`` they set)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_positions: int
    rope_theta: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def parameters(self) -> int:
        """Parameter count: embeddings (+ an untied head), and per layer q/k/v (with biases), o, the MLP, two norms."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k and v (+biases), o
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


QWEN25_05B = ModelShape(
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    vocab_size=151936,
    max_positions=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)
# For checks on a CPU: the same vocabulary and head_dim (64, which vLLM's CPU attention accepts), tiny body.
TINY_SHAPE = dataclasses.replace(QWEN25_05B, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                                 num_kv_heads=1)  # fmt: skip


def build_model(out_dir: str | Path, shape: ModelShape, dtype: str = "bfloat16", seed: int = 0,
                device: str = "auto") -> Path:  # fmt: skip
    """Write a random-init Qwen2 of ``shape`` in ``dtype`` and Tandem's tokenizer to ``out_dir``; reuse a
    complete directory built with the same arguments. ``device``: where the weights are initialised
    (``auto``: a CUDA GPU when there is one, much faster than the CPU at 0.5B)."""
    out = Path(out_dir)
    spec = {"shape": dataclasses.asdict(shape), "dtype": dtype, "seed": seed}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from actors.tiny_model import BOS, EOS, PAD, build_tokenizer, tiny_vocab

    vocab = tiny_vocab()
    if len(vocab) > shape.vocab_size:
        raise ValueError(f"vocab_size {shape.vocab_size} is smaller than the tokenizer's {len(vocab)} tokens")
    config = Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        max_window_layers=shape.num_layers,
        rope_theta=shape.rope_theta,  # transformers 5 moves it into rope_parameters
        tie_word_embeddings=shape.tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[PAD],
    )
    where = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    torch.manual_seed(seed)
    with torch.device(where):
        model = Qwen2ForCausalLM(config)
    model = model.to(getattr(torch, dtype)).cpu()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)  # no chat template: prompts go to the model as raw text
    marker.write_text(json.dumps(spec))
    return out


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    shape = TINY_SHAPE if args.tiny_shape else QWEN25_05B
    return dataclasses.replace(shape, num_layers=args.layers) if args.layers else shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="model directory to write (or reuse)")
    parser.add_argument("--tiny-shape", action="store_true", help="2 layers, hidden 128 (the 0.5B vocabulary)")
    parser.add_argument("--layers", type=int, help="override the number of layers")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="auto", help="where to initialise: auto, cpu, cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--describe", action="store_true", help="print the shape as JSON and build nothing")
    args = parser.parse_args(argv)
    shape = shape_from_args(args)
    info = {**dataclasses.asdict(shape), "head_dim": shape.head_dim, "parameters": shape.parameters()}
    if args.describe:
        print(json.dumps(info))
        return 0
    if not args.out:
        parser.error("give the model directory to write (or --describe)")
    path = build_model(args.out, shape, args.dtype, args.seed, args.device)
    print(json.dumps({"path": str(path.resolve()), "dtype": args.dtype, **info}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: actors/
    sys.exit(main())
