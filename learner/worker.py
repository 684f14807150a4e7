"""One data-parallel learner rank: a DeepSpeed engine inside a Ray actor.

Each optimizer step the rank receives its ``LearnerShard``, recomputes the log-probs
of the sampled tokens with its own weights, evaluates the policy loss with the
global normalisers (so N ranks x 1/N of the batch == 1 rank x the whole batch), runs
backward over its micro-batches and steps. Rank 0 exports the weights by Hugging
Face parameter name for the weight channel.

A process holds one or more roles: ``policy`` (the trained model), ``critic`` (PPO's
value model, its own DeepSpeed engine) and ``reference`` (the frozen KL reference).
Colocated, one rank holds all its run needs; placed separately, critic ranks form their
own DeepSpeed group beside the policy's (training concurrently on the same shards) and a
reference actor holds only the reference and no process group.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

from learner.algorithms import value_loss
from learner.batch import LearnerShard
from learner.critic import build_value_model
from learner.methods import build_objective, value_weights
from learner.packing import pack_sequences, packed_at_completion, packed_completion_logprobs


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


def _attention_of(model) -> str:
    """The attention implementation of a policy engine, a critic engine or a plain reference model."""
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps its module
    config = getattr(module, "config", None) or getattr(getattr(module, "backbone", None), "config", None)
    return getattr(config, "_attn_implementation", "sdpa")


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
        roles: tuple[str, ...] = ("policy",),
    ) -> dict[str, Any]:
        """Join the process group and build this process's models (all ranks of a group call it
        together; a reference-only process joins no group)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.roles = tuple(roles)
        if "policy" in roles or "critic" in roles:
            self._init_distributed(master_addr, master_port, cuda)
        self.pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id or 0
        self.algorithm = algorithm
        self.engine = self.critic = self.reference = None
        if "policy" in roles:
            self.engine = self._engine(
                AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), learner, dtype
            )
            self.objective = build_objective(algorithm)
        if "critic" in roles:
            critic_cfg = algorithm["critic"]
            value_model = build_value_model(critic_cfg["path"] or model_path, critic_cfg["init"], seed)
            self.critic = self._engine(value_model, {**learner, "lr": critic_cfg["lr"]}, dtype)
        if "reference" in roles:
            ref_path = algorithm["kl"]["reference_path"] or model_path
            dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
            self.reference = AutoModelForCausalLM.from_pretrained(ref_path, dtype=dt).to(self.device).eval()
            self.reference.requires_grad_(False)
        self.zero_stage = learner["zero_stage"]
        # sdpa takes a boolean block mask (a quarter of a float mask's memory); eager adds it to the scores.
        attention = _attention_of(next(m for m in (self.engine, self.critic, self.reference) if m is not None))
        self.mask_dtype = (
            torch.bool if attention == "sdpa" else (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        )
        self.row_tokens = learner["pack_row_tokens"]
        print(
            f"[{'learner' if self.engine else self.roles[0]} {self.rank}/{self.world_size}] ready: "
            f"{'+'.join(self.roles)}, {algorithm['name']}, "
            f"ZeRO-{self.zero_stage}, {dtype}",
            flush=True,
        )
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def _init_distributed(self, master_addr: str, master_port: int, cuda: bool) -> None:
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
            LOCAL_SIZE="1",  # keeps DeepSpeed's shared-memory comm op (a JIT build) out of the way
        )
        import deepspeed

        if not cuda:
            # DeepSpeed JIT-compiles a shared-memory all-reduce op for CPU at start (20-45 s of g++),
            # and with it loaded ZeRO-3 runs sometimes aborted at exit; gloo alone is enough here.
            # (importlib: the package attribute deepspeed.comm.torch is PyTorch itself, not the submodule)
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")

    def _engine(self, model, learner: dict[str, Any], dtype: str):
        import deepspeed
        import torch

        optimizer = torch.optim.AdamW(
            model.parameters(), lr=learner["lr"], betas=tuple(learner["betas"]), weight_decay=learner["weight_decay"]
        )
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(learner, dtype))
        return engine

    def _pack(self, micro_batch):
        """Pack a micro-batch into rows (an empty one becomes a zero-weight dummy: every rank
        must run the same number of passes for ZeRO's collectives)."""
        return pack_sequences(micro_batch, self.pad_id, self.device, self.mask_dtype, self.row_tokens)

    def _models(self) -> list:
        """The engines this process updates (policy and/or critic)."""
        return [m for m in (self.engine, self.critic) if m is not None]

    @staticmethod
    def _completion_logprobs(model, batch, with_entropy: bool = False):
        """``model``'s (policy or reference) log-probs of the packed completion tokens ``[n, T]``
        (and their entropy if asked)."""
        logits = model(**batch.model_inputs(), logits_to_keep=batch.logits_to_keep()).logits
        return packed_completion_logprobs(logits, batch, with_entropy=with_entropy)

    def score(self, shard: LearnerShard) -> list[dict[str, list[float]]]:
        """Before any update: per sequence, what this process's roles give: the log-probs under
        the current policy (the old policy of this batch), the reference log-probs, the critic's values."""
        import torch

        out: list[dict[str, list[float]]] = []
        for model in self._models():
            model.eval()
        with torch.no_grad():
            for mb in shard.minibatches:
                for micro in mb.micro_batches:
                    batch = self._pack(micro)
                    fields = {}
                    if self.engine is not None:
                        fields["old_logprobs"] = self._completion_logprobs(self.engine, batch)
                    if self.reference is not None:
                        fields["ref_logprobs"] = self._completion_logprobs(self.reference, batch)
                    if self.critic is not None:
                        values = self.critic(**batch.model_inputs())  # [1, L]
                        fields["values"] = packed_at_completion(values, batch).float() * batch.completion_mask
                    for i, n in enumerate(batch.completion_lengths):  # the dummy has no sequences
                        out.append({k: v[i, :n].tolist() for k, v in fields.items()})
        return out

    def train_step(self, shard: LearnerShard) -> dict[str, float]:
        """Every epoch, every minibatch: forward/backward its micro-batches, one optimizer step
        (of the policy and/or the critic, whichever this process holds). Returns token-weighted
        mean metrics; ``loss`` is this rank's share of the global policy loss (summed over
        minibatches and epochs)."""
        start = time.monotonic()
        totals: dict[str, float] = {"loss": 0.0}
        tokens = 0
        for model in self._models():
            model.train()
        for _ in range(shard.epochs):
            for mb in shard.minibatches:
                for micro in mb.micro_batches:
                    batch = self._pack(micro)
                    n = float(batch.completion_mask.sum())
                    tokens += int(n)
                    metrics = {}
                    if self.engine is not None:
                        learner_logprobs, entropy = self._completion_logprobs(self.engine, batch, with_entropy=True)
                        loss, metrics = self.objective(learner_logprobs, batch, mb, shard.kl_beta)
                        # DeepSpeed averages gradients over ranks; the loss is already a share of the
                        # global sum, so scale by world size to make the reduced gradient the global one.
                        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                        metrics["entropy"] = entropy.sum() / max(n, 1.0)
                        totals["loss"] += float(loss.detach())
                    if self.critic is not None:
                        metrics.update(self._critic_backward(batch, mb))
                    for key, value in metrics.items():  # token-weighted, summed across micro-batches
                        totals[key] = totals.get(key, 0.0) + float(value) * n
                for model in self._models():
                    model.step()
        out = {k: (v if k == "loss" else v / max(tokens, 1)) for k, v in totals.items()}
        out["tokens"] = tokens / shard.epochs
        out["seconds"] = time.monotonic() - start
        grad_norm = self.engine.get_global_grad_norm() if self.engine is not None else None
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        return out

    def _critic_backward(self, batch, minibatch) -> dict[str, float]:
        values = packed_at_completion(self.critic(**batch.model_inputs()), batch).float()  # [n, T]
        weights = value_weights(batch, minibatch, self.algorithm)
        clip = self.algorithm["critic"]["value_clip"]
        loss, metrics = value_loss(
            values,
            batch.returns,
            batch.completion_mask,
            weights,
            old_values=batch.old_values if clip else None,
            clip=clip,
        )
        self.critic.backward(loss * self.world_size, scale_wrt_gas=False)
        return {"value_loss_share": float(loss.detach()), **{f"critic_{k}": v for k, v in metrics.items()}}

    def logprobs(self, micro_batch) -> list[list[float]]:
        """Log-probs of each sequence's completion under the current weights (no grad)."""
        import torch

        self.engine.eval()
        with torch.no_grad():
            batch = self._pack(micro_batch)
            lp = self._completion_logprobs(self.engine, batch)
        return [row[:n] for row, n in zip(lp.tolist(), batch.completion_lengths)]

    def open_weight_publisher(self, receivers: int, weights: dict[str, Any], connect_timeout_s: float):
        """Rank 0: start the distributed weight group (this rank + ``receivers`` actors); returns its spec."""
        import ray

        from cluster.dist_channel import DistPublisher

        self.publisher = DistPublisher(
            ray.util.get_node_ip_address(),
            0,
            receivers + 1,
            weights["push_timeout_s"],
            connect_timeout_s=connect_timeout_s,
            bucket_bytes=weights["bucket_mb"] << 20,
            backend=weights["process_group"],
        )
        return self.publisher.spec

    def publish_weights(self, version: int) -> None:
        """Every rank (gathering ZeRO-3 shards is a collective); rank 0 pushes to the actors and
        raises ``WeightPushError`` naming any actor that did not take them within the deadline."""
        named = self.export_weights(copy=False)  # publish packs them into its buckets before returning
        if self.rank == 0:
            self.publisher.publish(version, named)

    def close_weight_publisher(self) -> None:
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()

    def export_flat_weights(self):
        """``export_weights`` as ``FlatWeights`` (rank 0; None elsewhere): the form the Ray weight
        path stores, so the one copy is into the object store as this method returns."""
        from cluster.weights import FlatWeights

        named = self.export_weights(copy=False)
        return FlatWeights(named) if named is not None else None

    def export_weights(self, copy: bool = True) -> list | None:
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
            # copy=False: views of the live parameters (on CPU), valid until the next step.
            return [(name, t.detach().to("cpu", copy=copy)) for name, t in module.state_dict().items()]
