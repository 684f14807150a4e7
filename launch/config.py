"""Tandem's typed run configuration: the components' sections composed, read from YAML plus overrides.

Each section lives next to the code that uses it and is handed to it typed: ``data`` in
``queues/config.py``; ``reward``, ``rollout`` and ``engine`` in ``actors/config.py``; ``learner``
and ``algorithm`` in ``learner/config.py``; ``resources`` and ``weights`` in ``cluster/config.py``.
This module adds the run-wide sections (``model``, ``run``), the rules that span sections, and
loading. Every field has a description; ``tandem config-reference`` prints them all and the
README's config reference is generated from them (a test keeps them in sync).
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from actors.config import ActorPlacement, EngineConfig, RewardConfig, RewardModelPlacement, RolloutConfig
from cluster.config import WeightsConfig
from learner.config import (
    REGROUPED,
    AlgorithmConfig,
    CriticPlacement,
    LearnerConfig,
    LearnerPlacement,
    ReferencePlacement,
    regroup,
    regrouped_warning,
)
from observe.trackers import TrackingConfig
from queues.config import DataConfig
from runtime.evaluation import EvalConfig
from runtime.saving import CheckpointConfig
from schema import ConfigError, Section


class ModelConfig(Section):
    path: str = Field(description="Hugging Face model id or local model directory (weights + tokenizer).")
    build_tiny: bool = Field(
        False, description="If the path does not exist, build the tiny random-init Qwen2 model there first."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weights dtype for generation and training compute."
    )


def parse_duration(text: str) -> float:
    """Seconds from ``"5400"``, ``"1:30:00"`` (H:MM:SS), ``"1:30"`` (H:MM) or ``"2-12:00:00"`` (D-H:MM:SS)."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if len(parts) == 1 and not days:
        try:
            return float(parts[0])
        except ValueError:
            raise ValueError(f"{text!r} is not seconds or [D-]H:MM[:SS]") from None
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts) or (days and not days.isdigit()):
        raise ValueError(f"{text!r} is not seconds or [D-]H:MM[:SS]")
    h, m, sec = (int(p) for p in (parts + ["0"])[:3])
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + sec


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
    reward_model: RewardModelPlacement = Field(default_factory=RewardModelPlacement)

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


class _RunStart(Section):
    name: str = Field("run", description="Run name; the run directory is <output_dir>/<name>-<timestamp>.")
    output_dir: str = Field("runs", description="Parent directory of run directories.")
    steps: int = Field(100, gt=0, description="Training steps (optimizer updates).")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    max_staleness: int = Field(
        1, ge=0, description="Max policy versions between generating a token and training on it (0 = synchronous)."
    )
    schedule: Literal["overlapped", "colocated"] = Field(
        "overlapped",
        description="overlapped: actors and learner on devices of their own, generating while the learner trains; "
        "colocated: they share the learner's devices and take turns, each phase using all of them (docs/schedules.md).",
    )
    data_timeout_s: float = Field(300, gt=0, description="Longest wait for a batch before the run fails.")
    weights_timeout_s: float = Field(120, gt=0, description="Longest wait for new weights before the run fails.")
    startup_timeout_s: float = Field(600, gt=0, description="Longest wait for actors and learners to start.")


class _RunMiddle(Section):
    log_samples: int = Field(4, ge=0, description="Completions per step written to samples.jsonl.")
    max_restarts: int = Field(
        0, ge=0, description="Times a failed run resumes by itself from its newest checkpoint (a dead learner rank...)."
    )
    max_nonfinite_steps: int = Field(
        3, gt=0, description="Steps in a row with a non-finite loss or gradient (each skipped) before the run stops."
    )
    max_empty_steps: int = Field(
        5, gt=0, description="Steps in a row that train no token (failed episodes, all rejected) before the run stops."
    )
    time_limit: str | float | None = Field(
        None,
        description="Wall-time limit as seconds or [D-]H:MM:SS (e.g. the SLURM allocation): the run checkpoints and "
        "stops cleanly before it runs out.",
    )
    private: bool = Field(True, description="Create the run directory readable by its owner only (mode 0700).")
    timeline: bool = Field(
        True,
        description="Record what every actor and learner rank does when (spans) into timeline.jsonl, for "
        "`tandem report` (costs well under 1% of a step).",
    )

    @field_validator("time_limit")
    @classmethod
    def _duration(cls, value: str | float | None) -> str | None:
        if value is not None:
            try:
                if parse_duration(str(value)) <= 0:
                    raise ValueError(f"{value!r} is not a positive duration")
            except ValueError as exc:
                raise ValueError(f"run.time_limit: {exc}; write e.g. 3600 or 23:30:00") from None
        return None if value is None else str(value)


