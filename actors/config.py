"""The generation actors' config sections: sampling (``rollout``), the vLLM engine (``engine``),
and the reward function (``reward``)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from schema import Section

DEFAULT_FORMAT_PATTERN = r"\s*<think>.+?</think>\s*\S.*"
MODEL_PART = "model"  # the reward.functions entry whose scores come from reward.model's actors
ENVIRONMENT_PART = "environment"  # the entry whose value is an episode's environment reward (multi-turn)
BY_SOURCE_PART = "by_source"  # the metrics name of a part whose function is chosen per row's data_source
SOURCE_FIELD = "data_source"  # verl's column naming the data set a row comes from: what by_source keys on


class RewardFunctionConfig(Section):
    function: str = Field(
        description="One part of the reward: 'path/to/file.py:function_name', 'builtin:<name>', 'model' "
        "(the reward model of reward.model) or 'environment' (a multi-turn episode's rewards from its environment, "
        "summed over its turns)."
    )
    weight: float = Field(1.0, description="Weight of this part in the reward (reward = sum of weight x part).")
    name: str | None = Field(
        None,
        description="Name of the part in the step metrics (reward/<name>); default: the function's name "
        "('builtin:math' -> math, 'file.py:fn' -> fn), or 'by_source' when by_source is set.",
    )
    by_source: dict[str, str] | None = Field(
        None,
        description="This part's function per row data_source (verl's column), {source: function}; rows of a "
        "source not listed, or without a data_source, use 'function'.",
    )

    @property
    def part_name(self) -> str:
        if self.name:
            return self.name
        if self.by_source:  # the value comes from several functions: no one function's name is true of it
            return BY_SOURCE_PART
        return self.function.rpartition(":")[2] or self.function

    @property
    def is_model(self) -> bool:
        return self.function == MODEL_PART

    @property
    def is_environment(self) -> bool:
        return self.function == ENVIRONMENT_PART

    @property
    def specs(self) -> list[str]:
        """Every function this part may call: ``function``, then the by_source ones (each once)."""
        return list(dict.fromkeys([self.function, *(self.by_source or {}).values()]))

    def function_for(self, row: dict) -> str:
        """The function this part calls on ``row``: the one ``by_source`` names for its data_source, else
        ``function`` (a source not listed, no data_source, or one that is not a string)."""
        source = row.get(SOURCE_FIELD)
        if not self.by_source or not isinstance(source, str):
            return self.function
        return self.by_source.get(source, self.function)


class RewardModelConfig(Section):
    path: str = Field(
        description="Hugging Face sequence-classification directory (AutoModelForSequenceClassification with one "
        "label): the part's value is that label's logit for prompt + completion."
    )
    batch_size: int = Field(16, gt=0, description="Sequences per forward pass of the reward model.")
    max_length: int = Field(
        2048, gt=0, description="Longest prompt + completion the reward model reads, in tokens (left-truncated)."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="The reward model's weights dtype.")


class RewardConfig(Section):
    function: str | None = Field(
        None,
        description="Reward function as 'path/to/file.py:function_name' (called as fn(prompt, completion, row) "
        "-> float, or fn(prompts, completions, rows) -> list[float] when it has batched = True), or "
        "'builtin:<name>' (math, format, or a built-in task), or 'environment' (a multi-turn episode's own "
        "rewards). Set this or reward.functions.",
    )
    functions: list[RewardFunctionConfig] | None = Field(
        None,
        description="A weighted sum of reward functions, [{function, weight, name, by_source}, ...]; each part is "
        "logged on its own as reward/<name>. Set this or reward.function.",
    )
    by_source: dict[str, str] | None = Field(
        None,
        description="reward.function per row data_source (verl's column), {source: function}, e.g. "
        "{openai/gsm8k: builtin:math, my_code: rewards.py:run_tests}; rows of a source not listed use "
        "reward.function. The part is logged as reward/by_source. With reward.functions, give by_source on the "
        "entry it applies to instead.",
    )
    math_extraction: Literal["strict", "flexible"] = Field(
        "strict",
        description="How builtin:math finds a completion's final answer. strict: the last \\boxed{}, else the "
        "number after the last '####' (GSM8K's form, lm-eval's strict-match), else an anchored 'the answer is "
        "...'. flexible: as strict, then the last number of the text (lm-eval's flexible-extract).",
    )
    format_pattern: str = Field(
        DEFAULT_FORMAT_PATTERN,
        description="builtin:format's regular expression (Python, DOTALL): 1.0 when it matches the whole "
        "completion, else 0.0. Default: a <think>...</think> block, then a non-empty answer.",
    )
    workers: int = Field(
        1, gt=0, description="Reward worker processes per generation actor; rewards run there, off the engine."
    )
    timeout_s: float = Field(
        30,
        gt=0,
        description="Deadline of one reward call (the G completions of one prompt); a call past it is abandoned "
        "(its worker replaced), its samples score 0 and the error is counted.",
    )
    import_timeout_s: float = Field(
        60,
        gt=0,
        description="Longest time the reward file may take to import when checked before the run starts, and in "
        "a reward worker as it starts.",
    )
    max_error_steps: int = Field(
        3, gt=0, description="Steps in a row in which every reward call failed before the run stops (it cannot learn)."
    )
    model: RewardModelConfig | None = Field(
        None,
        description="A reward model on its own Ray actors (resources.reward_model), used as the part "
        "{function: model, weight: w} of reward.functions.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        if (self.function is None) == (self.functions is None):
            raise ValueError(
                "set exactly one of reward.function (one function) or reward.functions (a weighted sum: "
                "[{function, weight}, ...])"
            )
        if self.functions is not None:
            if not self.functions:
                raise ValueError("reward.functions is empty; list at least one {function, weight}")
            names = [p.part_name for p in self.functions]
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"reward.functions has two parts named {repeated[0]!r}; give them distinct 'name's")
        if self.by_source is not None and self.functions is not None:
            raise ValueError(
                "reward.by_source chooses reward.function per data_source; with reward.functions put by_source "
                "on the entry it applies to ([{function, by_source: {source: function}}, ...])"
            )
        for part in self.parts:
            if part.by_source is None:
                continue
            if not part.by_source:
                raise ValueError(f"by_source of {part.function!r} is empty; map a data_source to a function")
            if part.is_model or MODEL_PART in part.by_source.values():
                raise ValueError(
                    "the reward model ('model') cannot be chosen by data_source; give it its own reward.functions entry"
                )
            if part.is_environment or ENVIRONMENT_PART in part.by_source.values():
                raise ValueError(
                    "the environment's reward ('environment') cannot be chosen by data_source; give it its own "
                    "reward.functions entry"
                )
        models = [p for p in self.parts if p.is_model]
        if len(models) > 1:
            raise ValueError("reward.functions names the reward model ('model') twice; list it once")
        if models and self.model is None:
            raise ValueError("reward.functions has a 'model' part but reward.model is not set; set reward.model.path")
        if self.model is not None and not models:
            raise ValueError(
                "reward.model is set but no part uses it; add {function: model, weight: 1.0} to reward.functions"
            )
        try:
            re.compile(self.format_pattern)
        except re.error as exc:
            raise ValueError(f"reward.format_pattern is not a valid regular expression: {exc}") from None
        return self

    @property
    def parts(self) -> list[RewardFunctionConfig]:
        """The reward's parts: ``functions``, or ``function`` as one part of weight 1."""
        if self.functions is not None:
            return list(self.functions)
        return [RewardFunctionConfig(function=self.function, by_source=self.by_source)]

    @property
    def function_parts(self) -> list[RewardFunctionConfig]:
        """The parts computed by functions in the reward workers (all but the reward model)."""
        return [p for p in self.parts if not p.is_model and not p.is_environment]

    @property
    def uses_environment(self) -> bool:
        """Whether a part is the episode's environment reward (multi-turn rollouts only)."""
        return any(p.is_environment for p in self.parts)


