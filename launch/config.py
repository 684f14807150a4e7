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
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from actors.config import EngineConfig, RewardConfig, RolloutConfig
from cluster.config import ResourcesConfig, WeightsConfig
from launch.trackers import CHOICES as TRACKER_CHOICES
from launch.trackers import RUN_FILES, check_trackers
from learner.config import AlgorithmConfig, LearnerConfig
from queues.config import DataConfig, Section


class ConfigError(ValueError):
    """A config problem, explained in one line that names the field and the fix."""


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
    checkpoint_every: int = Field(
        50,
        ge=0,
        description="Checkpoint (DeepSpeed state + run state) every N steps (0: by step never), and at every stop "
        "and every run.checkpoint_every_s.",
    )
    checkpoint_every_s: float = Field(
        3600,
        ge=0,
        description="Also checkpoint when this many seconds have passed since the last checkpoint (0: off): "
        "steps of long-reasoning jobs take minutes, so a step count alone can leave hours unsaved.",
    )
    save_every: int = Field(
        0,
        ge=0,
        description="Also write the policy as a Hugging Face model into the checkpoint every N steps (0: never).",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    save_final: bool = Field(
        True, description="Checkpoint and write model/ at the end of the run (`tandem tune`'s short probes do not)."
    )
    log_samples: int = Field(4, ge=0, description="Completions per step written to samples.jsonl.")
    max_restarts: int = Field(
        0, ge=0, description="Times a failed run resumes by itself from its newest checkpoint (a dead learner rank...)."
    )
    max_nonfinite_steps: int = Field(
        3, gt=0, description="Steps in a row with a non-finite loss or gradient (each skipped) before the run stops."
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
    trackers: list[str] = Field(
        default_factory=lambda: [RUN_FILES, "tensorboard"],
        description=f"Where metrics go, from {', '.join(TRACKER_CHOICES)}: jsonl (metrics/samples/eval.jsonl in "
        "the run directory, required: the report, the tuner and resume read them), tensorboard (RUN_DIR/tb: "
        "scalars, staleness/reward/length histograms, sample completions), wandb (Weights & Biases, RUN_DIR/wandb; "
        "pip install 'tandem-rl[wandb]'). On the command line: run.trackers=[jsonl,tensorboard,wandb].",
    )
    wandb_project: str = Field("tandem", description="W&B project of the run (run.trackers has wandb).")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: W&B writes RUN_DIR/wandb only (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it "
        "later); online: streams to the W&B server and needs a login (`wandb login` or WANDB_API_KEY).",
    )
    live: bool = Field(
        True,
        description="In a terminal, a live view at the bottom (progress bar, ETA, latest numbers) instead of a "
        "line a step; without a terminal (a pipe, a file, CI, Ray job logs) the plain lines either way.",
    )

    @field_validator("trackers")
    @classmethod
    def _trackers(cls, names: list[str]) -> list[str]:
        return check_trackers(names)

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


class EvalConfig(Section):
    prompts: str | None = Field(
        None, description="Held-out rows to evaluate on, in any form data.prompts takes (columns mapped the same way)."
    )
    split: str = Field("test", description="Split of eval.prompts when it is a dataset directory or name.")
    subset: str | None = Field(None, description="Configuration of eval.prompts (default: data.subset).")
    prompt_field: str | None = Field(None, description="Prompt column of eval.prompts (default: data.prompt_field).")
    answer_field: str | None = Field(None, description="Answer column of eval.prompts (default: data.answer_field).")
    fraction: float = Field(
        0.0, ge=0, lt=1, description="Hold this fraction of data.prompts out of training and evaluate on it instead."
    )
    max_prompts: int | None = Field(None, gt=0, description="Evaluate on the first N held-out rows only.")
    every: int = Field(
        0,
        ge=0,
        description="Evaluate every N steps; with a held-out set it also runs before step 1 and after the last one.",
    )
    samples: int = Field(4, gt=0, description="Completions per held-out prompt (k of pass@k).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for evaluation (0: greedy).")
    correct_reward: float = Field(
        1.0, description="A completion counts as correct (for pass@k) when its reward is at least this."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if self.prompts and self.fraction:
            raise ValueError("set eval.prompts or eval.fraction, not both")
        if self.every and not self.enabled:
            raise ValueError(
                f"eval.every = {self.every} but there is nothing to evaluate on; set eval.prompts or eval.fraction"
            )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.prompts or self.fraction)


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
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _cross_section_rules(self) -> TandemConfig:
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        minibatches = self.algorithm.minibatches
        if batch < minibatches:
            raise ValueError(
                f"rollout.prompts_per_step x rollout.group_size = {batch} sequences cannot fill "
                f"algorithm.minibatches = {minibatches} optimizer steps; lower algorithm.minibatches"
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
        if algo.soft_overlong and algo.soft_overlong.cache_len >= self.rollout.max_tokens:
            raise ValueError(
                f"algorithm.soft_overlong.cache_len = {algo.soft_overlong.cache_len} must be below "
                f"rollout.max_tokens = {self.rollout.max_tokens}"
            )
        return self

    @property
    def warnings(self) -> list[str]:
        """Valid settings that are probably not what the user meant: printed before the run, one line each."""
        return self.algorithm.warnings

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
            lines.append(f"missing config key '{where}'; add it to the YAML or pass {where}=...")
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
    for p in [] if path is None else path if isinstance(path, list) else [path]:
        tree = _merge(tree, _read_tree(Path(p)))
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
            optional = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(optional) == 1:  # an optional section (off when empty): its keys too
                walk(optional[0], f"{prefix}{name}.")

    walk(TandemConfig, "")
    return "\n".join(rows)
