"""The run's processes as placement sees them: one ``ProcessKind`` per kind of process.

The actors and the learner ranks always; PPO's critic and the KL reference model only when
the run has them and they are placed on processes of their own (colocated, they live on the
learner ranks and add no process). Each kind carries the environment its role needs.

The memory plan places ``cluster/memory.py``'s terms the same way: which process holds which term on
which GPU, in which phase (training, the optimizer step; colocated also generating and starting), from
the typed sections; ``tandem plan`` prints it and ``tandem train``'s preflight refuses a GPU over its device.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from actors.environment import actor_env, reward_model_env
from cluster.memory import (
    CUDA_CONTEXT,
    SLEEPING_ENGINE,
    EngineShare,
    Gpu,
    MemoryPlanError,
    ModelShape,
    Term,
    activation_bytes,
    chunk_bytes,
    engine_share,
    gib,
    known_shape,
    layer_activation_bytes,
    logits_bytes,
    mask_bytes,
    over,
    shape_of,
    training_state,
)
from cluster.placement import ProcessKind
from launch.config import TandemConfig
from learner.attention import select_attention
from learner.config import LearnerConfig
from learner.environment import rank_env


@dataclass(frozen=True)
class Plan:
    actors: ProcessKind
    learner: ProcessKind
    critic: ProcessKind | None  # separate critic ranks, one per learner rank
    reference: ProcessKind | None  # separate reference actors
    reward_model: ProcessKind | None = None  # the reward model's actors (reward.model)

    @property
    def kinds(self) -> list[ProcessKind]:
        kinds = (self.actors, self.learner, self.critic, self.reference, self.reward_model)
        return [k for k in kinds if k is not None]


def _kind(prefix: str, label: str, count: int, section, key: str, **extra) -> ProcessKind:
    """A kind of process whose resources are the ``resources.<key>`` section ``section``."""
    return ProcessKind(
        prefix, label, count, section.num_cpus, section.num_gpus, dict(section.custom), f"resources.{key}", **extra
    )


def build_plan(cfg: TandemConfig) -> Plan:
    res = cfg.resources
    tp = res.actors.tensor_parallel
    actors = _kind("actor", "actor", res.actors.count, res.actors, "actors", count_key="resources.actors.count",
                   note=f"vLLM tensor parallel {tp}" if tp > 1 else "")  # fmt: skip
    learner = _kind("learner", "learner rank", res.learner.ranks, res.learner, "learner",
                    count_key="resources.learner.ranks")  # fmt: skip
    separate_critic = cfg.has_critic and res.critic.placement == "separate"
    separate_reference = cfg.has_reference and res.reference.placement == "separate"
    both = separate_critic and separate_reference  # one hint names both: resources.critic/reference.placement
    critic = reference = None
    if separate_critic:  # as many critic ranks as learner ranks: they train on the same shards
        hint = "resources.critic/reference.placement" if both else "resources.critic.placement"
        critic = _kind("critic", "critic rank", res.learner.ranks, res.critic, "critic", colocate_hint=hint)
    if separate_reference:
        reference = _kind("reference", "reference actor", res.reference.count, res.reference, "reference",
                          count_key="resources.reference.count",
                          colocate_hint=None if both else "resources.reference.placement")  # fmt: skip
    reward_model = None
    if cfg.reward.model is not None:
        reward_model = _kind("reward-model", "reward model actor", res.reward_model.count, res.reward_model,
                             "reward_model", count_key="resources.reward_model.count")  # fmt: skip
    if cfg.run.schedule == "colocated":
        actors, learner = colocate(actors, learner)
    return Plan(actors, learner, critic, reference, reward_model)


def colocate(actors: ProcessKind, learner: ProcessKind) -> tuple[ProcessKind, ProcessKind]:
    """The colocated schedule: the actors go into the learner ranks' bundles (actor i into rank i's modulo
    the ranks), and every process of a shared bundle asks Ray for an equal fraction of what it uses, so
    the bundle's CPUs and GPUs are counted once: the phases take turns on them."""
    per_bundle = math.ceil(actors.count / learner.count)
    share = 1.0 / (1 + per_bundle)
    note = "shares the learner's devices, generating while the learner waits"
    return (
        replace(actors, shares=learner.prefix, share=share, note=", ".join(filter(None, [actors.note, note]))),
        replace(learner, share=share),
    )


