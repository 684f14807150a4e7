"""Learner throughput: Tandem's learner rank vs a bare DeepSpeed step, side by side in one run.

A: one ``LearnerWorker`` (Ray actor with the launcher's options), set up as Tandem does,
   timed around ``LearnerGroup.train_step(groups)`` on fixed synthetic trajectory groups, as
   in a run: the driver plans the step and sends the shard; the rank packs it once, computes
   GRPO advantages (its summary, the driver's group reduction, its expansion), then forward,
   the PPO-clip objective with TIS, backward per micro-batch, one optimizer step, metrics.
B: a plain Ray actor with the same options holding a DeepSpeed engine built from the
   same model, the same DeepSpeed config (``learner.worker.deepspeed_config``) and torch
   AdamW, timed around: for each micro-batch (same padded tensors, built once) forward,
   ``-(logprob * advantage).sum() / n`` with plain log_softmax/gather, backward; then step.

Tokens/s counts prompt + completion tokens (padding excluded), the same on both sides.
Rounds alternate A B A B; the table gives medians. Read the last line:
``RATIO learner / bare DeepSpeed`` (round-trip tokens/s, goal >= 0.9). ``in-actor tok/s``
uses each side's own timing of its step; ``outside s`` is Ray transfer plus anything
done around the step.

    .venv/bin/python bench/learner_throughput.py [--prompts 16 --samples 8 --rounds 15]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from _common import interleave, print_table, start_ray, synthetic_groups, timed


class BareDeepSpeed:
    """DeepSpeed with nothing around it: the baseline the learner rank is measured against."""

    def pid(self) -> int:
        return os.getpid()

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, port: int, model_path: str, learner, dtype: str, seed: int, micro_batches: list, num_tokens: float):
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1"
        )
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM

        from learner.worker import deepspeed_config

        # No patching: the learner rank's attempt to skip DeepSpeed's shared-memory comm op does not
        # take effect (see bench/README.md), so plain DeepSpeed matches what it really runs.
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=learner.lr, betas=tuple(learner.betas), weight_decay=learner.weight_decay
        )
        config = deepspeed_config(learner, dtype)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.micro_batches = micro_batches
        self.num_tokens = num_tokens  # trained tokens in the whole step: the loss normaliser

    def train_step(self) -> float:
        """One optimizer step over all micro-batches; returns its seconds."""
        import time

        import torch

        start = time.perf_counter()
        self.engine.train()
        for mb in self.micro_batches:
            ids = mb["input_ids"]  # [b, L]
            logits = self.engine(input_ids=ids, attention_mask=mb["attention_mask"]).logits  # [b, L, V]
            # log pi(x_{j+1} | x_<=j) at every position; weights are zero off completion tokens
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None]).squeeze(-1)
            loss = -(logp * mb["weights"]).sum() / self.num_tokens  # weights = advantage * completion mask
            self.engine.backward(loss)
        self.engine.step()
        return time.perf_counter() - start


def bare_micro_batch(tokens, start: int, stop: int, advantages, pad_id: int) -> dict:
    """Sequences ``start..stop-1`` of a ``TokenShard`` right-padded: ``input_ids``/``attention_mask``
    [b, L] and per-target-position ``weights`` [b, L-1] (the advantage where position j+1 is a
    trained completion token, else 0)."""
    import torch

    po, co = tokens.prompt_offsets, tokens.completion_offsets
    rows = [
        (tokens.prompt_ids[po[i] : po[i + 1]].tolist(), tokens.completion_ids[co[i] : co[i + 1]].tolist())
        for i in range(start, stop)
    ]
    L = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), L), dtype=torch.long)
    weights = torch.zeros((len(rows), L - 1))
    for i, (p, c) in enumerate(rows):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attention_mask[i, : len(p) + len(c)] = 1
        weights[i, len(p) - 1 : len(p) + len(c) - 1] = float(advantages[start + i])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (sequences = prompts x samples)")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--min-completion", type=int, default=32)
    parser.add_argument("--max-completion", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=None, help="default: the config's (4096)")
    parser.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3], help="default: the config's")
    parser.add_argument("--rounds", type=int, default=15, help="timed steps per contestant (A B A B ...)")
    parser.add_argument(
        "--pin-core", type=int, default=None, help="pin both contestants' processes to this core (default: unpinned)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache" / "tandem" / "models" / "tiny-qwen2"))
    args = parser.parse_args()

    import asyncio

    import ray

    from actors.tiny_model import build_tiny_model, tiny_vocab
    from cluster.placement import ray_options
    from launch.config import TandemConfig
    from launch.plan import build_plan, rank_environment
    from learner.algorithms import grpo_advantages
    from learner.group import LearnerGroup
    from learner.worker import LearnerWorker, RankSpec

    model_path = str(build_tiny_model(args.model_dir).resolve())
    learner_overrides = {}
    if args.token_budget:
        learner_overrides["token_budget"] = args.token_budget
    if args.zero_stage is not None:
        learner_overrides["zero_stage"] = args.zero_stage
    cfg = TandemConfig.model_validate(
        {
            "model": {"path": model_path, "dtype": args.dtype},
            "data": {"prompts": "bench"},
            "reward": {"function": "bench"},
            "learner": learner_overrides,
            "rollout": {"max_tokens": args.max_completion, "group_size": args.samples},
        }
    )
    learner, seed = cfg.learner, cfg.run.seed
    kind = build_plan(cfg).learner
    options = ray_options(kind, rank_environment(kind))

    groups = synthetic_groups(
        args.prompts,
        args.samples,
        args.prompt_len,
        lambda rng: rng.integers(args.min_completion, args.max_completion + 1),
        seed,
        sampler_logprob=lambda rng, n: -4.0 * rng.random(n),
    )
    start_ray()
    log_dir = tempfile.mkdtemp(prefix="bench-learner-")
    worker = ray.remote(LearnerWorker).options(**options).remote(0, 1, os.path.join(log_dir, "learner-0.log"))
    bare = ray.remote(BareDeepSpeed).options(**options).remote()
    addr, port = ray.get(worker.rendezvous_address.remote())
    spec = RankSpec(model_path, learner, cfg.algorithm, args.dtype, seed, cfg.rollout.max_tokens)
    info = ray.get(worker.setup.remote(addr, port, spec))
    group = LearnerGroup([worker], cfg.algorithm, learner.token_budget, cfg.rollout.max_tokens)

    # B trains on A's plan: the same micro-batches, with the same GRPO advantages
    plan = group.shape_rewards(groups)
    tokens, sizes = plan.shards[0].tokens, plan.shards[0].micro_sizes[0]
    advantages = grpo_advantages(plan.gather([{"r": tokens.rewards}])["r"], args.samples)[plan.order[0]]
    pad_id, start, bare_batches = tiny_vocab()["<pad>"], 0, []
    for size in sizes:
        bare_batches.append(bare_micro_batch(tokens, start, start + size, advantages, pad_id))
        start += size
    num_tokens = plan.shards[0].normalisers[0].num_tokens
    step_tokens = int(tokens.prompt_offsets[-1] + tokens.completion_offsets[-1])
    bare_port = ray.get(bare.free_port.remote())
    ray.get(bare.setup.remote(bare_port, model_path, learner, args.dtype, seed, bare_batches, num_tokens))

    if args.pin_core is not None:  # same core for both: they meet the same neighbours
        for pid in (info["pid"], ray.get(bare.pid.remote())):
            for tid in os.listdir(f"/proc/{pid}/task"):  # every thread: affinity is per thread
                os.sched_setaffinity(int(tid), {args.pin_core})

    def run_learner() -> tuple[int, float]:
        metrics = asyncio.run(group.train_step(groups))
        return step_tokens, metrics["learner_seconds"]

    def run_bare() -> tuple[int, float]:
        return step_tokens, ray.get(bare.train_step.remote())

    print(f"warm-up; logs in {log_dir}", flush=True)
    for _ in range(2):
        run_learner(), run_bare()

    print(
        f"{args.rounds} rounds: {args.prompts * args.samples} sequences ({step_tokens} tokens) in {len(sizes)} "
        f"micro-batches of <= {learner.token_budget} tokens, ZeRO-{learner.zero_stage}, {args.dtype}"
        + (f", both pinned to core {args.pin_core}" if args.pin_core is not None else ""),
        flush=True,
    )
    rounds = interleave(lambda: timed(run_learner), lambda: timed(run_bare), args.rounds)
    ratio = print_table(("learner rank (A)", "bare DeepSpeed (B)"), rounds)
    print(f"RATIO learner / bare DeepSpeed: {ratio:.2f} (goal >= 0.9)")
    ray.shutdown()


if __name__ == "__main__":
    main()