class EpisodeConfig(Section):
    environment: str | None = Field(
        None,
        description="The environment of a multi-turn episode, 'path/to/file.py:ClassName' or 'builtin:<name>' "
        "(lookup): a class with reset(row) -> messages and step(action_text) -> StepResult (actors/environments.py).",
    )
    args: dict = Field(default_factory=dict, description="Keyword arguments the environment class is built with.")
    max_turns: int = Field(4, gt=0, description="Model turns per episode; the episode ends after the last one.")
    turn_max_tokens: int | None = Field(
        None,
        gt=0,
        description="Longest model turn, in tokens (default: what is left of the episode budget, rollout.max_tokens).",
    )
    tool_format: Literal["hermes"] = Field(
        "hermes",
        description="How tool calls are written in the model's text: hermes (Qwen2.5/Qwen3, Hermes, and most "
        'chat templates\' tool support): <tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
    )
    workers: int = Field(
        2, gt=0, description="Environment worker processes per generation actor; environment steps run there."
    )
    step_timeout_s: float = Field(
        30,
        gt=0,
        description="Deadline of one environment step (or reset); past it the episode ends (reason 'timeout') and "
        "the worker is replaced.",
    )
    import_timeout_s: float = Field(60, gt=0, description="Longest time an environment worker may take to start.")


