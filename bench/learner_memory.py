"""Learner memory: peak memory and time of a real learner training step, long responses, chunked vs not.

The step is the learner's own: a ``LearnerWorker`` built in-process (``LearnerWorker.build``: the
attention kernel ``learner.attention=auto`` picks, the model loaded with it, a DeepSpeed ZeRO-0
engine with torch AdamW, float32, the packing layout, the ``RankStep``) on a one-rank gloo group, and
driven through ``LearnerGroup.train_step`` with in-process stand-ins for the Ray handles
(``tests/fakes.LocalActor``, as the fake-rank tests do): planning, packing, GRPO advantages, forward,
the PPO-clip objective, backward, the optimizer step.

The model: a tiny Qwen2 (hidden 128, 2 layers, 4 heads / 2 KV heads, untied embeddings) with a
realistic vocabulary (``--vocab``, default 32768 and 151936): the LM head and its ``[N, V]`` logits
are what long responses make large, and a tiny body keeps the run short. The batch: one group of a
response of ``N`` completion tokens and one of 64 (64-token prompts, rewards 1 and 0),
``learner.token_budget = N + 64``: each response is a micro-batch of one sequence (no block mask:
plain causal attention), the step is 2 micro-batches and one update, and its cost is the long one's.

Schemes (``learner.*`` keys): ``unchunked`` = ``logprob_chunk_tokens: 0`` (the log-prob and entropy
of all N tokens in one piece), ``chunked`` = ``logprob_chunk_tokens: 1024`` (the default), and
``chunked+ckpt`` = chunked with ``gradient_checkpointing: true``.

Memory: each config runs in its own child process (one torch thread, as a learner rank runs). After
one warm-up step (AdamW's state exists from then on) the child resets its peak RSS
(``/proc/self/clear_refs``: 5) and runs ``--repeats`` timed steps; ``peak GB`` is the peak RSS over
them (``ru_maxrss``), ``step GB`` that peak minus the RSS just before them (weights, gradients and
optimizer state are in the baseline). Time: the median step (``LearnerGroup.train_step``). Configs
whose estimated peak passes ``--max-gb`` are skipped with a note. Nothing here asserts a timing.
The figures are host memory: the bench is for CPU machines (on a GPU the tensors live on the device,
whose peak ``torch.cuda.max_memory_allocated`` would give; not measured here).

    .venv/bin/python bench/learner_memory.py [--tokens 1024 4096 16384 --vocab 32768 151936 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
PROMPT = 64  # prompt tokens of every response
SHORT = 64  # completion tokens of the group's second response
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 2, 4, 2, 256
SCHEMES = {  # name -> learner.* overrides
    "unchunked": {"logprob_chunk_tokens": 0},
    "chunked": {"logprob_chunk_tokens": 1024},
    "chunked+ckpt": {"logprob_chunk_tokens": 1024, "gradient_checkpointing": True},
}


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM, ru_maxrss) to the current RSS


def build_model(vocab: int, max_positions: int, out: Path) -> Path:
    """A random tiny Qwen2 with a ``vocab``-token LM head and the tiny character tokenizer (the
    learner reads only its pad id); reused when present."""
    marker = out / "learner-memory.json"
    spec = {"vocab": vocab, "max_positions": max_positions, "hidden": HIDDEN, "layers": LAYERS}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from actors.tiny_model import build_tokenizer

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out


def _groups(n: int, vocab: int, seed: int) -> list:
    """One scored group: a response of ``n`` random tokens (reward 1) and one of ``SHORT`` (reward 0),
    so the advantages are nonzero and the step's cost is the long response's."""
    import numpy as np

    from queues.messages import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(seed)
    prompt = rng.integers(4, vocab, PROMPT, dtype=np.int32)
    trajs = [
        Trajectory(
            prompt_token_ids=prompt,
            completion_token_ids=rng.integers(4, vocab, c, dtype=np.int32),
            completion_mask=np.ones(c, dtype=np.uint8),
            sampler_logprobs=(-12.0 * rng.random(c)).astype(np.float32),
            policy_versions=np.zeros(c, dtype=np.int32),
            reward=reward,
            finish_reason="length",
            completion_text="",
        )
        for c, reward in ((n, 1.0), (SHORT, 0.0))
    ]
    return [TrajectoryGroup(prompt_id=0, row={"prompt": ""}, trajectories=trajs, actor_name="bench")]


def _child(model_path: str, n: int, vocab: int, scheme: str, repeats: int, seed: int) -> dict:
    import asyncio

    import torch

    torch.set_num_threads(1)
    from learner.attention import flash_attn_importable, select_attention
    from learner.config import AlgorithmConfig, LearnerConfig
    from learner.group import LearnerGroup
    from learner.worker import LearnerWorker, RankSpec
    from tests.fakes import LocalActor

    learner = LearnerConfig(token_budget=n + PROMPT, **SCHEMES[scheme])
    algorithm = AlgorithmConfig()  # GRPO: one update per batch, no reference, no scoring pass
    spec = RankSpec(model_path, learner, algorithm, "float32", seed, max_tokens=n)
    worker = LearnerWorker(0, 1)
    worker.join_alone()
    cuda = torch.cuda.is_available()  # the rank's own choice (on this CPU: sdpa)
    attention = select_attention(learner.attention, cuda, cuda and flash_attn_importable(), spec.dtype)
    worker.build(spec, attention)
    group = LearnerGroup([LocalActor(worker)], algorithm, learner.token_budget, n)
    groups = _groups(n, vocab, seed)

    def step() -> float:
        start = time.perf_counter()
        metrics = asyncio.run(group.train_step(groups))
        assert metrics["tokens"] == n + SHORT and metrics["updates"] == 1.0, metrics
        return time.perf_counter() - start

    warmup = step()
    before = _rss_bytes()
    _reset_peak()
    seconds = [step() for _ in range(repeats)]
    peak = _maxrss_bytes()
    return {
        "scheme": scheme,
        "tokens": n,
        "vocab": vocab,
        "attention": f"{attention.implementation} ({attention.mask} mask)",
        "micro_batches": sum(len(mb) for mb in group.shape_rewards(groups).shards[0].micro_sizes),
        "before_gb": before / GB,
        "peak_gb": peak / GB,
        "step_gb": max(0, peak - before) / GB,
        "logits_gb": n * vocab * 4 / GB,
        "seconds": statistics.median(seconds),
        "all_seconds": seconds,
        "warmup_seconds": warmup,
        "threads": torch.get_num_threads(),
    }


def needed_gb(scheme: str, n: int, v: int) -> float:
    """Estimated peak RSS: ~0.7 GB of process, the model's weights, gradients and AdamW moments
    (16 B a parameter), and per micro-batch the fp32 logits and their gradient (``2 N V`` floats),
    unchunked ~1.5 more ``[N, V]`` (the one-piece backward's work buffer, the entropy's softmax;
    measured: step GB 3.2 N V x 4 B unchunked, 2.2 N V x 4 B chunked, at N 4096-16384, V 32768)."""
    params = 2 * v * HIDDEN + LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN)
    nv = n * v * 4 / GB
    return 0.7 + 16 * params / GB + (3.5 if scheme == "unchunked" else 2.2) * nv


def _run_child(*args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        model_path, n, vocab, scheme, repeats, seed = sys.argv[2:]
        print(json.dumps(_child(model_path, int(n), int(vocab), scheme, int(repeats), int(seed))))
        return

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384], help="completion tokens N")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936], help="vocabulary sizes V")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per config after one warm-up (median)")
    parser.add_argument(
        "--ckpt-max-vocab",
        type=int,
        default=32768,
        help="run chunked+ckpt only up to this V (what it saves, the layers' activations, does not depend on V)",
    )
    parser.add_argument("--max-gb", type=float, default=10.5, help="skip a config estimated to need more GB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-root", default=str(Path.home() / ".cache" / "tandem" / "models"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "learner_memory.json"))
    parser.add_argument("--print", metavar="FILE", help="only print the table of a results file")
    args = parser.parse_args()
    if args.print:
        saved = json.loads(Path(args.print).read_text())
        print_table(saved["rows"], [s for s in SCHEMES if s in saved["rows"][0]])
        return

    sys.path.insert(0, str(ROOT))
    started = time.perf_counter()
    positions = max(args.tokens) + PROMPT
    rows = []
    for v in sorted(args.vocab):
        model = build_model(v, positions, Path(args.model_root) / f"learner-memory-v{v}")
        for n in sorted(args.tokens):
            row = {"tokens": n, "vocab": v}
            for scheme in args.schemes:
                if scheme == "chunked+ckpt" and v > args.ckpt_max_vocab:
                    row[scheme] = {"skipped": f"not run (V > {args.ckpt_max_vocab})"}
                    continue
                need = needed_gb(scheme, n, v)
                if need > args.max_gb:
                    row[scheme] = {"skipped": f"would need ~{need:.0f} GB"}
                    print(f"N={n:>6} V={v:>6} {scheme:>12}: skipped: would need ~{need:.1f} GB", flush=True)
                    continue
                row[scheme] = r = _run_child(model, n, v, scheme, args.repeats, args.seed)
                print(
                    f"N={n:>6} V={v:>6} {scheme:>12}: peak {r['peak_gb']:6.2f} GB, step {r['step_gb']:6.2f} GB, "
                    f"{r['seconds']:6.2f} s/step ({r['attention']}, logits {r['logits_gb']:.2f} GB)",
                    flush=True,
                )
            rows.append(row)
    print_table(rows, args.schemes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": " ".join([".venv/bin/python", "bench/learner_memory.py", *sys.argv[1:]]),
                "machine": platform.platform(),
                "python": platform.python_version(),
                "repeats": args.repeats,
                "max_gb": args.max_gb,
                "model": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN},
                "batch": {"responses": ["N", SHORT], "prompt_tokens": PROMPT},
                "rows": rows,
                "wall_s": time.perf_counter() - started,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out} ({time.perf_counter() - started:.0f} s)")


def print_table(rows: list[dict], schemes: list[str]) -> None:
    """Markdown, one row per (N, V); each cell lists the schemes in order (``-``: not run).

    ``beyond GB`` = step GB minus the fp32 logits and their gradient (``2 N V x 4`` bytes), which
    every scheme holds: the log-prob stage's own memory plus what both share (the layers'
    activations, small here), the figure ``bench/logprob_memory.py`` measures on the stage alone."""

    def value(r: dict, key: str) -> float | None:
        if "skipped" in r:
            return None
        return r["step_gb"] - 2 * r["logits_gb"] if key == "beyond" else r[key]

    def cells(row: dict, key: str, fmt: str = ".2f") -> str:
        vals = [value(row[s], key) for s in schemes]
        return " / ".join("-" if v is None else format(v, fmt) for v in vals)

    def ratio(row: dict, key: str) -> str:
        a, b = (value(row[s], key) if s in row else None for s in ("unchunked", "chunked"))
        return f"{a / b:.1f}x" if a is not None and b else "-"

    names = " / ".join(schemes)
    head = ["N", "V", "logits GB", f"peak GB ({names})", f"step GB ({names})", "step ratio"]
    head += [f"beyond logits + grad GB ({names})", "beyond ratio", f"s/step ({names})"]
    print("\nN = completion tokens of the long response (its micro-batch); logits = fp32 [N, V];")
    print("peak = peak RSS over the timed steps; step = peak minus the RSS before them;")
    print("beyond = step minus the logits and their gradient; ratio = unchunked / chunked\n")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in rows:
        line = [str(row["tokens"]), str(row["vocab"]), f"{row['tokens'] * row['vocab'] * 4 / GB:.2f}"]
        if all("skipped" in row[s] for s in schemes):
            notes = "; ".join(f"{s}: {row[s]['skipped']}" for s in schemes)
            line += [f"skipped ({notes})"] + ["-"] * (len(head) - 4)
        else:
            line += [cells(row, "peak_gb"), cells(row, "step_gb"), ratio(row, "step_gb")]
            line += [cells(row, "beyond"), ratio(row, "beyond"), cells(row, "seconds", ".1f")]
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