def actor_environment(cfg: TandemConfig, index: int) -> dict[str, str]:
    return actor_env(cfg.resources.actors, index, cfg.engine)


def reward_model_environment(kind: ProcessKind) -> dict[str, str]:
    return reward_model_env(kind.num_cpus)


def rank_environment(kind: ProcessKind) -> dict[str, str]:
    return rank_env(kind.num_cpus, kind.num_gpus)


# --- the memory plan (cluster/memory.py's arithmetic, placed by the run's roles) ----------------------


def read_shape(source: str) -> ModelShape | None:
    """A folder's config.json, or a Qwen2.5 size or hub id (``known_shape``); None when neither (or the
    config lacks a field the plan reads)."""
    config = Path(source).expanduser() / "config.json"
    if not config.is_file():
        return known_shape(source)
    try:
        tree = json.loads(config.read_text())
        return shape_of(SimpleNamespace(**tree.get("text_config", tree)))
    except (ValueError, AttributeError, TypeError):
        return None


def model_shape(cfg: TandemConfig, given: str | None = None) -> ModelShape | None:
    """The shape to plan with: ``given`` (``tandem plan --model-shape``: a Qwen2.5 size such as 7B, or a
    folder with a config.json), else model.path's config.json, else a Qwen2.5 hub id's size; None if unknown."""
    for source in filter(None, (given, cfg.model.path)):
        if (shape := read_shape(source)) is not None:
            return shape
    return None


def dense_attention(cfg: TandemConfig, flash_attn: bool | None = None) -> bool:
    """The learner's kernel on a GPU needs a dense mask: every choice but flash_attention_2, which ``auto``
    picks only with flash_attn importable (``learner/attention.py``; ``flash_attn`` None: look here)."""
    if flash_attn is None:
        flash_attn = importlib.util.find_spec("flash_attn") is not None
    try:
        return not select_attention(cfg.learner.attention, True, flash_attn, cfg.model.dtype).varlen
    except ValueError:  # flash_attention_2 forced where it cannot run: the rank refuses it; plan as asked
        return False


def policy_terms(
    learner: LearnerConfig, shape: ModelShape, ranks: int, dtype: str, longest: int, dense: bool
) -> tuple[list[Term], list[Term], list[Term]]:
    """The trained policy on one learner rank's GPU (``ranks`` of them, ``dtype`` = model.dtype, sequences of up
    to ``longest`` tokens, ``dense``: the kernel takes a block mask): what stays, what the backward adds, what the
    optimizer step adds. ``bench/gpu_check.py`` prints the same beside what a GPU measured."""
    b = 2 if dtype == "bfloat16" else 4
    lora = learner.lora
    psi = shape.lora_params(lora.rank, lora.target_modules) if lora else shape.params
    st = training_state(psi, shape.params, learner.zero_stage, ranks, b)
    zero = "raise learner.zero_stage" if learner.zero_stage < 3 else "add learner ranks (resources.learner.ranks)"
    p = "learner rank"
    stays = [Term(p, "weights", st["weights"], zero), Term(p, "gradients", st["gradients"], zero),
             Term(p, "optimizer (fp32 master + AdamW moments)", st["optimizer"], zero),
             Term(p, "DeepSpeed buckets", st["reduce bucket"]), Term(p, "CUDA context", CUDA_CONTEXT)]  # fmt: skip
    tokens = max(learner.token_budget, longest)  # a longer sequence is a micro-batch of its own
    sdpa = dense and learner.attention != "eager"
    ckpt = learner.gradient_checkpointing
    backward = [
        Term(p, f"activations ({tokens} tokens{', checkpointed' if ckpt else ''})",
             activation_bytes(shape, tokens, b, ckpt, sdpa),
             "lower learner.token_budget" if ckpt else "set learner.gradient_checkpointing=true"),
        Term(p, "backward work (one layer)", tokens * layer_activation_bytes(shape, b, sdpa),
             "lower learner.token_budget"),
        Term(p, "logits and their gradient", logits_bytes(shape.vocab, tokens, b), "lower learner.token_budget"),
        Term(p, "logits chunk (fp32)", chunk_bytes(shape.vocab, min(learner.logprob_chunk_tokens or tokens, tokens)),
             "lower learner.logprob_chunk_tokens"),
    ]  # fmt: skip
    if dense:
        mask = mask_bytes(_mask_elements(learner, tokens, longest), b, shape.layers, ckpt, sdpa, shape.heads)
        flash = "set learner.attention=flash_attention_2 (pip install -e '.[flash]' --no-build-isolation)"
        what = "sdpa's copies" if sdpa else "eager's attention probabilities"
        backward.append(Term(p, f"attention mask of the micro-batch (and {what})", mask, flash))
    step = [Term(p, "fp32 gradients at the step", st["step"], zero)]
    return stays, backward, step


