"""Tandem's typed run configuration: one validated schema, read from YAML plus overrides.

Every field has a description; ``tandem config-reference`` prints them all and the
README's config reference is generated from this file (a test keeps them in sync).
Algorithm parameters and placement (``resources``) are separate sections, and each
component receives only its own section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config problem, explained in one line that names the field and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str = Field(description="Hugging Face model id or local model directory (weights + tokenizer).")
    build_tiny: bool = Field(
        False, description="If the path does not exist, build the tiny random-init Qwen2 model there first."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weights dtype for generation and training compute."
    )


class DataConfig(Section):
    prompts: str = Field(
        description='JSONL file of {"prompt": ..., "answer": ...} rows (other fields are passed to the '
        "reward function), or 'builtin:<task>' for a built-in task."
    )
    num_rows: int = Field(2048, gt=0, description="Rows to generate for a built-in task.")
    shuffle: bool = Field(True, description="Shuffle the rows each epoch (seeded by run.seed).")


class RewardConfig(Section):
    function: str = Field(
        description="Reward function as 'path/to/file.py:function_name' (called as fn(prompt, completion, row) "
        "-> float), or 'builtin:<task>'."
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


class LearnerConfig(Section):
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clip (0 disables).")
    token_budget: int = Field(
        4096, gt=0, description="Tokens per packed micro-batch (one forward/backward); a longer sequence gets its own."
    )
    pack_row_tokens: int | None = Field(
        None,
        ge=0,
        description="Row length inside a micro-batch: empty = the longest sequence (dense attention: CPU, sdpa), "
        "0 = one row of token_budget (a varlen attention kernel), or a number of tokens.",
    )


METHODS = ("reinforce", "rloo", "grpo", "grpo_process", "dr_grpo", "gspo", "cispo", "ppo")
CRITIC_METHODS = ("ppo",)  # the methods whose learner trains a value model (learner.methods: needs_critic)


class KLConfig(Section):
    placement: Literal["none", "reward", "loss"] = Field(
        "none", description="Where the KL to the reference model goes: per-token reward shaping, a loss term, or off."
    )
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL estimator: k1 = l, k2 = l^2/2, k3 = e^-l - 1 + l."
    )
    beta: float = Field(0.01, ge=0, description="KL coefficient (the starting value when adaptive).")
    adaptive: bool = Field(
        False, description="Adapt beta towards kl.target: beta *= 1 + clip(KL/target - 1, +-0.2) n/H."
    )
    target: float = Field(0.01, gt=0, description="Adaptive KL target per token.")
    horizon: int = Field(10000, gt=0, description="Adaptive KL horizon H, in samples.")
    reference_path: str | None = Field(None, description="Reference model (default: the initial policy, model.path).")


class CriticConfig(Section):
    init: Literal["policy", "reward_model", "fresh"] = Field(
        "policy", description="Value model start: the policy's transformer, a reward-model checkpoint, or random."
    )
    path: str | None = Field(
        None, description="Value model checkpoint (a reward model or a smaller model); default: model.path."
    )
    lr: float = Field(1e-3, gt=0, description="Critic AdamW learning rate.")
    value_clip: float | None = Field(
        None, gt=0, description="Clip value updates to +-this around V_old (off if empty)."
    )


class SoftOverlongConfig(Section):
    cache_len: int = Field(description="Tokens before max_tokens where the penalty starts ramping.")
    factor: float = Field(1.0, ge=0, description="Penalty at the length limit (ramps linearly from 0).")


class TISConfig(Section):
    mode: Literal["none", "truncate", "mask"] = Field(
        "truncate",
        description="Sampler/learner correction: weight min(rho, cap), drop tokens outside [1/cap, cap], or none.",
    )
    level: Literal["token", "sequence"] = Field(
        "token", description="Ratio per token, or per sequence (geometric mean of its token ratios)."
    )
    cap: float = Field(2.0, gt=1, description="C: the truncation cap (and the mask's band [1/C, C]).")


class AlgorithmConfig(Section):
    name: Literal[METHODS] = Field("grpo", description="Method: " + ", ".join(METHODS) + ".")  # type: ignore[valid-type]
    loss_aggregation: Literal["token_mean", "seq_mean", "fixed_length"] | None = Field(
        None, description="token_mean, seq_mean or fixed_length (empty: the method's own; Dr. GRPO: fixed_length)."
    )
    clip_eps_low: float | None = Field(None, ge=0, description="Ratio clip below, 1 - eps_low (empty: method default).")
    clip_eps_high: float | None = Field(
        None, ge=0, description="Ratio clip above, 1 + eps_high (empty: method default)."
    )
    dual_clip: float | None = Field(None, gt=1, description="PPO dual clip c for negative advantages (off if empty).")
    epochs: int = Field(1, gt=0, description="Passes over each batch.")
    minibatches: int = Field(1, gt=0, description="Optimizer steps per pass (the batch is split in this many).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (PPO).")
    advantage_eps: float = Field(1e-6, gt=0, description="Added to the group std in GRPO advantages.")
    whiten_advantages: bool = Field(False, description="Whiten advantages over the batch (masked).")
    normalise_rewards: bool = Field(False, description="Scale rewards to zero mean, unit variance with running stats.")
    whiten_rewards: Literal["none", "whiten", "whiten_keep_mean"] = Field(
        "none", description="Whiten rewards over the batch; whiten_keep_mean adds the mean back."
    )
    truncation_penalty: float | None = Field(
        None, description="Reward given instead of the score to a completion cut at max_tokens (off if empty)."
    )
    soft_overlong: SoftOverlongConfig | None = Field(
        None, description="Ramp a penalty over the last cache_len tokens of the budget (off if empty)."
    )
    step_delimiter: str = Field(
        "\n", description="Process supervision: separator of reasoning steps in the completion ('' = every character)."
    )
    tis: TISConfig = Field(default_factory=TISConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)


class WeightsConfig(Section):
    backend: Literal["ray", "distributed"] = Field(
        "ray",
        description="How weights reach the actors: Ray's object store, or a torch.distributed broadcast from "
        "learner rank 0 (gloo on CPU, NCCL on GPU) in buckets, with per-actor deadlines.",
    )
    process_group: Literal["gloo", "nccl"] = Field("gloo", description="Backend of the distributed weight group.")
    push_timeout_s: float = Field(60, gt=0, description="Deadline of one distributed push; a stalled actor is named.")
    bucket_mb: int = Field(64, gt=0, description="Bucket size of a distributed push, in MiB.")


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


class LearnerPlacement(Section):
    ranks: int = Field(1, gt=0, description="Data-parallel learner ranks (one DeepSpeed process each).")
    num_cpus: float = Field(1, ge=0, description="Ray CPUs reserved per learner rank.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs per learner rank.")
    custom: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per rank, e.g. {train_node: 1}, to pin them to nodes."
    )


class CriticPlacement(Section):
    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="PPO's critic: on the learner ranks (colocated) or on its own ranks, as many as the learner's, "
        "training beside the policy (separate).",
    )
    num_cpus: float = Field(1, ge=0, description="Ray CPUs per separate critic rank.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs per separate critic rank.")
    custom: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per separate critic rank.")


class ReferencePlacement(Section):
    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="The frozen KL reference model: on every learner rank (colocated) or in its own actors (separate).",
    )
    count: int = Field(1, gt=0, description="Separate reference actors; the learner's shards are spread over them.")
    num_cpus: float = Field(1, ge=0, description="Ray CPUs per separate reference actor.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs per separate reference actor.")
    custom: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per reference actor.")


class ResourcesConfig(Section):
    address: str | None = Field(None, description="Ray cluster address to join; empty starts a local Ray.")
    local_num_cpus: int | None = Field(
        None, gt=0, description="CPUs a local Ray advertises (default: this machine's cores, or what the plan needs)."
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for all actors and ranks (one bundle each)."
    )
    placement_timeout_s: float = Field(60, gt=0, description="Longest wait for the placement group to be placed.")
    actors: ActorPlacement = Field(default_factory=ActorPlacement)
    learner: LearnerPlacement = Field(default_factory=LearnerPlacement)
    critic: CriticPlacement = Field(default_factory=CriticPlacement)
    reference: ReferencePlacement = Field(default_factory=ReferencePlacement)

    @model_validator(mode="after")
    def _gpus_match_tensor_parallel(self) -> ResourcesConfig:
        a = self.actors
        if a.num_gpus and a.num_gpus != a.tensor_parallel:
            raise ValueError(
                f"resources.actors.num_gpus = {a.num_gpus:g} but resources.actors.tensor_parallel = "
                f"{a.tensor_parallel}: each vLLM engine shards over all its GPUs; set them equal"
            )
        if not a.num_gpus and a.num_cpus < a.tensor_parallel:
            raise ValueError(
                f"resources.actors.tensor_parallel = {a.tensor_parallel} on CPU runs one shard per core, but "
                f"resources.actors.num_cpus = {a.num_cpus:g} reserves fewer; set num_cpus={a.tensor_parallel}"
            )
        return self


class RunConfig(Section):
    name: str = Field("run", description="Run name; the run directory is <output_dir>/<name>-<timestamp>.")
    output_dir: str = Field("runs", description="Parent directory of run directories.")
    steps: int = Field(100, gt=0, description="Training steps (optimizer updates).")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    max_staleness: int = Field(
        1, ge=0, description="Max policy versions between generating a token and training on it (0 = synchronous)."
    )
    data_timeout_s: float = Field(300, gt=0, description="Longest wait for a batch before the run fails.")
    weights_timeout_s: float = Field(120, gt=0, description="Longest wait for new weights before the run fails.")
    startup_timeout_s: float = Field(600, gt=0, description="Longest wait for actors and learners to start.")


class TandemConfig(Section):
    model: ModelConfig
    data: DataConfig
    reward: RewardConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> TandemConfig:
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        minibatches = self.algorithm.minibatches
        if batch < minibatches:
            raise ValueError(
                f"rollout.prompts_per_step x rollout.group_size = {batch} sequences cannot fill "
                f"algorithm.minibatches = {minibatches} optimizer steps; lower algorithm.minibatches"
            )
        algo = self.algorithm
        if algo.name == "grpo_process" and algo.kl.placement == "reward":
            raise ValueError(
                "algorithm.kl.placement=reward is not defined for grpo_process (its rewards are per step); "
                "use algorithm.kl.placement=loss"
            )
        if algo.soft_overlong and algo.soft_overlong.cache_len >= self.rollout.max_tokens:
            raise ValueError(
                f"algorithm.soft_overlong.cache_len = {algo.soft_overlong.cache_len} must be below "
                f"rollout.max_tokens = {self.rollout.max_tokens}"
            )
        return self

    @property
    def has_critic(self) -> bool:
        """The method trains a value model (PPO)."""
        return self.algorithm.name in CRITIC_METHODS

    @property
    def has_reference(self) -> bool:
        """A KL term needs the frozen reference model."""
        return self.algorithm.kl.placement != "none"

    def placement(self) -> dict[str, Any]:
        """The ``resources`` section as the placement code reads it: ``critic`` / ``reference`` are
        None unless this run has one and it is placed separately."""
        res = self.resources.model_dump()
        if res["critic"]["placement"] != "separate" or not self.has_critic:
            res["critic"] = None
        if res["reference"]["placement"] != "separate" or not self.has_reference:
            res["reference"] = None
        return res


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Turn ``["learner.lr=3e-4", "run.steps=5"]`` into (dotted key, YAML-typed value) pairs."""
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value; write e.g. learner.lr=3e-4")
        pairs.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return pairs


def _explain(err: ValidationError) -> str:
    """One line per problem, naming the field and what to do."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            parent = e["loc"][:-1]
            section = _section_of(parent)
            valid = ", ".join(section.model_fields) if section else "?"
            lines.append(f"unknown config key '{where}'; valid keys here: {valid}")
        elif e["type"] == "missing":
            lines.append(f"missing config key '{where}'; add it to the YAML or pass {where}=...")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"config key '{where}': {msg} (got {e.get('input')!r})" if e["loc"] else msg)
    return "; ".join(lines)


def _section_of(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = TandemConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TandemConfig:
    """Read a YAML config, apply ``key=value`` overrides, validate; raise ``ConfigError`` on any problem."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass an existing YAML file to --config")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(tree).__name__}")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    try:
        return TandemConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def config_reference() -> str:
    """Markdown table of every config key, its default and its description."""
    rows = ["| key | default | description |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            rows.append(f"| `{prefix}{name}` | `{default}` | {field.description} |")

    walk(TandemConfig, "")
    return "\n".join(rows)
