"""One data-parallel learner rank: DeepSpeed engines inside a Ray actor.

The rank builds its models and hands them to a ``RankStep`` (``learner/rank.py``), which
does the step's work on the shard it keeps between scoring and training; this module adds
what needs Ray and DeepSpeed: the process group, the engines, and the weights' way out
(rank 0 publishes them on the weight channel, ``cluster/channel.py``).

A process holds one or more roles: ``policy`` (the trained model), ``critic`` (PPO's
value model, its own DeepSpeed engine) and ``reference`` (the frozen KL reference).
Colocated, one rank holds all its run needs; placed separately, critic ranks form their
own DeepSpeed group beside the policy's (training concurrently on the same shards) and a
reference actor holds only the reference and no process group.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from cluster.channel import WeightPublisher, WeightReceiver, open_weight_publisher
from cluster.config import WeightsConfig
from cluster.dist_group import bound_store, listening_socket
from cluster.logs import redirect_output
from cluster.timeline import Span, Spans
from learner import saving
from learner.attention import Attention, flash_attn_importable, select_attention
from learner.config import AlgorithmConfig, LearnerConfig
from learner.critic import build_value_model
from learner.lora import adapter_weights, is_peft, lora_summary, merge_lora, save_adapter, with_lora
from learner.offload import offload, reload
from learner.rank import Layout, Models, RankStep, Sampled
from learner.schedule import lr_factor
from learner.shard import RankShard
from schema.process import ignore_sigterm


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a group is set up with."""

    model_path: str
    learner: LearnerConfig
    algorithm: AlgorithmConfig
    dtype: str  # "float32" | "bfloat16"
    seed: int
    max_tokens: int  # rollout.max_tokens: L_max of fixed-length aggregation
    roles: tuple[str, ...] = ("policy",)  # policy / critic / reference
    total_updates: int = 0  # optimizer updates in the run (the schedule's decay length; 0: no decay)
    timeline: bool = True  # record spans for RUN_DIR/timeline.jsonl (run.timeline)
    temperature: float = 1.0  # rollout.temperature: the ranks score softmax(z / T), what the actors sampled
    min_tokens: int = 0  # rollout.min_tokens: the actors could not stop before it


