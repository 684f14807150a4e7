"""The learner's config sections: the optimiser (``learner``) and the method (``algorithm``).

Every choice is spelled by the registry that implements it: method names by
``learner.methods.METHODS``, loss aggregations by ``learner.algorithms.AGGREGATIONS``, KL
estimators by ``KL_ESTIMATORS``, importance-sampling levels and modes by
``learner.algorithms.importance``; adding one there adds it here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from learner.algorithms import AGGREGATIONS, KL_ESTIMATORS
from learner.algorithms.importance import LEVELS as TIS_LEVELS
from learner.algorithms.importance import MODES as TIS_MODES
from learner.algorithms.rejection import DIVERGENCES, REDUCTIONS, RejectRule
from learner.attention import CHOICES as ATTENTION_CHOICES
from learner.methods import METHODS
from learner.schedule import SCHEDULES
from schema import Section

METHOD_NAMES = tuple(METHODS)


class LoraConfig(Section):
    rank: int = Field(16, gt=0, le=512, description="LoRA rank r of each adapted weight (vLLM serves ranks up to 512).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: an adapted weight is W + (alpha / r) B A.")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get an adapter: names (e.g. [q_proj, v_proj]) or all-linear (every linear layer but "
        "the output head).",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input while training (the sampler has none: keep 0)."
    )

    @property
    def warnings(self) -> list[str]:
        """Valid settings that are probably not what the user meant, one line each."""
        if not self.dropout:
            return []
        return [
            f"learner.lora.dropout = {self.dropout:g}: the sampler (vLLM) has no dropout, so the learner's log-probs "
            "of its tokens differ from the sampler's by the dropout noise (importance weights and the mismatch "
            "KL see it as staleness); set learner.lora.dropout=0"
        ]

    @model_validator(mode="after")
    def _served_modules(self) -> LoraConfig:
        names = [self.target_modules] if isinstance(self.target_modules, str) else self.target_modules
        unserved = [n for n in names if n.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens")]
        if unserved:
            raise ValueError(
                f"learner.lora.target_modules: vLLM serves no adapter on {', '.join(unserved)} (the output head and "
                "the embeddings); adapt the linear layers (all-linear, or names such as q_proj, v_proj)"
            )
        return self


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
        description="Row length inside a micro-batch with a dense mask (sdpa, eager): empty = the longest "
        "sequence, 0 = one row of token_budget, or a number of tokens. A varlen kernel always takes one row.",
    )
    attention: Literal[ATTENTION_CHOICES] = Field(  # type: ignore[valid-type]
        "auto",
        description="Attention kernel of the learner's models: auto = flash_attention_2 (varlen: no [L, L] mask) "
        "on a CUDA GPU with flash_attn installed and model.dtype bfloat16, else sdpa with a dense block mask.",
    )
    lr_schedule: Literal[SCHEDULES] = Field(  # type: ignore[valid-type]
        "constant", description="After warm-up: constant, linear or cosine decay over the run's updates."
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer updates of linear learning-rate warm-up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Decay ends at learner.lr x this.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute layer activations in the backward: much less memory, ~30% more compute."
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Tokens per chunk of the log-prob/entropy computation: its memory is chunk x vocab, not "
        "tokens x vocab (0: all at once).",
    )
    collective_timeout_s: float = Field(
        600, gt=0, description="Deadline of one collective between learner ranks (torch's default is 30 minutes)."
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters instead of the whole policy (docs/lora.md): only they train and travel to "
        "the actors, which serve them with vLLM's LoRA support; model/ is saved merged, the adapter in model/adapter/.",
    )


class KLConfig(Section):
    placement: Literal["none", "reward", "loss"] = Field(
        "none", description="Where the KL to the reference model goes: per-token reward shaping, a loss term, or off."
    )
    estimator: Literal[(*KL_ESTIMATORS, "exact")] = Field(  # type: ignore[valid-type]
        "k3",
        description="KL estimator: k1 = l, k2 = l^2/2, k3 = e^-l - 1 + l, abs = |l|; k1_plus, k3_plus, abs_plus: "
        "the value of k1, k3 or abs with k2's unbiased gradient (for placement=loss); exact: the KL over the whole "
        "vocabulary from both models' logits (placement=loss, the reference on the learner ranks; logged with k3).",
    )
    beta: float = Field(0.01, ge=0, description="KL coefficient (the starting value when adaptive).")
    adaptive: bool = Field(
        False, description="Adapt beta towards kl.target: beta *= 1 + clip(KL/target - 1, +-0.2) n/H."
    )
    target: float = Field(0.01, gt=0, description="Adaptive KL target per token.")
    horizon: int = Field(10000, gt=0, description="Adaptive KL horizon H, in samples.")
    reference_path: str | None = Field(None, description="Reference model (default: the initial policy, model.path).")

    @property
    def enabled(self) -> bool:
        """A reference model is needed and the KL is measured."""
        return self.placement != "none"

    @property
    def in_reward(self) -> bool:
        return self.placement == "reward"

    @property
    def in_loss(self) -> bool:
        return self.placement == "loss"

    @property
    def exact(self) -> bool:
        """The loss term is the exact KL over the vocabulary (``learner/logprobs.py`` ``token_kl``)."""
        return self.estimator == "exact"

    @property
    def sampled_estimator(self) -> str:
        """The estimator from the sampled tokens' log-probs: the logged KL, a KL in the reward (k3 for exact)."""
        return "k3" if self.exact else self.estimator

    @model_validator(mode="after")
    def _exact_in_the_loss(self) -> KLConfig:
        if self.exact and not self.in_loss:
            raise ValueError(
                "algorithm.kl.estimator = exact needs both models' logits during the update: set kl.placement=loss"
            )
        return self


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


