"""LoRA against full fine-tuning on the same model: what a weight push carries and costs, learner memory
and step time.

Contestants: ``full`` (every weight trains and travels) and ``lora-r<R>`` (``learner.lora.rank=R``,
alpha 2R, all linear layers). Per contestant, two child processes (one torch thread each, as a learner
rank and an actor run):

- learner: a ``LearnerWorker`` built in-process on a one-rank gloo group (DeepSpeed ZeRO-0, torch AdamW,
  float32; as ``bench/learner_memory.py``), driven by ``LearnerGroup.train_step`` on one batch of
  ``--sequences`` responses of ``--tokens`` tokens. Measured: trainable parameters, the median step
  (after one warm-up), RSS before the timed steps (weights + gradients + AdamW state), and per push the
  export (``export_weights``: what rank 0 publishes) and its packing into the Ray path's ``FlatWeights``
  (one copy), with the bytes.
- actor: vLLM's ``LLM`` in-process on one core, started as the actor starts it (``engine_kwargs``; with
  LoRA slots for 2 adapters), loading ``--pushes`` published versions the way the actor does: the full
  weights through ``load_named_weights`` and a prefix-cache reset; an adapter written by
  ``actors/adapters.py`` and loaded by vLLM at the next generate (timed: one 1-token generate with it,
  minus the same generate without a new version). And one generate of 16 prompts x 64 tokens, to show
  what serving the adapter costs per token.

The model: a Qwen2 of ``--hidden`` (512), ``--layers`` (8), 8 heads / 4 KV heads, FFN 1408, vocabulary
32768, untied (about 59M parameters), built locally. Nothing here asserts a timing.

    .venv/bin/python bench/lora.py [--ranks 8 64 --tokens 256 --sequences 8 --pushes 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1e6


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """The bench's Qwen2 (``bench/gpu_model.py`` builds it; reused when present): 8 heads / 4 KV heads,
    FFN 11/4 of ``hidden``, vocabulary 32768, untied, float32."""
    from bench.gpu_model import QWEN25_05B
    from bench.gpu_model import build_model as build

    shape = dataclasses.replace(
        QWEN25_05B, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_layers=layers, num_heads=8,
        num_kv_heads=4, vocab_size=32768, max_positions=2048, tie_word_embeddings=False,
    )  # fmt: skip
    return build(out, shape, dtype="float32", device="cpu")


def _rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _groups(tokens: int, sequences: int, seed: int) -> list:
    import numpy as np

    from queues.messages import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(seed)
    prompt = rng.integers(4, 32768, 32, dtype=np.int32)
    trajs = [
        Trajectory(
            prompt_token_ids=prompt, completion_token_ids=rng.integers(4, 32768, tokens, dtype=np.int32),
            completion_mask=np.ones(tokens, dtype=np.uint8),
            sampler_logprobs=(-10.0 * rng.random(tokens)).astype(np.float32),
            policy_versions=np.zeros(tokens, dtype=np.int32), reward=float(i % 2), finish_reason="length",
            completion_text="",
        )
        for i in range(sequences)
    ]  # fmt: skip
    return [TrajectoryGroup(prompt_id=0, row={"prompt": ""}, trajectories=trajs, actor_name="bench")]


def learner_child(model: str, rank: int, tokens: int, sequences: int, pushes: int, out: str) -> dict:
    import asyncio

    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    from cluster.weights import FlatWeights
    from learner.attention import select_attention
    from learner.config import AlgorithmConfig, LearnerConfig, LoraConfig
    from learner.group import LearnerGroup
    from learner.worker import LearnerWorker, RankSpec
    from tests.fakes import LocalActor

    lora = LoraConfig(rank=rank, alpha=2.0 * rank) if rank else None
    learner = LearnerConfig(token_budget=tokens + 32, lora=lora, lr=1e-4)
    algorithm = AlgorithmConfig()
    spec = RankSpec(model, learner, algorithm, "float32", 0, max_tokens=tokens)
    worker = LearnerWorker(0, 1)
    worker.join_alone()
    worker.build(spec, select_attention("auto", False, False, "float32"))
    group = LearnerGroup([LocalActor(worker)], algorithm, learner.token_budget, tokens)
    groups = _groups(tokens, sequences, 0)

    def step() -> float:
        start = time.perf_counter()
        asyncio.run(group.train_step(groups))
        return time.perf_counter() - start

    step()
    rss = _rss()
    steps = [step() for _ in range(2)]
    exports, packs = [], []
    for _ in range(pushes):
        start = time.perf_counter()
        named = worker.export_weights(copy=False)
        exports.append(time.perf_counter() - start)
        start = time.perf_counter()
        flat = FlatWeights(named)
        packs.append(time.perf_counter() - start)
    save_file({n: t.contiguous() for n, t in worker.export_weights()}, out)  # what the actor child loads
    trainable = sum(p.numel() for p in worker.policy.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in worker.policy.module.parameters())
    return {
        "trainable": trainable, "params": total, "push_mb": flat.nbytes / MB, "tensors": len(named),
        "export_s": statistics.median(exports), "pack_s": statistics.median(packs),
        "step_s": statistics.median(steps), "rss_mb": rss,
    }  # fmt: skip


def actor_child(model: str, rank: int, weights: str, pushes: int) -> dict:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="0", TORCHDYNAMO_DISABLE="1")
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from actors.adapters import Adapters, AdapterSpec, lora_kwargs
    from actors.between_requests import _build_llm
    from actors.config import EngineConfig, RewardConfig, RolloutConfig
    from actors.spec import ActorSpec

    adapter = AdapterSpec(rank, 2.0 * rank, slots=2) if rank else None
    spec = ActorSpec(
        "bench", model, EngineConfig(max_model_len=512), RolloutConfig(max_tokens=64), RewardConfig(function="x"),
        "float32", 0, adapter=adapter,
    )  # fmt: skip
    llm = _build_llm(spec)
    named = list(load_file(weights).items())
    one = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=[5 + i, 6, 7, 8]) for i in range(16)]
    adapters = Adapters(adapter, model, "bench") if adapter else None

    def generate(params, batch, version=None):
        lora = adapters.request(version) if adapters else None
        return llm.generate(batch, params, use_tqdm=False, **lora_kwargs(lora))

    generate(one, prompts[:1])
    loads = []
    for version in range(1, pushes + 1):
        start = time.perf_counter()
        if adapters:
            adapters.add(version, named)
            for lora_id in adapters.retire():
                llm.llm_engine.remove_lora(lora_id)
            generate(one, prompts[:1], version)  # vLLM loads the adapter here
            loaded = time.perf_counter() - start
            start = time.perf_counter()
            generate(one, prompts[:1], version)  # the same generate, adapter already loaded
            loaded -= time.perf_counter() - start
        else:
            llm.collective_rpc("load_named_weights", args=(named,))
            llm.reset_prefix_cache()
            loaded = time.perf_counter() - start
        loads.append(loaded)
    full = SamplingParams(max_tokens=64, min_tokens=64, temperature=1.0, seed=0)
    generate(full, prompts, pushes)
    start = time.perf_counter()
    generate(full, prompts, pushes)
    gen = time.perf_counter() - start
    if adapters:
        adapters.close()
    return {"load_s": statistics.median(loads), "generate_tok_s": 16 * 64 / gen}


def _child(kind: str, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), f"--{kind}", *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{kind} child {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--learner"]:
        model, rank, tokens, sequences, pushes, out = sys.argv[2:]
        print(json.dumps(learner_child(model, int(rank), int(tokens), int(sequences), int(pushes), out)))
        return
    if sys.argv[1:2] == ["--actor"]:
        model, rank, weights, pushes = sys.argv[2:]
        print(json.dumps(actor_child(model, int(rank), weights, int(pushes))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64], help="LoRA ranks (full is always run)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per response of the learner's batch")
    parser.add_argument("--sequences", type=int, default=8, help="responses in the learner's batch")
    parser.add_argument("--pushes", type=int, default=3, help="published versions timed (median)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model-root", default=str(Path.home() / ".cache" / "tandem" / "models"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    started = time.perf_counter()
    model = str(
        build_model(Path(args.model_root) / f"lora-bench-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    )
    rows = []
    for rank in [0, *args.ranks]:
        name = f"lora-r{rank}" if rank else "full"
        weights = Path(tempfile.gettempdir()) / f"lora-bench-published-{name}.safetensors"  # not in the model dir
        row = {"name": name, **_child("learner", model, rank, args.tokens, args.sequences, args.pushes, weights)}
        row.update(_child("actor", model, rank, weights, args.pushes))
        weights.unlink()
        rows.append(row)
        print(f"{name}: {json.dumps(row)}", flush=True)
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join([".venv/bin/python", "bench/lora.py", *sys.argv[1:]]), "machine": platform.platform(),
        "python": platform.python_version(), "model": {"hidden": args.hidden, "layers": args.layers},
        "batch": {"tokens": args.tokens, "sequences": args.sequences}, "rows": rows,
        "wall_s": time.perf_counter() - started, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }  # fmt: skip
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out} ({time.perf_counter() - started:.0f} s)")


def print_table(rows: list[dict]) -> None:
    full = rows[0]
    print("\n| contestant | trainable params | push MB | export + pack s | actor load s | learner step s | "
          "learner RSS MB | generate tok/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = "" if r is full else f" ({r['push_mb'] / full['push_mb']:.4f}x)"
        print(
            f"| {r['name']} | {r['trainable'] / 1e6:.2f}M of {r['params'] / 1e6:.1f}M | {r['push_mb']:.2f}{ratio} | "
            f"{r['export_s'] + r['pack_s']:.4f} | {r['load_s']:.3f} | {r['step_s']:.2f} | {r['rss_mb']:.0f} | "
            f"{r['generate_tok_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
