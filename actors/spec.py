"""What a generation actor is built from, and what its two engines share: engine arguments, sampling
parameters, the start-up report. The driver builds one ``ActorSpec`` per actor.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass
from typing import Any

from actors.adapters import AdapterSpec
from actors.config import EngineConfig, RewardConfig, RolloutConfig
from queues.messages import PromptRequest


@dataclass(frozen=True)
class ActorSpec:
    """One generation actor."""

    name: str  # "actor-<i>": in messages, logs and the placement plan
    model_path: str  # Hugging Face directory or hub id
    engine: EngineConfig
    rollout: RolloutConfig
    reward: RewardConfig  # the reward's parts and its workers' settings
    dtype: str  # "float32" | "bfloat16"
    seed: int  # sampling seed of this actor
    tensor_parallel: int = 1  # vLLM shards (placement decides: GPUs, or cores on CPU)
    log_path: str | None = None  # this process's output file
    step_delimiter: str | None = None  # set for process supervision: one reward per reasoning step
    reward_model_actors: tuple[str, ...] = ()  # Ray names of the reward model actors (reward.model)
    timeline: bool = True  # record spans for RUN_DIR/timeline.jsonl (run.timeline)
    chat_template: str | None = None  # data.chat_template's file text (episodes render their own turns)
    system_prompt: str | None = None  # data.system_prompt: an episode's first message when reset() gives none
    adapter: AdapterSpec | None = None  # learner.lora: the policy's versions arrive as LoRA adapters
    sleep_level: int = 0  # run.schedule=colocated on GPUs: what the engine frees while asleep (actors/sleep.py)


@dataclass(frozen=True)
class ActorTimeouts:
    """The deadlines of an actor's loop."""

    data_s: float  # longest wait to hand a group to a full results queue
    weights_s: float  # longest wait for the weights a prompt needs
    idle_s: float = 60.0  # one wait for prompts (renewed; a put or closing the queue wakes it sooner)


def engine_kwargs(spec: ActorSpec) -> dict[str, Any]:
    """vLLM engine arguments, shared by both engines (between requests and in flight)."""
    import torch

    tp = spec.tensor_parallel
    device = (
        {"gpu_memory_utilization": spec.engine.gpu_memory_utilization}
        if torch.cuda.is_available()
        else {"kv_cache_memory_bytes": spec.engine.kv_cache_gib << 30, **whole_prompt_prefill(spec.engine)}
    )
    return dict(
        model=spec.model_path,
        dtype=spec.dtype,
        seed=spec.seed,
        max_model_len=spec.engine.max_model_len,
        enforce_eager=spec.engine.enforce_eager,
        worker_extension_cls="actors.vllm_worker.WeightReceiver",
        tensor_parallel_size=tp,
        # the sampled tokens' log-probs of the distribution sampled (after temperature), not of the raw
        # logits: the learner scores softmax(z / T) too, so the importance ratios compare like with like
        logprobs_mode="processed_logprobs",
        # shard workers as child processes of this actor, on the GPUs (or cores) Ray gave it;
        # inside a Ray actor vLLM would otherwise pick its Ray executor and ask for new bundles
        **({"distributed_executor_backend": "mp"} if tp > 1 else {}),
        **(spec.adapter.engine_kwargs() if spec.adapter is not None else {}),
        **({"enable_sleep_mode": True} if spec.sleep_level else {}),
        **proven_scheduling(spec, torch.cuda.is_available()),
        **device,
    )


IN_FLIGHT_PROVEN = "in-flight updates are proven only without it"  # the ready line's reason for async scheduling off


def proven_scheduling(spec: ActorSpec, cuda: bool) -> dict[str, Any]:
    """Async scheduling off for the in-flight engine on a GPU, where vLLM would turn it on.

    With async scheduling the engine keeps a batch in flight while it schedules the next; an in-flight
    update pauses (``keep``), loads and relabels the engine's weight version, and whether a batch can
    straddle that relabel (tokens of the old weights tagged with the new version) has never been run:
    every in-flight run so far was on the CPU, whose platform forces async scheduling off
    (``vllm/platforms/cpu.py``). So the proven combination is chosen, and the ready line says so.
    Between requests nothing runs during a load, so vLLM's own choice stays."""
    return {"async_scheduling": False} if cuda and spec.rollout.weight_update == "inflight" else {}


