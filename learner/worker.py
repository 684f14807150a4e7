"""One data-parallel learner rank: a DeepSpeed engine inside a Ray actor.

Each optimizer step the rank receives its ``LearnerShard``, recomputes the log-probs
of the sampled tokens with its own weights, evaluates the policy loss with the
global normalisers (so N ranks x 1/N of the batch == 1 rank x the whole batch), runs
backward over its micro-batches and steps. Rank 0 exports the weights by Hugging
Face parameter name for the weight channel.
"""

from __future__ import annotations

import os
import time
from typing import Any

from learner.batch import LearnerShard, completion_logprobs, pad_sequences
from learner.objective import build_objective


def deepspeed_config(learner: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The DeepSpeed config a rank runs with. Micro-batching and the loss normaliser are ours:
    each ``step()`` is one accumulation boundary after however many ``backward()`` calls."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": learner["grad_clip"],
        "zero_optimization": {"stage": learner["zero_stage"]},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 10**9,
    }


class LearnerWorker:
    """A learner rank: created, asked for a rendezvous address (rank 0), then ``setup`` on all ranks."""

    def __init__(self, rank: int, world_size: int, log_path: str | None = None):
        from actors.generation import redirect_output

        redirect_output(log_path)
        self.rank, self.world_size = rank, world_size

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0's answer becomes every rank's MASTER_ADDR/PORT."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(
        self,
        master_addr: str,
        master_port: int,
        model_path: str,
        learner: dict[str, Any],
        algorithm: dict[str, Any],
        dtype: str,
        seed: int,
    ) -> dict[str, Any]:
        """Join the process group and build the DeepSpeed engine (all ranks call it together)."""
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
            LOCAL_SIZE="1",  # keeps DeepSpeed's shared-memory comm op (a JIT build) out of the way
        )
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if not cuda:
            # DeepSpeed JIT-compiles a shared-memory all-reduce op for CPU at start (20-45 s of g++),
            # and with it loaded ZeRO-3 runs sometimes aborted at exit; gloo alone is enough here.
            import deepspeed.comm.torch as ds_torch_comm

            ds_torch_comm.build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id or 0
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=learner["lr"], betas=tuple(learner["betas"]), weight_decay=learner["weight_decay"]
        )
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(learner, dtype))
        self.objective = build_objective(algorithm)
        self.zero_stage = learner["zero_stage"]
        print(f"[learner {self.rank}/{self.world_size}] ready: ZeRO-{self.zero_stage}, {dtype}", flush=True)
        return {"rank": self.rank, "pid": os.getpid()}

    def _forward_logprobs(self, micro_batch):
        batch = pad_sequences(micro_batch, self.pad_id, self.device)
        logits = self.engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return batch, completion_logprobs(logits, batch)

    def train_step(self, shard: LearnerShard) -> dict[str, float]:
        """Forward/backward every micro-batch, then one optimizer step. Returns summed metrics."""
        start = time.monotonic()
        self.engine.train()
        totals: dict[str, float] = {}
        tokens = 0
        for micro_batch in shard.micro_batches:
            batch, learner_logprobs = self._forward_logprobs(micro_batch)
            loss, metrics = self.objective(learner_logprobs, batch, shard)
            # DeepSpeed averages gradients over ranks; the loss is already a share of the
            # global sum, so scale by world size to make the reduced gradient the global one.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            n = float(batch.completion_mask.sum())
            tokens += int(n)
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for key, value in metrics.items():  # token-weighted, summed across micro-batches
                totals[key] = totals.get(key, 0.0) + float(value) * n
        self.engine.step()
        out = {k: (v if k == "loss" else v / max(tokens, 1)) for k, v in totals.items()}
        out["tokens"] = tokens
        out["seconds"] = time.monotonic() - start
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        return out

    def logprobs(self, micro_batch) -> list[list[float]]:
        """Log-probs of each sequence's completion under the current weights (no grad)."""
        import torch

        self.engine.eval()
        with torch.no_grad():
            batch, lp = self._forward_logprobs(micro_batch)
        lengths = batch.completion_mask.sum(1).long().tolist()
        return [row[:n] for row, n in zip(lp.tolist(), lengths)]

    def export_weights(self) -> list | None:
        """(HF name, CPU tensor) pairs on rank 0, None elsewhere. Every rank must call it
        (under ZeRO-3 gathering the shards is a collective)."""
        import deepspeed
        import torch

        module = self.engine.module
        with torch.no_grad():
            if self.zero_stage == 3:
                named = []
                for name, param in module.named_parameters():
                    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                        if self.rank == 0:
                            named.append((name, param.detach().to("cpu", copy=True)))
                return named if self.rank == 0 else None
            if self.rank != 0:
                return None
            return [(name, t.detach().to("cpu", copy=True)) for name, t in module.state_dict().items()]
