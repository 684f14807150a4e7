"""The learner-side GPU check: what a lent GPU machine without vLLM or Ray can run of Tandem.

Each check runs in a child process of its own (a fresh CUDA context and DeepSpeed state) and prints
one JSON line; ``bench/gpu_device_check.sh`` runs them in order and prints one table.

- ``collectives``: the learner's own group set-up (``LearnerWorker.join_alone``: ``nccl`` on a
  GPU, ``gloo`` on the CPU) at world size 1, then all-reduce and broadcast of a 64 MiB tensor.
- ``step``: a real learner step (``LearnerWorker.build`` + ``LearnerGroup.train_step``: packing, GRPO,
  the loss, backward, the optimizer) on the 0.5B-shaped model (``bench/gpu_model.py``) in bfloat16,
  with ``--zero`` (2 or 3) and ``--attention`` (sdpa, or flash_attention_2: the varlen kernel, when
  flash_attn is importable), on ``--sequences`` x ``--tokens`` response tokens; ``--checkpointing``
  turns on gradient checkpointing (with the default chunked log-probs, ``logprob_chunk_tokens``
  1024). Reports the median step, trained tokens/s, peak device memory beside what the memory plan
  predicts for the same rank (``tandem plan``'s arithmetic, ``cluster/memory.py``), and model-FLOPs utilisation
  against ``--peak-tflops``: ``(6 N + 6 L H S) x tokens / s``, N the parameters without the embedding
  table, L layers, H the hidden size, S the mean sequence length (causal attention: half of 12 L H S).
  Then the exported weights: their dtype must be the run's (bf16), and the learner's log-probs of
  the batch must be finite. ``--offload``: then the colocated schedule's round trip
  (``LearnerWorker.offload_states`` / ``reload_states``, DeepSpeed's ``offload_states``): device memory
  held before and after, seconds each way, and one more step that must train (finite loss).
- ``weights``: the same-device weight path between two processes: the learner exports the model's
  weights and packs them as handles (``actors/engine_weights.py``, ``shared``: CUDA IPC on a GPU,
  shared memory on the CPU); a second process rebuilds them and checks every byte; time per push.

    python bench/gpu_check.py collectives
    python bench/gpu_check.py step --model DIR --zero 3 --attention sdpa --tokens 8192 --sequences 2
    python bench/gpu_check.py weights --model DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def collectives(args) -> dict:
    import torch
    import torch.distributed as dist

    from learner.worker import LearnerWorker

    LearnerWorker(0, 1).join_alone(120)
    x = torch.arange(16 << 20, dtype=torch.float32, device=_device())  # 64 MiB
    times = {}
    for name, op in (("all_reduce", lambda: dist.all_reduce(x)), ("broadcast", lambda: dist.broadcast(x, 0))):
        op()
        _sync()
        start = time.perf_counter()
        for _ in range(5):
            op()
        _sync()
        times[name] = (time.perf_counter() - start) / 5
    ok = bool(torch.equal(x[:4].cpu(), torch.arange(4, dtype=torch.float32)))
    if not ok:
        raise RuntimeError("a world-size-1 all-reduce changed the tensor")
    return {
        "backend": dist.get_backend(),
        "all_reduce_ms": 1e3 * times["all_reduce"],
        "broadcast_ms": 1e3 * times["broadcast"],
    }


def _groups(n: int, sequences: int, vocab: int) -> list:
    import numpy as np

    from queues.messages import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(0)
    prompt = rng.integers(10, min(vocab, 100), 64, dtype=np.int32)
    trajs = [
        Trajectory(
            prompt_token_ids=prompt, completion_token_ids=rng.integers(10, min(vocab, 100), n, dtype=np.int32),
            completion_mask=np.ones(n, dtype=np.uint8), sampler_logprobs=(-4.0 * rng.random(n)).astype(np.float32),
            policy_versions=np.zeros(n, dtype=np.int32), reward=float(i % 2), finish_reason="length",
            completion_text="",
        )
        for i in range(sequences)
    ]  # fmt: skip
    return [TrajectoryGroup(prompt_id=0, row={"prompt": ""}, trajectories=trajs, actor_name="check")]


def step(args) -> dict:
    import asyncio

    import torch

    from learner.attention import select_attention
    from learner.config import AlgorithmConfig, LearnerConfig
    from learner.group import LearnerGroup
    from learner.worker import LearnerWorker, RankSpec
    from tests.fakes import LocalActor

    cuda = torch.cuda.is_available()
    n, sequences = args.tokens, args.sequences
    learner = LearnerConfig(
        zero_stage=args.zero, token_budget=n + 64, attention=args.attention, gradient_checkpointing=args.checkpointing,
        lr=1e-6,
    )  # fmt: skip
    algorithm = AlgorithmConfig()
    spec = RankSpec(args.model, learner, algorithm, args.dtype, 0, max_tokens=n)
    worker = LearnerWorker(0, 1)
    worker.join_alone()
    from learner.attention import flash_attn_importable

    attention = select_attention(args.attention, cuda, cuda and flash_attn_importable(), args.dtype)
    worker.build(spec, attention)
    group = LearnerGroup([LocalActor(worker)], algorithm, learner.token_budget, n)
    config = worker.policy.module.config
    groups = _groups(n, sequences, config.vocab_size)

    def one() -> tuple[float, dict]:
        _sync()
        start = time.perf_counter()
        metrics = asyncio.run(group.train_step(groups))
        _sync()
        return time.perf_counter() - start, metrics

    one()  # warm-up: kernels, AdamW's state
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    runs = [one() for _ in range(args.repeats)]
    seconds = statistics.median(s for s, _ in runs)
    metrics = runs[-1][1]
    if not all(torch.isfinite(torch.tensor(float(v))) for k, v in metrics.items() if k.startswith("loss")):
        raise RuntimeError(f"non-finite loss: {metrics}")
    tokens = sequences * (n + 64)
    params = sum(p.numel() for p in worker.policy.module.parameters()) if args.zero != 3 else _params(config)
    body = params - config.vocab_size * config.hidden_size  # the embedding lookup costs no FLOPs
    flops_per_token = 6 * body + 6 * config.num_hidden_layers * config.hidden_size * (n + 64)
    achieved = flops_per_token * tokens / seconds
    named = worker.export_weights(copy=False)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for _, t in named}) if named else []
    if dtypes != [args.dtype]:
        raise RuntimeError(f"exported weights are {dtypes}, the run's dtype is {args.dtype}")
    exported = f"{len(named)} tensors, {dtypes[0]}"
    del named  # (ZeRO-3 gathered copies: not held through the offload)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None  # the steps' and the export's
    offload = _offload_round_trip(worker, one) if args.offload else {}
    return {**offload,
        "zero": args.zero, "attention": f"{attention.implementation} ({attention.mask} mask)",
        "checkpointing": args.checkpointing, "dtype": args.dtype, "tokens": tokens, "seconds": seconds,
        "tokens_s": tokens / seconds, "tflops": achieved / 1e12, "mfu": achieved / (args.peak_tflops * 1e12),
        "peak_gib": peak, "predicted_gib": _predicted(learner, config, args.dtype, n + 64, attention),
        "params": params,
        "exported": exported, "loss": metrics.get("loss"),
    }  # fmt: skip


def _predicted(learner, config, dtype: str, longest: int, attention) -> float:
    """GiB the memory plan (``tandem plan``: ``launch/plan.py`` policy_terms) predicts for this one-rank step,
    without its CUDA-context allowance: ``max_memory_allocated`` counts tensors only."""
    from cluster.memory import GIB, shape_of
    from launch.plan import policy_terms

    stays, backward, step = policy_terms(learner, shape_of(config), 1, dtype, longest, not attention.varlen)
    held = sum(t.bytes for t in stays if t.name != "CUDA context")
    return (held + max(sum(t.bytes for t in backward), sum(t.bytes for t in step))) / GIB


def _offload_round_trip(worker, one) -> dict:
    """The learner's turn in the colocated schedule: its states out while the engines generate, then back."""
    import torch

    cuda = torch.cuda.is_available()
    held = lambda: torch.cuda.memory_allocated() / 2**30 if cuda else None  # noqa: E731
    before = held()
    _sync()
    start = time.perf_counter()
    worker.offload_states()
    _sync()
    out_s, after = time.perf_counter() - start, held()
    start = time.perf_counter()
    worker.reload_states()
    _sync()
    back_s = time.perf_counter() - start
    _, metrics = one()
    if not torch.isfinite(torch.tensor(float(metrics["loss"]))):
        raise RuntimeError(f"non-finite loss after the offload round trip: {metrics}")
    return {"offload_s": out_s, "reload_s": back_s, "held_gib": before, "offloaded_gib": after}