class RunConfig(TrackingConfig, _RunMiddle, CheckpointConfig, _RunStart):
    """The ``run`` section: its start (name, length, staleness, deadlines), checkpoints (owned by
    ``runtime/saving.py``), the rest, and tracking (owned by ``observe/trackers.py``), in that order."""


class TandemConfig(Section):
    _regrouped: list[str] = PrivateAttr(default_factory=list)  # flat algorithm keys read in their groups (load_config)

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
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _cross_section_rules(self) -> TandemConfig:
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        minibatches = self.algorithm.loss.minibatches
        if batch < minibatches:
            raise ValueError(
                f"rollout.prompts_per_step x rollout.group_size = {batch} sequences cannot fill "
                f"algorithm.loss.minibatches = {minibatches} optimizer steps; lower algorithm.loss.minibatches"
            )
        if self.rollout.max_tokens >= self.engine.max_model_len:
            raise ValueError(
                f"rollout.max_tokens = {self.rollout.max_tokens} leaves no room for a prompt in "
                f"engine.max_model_len = {self.engine.max_model_len} (prompt + completion); lower "
                "rollout.max_tokens or raise engine.max_model_len"
            )
        algo = self.algorithm
        if algo.method.per_step_rewards and len(self.reward.parts) > 1:
            raise ValueError(
                f"algorithm.name = {algo.name} scores every reasoning step with one reward function; set "
                "reward.function, not a weighted sum in reward.functions"
            )
        if self.algorithm.kl.exact and self.resources.reference.placement == "separate":
            raise ValueError(
                "algorithm.kl.estimator = exact needs the reference's logits on the learner ranks: set "
                "resources.reference.placement=colocated"
            )
        gpus = self.resources.learner.num_gpus
        if self.run.schedule == "colocated" and bool(self.resources.actors.num_gpus) != bool(gpus):
            raise ValueError(
                f"run.schedule = colocated puts the actors on the learner's devices, which are "
                f"{'GPUs' if gpus else 'CPUs'}: set resources.actors.num_gpus {'> 0' if gpus else '= 0'} "
                "(docs/schedules.md)"
            )
        if self.run.schedule == "colocated" and gpus:
            self._check_offload()
        self.weights.check_placement(self.run.schedule == "colocated", self.resources.actors.tensor_parallel)
        episodes = self.rollout.kind == "multi_turn"
        if self.reward.uses_environment and not episodes:
            raise ValueError(
                "reward part 'environment' is an episode's own reward, and rollout.kind is single_turn; set "
                "rollout.kind=multi_turn with rollout.episode.environment, or use a reward function"
            )
        if episodes and algo.method.per_step_rewards and self.reward.function != "environment":
            raise ValueError(
                f"algorithm.name = {algo.name} rewards each turn of an episode with the environment's reward of "
                "that turn; set reward.function=environment"
            )
        if algo.shaping.soft_overlong and algo.shaping.soft_overlong.cache_len >= self.rollout.max_tokens:
            raise ValueError(
                f"algorithm.shaping.soft_overlong.cache_len = {algo.shaping.soft_overlong.cache_len} must be below "
                f"rollout.max_tokens = {self.rollout.max_tokens}"
            )
        return self

    def _check_offload(self) -> None:
        """Colocated on GPUs the learner's states leave the device while the engines generate, which
        DeepSpeed does at ZeRO stages 1-3, and under ZeRO-3 not with frozen parameters (LoRA)."""
        zero = self.learner.zero_stage
        if zero == 0:
            raise ValueError(
                "run.schedule = colocated on GPUs moves the learner's optimizer states to host memory while the "
                "engines generate, which DeepSpeed does at ZeRO stages 1-3: set learner.zero_stage=1"
            )
        if zero == 3 and self.learner.lora is not None:
            raise ValueError(
                "run.schedule = colocated on GPUs with learner.lora cannot offload the learner under ZeRO-3 (DeepSpeed "
                "maps the frozen base into the trained partitions' buffer): set learner.zero_stage=1 or 2"
            )

    @property
    def warnings(self) -> list[str]:
        """Valid settings that are probably not what the user meant: printed before the run, one line each."""
        out = ([regrouped_warning(self._regrouped)] if self._regrouped else []) + self.algorithm.warnings
        out += self.learner.lora.warnings if self.learner.lora else []
        if self.rollout.max_tokens_field and self.algorithm.shaping.soft_overlong is not None:
            out.append(
                "rollout.max_tokens_field with algorithm.shaping.soft_overlong: the penalty ramps toward "
                "rollout.max_tokens, so a row cut at its own smaller budget gets no ramp"
            )
        res = self.resources
        engine_cores = res.actors.count * res.actors.tensor_parallel
        learner_cores = res.learner.ranks * res.learner.num_cpus
        if self.run.schedule == "colocated" and not res.actors.num_gpus and engine_cores != learner_cores:
            out.append(
                f"run.schedule = colocated: {engine_cores:g} engine core(s) (resources.actors.count x tensor_parallel) "
                f"take turns with {learner_cores:g} learner core(s) (resources.learner.ranks x num_cpus); with as "
                "many engines as the learner has cores each phase uses every core"
            )
        estimator = self.algorithm.estimator
        if estimator.discount == "turn" and estimator.gamma < 1 and self.rollout.kind != "multi_turn":
            out.append(
                f"algorithm.estimator.discount = turn with gamma = {estimator.gamma} discounts nothing in single-turn "
                "completions (one turn each); use discount: token, or rollout.kind: multi_turn"
            )
        return out

    @property
    def has_critic(self) -> bool:
        """The method trains a value model (PPO)."""
        return self.algorithm.method.needs_critic

    @property
    def has_reference(self) -> bool:
        """A KL term needs the frozen reference model."""
        return self.algorithm.kl.enabled


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
            section = _section_of(e["loc"])  # a whole section missing: name the keys it needs
            needed = [f"{where}.{n}" for n, f in section.model_fields.items() if f.is_required()] if section else []
            lines.append(
                f"missing config key '{where}'; add it to the YAML or pass {'=... '.join(needed or [where])}=..."
            )
        elif e["type"] == "value_error":  # a rule of a section's own: its message names the keys
            lines.append(e["msg"].removeprefix("Value error, "))
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