def proven_runner_env(spec: ActorSpec, cuda: bool) -> dict[str, str]:
    """vLLM's V1 model runner wherever ``proven_scheduling`` turns async scheduling off (vLLM 0.32 picks
    V2 wherever Triton runs): every in-flight update so far ran on the CPU, whose vLLM has no Triton and
    runs V1. vLLM reads the variable from the environment (``envs.VLLM_USE_V2_MODEL_RUNNER``), in the
    actor and in the engine processes it starts, so the in-flight engine sets it before it builds them."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if proven_scheduling(spec, cuda) else {}


MIN_PREFILL_TOKENS = 8192  # tokens per engine step on the CPU: vLLM's CPU default is 4096


def whole_prompt_prefill(engine: EngineConfig) -> dict[str, Any]:
    """CPU engine arguments that never split a prompt's prefill over two engine steps.

    When a generate call holds more prompt tokens than one step's budget, vLLM's chunked prefill splits
    a prompt, throws away the token sampled after the partial prefill and rewinds that request's seeded
    generator, and a CPU ``torch.Generator`` cannot rewind ("CPU Generator does not use offset"): the
    actor died on any call of more than ~4K prompt tokens with the default per-prompt seeds. Without
    chunked prefill a prompt is prefilled whole or waits for the next step, so seeded sampling stays
    reproducible per prompt (vLLM warns that the model does not "officially support" this; the sampled
    tokens and log-probs are the same as with chunking, measured on the tiny model). The budget must hold
    the longest prompt: at least ``engine.max_model_len``."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(engine.max_model_len, MIN_PREFILL_TOKENS)}


def sampling_params(
    rollout: RolloutConfig,
    n: int,
    seed: int | None = None,
    stream: bool = False,
    temperature: float | None = None,
    max_tokens: int | None = None,
):
    """``n`` samples per prompt with the sampled tokens' logprobs; ``seed`` makes them reproducible
    per prompt; ``stream`` returns tokens as they are produced (the in-flight actor); ``temperature``
    overrides the rollout's (evaluation; 0 is greedy); ``max_tokens`` the rollout's (an episode's turn).

    The engine returns token ids only: the actors decode each finished completion once with the
    tokenizer (``decode_completions``). vLLM's incremental detokenizer runs per token per sequence in
    Python and cost 14-36% of generation throughput on a CPU (bench: 16 prompts x 8, 128-512 tokens)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    max_tokens = rollout.max_tokens if max_tokens is None else max_tokens
    return SamplingParams(
        n=n,
        max_tokens=max_tokens,
        min_tokens=min(rollout.min_tokens, max_tokens),
        temperature=rollout.temperature if temperature is None else temperature,
        top_p=rollout.top_p,
        logprobs=0,  # the sampled token's logprob
        seed=seed,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.CUMULATIVE,  # vLLM's default
    )


def decode_completions(tokenizer, completions: list[list[int]]) -> list[str]:
    """The completions' texts as the rewards see them: special tokens (EOS) left out."""
    return tokenizer.batch_decode(completions, skip_special_tokens=True)


def engine_prompt(request: PromptRequest):
    """What the engine is given: the driver's rendered token ids (the learner trains on exactly these),
    or the raw prompt text of a request made without them (tests, tools)."""
    if request.prompt_token_ids is None:
        return request.row["prompt"]
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))


def request_params(
    spec: ActorSpec, request: PromptRequest, seed: int | None, stream: bool = False, n: int | None = None
):
    """Sampling parameters of one request: ``group_size`` samples, or the evaluation's own count and temperature
    (``n``: this many instead, e.g. one per streamed request); at most the row's own budget of tokens
    (``rollout.max_tokens_field``)."""
    n = n or request.samples or spec.rollout.group_size
    budget = row_budget(spec.rollout, request.row)
    return sampling_params(
        spec.rollout, n, seed=seed, stream=stream, temperature=request.temperature, max_tokens=budget
    )