class RolloutConfig(Section):
    prompts_per_step: int = Field(16, gt=0, description="Prompts in one training batch.")
    group_size: int = Field(8, ge=2, description="Completions sampled per prompt (G); advantages are group-relative.")
    max_tokens: int = Field(16, gt=0, description="Longest completion, in tokens; longer ones are truncated.")
    min_tokens: int = Field(0, ge=0, description="Tokens sampled before EOS is allowed (1 forbids empty answers).")
    max_tokens_field: str | None = Field(
        None,
        description="Row column holding that prompt's own completion budget in tokens (a length budget per "
        "problem), capped at rollout.max_tokens; a row without a value uses rollout.max_tokens. Single-turn only.",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature T. The policy trained is softmax(logits / T), the distribution sampled: "
        "the engine reports its log-probs and the learner scores logits / T, so TIS and the ratios compare like "
        "with like.",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling threshold; only 1.0 (off) can be trained on: the learner does not model the "
        "truncated distribution.",
    )
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
    kind: Literal["single_turn", "multi_turn"] = Field(
        "single_turn",
        description="single_turn: one completion per sample; multi_turn: an episode of model turns and environment "
        "(tool) turns, rollout.episode.*; rollout.max_tokens is then the episode's budget after the prompt (model "
        "and environment tokens).",
    )
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig, description="Multi-turn episodes (rollout.kind).")

    @model_validator(mode="after")
    def _sampling_the_learner_can_model(self) -> RolloutConfig:
        # Tokens drawn from the nucleus would be trained and TIS-corrected as if drawn from the whole
        # vocabulary: the ratios would be wrong by the nucleus mass, silently. Refuse it instead.
        if self.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p = {self.top_p} is not modelled by the learner (it scores the whole softmax(logits / "
                "T), so the importance ratios of nucleus samples would be wrong); set rollout.top_p=1.0 and use "
                "rollout.temperature to sharpen sampling"
            )
        if self.max_tokens_field and self.kind == "multi_turn":
            raise ValueError(
                "rollout.max_tokens_field is for single-turn rollouts; an episode's budget is rollout.max_tokens "
                "(set rollout.max_tokens_field=null or rollout.kind=single_turn)"
            )
        if self.kind == "multi_turn" and not self.episode.environment:
            raise ValueError(
                "rollout.kind = multi_turn needs an environment: set rollout.episode.environment=path/to/env.py:Class "
                "(or builtin:lookup)"
            )
        return self


class EngineConfig(Section):
    max_model_len: int = Field(512, gt=0, description="vLLM context length (prompt + completion).")
    kv_cache_gib: int = Field(1, gt=0, description="KV cache size per engine on CPU, in GiB.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Fraction of GPU memory for vLLM on GPU.")
    enforce_eager: bool = Field(True, description="Skip graph compilation in vLLM (fast start-up).")
    weight_transfer: Literal["auto", "bytes", "shared"] = Field(
        "auto",
        description=(
            "How an in-flight actor hands new weights to its engine's process: bytes (a safetensors copy per "
            "update), shared (CUDA IPC or shared-memory handles, no copy through the message); auto: shared "
            "with a GPU when /dev/shm has room for the update's host tensors twice over, else bytes (said "
            "once); bytes on the CPU."
        ),
    )


class ActorPlacement(Section):
    count: int = Field(1, gt=0, description="Number of generation actors (one vLLM engine each).")
    num_cpus: float = Field(1, ge=0, description="Ray CPUs reserved per generation actor.")
    num_gpus: float = Field(
        0, ge=0, description="Ray GPUs per generation actor; on GPU it must equal tensor_parallel (vLLM uses them all)."
    )
    tensor_parallel: int = Field(
        1, gt=0, description="vLLM tensor parallel size: the engine shards the model over this many GPUs (CPU: cores)."
    )
    custom: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per actor, e.g. {rollout_node: 1}, to pin them to nodes.",
    )
    max_restarts: int = Field(
        3, ge=0, description="Times each dead generation actor is replaced; past that the run checkpoints and stops."
    )


class RewardModelPlacement(Section):
    count: int = Field(1, gt=0, description="Reward model actors (used only with reward.model); calls alternate.")
    num_cpus: float = Field(1, ge=0, description="Ray CPUs per reward model actor.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs per reward model actor.")
    custom: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per reward model actor.")
