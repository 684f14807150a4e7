"""Weight push bandwidth: the torch.distributed weight channel vs a memcpy (and Ray), in one run.

For each state dict (the tiny 2-layer Qwen2 the tests train, and synthetic bf16 state dicts
of ~20, ~100 and ~400 MB with Qwen2 parameter names and shapes, built without a model):

A: ``DistPublisher.publish(version, named)`` from this process to one ``DistReceiver`` in
   another (gloo over loopback TCP), timed until the receiver has acknowledged: header,
   packing into buckets, broadcast, acknowledgement.
B: ``dst.copy_(src)`` of one flat buffer of the same number of bytes in this process: the
   memory bandwidth the push is compared with (``push/memcpy``, goal >= 0.5).
C: bare gloo: one ``broadcast`` of a flat buffer of the same bytes into a reused buffer in a
   third process, over a plain ``ProcessGroupGloo``, timed until its acknowledgement: the
   transport's ceiling, so ``push/gloo`` is the channel's own overhead.
D: (unless ``--no-ray``) the Ray object-store path the ``ray`` backend takes: ``ray.put`` of
   ``FlatWeights`` here (as learner rank 0 stores them), ``ray.get`` and ``.tensors()`` in an
   actor on the same node, timed around both (``ray/memcpy``: the same goal).

Rounds alternate A B C D A B C D; the table gives medians. Both processes run torch with one
thread, as learner ranks and actors do (OMP_NUM_THREADS=1).

    .venv/bin/python bench/weight_push.py [--rounds 5 --bucket-mb 64 --no-ray]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path

from cluster.weights import FlatWeights

HOST = "127.0.0.1"
WARMUP = 2  # untimed rounds per state dict

# Synthetic Qwen2-shaped state dicts (tied embeddings, bf16): name -> config fields.
SYNTHETIC = {
    "qwen2 ~20MB": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "qwen2 ~100MB": dict(
        vocab_size=24576,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    "qwen2 ~400MB": dict(
        vocab_size=65536,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
}


def qwen2_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor in a Qwen2ForCausalLM state dict, from its config alone."""
    H, F, V = config.hidden_size, config.intermediate_size, config.vocab_size  # F: the MLP width
    head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = [("model.embed_tokens.weight", (V, H))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q, H)),
            (p + "self_attn.q_proj.bias", (q,)),
            (p + "self_attn.k_proj.weight", (kv, H)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, H)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (H, q)),
            (p + "mlp.gate_proj.weight", (F, H)),
            (p + "mlp.up_proj.weight", (F, H)),
            (p + "mlp.down_proj.weight", (H, F)),
            (p + "input_layernorm.weight", (H,)),
            (p + "post_attention_layernorm.weight", (H,)),
        ]
    shapes.append(("model.norm.weight", (H,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (V, H)))
    return shapes


def tiny_state_dict(model_dir: Path) -> list:
    """The tiny model's weights as saved (fp32); also checks ``qwen2_shapes`` against them."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config

    from actors.tiny_model import build_tiny_model

    path = build_tiny_model(model_dir)
    saved = load_file(str(path / "model.safetensors"))
    expected = dict(qwen2_shapes(Qwen2Config.from_pretrained(path)))
    assert {k: tuple(v.shape) for k, v in saved.items()} == expected, "qwen2_shapes disagrees with the tiny model"
    return [(name, saved[name]) for name in expected]


def synthetic_state_dict(fields: dict, seed: int) -> list:
    import torch
    from transformers import Qwen2Config

    g = torch.Generator().manual_seed(seed)
    config = Qwen2Config(tie_word_embeddings=True, **fields)
    return [(n, torch.empty(s, dtype=torch.bfloat16).uniform_(-0.1, 0.1, generator=g)) for n, s in qwen2_shapes(config)]


def receiver_process(port: int, timeout_s: float) -> None:
    """The other end: keep receiving until the publisher closes the channel."""
    import torch

    from cluster.dist_receiver import DistReceiver

    torch.set_num_threads(1)
    rx = DistReceiver(HOST, port, 1, 2, "bench-receiver", timeout_s, connect_timeout_s=120)
    while not rx.is_closed():
        time.sleep(0.1)


def bare_gloo_process(port: int, schedule: list[tuple[int, int]]) -> None:
    """Bare-gloo contestant's other end: ``rounds`` broadcasts of ``nbytes`` per state dict."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, None, False, timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("bare", store), 1, 2, timedelta(seconds=120))
    n = 0
    for nbytes, rounds in schedule:
        buf = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
        for _ in range(rounds):
            group.broadcast([buf], dist.BroadcastOptions()).wait()
            n += 1
            store.set(f"ack/{n}", "1")


class RaySink:
    """Ray contestant: takes the published reference and gets the weights, as an actor does."""

    def take(self, box: list) -> int:
        import ray

        named = ray.get(box[0]).tensors()
        return sum(t.numel() * t.element_size() for _, t in named)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="push deadline")
    parser.add_argument("--model-dir", default="~/.cache/tandem/models/tiny-qwen2")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray object-store contestant")
    args = parser.parse_args()

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from cluster.dist_channel import DistPublisher

    torch.set_num_threads(1)
    t0 = time.monotonic()
    models = {"tiny qwen2 (fp32)": tiny_state_dict(Path(args.model_dir).expanduser())}
    models.update({name: synthetic_state_dict(fields, i) for i, (name, fields) in enumerate(SYNTHETIC.items())})
    print(f"state dicts built in {time.monotonic() - t0:.1f}s", flush=True)

    pub = DistPublisher(HOST, 0, 2, args.timeout_s, connect_timeout_s=120, bucket_bytes=args.bucket_mb << 20)
    spawn = mp.get_context("spawn")
    receiver = spawn.Process(target=receiver_process, args=(pub.port, args.timeout_s), daemon=True)
    receiver.start()
    sizes = [sum(t.numel() * t.element_size() for _, t in named) for named in models.values()]
    bare_store = dist.TCPStore(HOST, 0, None, True, timedelta(seconds=120), wait_for_workers=False)
    bare_peer = spawn.Process(
        target=bare_gloo_process, args=(bare_store.port, [(n, args.rounds + WARMUP) for n in sizes]), daemon=True
    )
    bare_peer.start()
    bare_group = dist.ProcessGroupGloo(dist.PrefixStore("bare", bare_store), 0, 2, timedelta(seconds=120))
    bare_sent = 0
    sink = None
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=2 << 30)
        sink = ray.remote(RaySink).options(num_cpus=0, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()
    pub.wait_connected()
    version = 0

    def push(named) -> float:
        nonlocal version
        version += 1
        start = time.perf_counter()
        pub.publish(version, named)
        return time.perf_counter() - start

    def bare_gloo(src) -> float:
        nonlocal bare_sent
        bare_sent += 1
        start = time.perf_counter()
        bare_group.broadcast([src], dist.BroadcastOptions()).wait()
        bare_store.wait([f"ack/{bare_sent}"])
        return time.perf_counter() - start

    def memcpy(src, dst) -> float:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start

    def ray_path(named) -> float:
        start = time.perf_counter()
        ray.get(sink.take.remote([ray.put(FlatWeights(named))]))
        return time.perf_counter() - start

    rows = []
    try:
        for name, named in models.items():
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
            times = {"push": [], "memcpy": [], "gloo": [], "ray": []}
            for _ in range(WARMUP):  # warm up: connections, pages (the object store reuses a freed object's pages)
                push(named), memcpy(src, dst), bare_gloo(src), sink and ray_path(named)
            for _ in range(args.rounds):
                times["push"].append(push(named))
                times["memcpy"].append(memcpy(src, dst))
                times["gloo"].append(bare_gloo(src))
                if sink:
                    times["ray"].append(ray_path(named))
            med = {k: statistics.median(v) for k, v in times.items() if v}
            rows.append((name, len(named), nbytes, med))
            print(
                f"  {name}: push {med['push'] * 1e3:.1f} ms, memcpy {med['memcpy'] * 1e3:.1f} ms, "
                f"bare gloo {med['gloo'] * 1e3:.1f} ms" + (f", ray {med['ray'] * 1e3:.1f} ms" if "ray" in med else ""),
                flush=True,
            )
            del src, dst
    finally:
        pub.close()
        for label, process in (("receiver", receiver), ("bare gloo peer", bare_peer)):
            process.join(10)
            if process.is_alive():
                process.kill()
            elif process.exitcode:
                print(f"note: the {label} process exited with code {process.exitcode}")

    print(f"\nbucket {args.bucket_mb} MiB, {args.rounds} rounds (medians), one torch thread per process")
    print(
        f"{'state dict':<20}{'tensors':>8}{'MB':>8}{'push ms':>9}{'push GB/s':>11}{'memcpy GB/s':>13}"
        f"{'push/memcpy':>13}{'gloo GB/s':>11}{'push/gloo':>11}{'ray ms':>9}{'ray GB/s':>10}{'ray/memcpy':>12}"
    )
    for name, count, nbytes, med in rows:
        gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
        ray_cols = (
            f"{med['ray'] * 1e3:>9.1f}{gbs['ray']:>10.2f}{gbs['ray'] / gbs['memcpy']:>12.2f}"
            if "ray" in med
            else f"{'-':>9}{'-':>10}{'-':>12}"
        )
        print(
            f"{name:<20}{count:>8}{nbytes / 1e6:>8.1f}{med['push'] * 1e3:>9.1f}{gbs['push']:>11.2f}"
            f"{gbs['memcpy']:>13.2f}{gbs['push'] / gbs['memcpy']:>13.2f}{gbs['gloo']:>11.2f}"
            f"{gbs['push'] / gbs['gloo']:>11.2f}{ray_cols}"
        )
    print(f"total {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
