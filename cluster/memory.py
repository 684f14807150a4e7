"""Device memory a plan needs, predicted by arithmetic before anything starts (``tandem plan``).

Pure arithmetic on a model's shape: no torch, Ray, vLLM or DeepSpeed. ``launch/plan.py`` says
which process holds which term on which GPU (this module knows no roles); each term is bytes.
Symbols: ``Phi`` parameters of the model, ``Psi`` the trained ones (``Phi``, or LoRA's adapters),
``n`` ZeRO ranks, ``b`` bytes per element of the compute dtype (2 bf16, 4 fp32), ``T`` tokens of a
micro-batch, ``V`` vocabulary, ``H`` hidden size, ``I`` MLP width, ``a`` / ``k`` query / key-value
heads of ``d`` dims, ``L`` layers, ``c`` log-prob chunk tokens. One line per term, its equation:

- weights          Phi b; ZeRO-3: Phi b / n (DeepSpeed partitions every parameter, frozen ones too)
- gradients        Psi b at ZeRO 0-1; Psi b / n at ZeRO 2-3 (the low-precision gradients)
- optimizer        12 Psi / n' (fp32 master copy 4 + AdamW's two fp32 moments 8), n' = n at ZeRO 1-3,
                   1 at ZeRO 0; ZeRO 0 in fp32 has no master copy: 8 Psi
- step (fp32 grad) 4 Psi / n' at the optimizer step (ZeRO 0 fp32: 0); activations are freed by then
- reduce bucket    ZeRO 1-2: 5e8 b (DeepSpeed's reduce_bucket_size, allocated whole); ZeRO 3: 5e8 b
                   plus min(1e9, Phi) b (n - 1) / n of gathered parameters (stage3_max_live_parameters)
- activations      no checkpointing: L T A + T B; checkpointing: L T H b + T B + T A (one layer
                   recomputed), with, per token, A = (4b + 8) H + 4b I + 2b a d + 2b k' d + 4a + 8
                   (two RMSNorms keeping fp32 copies, q / attention output, k and v, SwiGLU's four
                   I-wide tensors, fp32 log-sum-exp per head, two fp32 norms) and outside the layers
                   B = (b + 4) H + 2 b d + 12 (final norm, RoPE cos/sin, ids); k' = a where sdpa
                   runs with a dense mask (transformers repeats k, v on CUDA), else k
- backward work    T A: the gradients of one layer's activations
- logits           2 T V b: the LM head's output at the scored positions, kept for the backward, and
                   its gradient (``learner/head.py`` runs the head on those positions in every layout)
- logits chunk     4 c V 4: fp32 [c, V] temporaries of the chunked log-prob / entropy
- mask             dense attention: R Lr^2 elements for the micro-batch being run (Lr the row length;
                   one micro-batch is packed at a time, ``learner/rank_batch.py``): bool for sdpa, which
                   turns it into the compute dtype at every call and saves that copy for the backward:
                   + L R Lr^2 b (checkpointing: + R Lr^2 b, one layer at a time); b for eager, whose
                   softmax saves its fp32 output and the compute-dtype copy the matmul reads, per layer:
                   + L a R Lr^2 (4 + b) (checkpointing: one layer's)
- frozen model     Phi b (a reference model next to the trained one)
- engine share     u M: vLLM claims gpu_memory_utilization x device memory and fits in it the weights
                   Phi b / t (t tensor-parallel GPUs), its profile peak (8192 batched tokens x (2 I +
                   4 H) b + 1024 sequences x V x 4), CUDA graphs (a 1 GiB allowance unless
                   enforce_eager) and the KV cache: the rest. KV bytes per token on each GPU =
                   2 L max(1, k / t) d b (vLLM keeps at least one KV head per GPU); it must hold
                   max_model_len tokens or vLLM refuses to start
- sleeping engine  1 GiB per engine asleep at level 1 (weights on the host, KV cache discarded; the
                   CUDA context and what vLLM's allocator does not manage stay)
- CUDA context     1 GiB per process that uses the GPU (context, cuBLAS workspace, NCCL buffers)
- weight channel   NCCL: 2 x bucket bytes on the publisher (its pack ring), twice the model 2 Phi b on
                   the receiving engine's first GPU (the newest version's receive buffers, kept for the
                   engine, and the next push's, allocated fresh; outside vLLM's share)
- /dev/shm (host)  Ray channel, in-flight updates with shared transfer on GPUs: Phi b per actor per
                   update (each engine's copy of the object-store tensors, actors/engine_weights.py)

Nothing here has been measured on a GPU yet: ``tests/test_memory_plan.py`` measures the weights,
AdamW states and activations of the same shapes on the CPU (meta tensors, saved-tensor hooks: exact, or
within 2%) and a small model's forward and backward peak (the plan is above it, by less than 35%: it
adds the backward's transients as if all alive at once); ``bench/gpu_device_check.sh`` prints predicted
beside measured when it runs on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.placement import PlacementError

GIB = 1 << 30
REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default, elements
LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default
CUDA_GRAPHS = 1 * GIB  # allowance for vLLM's captured graphs
SLEEPING_ENGINE = 1 * GIB  # what an engine at sleep level 1 keeps on its GPU
CUDA_CONTEXT = 1 * GIB  # per process that uses the GPU
PROFILE_TOKENS, PROFILE_SEQS = 8192, 1024  # vLLM's profile run: batched tokens, sampled sequences
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Qwen2 / Llama layout: RMSNorm, GQA, SwiGLU)."""

    vocab: int  # V
    hidden: int  # H
    layers: int  # L
    heads: int  # a, query heads
    kv_heads: int  # k, key/value heads
    head_dim: int  # d
    intermediate: int  # I, the MLP width
    tied: bool  # the LM head shares the embedding matrix
    qkv_bias: bool = True  # Qwen2: q, k, v projections carry a bias

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def params(self) -> int:
        """Phi = V H (embedding) + L (linears + q/k/v biases + 2 norms) + H (final norm) + V H (untied head)."""
        dims = self.linear_dims()
        bias = sum(dims[n][1] for n in ("q_proj", "k_proj", "v_proj")) if self.qkv_bias else 0
        layer = sum(i * o for i, o in dims.values()) + bias + 2 * self.hidden
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * layer + self.hidden + head

    def lora_params(self, rank: int, targets: str | list[str]) -> int:
        """r (in + out) per adapted linear per layer; ``all-linear``: every linear but the head."""
        names = LINEARS if targets == "all-linear" else [targets] if isinstance(targets, str) else targets
        names = [n.rsplit(".", 1)[-1] for n in names]  # "model.layers.0.self_attn.q_proj" -> "q_proj"
        dims = self.linear_dims()
        return self.layers * sum(rank * sum(dims[n]) for n in names if n in dims)

    def kv_bytes_per_token(self, b: int, tensor_parallel: int = 1) -> int:
        """2 (K and V) L max(1, k / t) d b: one token's KV cache on each of an engine's t GPUs (vLLM
        replicates a KV head where there are more GPUs than heads)."""
        return 2 * self.layers * max(1, self.kv_heads // tensor_parallel) * self.head_dim * b


def shape_of(config) -> ModelShape:
    """The shape of a Hugging Face config (``config.json``'s fields, read duck-typed)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    bias = getattr(text, "model_type", "") == "qwen2" or bool(getattr(text, "attention_bias", False))
    return ModelShape(text.vocab_size, text.hidden_size, text.num_hidden_layers, heads,
                      getattr(text, "num_key_value_heads", None) or heads, head_dim, text.intermediate_size,
                      bool(getattr(text, "tie_word_embeddings", False)), bias)  # fmt: skip


# Qwen2.5 shapes (their config.json), for model names that are not a local folder
KNOWN_SHAPES = {
    "0.5B": ModelShape(151936, 896, 24, 14, 2, 64, 4864, tied=True),
    "1.5B": ModelShape(151936, 1536, 28, 12, 2, 128, 8960, tied=True),
    "3B": ModelShape(151936, 2048, 36, 16, 2, 128, 11008, tied=True),
    "7B": ModelShape(152064, 3584, 28, 28, 4, 128, 18944, tied=False),
}


def known_shape(name: str) -> ModelShape | None:
    """A Qwen2.5 shape named by its size, or a hub id that contains one (``Qwen/Qwen2.5-1.5B-Instruct``)."""
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name]
    if "qwen2.5" not in name.lower():
        return None
    return next((s for size, s in KNOWN_SHAPES.items() if f"-{size}".lower() in name.lower()), None)


@dataclass(frozen=True)
class Term:
    """``bytes`` of one thing ``process`` holds on a GPU, and the setting that changes it."""

    process: str  # e.g. "learner rank", "actor"
    name: str  # e.g. "optimizer (fp32 master + AdamW moments)"
    bytes: int
    knob: str = ""  # the config key (or plan option) to turn when this term is what does not fit


@dataclass
class Gpu:
    """One GPU: its phases (what is on it at once), the largest of which must fit."""

    label: str  # e.g. "GPU of learner rank 0"
    phases: dict[str, list[Term]] = field(default_factory=dict)

    def total(self, phase: str) -> int:
        return sum(t.bytes for t in self.phases[phase])

    @property
    def peak(self) -> tuple[str, int]:
        return max(((p, self.total(p)) for p in self.phases), key=lambda x: x[1])


def training_state(psi: int, phi: int, zero: int, ranks: int, b: int) -> dict[str, int]:
    """The ZeRO terms of a trained model (see the module docstring): persistent, and the step's."""
    n = ranks if zero >= 1 else 1
    grads = psi * b // (ranks if zero >= 2 else 1)
    optimizer = (8 * psi if (zero == 0 and b == 4) else 12 * psi) // n
    bucket = REDUCE_BUCKET * b if zero >= 1 else 0
    if zero == 3:  # the parameters gathered from the other ranks' shards while a module runs
        bucket += min(LIVE_PARAMETERS, phi) * b * (ranks - 1) // ranks
    return {
        "weights": phi * b // (ranks if zero == 3 else 1),
        "gradients": grads,
        "optimizer": optimizer,
        "reduce bucket": bucket,
        "step": 0 if (zero == 0 and b == 4) else 4 * psi // n,
    }


def layer_activation_bytes(shape: ModelShape, b: int, dense_sdpa: bool = False) -> int:
    """A: bytes one decoder layer saves for the backward per token."""
    s, kv = shape, (shape.heads if dense_sdpa else shape.kv_heads)
    return (4 * b + 8) * s.hidden + 4 * b * s.intermediate + 2 * b * s.heads * s.head_dim \
        + 2 * b * kv * s.head_dim + 4 * s.heads + 8  # fmt: skip


def activation_bytes(shape: ModelShape, tokens: int, b: int, checkpointing: bool, dense_sdpa: bool = False) -> int:
    """Saved activations of a forward over ``tokens`` tokens (module docstring: activations)."""
    a = layer_activation_bytes(shape, b, dense_sdpa)
    outside = (b + 4) * shape.hidden + 2 * b * shape.head_dim + 12
    if checkpointing:
        return shape.layers * tokens * shape.hidden * b + tokens * (outside + a)
    return shape.layers * tokens * a + tokens * outside


def logits_bytes(vocab: int, tokens: int, b: int) -> int:
    """2 T V b: the scored positions' logits and their gradient (module docstring: logits)."""
    return 2 * tokens * vocab * b


def mask_bytes(elements: int, b: int, layers: int, checkpointing: bool, sdpa: bool, heads: int = 0) -> int:
    """A dense mask of ``elements`` R Lr^2 and, for sdpa, the compute-dtype copy each layer saves; for eager
    its additive mask and the ``heads`` attention probabilities each layer saves (module docstring: mask)."""
    saving = 1 if checkpointing else layers
    if not sdpa:
        return elements * b + saving * heads * elements * (4 + b)
    return elements + elements * b * saving


def chunk_bytes(vocab: int, chunk: int) -> int:
    """4 fp32 [c, V] temporaries of the chunked log-prob and entropy."""
    return 4 * chunk * vocab * 4


@dataclass(frozen=True)
class EngineShare:
    """What vLLM fits into its share ``u M`` of one GPU, and the KV cache left (may be negative)."""

    share: int
    weights: int
    profile: int
    graphs: int

    @property
    def kv_cache(self) -> int:
        return self.share - self.weights - self.profile - self.graphs


def engine_share(shape: ModelShape, device: int, utilization: float, b: int, tp: int, eager: bool) -> EngineShare:
    profile = PROFILE_TOKENS * (2 * shape.intermediate + 4 * shape.hidden) * b // tp + PROFILE_SEQS * shape.vocab * 4
    return EngineShare(math.ceil(device * utilization), shape.params * b // tp, profile, 0 if eager else CUDA_GRAPHS)


class MemoryPlanError(PlacementError):
    """A GPU of the plan needs more memory than the device has; one line naming the knob to turn."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def render(gpus: list[Gpu], device: int) -> str:
    """The per-GPU table: each GPU's peak phase, one row per term, then its total against the device."""
    lines = [f"memory per GPU (device {gib(device)} GiB):", "  process | term | GiB"]
    for gpu in gpus:
        phase, total = gpu.peak
        lines.append(f"  {gpu.label}, peak while {phase}:")
        lines += [f"    {t.process} | {t.name} | {gib(t.bytes)}" for t in gpu.phases[phase] if t.bytes]
        fits = "fits" if total <= device else "DOES NOT FIT"
        lines.append(f"    total | {gib(total)} of {gib(device)} GiB: {fits}")
    return "\n".join(lines)


def over(gpus: list[Gpu], device: int) -> str | None:
    """One line naming the first GPU over ``device`` bytes, its largest term and the knob to turn; None when all fit."""
    for gpu in gpus:
        phase, total = gpu.peak
        if total > device:
            terms = gpu.phases[phase]
            big = max([t for t in terms if t.knob] or terms, key=lambda t: t.bytes)
            return (
                f"the plan needs {gib(total)} GiB on the {gpu.label} while {phase}, more than the device's "
                f"{gib(device)} GiB; the largest part is {big.process} {big.name} ({gib(big.bytes)} GiB): "
                f"{big.knob or 'choose a smaller plan'}"
            )
    return None
