"""The generation actors' config sections: sampling (``rollout``), the vLLM engine (``engine``),
and the reward function (``reward``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from queues.config import Section


class RewardConfig(Section):
    function: str = Field(
        description="Reward function as 'path/to/file.py:function_name' (called as fn(prompt, completion, row) "
        "-> float), or 'builtin:<task>'."
    )
    import_timeout_s: float = Field(
        60, gt=0, description="Longest time the reward file may take to import when checked before the run starts."
    )
    max_error_steps: int = Field(
        3, gt=0, description="Steps in a row in which every reward call failed before the run stops (it cannot learn)."
    )


class RolloutConfig(Section):
    prompts_per_step: int = Field(16, gt=0, description="Prompts in one training batch.")
    group_size: int = Field(8, ge=2, description="Completions sampled per prompt (G); advantages are group-relative.")
    max_tokens: int = Field(16, gt=0, description="Longest completion, in tokens; longer ones are truncated.")
    min_tokens: int = Field(0, ge=0, description="Tokens sampled before EOS is allowed (1 forbids empty answers).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    prompts_per_request: int = Field(
        8, gt=0, description="Prompts an actor takes from the prompt queue per vLLM generate call."
    )
    weight_update: Literal["between_requests", "inflight"] = Field(
        "between_requests",
        description="between_requests: generate calls finish on the weights they started with; inflight: the "
        "async engine pauses mid-generation, loads new weights and resumes (per-token versions).",
    )
    max_inflight_prompts: int = Field(
        16, gt=0, description="Prompts an inflight actor keeps generating at once (continuous batching)."
    )


class EngineConfig(Section):
    max_model_len: int = Field(512, gt=0, description="vLLM context length (prompt + completion).")
    kv_cache_gib: int = Field(1, gt=0, description="KV cache size per engine on CPU, in GiB.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Fraction of GPU memory for vLLM on GPU.")
    enforce_eager: bool = Field(True, description="Skip graph compilation in vLLM (fast start-up).")