class RejectConfig(Section):
    """One rejection rule (``learner/algorithms/rejection.py``): keep while low <= divergence <= high."""

    level: Literal["token", "sequence"] = Field(
        "token", description="Reject tokens one by one, or whole sequences by a reduction of their tokens'."
    )
    divergence: Literal[DIVERGENCES] = Field(  # type: ignore[valid-type]
        "k3", description="Per-token learner/sampler divergence: k1 = -l, k2 = l^2/2, k3 = rho - 1 - l."
    )
    reduce: Literal[REDUCTIONS] = Field(  # type: ignore[valid-type]
        "mean", description="Sequence level: the mean, sum or max of its tokens' divergences."
    )
    low: float | None = Field(None, description="Keep only at or above this (empty: no lower bound).")
    high: float | None = Field(None, description="Keep only at or below this (empty: no upper bound).")

    @model_validator(mode="after")
    def _bounds(self) -> RejectConfig:
        self.rule()
        return self

    def rule(self) -> RejectRule:
        return RejectRule(self.level, self.divergence, self.reduce, self.low, self.high).check()


class TISConfig(Section):
    mode: Literal[("none", *TIS_MODES)] = Field(  # type: ignore[valid-type]
        "truncate",
        description="Sampler/learner correction: weight min(rho, cap) (truncate), drop tokens outside [1/cap, cap] "
        "(mask), weight rho inside [low, high] and drop the rest (band), or none.",
    )
    level: Literal[TIS_LEVELS] = Field(  # type: ignore[valid-type]
        "token", description="Ratio per token, or per sequence (geometric mean of its token ratios)."
    )
    cap: float = Field(2.0, gt=1, description="C: the truncation cap (and the mask's band [1/C, C]).")
    low: float | None = Field(None, ge=0, lt=1, description="band: the lowest ratio kept (empty: 1/cap).")
    high: float | None = Field(None, gt=1, description="band: the highest ratio kept (empty: cap).")
    normalize: bool = Field(
        False,
        description="Rescale the importance weights to mean 1 over each optimizer step's trained tokens (or "
        "sequences, at the sequence level), over every rank: truncation then does not shrink the step.",
    )
    reject: list[RejectConfig] = Field(
        [],
        description="Rejection rules by learner/sampler divergence, all applied (a token is trained if every rule "
        "keeps it); each: level, divergence, reduce, low, high.",
    )

    def rules(self) -> tuple[RejectRule, ...]:
        return tuple(r.rule() for r in self.reject)

    @model_validator(mode="after")
    def _normalize_needs_weights(self) -> TISConfig:
        if self.normalize and self.mode == "none":
            raise ValueError("algorithm.tis.normalize rescales importance weights, and tis.mode is none: set a mode")
        if (self.low is not None or self.high is not None) and self.mode != "band":
            raise ValueError(f"algorithm.tis.low/high bound the band, and tis.mode is {self.mode}: set tis.mode=band")
        return self