def _learner_terms(cfg: TandemConfig, shape: ModelShape, dense: bool) -> tuple[list[Term], list[Term], list[Term]]:
    """Learner rank 0's GPU: the policy's terms, and the reference, critic and weight channel it holds."""
    res, b = cfg.resources, _bytes(cfg)
    stays, backward, step = policy_terms(cfg.learner, shape, res.learner.ranks, cfg.model.dtype,
                                         cfg.engine.max_model_len, dense)  # fmt: skip
    if cfg.has_reference and res.reference.placement == "colocated":
        stays.append(Term("reference", "weights", shape.params * b, "set resources.reference.placement=separate"))
    if cfg.has_critic and res.critic.placement == "colocated":
        value = shape.params - (0 if shape.tied else shape.vocab * shape.hidden) + shape.hidden + 1
        cs = training_state(value, value, cfg.learner.zero_stage, res.learner.ranks, b)
        knob = "set resources.critic.placement=separate"
        stays += [Term("critic", k, cs[k], knob) for k in ("weights", "gradients", "optimizer", "reduce bucket")]
    if cfg.weights.backend == "distributed" and cfg.weights.process_group == "nccl":
        ring = 2 * cfg.weights.bucket_mb << 20
        stays.append(Term("learner rank", "weight channel pack ring (2 buckets)", ring, "lower weights.bucket_mb"))
    return stays, backward, step


def _trained(cfg: TandemConfig, shape: ModelShape) -> int:
    """Psi: the policy's trained parameters (all, or LoRA's adapters)."""
    lora = cfg.learner.lora
    return shape.lora_params(lora.rank, lora.target_modules) if lora else shape.params


def _bytes(cfg: TandemConfig) -> int:
    return 2 if cfg.model.dtype == "bfloat16" else 4