def row_budget(rollout, row: dict) -> int:
    """A prompt's longest completion: its row's ``rollout.max_tokens_field`` (a column or a dotted path; a
    positive whole number, as a number or as text) capped at ``rollout.max_tokens``, or
    ``rollout.max_tokens`` for a row without one."""
    from queues.sources import field_value

    field = rollout.max_tokens_field
    value = field_value(row, field) if field else None
    if value is None:
        return rollout.max_tokens
    number = None
    if isinstance(value, str) and value.strip().isdecimal():  # a CSV column's numbers are text
        number = int(value.strip()) if value.strip().isascii() else None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        number = int(value) if value == int(value) else None
    if number is None or number < 1:
        raise ValueError(
            f"rollout.max_tokens_field: column {field!r} holds {value!r}, not a positive whole number of tokens; "
            "fix that row or leave the column empty there (rollout.max_tokens applies)"
        )
    return min(number, rollout.max_tokens)


def turn_params(spec: ActorSpec, request: PromptRequest, max_tokens: int, seed: int | None, stream: bool = False):
    """Sampling parameters of one turn of an episode: one sample of at most ``max_tokens``."""
    return sampling_params(
        spec.rollout, 1, seed=seed, stream=stream, temperature=request.temperature, max_tokens=max_tokens
    )


@dataclass(frozen=True)
class EngineChoices:
    """What vLLM chose when it started an engine, read back from it (None: this vLLM does not say)."""

    async_scheduling: bool | None  # a batch scheduled while the last one runs (vLLM's default on GPUs)
    model_runner: str | None  # "V1" or "V2" (vLLM picks V2 on GPUs where Triton runs)
    kv_cache_bytes: int | None  # KV cache of one shard (the first worker's), in bytes
    kv_cache_blocks: int | None  # KV cache blocks of the engine's scheduler
    block_size: int | None  # tokens per block
    attention: str | None  # the attention backend of the model's layers ("+"-joined if several)


def _read(value):
    """``value()``, or None where this vLLM has no such field or property (the ready line must not fail)."""
    try:
        return value()
    except Exception:  # noqa: BLE001 - a report: an unknown value is said as such
        return None


REPORT_TIMEOUT_S = 60.0  # the ready line's question to the engine's workers


def engine_choices(vllm_config, worker: dict | None) -> EngineChoices:
    """What the engine with ``vllm_config`` chose, after start; ``worker``: the first worker's
    ``engine_report`` (``actors/vllm_worker.py``), or None if it could not be asked."""
    runner = _read(lambda: vllm_config.use_v2_model_runner)
    worker = worker or {}
    return EngineChoices(
        async_scheduling=_read(lambda: vllm_config.scheduler_config.async_scheduling),
        model_runner=None if runner is None else ("V2" if runner else "V1"),
        kv_cache_bytes=worker.get("kv_cache_bytes"),
        kv_cache_blocks=_read(lambda: vllm_config.cache_config.num_gpu_blocks),
        block_size=_read(lambda: vllm_config.cache_config.block_size),
        attention=worker.get("attention"),
    )


def describe_choices(choices: EngineChoices, pinned: bool) -> str:
    """The ready line's part on what vLLM chose; ``pinned``: Tandem turned async scheduling off and
    asked for the V1 runner (the in-flight engine on a GPU)."""
    scheduling = {True: "on", False: "off", None: "unknown"}[choices.async_scheduling]
    if pinned and choices.async_scheduling is False:
        scheduling += f": {IN_FLIGHT_PROVEN}"
    runner = choices.model_runner or "unknown"
    if pinned and choices.model_runner == "V1":  # proven_runner_env
        runner += f": {IN_FLIGHT_PROVEN.replace('without', 'with')}"
    kv = []
    if choices.kv_cache_bytes is not None:
        kv.append(f"{choices.kv_cache_bytes / 2**30:.2f} GiB per shard")
    if choices.kv_cache_blocks is not None:
        kv.append(f"{choices.kv_cache_blocks} blocks of {choices.block_size} tokens")
    return (
        f"async scheduling {scheduling}; model runner {runner}; "
        f"KV cache {', '.join(kv) or 'unknown'}; attention {choices.attention or 'unknown'}"
    )


def ready_report(spec: ActorSpec, version: int, tensor_parallel: int, choices: EngineChoices) -> dict[str, Any]:
    """What ``ready()`` returns: who and where the actor is, how vLLM really sharded it, and what it chose."""
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    where = {"name": spec.name, "pid": os.getpid(), "version": version, "node": node}
    return {**where, "tensor_parallel": tensor_parallel, **asdict(choices)}