class EstimatorConfig(Section):
    """How returns and advantages are computed from the rewards."""

    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor (REINFORCE, PPO).")
    discount: Literal["token", "turn"] = Field(
        "token",
        description="What gamma discounts: each token, or each turn of a multi-turn episode (a reward k model turns "
        "later counts gamma^k; environment tokens are skipped either way).",
    )
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (PPO).")
    advantage_eps: float = Field(1e-6, gt=0, description="Added to the group std in GRPO advantages.")
    whiten_advantages: bool = Field(False, description="Whiten advantages over the batch (masked).")
    step_delimiter: str = Field(
        "\n", description="Process supervision: separator of reasoning steps in the completion ('' = every character)."
    )


class LossConfig(Section):
    """The policy loss and how often it is stepped on each batch."""

    aggregation: Literal[AGGREGATIONS] | None = Field(  # type: ignore[valid-type]
        None,
        description="token_mean, seq_mean, fixed_length, token_sum or seq_mean_token_sum (docs/offpolicy.md; empty: "
        "the method's own; Dr. GRPO: fixed_length).",
    )
    clip_eps_low: float | None = Field(None, ge=0, description="Ratio clip below, 1 - eps_low (empty: method default).")
    clip_eps_high: float | None = Field(
        None, ge=0, description="Ratio clip above, 1 + eps_high (empty: method default)."
    )
    dual_clip: float | None = Field(None, gt=1, description="PPO dual clip c for negative advantages (off if empty).")
    epochs: int = Field(1, gt=0, description="Passes over each batch.")
    minibatches: int = Field(1, gt=0, description="Optimizer steps per pass (the batch is split in this many).")


class ShapingConfig(Section):
    """What is done to each sequence's reward before the advantages: penalties, normalisation, masking."""

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
    mask_truncated: bool = Field(
        False,
        description="Overlong filtering: completions cut at rollout.max_tokens train no token (their rewards still "
        "count in their group's baseline).",
    )


class FilteringConfig(Section):
    """Which collected groups a step trains on."""

    groups: Literal["none", "zero_variance"] = Field(
        "none",
        description="Dynamic sampling (DAPO): zero_variance drops groups whose rewards are all equal (no signal) "
        "and keeps collecting until the batch is full.",
    )
    max_oversample: float = Field(
        3.0,
        ge=1,
        description="With filtering.groups: a step takes at most this x prompts_per_step groups; past it, "
        "zero-variance groups fill the batch (and the run says so).",
    )


# Where each key of the flat algorithm section of configs written before the groups went: still read.
REGROUPED = {
    **{
        k: ("estimator", k)
        for k in ("gamma", "discount", "lam", "advantage_eps", "whiten_advantages", "step_delimiter")
    },
    "loss_aggregation": ("loss", "aggregation"),
    **{k: ("loss", k) for k in ("clip_eps_low", "clip_eps_high", "dual_clip", "epochs", "minibatches")},
    **{
        k: ("shaping", k)
        for k in ("normalise_rewards", "whiten_rewards", "truncation_penalty", "soft_overlong", "mask_truncated")
    },  # fmt: skip
    "filter_groups": ("filtering", "groups"),
    "max_oversample": ("filtering", "max_oversample"),
}


def regrouped_warning(moved: list[str]) -> str:
    """The one line that says a config's flat algorithm keys were read in their groups."""
    moves = [f"{key} -> {'.'.join(REGROUPED[key])}" for key in moved]
    more = f" and {len(moves) - 3} more" if len(moves) > 3 else ""
    return (
        f"algorithm keys written flat, as before they were grouped ({', '.join(moves[:3])}{more}): they load the "
        "same; new configs use the grouped names"
    )