def _mask_elements(learner: LearnerConfig, tokens: int, longest: int) -> int:
    """R Lr^2 of the largest [R, 1, Lr, Lr] mask one micro-batch of ``tokens`` can carry (``learner/rank_batch.py``
    packs one at a time): n sequences of l tokens, n = tokens // l >= 2 (one sequence runs without a mask), l = the
    longest or half the budget, in rows of Lr = max(l, learner.pack_row_tokens) (``learner/packing.py``)."""
    row, worst = learner.pack_row_tokens, 0
    for length in {longest, min(longest, tokens // 2)}:
        n = tokens // max(length, 1)
        if n >= 2:
            width = length if row is None else max(row or tokens, length)
            worst = max(worst, math.ceil(n * length / width) * width * width)
    return worst


def _engine_terms(cfg: TandemConfig, shape: ModelShape, device: int) -> tuple[list[Term], EngineShare]:
    eng, tp = cfg.engine, cfg.resources.actors.tensor_parallel
    share = engine_share(shape, device, eng.gpu_memory_utilization, _bytes(cfg), tp, eng.enforce_eager)
    u = f"lower engine.gpu_memory_utilization ({eng.gpu_memory_utilization:g})"
    terms = [Term("actor", "vLLM weights", share.weights, u), Term("actor", "vLLM profile peak", share.profile, u),
             Term("actor", "vLLM CUDA graphs", share.graphs, u),
             Term("actor", "vLLM KV cache (the rest of its share)", max(share.kv_cache, 0), u)]  # fmt: skip
    return terms, share


def memory_plan(cfg: TandemConfig, shape: ModelShape, device: int, dense: bool) -> tuple[list[Gpu], list[str]]:
    """Each kind of GPU of the run (learner rank 0's, actor 0's first) with its phases, and the KV-cache
    problems (an engine whose share leaves no room for one engine.max_model_len sequence)."""
    res, problems, gpus = cfg.resources, [], []
    stays, backward, step = _learner_terms(cfg, shape, dense)
    engines, share = _engine_terms(cfg, shape, device)
    need = cfg.engine.max_model_len * shape.kv_bytes_per_token(_bytes(cfg), res.actors.tensor_parallel)
    if res.actors.num_gpus and share.kv_cache < need:
        problems.append(
            f"vLLM's share of a GPU (engine.gpu_memory_utilization = {cfg.engine.gpu_memory_utilization:g} of "
            f"{gib(device)} GiB) leaves {gib(max(share.kv_cache, 0))} GiB of KV cache, less than one "
            f"engine.max_model_len = {cfg.engine.max_model_len} sequence needs ({gib(need)} GiB): raise "
            "engine.gpu_memory_utilization"
        )
    nccl = cfg.weights.backend == "distributed" and cfg.weights.process_group == "nccl"
    # the newest version's receive buffers (held for the engine) and the next push's: twice the model
    receive = [Term("actor", "weight channel receive buffers (2 x the model)", 2 * shape.params * _bytes(cfg),
                    "set weights.backend=ray")] if nccl else []  # fmt: skip
    if cfg.run.schedule == "colocated" and res.learner.num_gpus:
        per_gpu = math.ceil(res.actors.count / res.learner.ranks)
        asleep = [Term("actor", f"{per_gpu} engine(s) asleep (level 1)", per_gpu * SLEEPING_ENGINE)]
        awake = [Term(t.process, f"{t.name} x {per_gpu}" if per_gpu > 1 else t.name, t.bytes * per_gpu, t.knob)
                 for t in engines + receive]  # fmt: skip
        # offloaded: the weights (a LoRA base too, learner/offload.py), gradients and optimizer states; DeepSpeed's
        # gradient bucket stays (its offload_states leaves the ipg buffers), and so does the frozen reference
        kept = [t for t in stays if t.process == "reference" or t.name in ("DeepSpeed buckets", "CUDA context")]
        init = [t for t in stays if t.name in ("weights", "CUDA context") or t.process == "reference"]
        master = 4 * _trained(cfg, shape) // res.learner.ranks  # ZeRO 1-3 (the config refuses 0 colocated on GPUs)
        init.append(Term("learner rank", "fp32 master weights", master))
        gpus.append(
            Gpu(
                "GPU of learner rank 0 and its engines (colocated)",
                {
                    "training": stays + backward + asleep,
                    "at the optimizer step": stays + step + asleep,
                    "generating": awake + kept,
                    "starting (the learner builds beside the awake engines)": awake + init,
                },
            )
        )
        return gpus, problems
    if res.learner.num_gpus:
        gpus.append(Gpu("GPU of learner rank 0", {"training": stays + backward, "at the optimizer step": stays + step}))
    if res.actors.num_gpus:
        gpus.append(Gpu("first GPU of actor 0", {"generating": engines + receive}))
    return gpus, problems


def check_memory(cfg: TandemConfig, shape: ModelShape, device: int, dense: bool) -> list[Gpu]:
    """``memory_plan``, raising ``MemoryPlanError`` (one line, the knob to turn) when a GPU does not fit."""
    gpus, problems = memory_plan(cfg, shape, device, dense)
    line = over(gpus, device) or (problems[0] if problems else None)
    if line:
        raise MemoryPlanError(line)
    return gpus


def shm_note(cfg: TandemConfig, shape: ModelShape) -> str | None:
    """The host's /dev/shm an in-flight Ray channel on GPUs writes per update (review B5), or None."""
    eng, res = cfg.engine, cfg.resources
    if not (cfg.weights.backend == "ray" and cfg.rollout.weight_update == "inflight" and res.actors.num_gpus):
        return None
    if eng.weight_transfer == "bytes":
        return None
    each = shape.params * _bytes(cfg)
    return (
        f"host /dev/shm: {gib(each)} GiB per actor per update ({res.actors.count} actors: "
        f"{gib(each * res.actors.count)} GiB, beside Ray's object store); where it has less than twice an "
        "update, engine.weight_transfer=auto sends the update as a bytes copy instead (actors/engine_weights.py)"
    )