def _read_tree(p: Path) -> dict:
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass an existing YAML file to --config")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(tree).__name__}")
    return tree


def _merge(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``, section by section (a later file's keys win)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | list | None, overrides: list[str] | None = None) -> TandemConfig:
    """Read a YAML config (or several, merged in order: e.g. a job and the overrides ``tandem tune``
    wrote), apply ``key=value`` overrides, validate; raise ``ConfigError`` on any problem."""
    tree: dict = {}
    moved: list[str] = []  # flat algorithm keys (written before the groups), read in their groups
    for p in [] if path is None else path if isinstance(path, list) else [path]:
        tree = _merge(tree, _grouped(_read_tree(Path(p)), moved))
    pairs = parse_overrides(overrides or [])
    given = {key for key, _ in pairs}
    for key, value in pairs:
        _set_dotted(tree, _grouped_key(key, given, moved), value)
    try:
        cfg = TandemConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None
    cfg._regrouped = list(dict.fromkeys(moved))
    return cfg


def _grouped(tree: dict, moved: list[str]) -> dict:
    """One config file's tree with a flat ``algorithm`` section (older configs) in its groups: each source is
    grouped before the sources merge, so a later source's key wins however either was written."""
    if isinstance(tree.get("algorithm"), dict):
        try:
            tree["algorithm"], keys = regroup(tree["algorithm"])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        moved += keys
    return tree


def _grouped_key(key: str, given: set[str], moved: list[str]) -> str:
    """An override's key, a flat ``algorithm.<key>`` moved to its group (refused when the overrides also
    give the grouped key)."""
    section, _, name = key.partition(".")
    if section != "algorithm" or name not in REGROUPED:
        return key
    grouped = "algorithm." + ".".join(REGROUPED[name])
    if grouped in given:
        raise ConfigError(f"{key} and {grouped} are the same setting, given twice; keep {grouped}")
    moved.append(name)
    return grouped


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
            optional = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(optional) == 1:  # an optional section (off when empty): its keys too
                walk(optional[0], f"{prefix}{name}.")

    walk(TandemConfig, "")
    return "\n".join(rows)