def deepspeed_config(learner: LearnerConfig, dtype: str) -> dict[str, Any]:
    """The DeepSpeed config a rank runs with. Micro-batching and the loss normaliser are ours:
    each ``step()`` is one accumulation boundary after however many ``backward()`` calls."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": learner.grad_clip,
        "zero_optimization": {"stage": learner.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bfloat16"},
        "steps_per_print": 10**9,
    }


def packing_layout(
    attention: Attention, learner: LearnerConfig, dtype: str, pad_id: int, device, sampled: Sampled | None = None
) -> Layout:
    """How a rank packs for ``attention``: varlen kernels get one row per micro-batch and no mask
    (the sequences are found from the position ids); sdpa a boolean block mask (a quarter of a
    float mask's memory); eager an additive one in the compute dtype, which it adds to the scores."""
    import torch

    if attention.varlen:
        mask_dtype, row_tokens = None, 0
    else:
        float_mask = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        mask_dtype, row_tokens = (torch.bool if attention.mask == "bool" else float_mask), learner.pack_row_tokens
    chunk = learner.logprob_chunk_tokens
    return Layout(pad_id, device, mask_dtype, row_tokens, logprob_chunk=chunk, sampled=sampled or Sampled())


def stop_token_ids(model_path: str, tokenizer) -> tuple[int, ...]:
    """The tokens vLLM stops on, and bans before ``rollout.min_tokens``: the tokenizer's EOS and the
    ``eos_token_id`` (one or a list) of the model's generation config, as vLLM reads them."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return tuple(sorted(ids))


def enable_gradient_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward instead of keeping them (non-reentrant:
    works with packed rows and frozen inputs)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


class LearnerWorker:
    """A learner rank: created, asked for a rendezvous address (rank 0), then ``setup`` on all ranks."""

    def __init__(self, rank: int, world_size: int, log_path: str | None = None, name: str | None = None):
        ignore_sigterm()  # a SIGTERM to every process of a job is the driver's to act on
        redirect_output(log_path)
        self.rank, self.world_size = rank, world_size
        self.publisher: WeightPublisher | None = None
        self.spans = Spans(name or f"learner-{rank}")  # returned by publish_weights, once a step
        self._listener = None  # rank 0: the socket its group store will serve on (rendezvous_address)
        self._published = False  # rank 0 has said what a published version holds
        self._offloaded: dict = {}  # role -> what learner/offload.py moved out (colocated, GPUs)
        self.lora: dict[str, int] | None = None  # learner.lora: lora_summary of the policy

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a port listening there only (kept for ``setup``, where rank 0 serves the
        group's store on it): rank 0's answer becomes every rank's MASTER_ADDR/PORT."""
        import ray

        self._listener = listening_socket(ray.util.get_node_ip_address())
        return self._listener.getsockname()[:2]

    def setup(self, master_addr: str, master_port: int, spec: RankSpec) -> dict[str, Any]:
        """Join the process group and build this process's models (all ranks of a group call it
        together; a reference-only process joins no group)."""
        import ray
        import torch

        self.spans.enabled = spec.timeline
        cuda = torch.cuda.is_available()
        # chosen before joining the group: a forced kernel that cannot run here fails at once, in one line
        attention = select_attention(spec.learner.attention, cuda, cuda and flash_attn_importable(), spec.dtype)
        if "policy" in spec.roles or "critic" in spec.roles:
            self._init_distributed(master_addr, master_port, cuda, spec.learner.collective_timeout_s)
        self.build(spec, attention)
        context = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node": context.get_node_id(),
            "actor_id": context.get_actor_id(),
            "attention": attention.describe(),  # rank 0's is said on the console
            **({"lora": self.lora} if self.lora else {}),
        }

    def build(self, spec: RankSpec, attention: Attention) -> None:
        """This process's models (loaded with ``attention``'s kernel), packing layout and ``RankStep``.
        Needs the process group when the process trains; needs no Ray (``bench/learner_memory.py``
        calls it in-process)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(spec.seed)
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        roles = tuple(spec.roles)
        attn = {"attn_implementation": attention.implementation}
        models = Models()
        if "policy" in roles:
            model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.float32, **attn)
            if spec.learner.gradient_checkpointing:
                enable_gradient_checkpointing(model)
            if spec.learner.lora is not None:
                model = with_lora(model, spec.learner.lora)  # the base frozen: only the adapters train
                self.lora = lora_summary(model, spec.dtype)  # the console's line (before ZeRO-3 partitions it)
            models.policy = self._engine(model, spec.learner, spec.learner.lr, spec.dtype, spec.total_updates)
        if "critic" in roles:
            critic = spec.algorithm.critic
            value_model = build_value_model(critic.path or spec.model_path, critic.init, spec.seed, **attn)
            models.critic = self._engine(value_model, spec.learner, critic.lr, spec.dtype, spec.total_updates)
        if "reference" in roles:
            ref_path = spec.algorithm.kl.reference_path or spec.model_path
            dt = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
            models.reference = AutoModelForCausalLM.from_pretrained(ref_path, dtype=dt, **attn).to(device).eval()
            models.reference.requires_grad_(False)
        self.zero_stage = spec.learner.zero_stage
        self.policy, self.critic = models.policy, models.critic
        self.model_path = spec.model_path
        tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
        pad_id = tokenizer.pad_token_id or 0
        stops = stop_token_ids(spec.model_path, tokenizer) if spec.min_tokens > 0 else ()
        sampled = Sampled(spec.temperature, spec.min_tokens, stops)
        layout = packing_layout(attention, spec.learner, spec.dtype, pad_id, device, sampled)
        self.step = RankStep(models, spec.algorithm, layout, spec.max_tokens, self.world_size)
        print(
            f"[{'learner' if models.policy else roles[0]} {self.rank}/{self.world_size}] ready: "
            f"{'+'.join(roles)}, {spec.algorithm.name}, ZeRO-{self.zero_stage}, {spec.dtype}, "
            f"{attention.describe()}",
            flush=True,
        )

    def join_alone(self, timeout_s: float = 600) -> None:
        """A group of this one rank on this host: benches and checks that build a rank in-process, without
        Ray (``nccl`` with a GPU, ``gloo`` without, as a run's ranks)."""
        import torch

        self._listener = listening_socket("127.0.0.1")
        host, port = self._listener.getsockname()[:2]
        self._init_distributed(host, port, torch.cuda.is_available(), timeout_s)

    def _init_distributed(self, master_addr: str, master_port: int, cuda: bool, timeout_s: float) -> None:
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
        import torch.distributed as dist

        # The group's store: rank 0 serves it on the socket bound in rendezvous_address (torch's env://
        # rendezvous would listen on every interface); DeepSpeed then takes the initialised group.
        # Every collective of the group (ZeRO's, the export's, the checkpoint's) gets this deadline.
        timeout, backend = timedelta(seconds=timeout_s), "nccl" if cuda else "gloo"
        if self.rank == 0 and self._listener is not None:
            store = bound_store(self._listener, self.world_size, timeout)
        else:
            store = dist.TCPStore(master_addr, master_port, self.world_size, False, timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)

    def _engine(self, model, learner: LearnerConfig, lr: float, dtype: str, total_updates: int):
        import deepspeed
        import torch

        trained = [p for p in model.parameters() if p.requires_grad]  # all of them, or LoRA's adapters
        optimizer = torch.optim.AdamW(trained, lr=lr, betas=tuple(learner.betas), weight_decay=learner.weight_decay)
        factor = functools.partial(
            lr_factor,
            kind=learner.lr_schedule,
            warmup=learner.warmup_steps,
            total=total_updates,
            min_ratio=learner.min_lr_ratio,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)  # saved and restored with the engine
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=schedule, config=deepspeed_config(learner, dtype)
        )
        return engine

    # --- one training step (learner/rank.py) ----------------------------------------------
    def score(self, shard: RankShard):
        with self.spans.span("score"):
            return self.step.score(shard)

    def summarise(self, kl_beta: float, *imports):
        with self.spans.span("advantages"):
            return self.step.summarise(kl_beta, *imports)

    def expand(self, per_sequence):
        with self.spans.span("advantages"):
            return self.step.expand(per_sequence)

    def train(self, whitening, kl_beta: float, *imports, is_means: list[float] | None = None):
        with self.spans.span("train"):
            return self.step.train(whitening, kl_beta, *imports, is_means=is_means)

    def completion_logprobs(self, prompt_token_ids: list[int], completion_token_ids: list[int]) -> list[float]:
        """Log-probabilities of a fixed completion under the current policy (for checks and tests)."""
        import numpy as np
        import torch

        from learner.packing import pack_range, packed_completion_logprobs
        from learner.shard import TokenShard

        n = len(completion_token_ids)
        tokens = TokenShard(
            np.asarray(prompt_token_ids, np.int32),
            np.array([0, len(prompt_token_ids)]),
            np.asarray(completion_token_ids, np.int32),
            np.array([0, n]),
            np.ones(n, np.uint8),
            np.zeros(n, np.float32),
            np.zeros(1, np.float32),
        )
        lay = self.step.layout
        micro = pack_range(tokens, 0, 1, lay.pad_id, lay.device, lay.mask_dtype, lay.row_tokens)
        self.policy.eval()
        with torch.no_grad():
            logits = self.policy(**micro.model_inputs(), logits_to_keep=micro.logits_to_keep()).logits
            return packed_completion_logprobs(logits, micro)[0].tolist()

    # --- saving and restoring (learner/saving.py) ---------------------------------------------
    def _engines(self) -> dict:
        return {role: m for role, m in (("policy", self.policy), ("critic", self.critic)) if m is not None}

    def save_checkpoint(self, directory: str) -> None:
        """Every rank of the group: the DeepSpeed state of the models this process trains."""
        saving.save_engines(self._engines(), directory, {"rng": saving.rng_state()})
        if self.rank == 0 and self.policy is not None:
            module = self.policy.module
            saving.save_hf_files(module, self.model_path, os.path.join(directory, "hf"))
            if is_peft(module):  # its rank and alpha: what `tandem export` merges the adapter with
                module.peft_config["default"].save_pretrained(os.path.join(directory, "hf"))

    def offload_states(self) -> None:
        """The colocated schedule on GPUs, while the engines generate: this rank's optimizer states,
        master and model weights and gradient buffers go to host memory (``learner/offload.py``), and
        the allocator's cache goes back to the device."""
        import torch

        if self._offloaded:  # already out (a second call records nothing new)
            return
        cuda = torch.cuda.is_available()
        self._offloaded = {role: offload(engine, cuda) for role, engine in self._engines().items()}
        if cuda:
            torch.cuda.empty_cache()

    def reload_states(self) -> None:
        """Everything ``offload_states`` moved, back on the device before the training phase."""
        for role, engine in self._engines().items():
            if role in self._offloaded:
                reload(engine, self._offloaded.pop(role))

    def load_checkpoint(self, directory: str) -> None:
        state = saving.load_engines(self._engines(), directory)
        saving.set_rng_state(state.get("rng", {}))

    def save_model(self, directory: str) -> None:
        """Every policy rank (ZeRO-3 gathers); rank 0 writes the Hugging Face model directory."""
        if self.policy is None:
            return
        module = self.policy.module
        if not is_peft(module):
            named = self.export_weights(copy=False)
            if self.rank == 0:
                saving.save_hf_model(module, named, self.model_path, directory)
            return
        everything = self._gather(lambda name: True)  # LoRA: the base merged, and the adapter beside it
        if self.rank == 0:
            config = module.peft_config["default"]
            merged = merge_lora(dict(everything), config.r, config.lora_alpha)
            saving.save_hf_model(module.get_base_model(), list(merged.items()), self.model_path, directory)
            save_adapter(module, adapter_weights(everything), os.path.join(directory, "adapter"))

    # --- the weights' way out ---------------------------------------------------------------
    def open_weight_publisher(
        self, weights: WeightsConfig, names: list[str], connect_timeout_s: float
    ) -> list[WeightReceiver]:
        """Rank 0: open the weight channel to the actors ``names``; returns their receivers, in order."""
        self.publisher = open_weight_publisher(weights, len(names), connect_timeout_s)
        return self.publisher.receivers(names)

    def publish_weights(self, version: int) -> list[Span]:
        """Every rank (gathering ZeRO-3 shards is a collective); rank 0 publishes, and raises
        (``WeightPushError`` on the distributed channel) naming any actor that missed the deadline.
        Returns this rank's spans of the step, each marked with the ``version`` it produced."""
        with self.spans.span("publish"):
            # publish copies them out before returning; an NCCL channel sends them from the GPU
            named = self.export_weights(copy=False, device=self.publisher.device if self.publisher else "cpu")
            if self.rank == 0:
                if not self._published:
                    size = sum(t.numel() * t.element_size() for _, t in named)
                    what = "the LoRA adapter" if is_peft(self.policy.module) else "the whole policy"
                    print(
                        f"[learner 0] each version published: {what}, {len(named)} tensors, {size / 1e6:.2f} MB",
                        flush=True,
                    )
                    self._published = True
                self.publisher.publish(version, named)
        return self.take_spans(version)

    def take_spans(self, version: int) -> list[Span]:
        """This process's spans since the last take, each marked with the ``version`` its step
        produced (a separate critic or reference process is asked for them at each publish)."""
        return [dataclasses.replace(span, version=version) for span in self.spans.take()]

    def close_weight_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    def export_weights(self, copy: bool = True, device: str = "cpu") -> list | None:
        """(HF name, tensor) pairs on rank 0, None elsewhere: the policy's weights, or with
        ``learner.lora`` its adapter's (PEFT's names). Every rank must call it (under ZeRO-3 gathering
        the shards is a collective). ``device``: where the tensors are wanted (``cuda`` for an NCCL
        weight channel: at ZeRO 0-2 with ``copy=False`` the live parameters themselves, no copy through
        the host); ZeRO-3's gathered parameters always come to the host one by one, never the whole
        model gathered on the device."""
        import torch

        module = self.policy.module
        if is_peft(module):
            return adapter_weights(self._gather(lambda name: ".lora_" in name, copy, device))
        if self.zero_stage == 3:
            return self._gather(lambda name: True)
        with torch.no_grad():
            if self.rank != 0:
                return None
            # copy=False: views of the live parameters (where they are wanted), valid until the next step.
            return [(name, t.detach().to(device, copy=copy)) for name, t in module.state_dict().items()]

    def _gather(self, wanted, copy: bool = True, device: str = "cpu") -> list | None:
        """(name, tensor) of the policy's parameters whose name ``wanted`` accepts, on rank 0 (None
        elsewhere), on ``device`` (ZeRO-3: the host); under ZeRO-3 every rank gathers them together."""
        import deepspeed
        import torch

        params = [(name, p) for name, p in self.policy.module.named_parameters() if wanted(name)]
        with torch.no_grad():
            if self.zero_stage == 3:  # one parameter at a time: never the whole model gathered at once
                named = []
                for name, param in params:
                    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                        if self.rank == 0:
                            named.append((name, param.detach().to("cpu", copy=True)))
                return named if self.rank == 0 else None
            if self.rank != 0:
                return None
            return [(n, p.detach().to(device, copy=copy)) for n, p in params]