def _params(config) -> int:
    """Parameters of a Qwen2 config (ZeRO-3 partitions the module's own, so they are counted from it)."""
    h, kv = config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    layer = 2 * h * h + h + 2 * (h * kv + kv) + 3 * h * config.intermediate_size + 2 * h
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.vocab_size * h + config.num_hidden_layers * layer + h + head


def _receive(conn) -> None:
    """The second process: rebuild the handles' tensors and answer their checksum, for every push."""
    from multiprocessing.reduction import ForkingPickler

    while True:
        packed = conn.recv_bytes()
        if not packed:
            return
        start = time.perf_counter()
        named = ForkingPickler.loads(packed)
        total = sum(float(t.double().sum()) for _, t in named)
        conn.send((total, time.perf_counter() - start))


def weights(args) -> dict:
    import multiprocessing as mp

    import torch
    from transformers import AutoModelForCausalLM

    from actors.engine_weights import weights_to_handles

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(_device())
    named = list(model.state_dict().items())
    expected = sum(float(t.double().sum()) for _, t in named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive, args=(child,), daemon=True)
    proc.start()
    sends, rebuilds = [], []
    try:
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            packed, keep = weights_to_handles(named)
            parent.send_bytes(packed)
            total, rebuild = parent.recv()
            sends.append(time.perf_counter() - start)
            rebuilds.append(rebuild)
            if total != expected:
                raise RuntimeError(f"the second process read other weights (checksum {total} != {expected})")
            del keep
        parent.send_bytes(b"")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    path = "CUDA IPC" if _device().type == "cuda" else "shared memory"
    return {
        "path": path, "mb": nbytes / 1e6, "tensors": len(named), "push_s": statistics.median(sends[1:]),
        "rebuild_and_read_s": statistics.median(rebuilds[1:]), "bytes_equal": True,
    }  # fmt: skip