def regroup(section: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An ``algorithm`` section written flat (before its keys were grouped) in the grouped form, and the
    keys moved (``[]`` for a section already grouped). One source (a YAML file, the overrides) giving a key
    both ways is refused; ``launch/config.py`` regroups each source before merging them, so a later
    source's key wins whichever way either was written. ``section`` is left as it was."""
    groups = {group for group, _ in REGROUPED.values()}
    out, moved = {k: (dict(v) if k in groups and isinstance(v, dict) else v) for k, v in section.items()}, []
    for key in [k for k in out if k in REGROUPED]:
        group, name = REGROUPED[key]
        target = out.setdefault(group, {})
        if not isinstance(target, dict):
            continue  # the group itself is malformed: validation names it
        if name in target:
            raise ValueError(
                f"algorithm.{key} and algorithm.{group}.{name} are the same setting, given twice; "
                f"keep algorithm.{group}.{name}"
            )
        target[name] = out.pop(key)
        moved.append(key)
    return out, moved


class AlgorithmConfig(Section):
    """The RL method and its settings, in groups: the estimator, the loss, reward shaping, group
    filtering, importance sampling (tis), the KL and the critic."""

    name: Literal[METHOD_NAMES] = Field(  # type: ignore[valid-type]
        "grpo", description="Method: " + ", ".join(METHOD_NAMES) + "."
    )
    estimator: EstimatorConfig = Field(default_factory=EstimatorConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    shaping: ShapingConfig = Field(default_factory=ShapingConfig)
    filtering: FilteringConfig = Field(default_factory=FilteringConfig)
    tis: TISConfig = Field(default_factory=TISConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)

    @model_validator(mode="before")
    @classmethod
    def _read_flat_keys(cls, data: Any) -> Any:
        """A section written before the groups (``minibatches``) still loads (``launch/config.py`` says so)."""
        return regroup(data)[0] if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _kl_fits_the_method(self) -> AlgorithmConfig:
        if self.kl.in_reward and not self.method.kl_in_reward:
            raise ValueError(
                f"algorithm.kl.placement=reward is not defined for {self.name} (its rewards are per step); "
                "use algorithm.kl.placement=loss"
            )
        return self

    @model_validator(mode="after")
    def _sequence_shaping_fits_the_method(self) -> AlgorithmConfig:
        # Per-step methods take their advantages from the step rewards alone; a shaped sequence reward would
        # be computed and then never reach a gradient, so the setting would silently do nothing.
        if self.method.per_step_rewards:
            s = self.shaping
            shaping = {
                "algorithm.shaping.truncation_penalty": s.truncation_penalty is not None,
                "algorithm.shaping.soft_overlong": s.soft_overlong is not None,
                "algorithm.shaping.normalise_rewards": s.normalise_rewards,
                "algorithm.shaping.whiten_rewards": s.whiten_rewards != "none",
            }
            used = [key for key, on in shaping.items() if on]
            if used:
                raise ValueError(
                    f"{used[0]} shapes the sequence reward, which {self.name} does not train on (its advantages "
                    "come from the step rewards, normalised over each group's steps); remove it, or shape the "
                    "step rewards in the reward function"
                )
        return self

    @property
    def warnings(self) -> list[str]:
        """Settings that are valid but probably not what the user wants, one line each."""
        out = [
            f"algorithm.tis.reject: a rule keeps only {r.divergence} >= {r.low:g}, but {r.divergence} is 0 for a token "
            "the learner and the sampler agree on (on-policy): such a rule rejects the tokens that need no "
            "correction; did you mean high?"
            for r in self.tis.reject
            if r.divergence in ("k2", "k3") and r.low is not None and r.low > 0
        ]
        if self.kl.in_loss and self.kl.estimator == "k1":
            out.append(
                "algorithm.kl.placement=loss with estimator=k1: the gradient of the k1 term does not involve the "
                "reference (it is grad log pi of the sampled tokens): zero in expectation on-policy, and off-policy "
                "it pushes the policy away from the sampler, never towards the reference; use estimator=k2 (its "
                "gradient is that of the KL), or k1_plus / k3_plus / abs_plus (their value, k2's gradient)"
            )
        return out

    @property
    def method(self):
        """The ``learner.methods.Method`` this section names."""
        return METHODS[self.name]

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps on each batch: epochs x minibatches."""
        return self.loss.epochs * self.loss.minibatches

    @property
    def aggregation(self) -> str:
        """The loss aggregation in force: the configured one, else the method's own."""
        return self.loss.aggregation or self.method.aggregation

    @property
    def clip(self) -> tuple[float, float] | None:
        """(eps_low, eps_high) of the ratio clip, or None for a loss without one."""
        default = self.method.clip
        if default is None:
            return None
        low = self.loss.clip_eps_low if self.loss.clip_eps_low is not None else default[0]
        high = self.loss.clip_eps_high if self.loss.clip_eps_high is not None else default[1]
        return low, high


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