def table(args) -> None:
    """The results file of ``bench/gpu_device_check.sh`` as one markdown table."""
    rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
    print(f"\n| check ({args.mode}) | result | seconds | tokens/s | TFLOP/s (MFU) | peak GiB (plan) | notes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if "error" in row:
            last = [x for x in row["error"].strip().splitlines() if x.strip()][-1:] or ["?"]
            print(f"| {row['name']} | FAILED | | | | | {last[0][:150]} |")
            continue
        r = row["result"]
        if r["check"] == "collectives":
            note = f"{r['backend']}: all-reduce {r['all_reduce_ms']:.2f} ms, broadcast {r['broadcast_ms']:.2f} ms"
            cells = ["", "", "", "", note + " (64 MiB)"]
        elif r["check"] == "step":
            peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            peak += f" (plan {r['predicted_gib']:.1f})" if "predicted_gib" in r else ""
            ckpt = ", grad. ckpt" if r["checkpointing"] else ""
            note = f"ZeRO-{r['zero']}, {r['attention']}, {r['dtype']}{ckpt}; {r['tokens']} tokens; {r['exported']}"
            if "offload_s" in r:
                held = "" if r["held_gib"] is None else f" ({r['held_gib']:.1f} -> {r['offloaded_gib']:.1f} GiB held)"
                note += f"; states offloaded {r['offload_s']:.2f} s, reloaded {r['reload_s']:.2f} s{held}"
            mfu = f"{r['tflops']:.1f} ({r['mfu']:.1%})"
            cells = [f"{r['seconds']:.2f}", f"{r['tokens_s']:,.0f}", mfu, peak, note]
        else:
            note = f"{r['path']}: {r['mb']:.0f} MB, {r['tensors']} tensors, every byte equal"
            cells = [f"{r['push_s']:.3f}", "", "", "", f"{note}; rebuild+read {r['rebuild_and_read_s']:.3f} s"]
        print(f"| {row['name']} | ok | " + " | ".join(cells) + " |")


def main() -> None:
    if sys.argv[1:2] == ["table"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("table")
        parser.add_argument("--results", required=True)
        parser.add_argument("--mode", default="gpu")
        return table(parser.parse_args())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["collectives", "step", "weights"])
    parser.add_argument("--model", help="model directory (bench/gpu_model.py)")
    parser.add_argument("--zero", type=int, default=2, choices=[2, 3])
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--offload", action="store_true", help="then offload and reload the learner's states")
    parser.add_argument("--tokens", type=int, default=4096, help="completion tokens per response")
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="the chip's dense bf16 peak (H200: ~790)")
    args = parser.parse_args()
    result = {"collectives": collectives, "step": step, "weights": weights}[args.check](args)
    print("RESULT " + json.dumps({"check": args.check, **result}), flush=True)


if __name__ == "__main__":
    main()
