"""``tandem tune --config F``: a short measured probe of what trades staleness for throughput.

Each probed setting is ``run.max_staleness`` (``--staleness``), ``rollout.weight_update``
(``--modes``; in-flight only with k >= 1: at k = 0 nothing generates while the learner trains)
and an actor:learner split the configured resources allow (``splits``), in the overlapped schedule;
on CPUs also the colocated schedule (``runtime/schedule.py``), where one engine per core and the
learner ranks take turns on all the cores. Each trains ``--steps``
steps of the real job in a run directory of its own under ``<run.output_dir>/tune-<name>-<stamp>/``
(no evaluation, no final save), and its ``metrics.jsonl`` and ``timeline.jsonl`` say how it went
(``observe/run_stats.py``): trained tokens/s, learner and actor idle, dropped-stale groups, the TIS
truncated fraction and the sampler/learner mismatch KL.

The recommendation (``recommend``): of the settings whose off-policy metrics stay under
``Thresholds``, the fastest. Settings within ``margin`` of the fastest are as fast as a short
probe can tell, and of those the least off-policy one wins: the smaller k, then updates between
requests, then fewer actors. So a job where generation dominates gets a larger k or more actors
(the learner stops waiting), and a job where training dominates keeps a small k and gives the
cores to the learner (running ahead buys nothing but staleness).
"""

from __future__ import annotations

import contextlib
import json
import sys
import typing
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from actors.config import RolloutConfig
from launch.config import ConfigError, TandemConfig, load_config
from launch.plan import build_plan


@dataclass(frozen=True)
class Setting:
    max_staleness: int
    weight_update: str  # "between_requests" | "inflight"
    actors: int
    ranks: int
    schedule: str = "overlapped"  # run.schedule
    learner_cpus: float | None = None  # resources.learner.num_cpus when the setting changes it

    @property
    def label(self) -> str:
        mode = "in-flight" if self.weight_update == "inflight" else "between requests"
        where = ", colocated" if self.schedule == "colocated" else ""
        return f"k={self.max_staleness}, {mode}, {self.actors}:{self.ranks}{where}"

    def tree(self) -> dict[str, Any]:
        """The setting as config sections (the overrides file)."""
        learner: dict[str, Any] = {"ranks": self.ranks}
        if self.learner_cpus is not None:
            learner["num_cpus"] = self.learner_cpus
        return {
            "run": {"max_staleness": self.max_staleness, "schedule": self.schedule},
            "rollout": {"weight_update": self.weight_update},
            "resources": {"actors": {"count": self.actors}, "learner": learner},
        }

    def overrides(self) -> list[str]:
        cpus = [] if self.learner_cpus is None else [f"resources.learner.num_cpus={self.learner_cpus:g}"]
        return [
            f"run.max_staleness={self.max_staleness}",
            f"run.schedule={self.schedule}",
            f"rollout.weight_update={self.weight_update}",
            f"resources.actors.count={self.actors}",
            f"resources.learner.ranks={self.ranks}",
            *cpus,
        ]


@dataclass(frozen=True)
class Thresholds:
    """What a recommended setting's off-policy metrics must stay under (means over its steps)."""

    tis_truncated_frac: float = 0.05  # share of tokens whose importance weight hit the TIS cap
    mismatch_kl: float = 0.02  # KL between the sampler's and the learner's token distributions
    dropped_frac: float = 0.10  # groups dropped as too stale, per trained group
    margin: float = 0.10  # tokens/s within this share of the fastest count as equally fast


@dataclass
class Measurement:
    setting: Setting
    tokens_per_s: float = 0.0  # trained (completion) tokens per second over the steps after the first
    learner_idle: float = 0.0  # share of step time the learner waited for data
    actor_idle: float = 0.0  # share of the actors' time waiting for prompts or weights
    dropped_frac: float = 0.0
    starved: int = 0  # prompts given up, too stale at every try: the setting trains short completions only
    tis_truncated_frac: float = 0.0
    mismatch_kl: float = 0.0
    run_dir: str = ""
    error: str | None = None  # the probe failed (its first line)

    def over(self, limits: Thresholds) -> list[str]:
        """The thresholds this setting exceeds, as words."""
        out = []
        if self.tis_truncated_frac > limits.tis_truncated_frac:
            out.append(f"TIS truncated {self.tis_truncated_frac:.1%} > {limits.tis_truncated_frac:.0%}")
        if self.mismatch_kl > limits.mismatch_kl:
            out.append(f"mismatch KL {self.mismatch_kl:.3g} > {limits.mismatch_kl:g}")
        if self.dropped_frac > limits.dropped_frac:
            out.append(f"dropped {self.dropped_frac:.0%} > {limits.dropped_frac:.0%}")
        if self.starved:
            out.append(f"{self.starved} prompt(s) too stale at every try (their long completions go untrained)")
        return out


@dataclass
class Recommendation:
    setting: Setting | None
    reason: str
    measurements: list[Measurement] = field(default_factory=list)


def splits(cfg: TandemConfig) -> list[tuple[int, int]]:
    """``(actors, learner ranks)`` pairs that fill what the config reserves for both together, on
    the resource they use (GPUs when any of them has one, else CPUs). A separately placed critic
    has one rank per learner rank and counts with it. A colocated config's shared cores are split
    with one core per rank (``overlapped_cpus``)."""
    res = cfg.resources
    gpu = bool(res.actors.num_gpus or res.learner.num_gpus)
    per_actor = res.actors.num_gpus if gpu else res.actors.num_cpus
    per_rank = res.learner.num_gpus if gpu else overlapped_cpus(cfg) or res.learner.num_cpus
    if build_plan(cfg).critic is not None:
        per_rank += res.critic.num_gpus if gpu else res.critic.num_cpus
    budget = shared_budget(cfg) or res.actors.count * per_actor + res.learner.ranks * per_rank
    if per_actor <= 0 or per_rank <= 0:  # processes that reserve nothing: only the configured split
        return [(res.actors.count, res.learner.ranks)]
    out = []
    for actors in range(1, int(budget // per_actor) + 1):
        ranks = int((budget - actors * per_actor + 1e-9) // per_rank)
        left = budget - actors * per_actor - ranks * per_rank
        if ranks >= 1 and left < min(per_actor, per_rank) - 1e-9:  # nothing more fits: no idle reservation
            out.append((actors, ranks))
    return out


def overlapped_cpus(cfg: TandemConfig) -> float | None:
    """A learner rank's CPUs in the overlapped probes of a colocated config (one core: the others go to
    actors); None for an overlapped config (its own ``num_cpus``)."""
    return 1.0 if cfg.run.schedule == "colocated" else None


def shared_budget(cfg: TandemConfig) -> float:
    """The CPUs of a colocated config's learner ranks, which its actors share (0: not colocated)."""
    res = cfg.resources
    return res.learner.ranks * res.learner.num_cpus if cfg.run.schedule == "colocated" else 0.0


def colocated_split(cfg: TandemConfig) -> tuple[int, int, float] | None:
    """``(actors, learner ranks, CPUs per rank)`` of the colocated schedule on the cores the config
    reserves: one engine per core, the configured ranks sharing the cores evenly. None on GPUs (not
    built), with a critic or a tensor-parallel engine of its own, or with fewer cores than ranks."""
    res = cfg.resources
    if res.actors.num_gpus or res.learner.num_gpus or res.actors.tensor_parallel > 1 or build_plan(cfg).critic:
        return None
    cores = shared_budget(cfg) or res.actors.count * res.actors.num_cpus + res.learner.ranks * res.learner.num_cpus
    if cores < res.learner.ranks or cores < 1:
        return None
    return int(cores), res.learner.ranks, cores / res.learner.ranks


def probe_settings(
    cfg: TandemConfig, staleness: list[int], modes: list[str], schedules: tuple[str, ...] = ("overlapped", "colocated")
) -> list[Setting]:
    layouts = []
    if "overlapped" in schedules:
        layouts += [(actors, ranks, "overlapped", overlapped_cpus(cfg)) for actors, ranks in splits(cfg)]
    colocated = colocated_split(cfg) if "colocated" in schedules else None
    if colocated is not None:
        actors, ranks, cpus = colocated
        layouts.append((actors, ranks, "colocated", cpus))
    out = []
    for actors, ranks, schedule, cpus in layouts:
        for k in staleness:
            for mode in modes:
                if mode != modes[0] and k == 0:
                    continue  # at k = 0 the modes are one: the actors idle while the learner trains
                out.append(Setting(k, mode, actors, ranks, schedule, cpus))
    return out


def measure(setting: Setting, run_dir: str) -> Measurement:
    """The probe's figures, from its run directory."""
    from observe.run_stats import load_run, run_summary

    s = run_summary(load_run(run_dir))
    number = lambda key: float(s.get(key) or 0.0)  # noqa: E731  (None: not recorded, e.g. TIS off)
    return Measurement(
        setting,
        tokens_per_s=number("trained_tokens_per_s"),
        learner_idle=number("learner_idle"),
        actor_idle=number("actor_idle"),
        dropped_frac=number("dropped_stale") / max(number("groups"), 1.0),
        starved=int(number("starved_prompts")),
        tis_truncated_frac=number("tis_truncated_frac"),
        mismatch_kl=number("tis_mismatch_kl"),
        run_dir=run_dir,
    )


def _calmness(m: Measurement) -> tuple:
    s = m.setting
    return (s.max_staleness, s.weight_update == "inflight", s.schedule == "colocated", s.actors)


def _baseline(measured: list[Measurement], configured: tuple[int, int] | None) -> Measurement | None:
    """The synchronous probe (k = 0) of the configured split (else the calmest one): what the
    speed-ups are against, and where the bottleneck is read."""
    sync = [m for m in measured if m.error is None and m.setting.max_staleness == 0]
    own = [m for m in sync if (m.setting.actors, m.setting.ranks) == configured]
    return min(own or sync, key=_calmness) if sync else None


def recommend(
    measured: list[Measurement], limits: Thresholds = Thresholds(), configured: tuple[int, int] | None = None
) -> Recommendation:
    """``configured``: the job's own (actors, learner ranks), the baseline's split."""
    ok = [m for m in measured if m.error is None and m.tokens_per_s > 0]
    if not ok:
        return Recommendation(None, "every probe failed; see the errors in the table and the probes' logs", measured)
    eligible = [m for m in ok if not m.over(limits)]
    if not eligible:
        return Recommendation(
            None,
            "no probed setting kept its off-policy metrics under the thresholds; probe smaller --staleness values",
            measured,
        )
    fastest = max(eligible, key=lambda m: m.tokens_per_s)
    tied = [m for m in eligible if m.tokens_per_s >= (1 - limits.margin) * fastest.tokens_per_s]
    chosen = min(tied, key=_calmness)
    return Recommendation(chosen.setting, explain(chosen, fastest, _baseline(ok, configured), limits), measured)


def explain(chosen: Measurement, fastest: Measurement, base: Measurement | None, limits: Thresholds) -> str:
    """One sentence (or two) on why ``chosen`` won."""
    s = chosen.setting
    text = f"{s.label} trains {chosen.tokens_per_s:,.0f} tokens/s"
    if base is not None and base is not chosen:
        text += (
            f", {chosen.tokens_per_s / max(base.tokens_per_s, 1e-9):.2f}x synchronous training ({base.setting.label})"
        )
    text += f", with mismatch KL {chosen.mismatch_kl:.3g} and {chosen.tis_truncated_frac:.1%} of weights truncated."
    if s.schedule == "colocated":
        text += (
            f" The {s.actors} engines and the learner take turns on all the cores (run.schedule: colocated), "
            "which here beat dividing the cores between them."
        )
    elif base is not None:
        if base.learner_idle >= base.actor_idle:
            text += (
                f" Generation dominates this job (at k=0 the learner waits {base.learner_idle:.0%} of each step), "
                "so letting the actors run ahead pays."
            )
        else:
            text += (
                f" Training dominates this job (at k=0 the actors idle {base.actor_idle:.0%} of the time), "
                "so running further ahead buys staleness, not speed."
            )
    if fastest is not chosen:
        text += (
            f" {fastest.setting.label} was at most {limits.margin:.0%} faster "
            f"({fastest.tokens_per_s:,.0f} tokens/s, within a short probe's noise) and more off-policy."
        )
    return text


def table(rec: Recommendation, limits: Thresholds) -> Any:
    """The probe's results as a ``rich`` table (plain text where there is no terminal)."""
    from rich.table import Table

    t = Table(title="tandem tune: one row per probed setting")
    for col in ("setting", "tokens/s", "learner idle", "actor idle", "dropped", "TIS trunc.", "mismatch KL", "note"):
        t.add_column(col, justify="left" if col in ("setting", "note") else "right")
    for m in rec.measurements:
        mark = "<- recommended" if m.setting == rec.setting else ""
        if m.error is not None:
            t.add_row(m.setting.label, "-", "-", "-", "-", "-", "-", "failed (below)")
            continue
        note = "; ".join(m.over(limits)) or mark
        t.add_row(
            m.setting.label,
            f"{m.tokens_per_s:,.0f}",
            f"{m.learner_idle:.0%}",
            f"{m.actor_idle:.0%}",
            f"{m.dropped_frac:.0%}",
            f"{m.tis_truncated_frac:.1%}",
            f"{m.mismatch_kl:.3g}",
            note,
        )
    return t


def _probe(config: str, overrides: list[str], setting: Setting, steps: int, root: Path, index: int) -> Measurement:
    """Train ``steps`` steps with ``setting``; its output goes to ``root/probe-<i>.log``."""
    from launch.run import run_training

    name = f"probe{index}-k{setting.max_staleness}-{setting.weight_update}-a{setting.actors}r{setting.ranks}"
    name += "-colocated" if setting.schedule == "colocated" else ""
    trial = [
        *overrides,
        *setting.overrides(),
        f"run.steps={steps}",
        f"run.output_dir={root}",
        f"run.name={name}",
        "run.save_final=false",
        "run.checkpoint_every=0",
        "run.max_restarts=0",
        "run.timeline=true",
        "run.trackers=[jsonl]",  # no TensorBoard files or W&B runs per probe
        "eval.prompts=null",  # no evaluation rounds: they would share the actors with the probe
        "eval.fraction=0",
        "eval.every=0",
    ]
    result: dict[str, Any] = {}
    log = root / f"{name}.log"
    try:
        with log.open("w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = run_training(config, trial, result=result)
        if code != 0:  # a signal (Ctrl-C, SIGTERM) stopped the probe cleanly: the user wants to stop
            raise KeyboardInterrupt
        return measure(setting, result["run_dir"])
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # one failed probe (e.g. out of memory) leaves the others' figures
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return Measurement(setting, run_dir=result.get("run_dir", ""), error=f"{first}; log: {log}")


def _numbers(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: give comma-separated whole numbers, e.g. 0,1,2,4") from None


def run_tune(
    config: str,
    overrides: list[str],
    steps: int,
    out: str | None,
    staleness: str,
    modes: str,
    limits: Thresholds = Thresholds(),
    schedules: str = "overlapped,colocated",
) -> int:
    """The ``tandem tune`` command: probe, print the table and the recommendation, write the overrides."""
    from rich.console import Console

    if steps < 3:
        raise ConfigError(f"--steps {steps}: a probe needs at least 3 steps (the first one warms up)")
    cfg = load_config(config, overrides)
    ks = _numbers(staleness, "staleness")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    known = typing.get_args(RolloutConfig.model_fields["weight_update"].annotation)
    bad = [m for m in mode_list if m not in known] or ([] if mode_list else [modes])
    if bad:
        raise ConfigError(f"--modes {','.join(bad)!r}: give one or more of {', '.join(known)}, comma-separated")
    if not ks or min(ks) < 0:
        raise ConfigError(f"--staleness {staleness!r}: give whole numbers >= 0, e.g. 0,1,2,4")
    path = Path(out) if out else None
    if path is not None and not path.parent.is_dir():
        raise ConfigError(f"--out {path}: the directory {path.parent} does not exist; create it or pick another")
    schedule_list = tuple(x.strip() for x in schedules.split(",") if x.strip())
    bad = [x for x in schedule_list if x not in ("overlapped", "colocated")] or ([] if schedule_list else [schedules])
    if bad:
        raise ConfigError(f"--schedules {','.join(bad)!r}: give overlapped and/or colocated, comma-separated")
    settings = probe_settings(cfg, sorted(set(ks)), mode_list, schedule_list)
    if not settings:
        raise ConfigError(
            "--schedules colocated: the colocated schedule is probed on CPUs only (not with GPUs, a separate critic "
            "or tensor-parallel engines); add overlapped"
        )
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    root, suffix = Path(cfg.run.output_dir) / f"tune-{cfg.run.name}-{stamp}", 1
    while root.exists():  # two tunes started in the same second
        root, suffix = Path(cfg.run.output_dir) / f"tune-{cfg.run.name}-{stamp}-{suffix}", suffix + 1
    root.mkdir(parents=True)
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 132)  # a log keeps the table whole
    console.print(f"tandem tune: {len(settings)} settings x {steps} steps; probe runs in {root}")
    measured = []
    for i, setting in enumerate(settings, 1):
        console.print(f"probe {i}/{len(settings)}: {setting.label} ...")
        try:
            m = _probe(config, overrides, setting, steps, root, i)
        except KeyboardInterrupt:
            console.print(f"interrupted: the recommendation is of the {len(measured)} finished probe(s)")
            break
        measured.append(m)
        console.print(
            f"  failed: {m.error}"
            if m.error
            else f"  {m.tokens_per_s:,.0f} tokens/s, learner idle {m.learner_idle:.0%}, actor idle {m.actor_idle:.0%}"
        )
    rec = recommend(measured, limits, (cfg.resources.actors.count, cfg.resources.learner.ranks))
    console.print(table(rec, limits))
    for m in measured:
        if m.error is not None:
            console.print(f"{m.setting.label} failed: {m.error}", soft_wrap=True)
    (root / "tune.json").write_text(
        json.dumps({"thresholds": asdict(limits), "measurements": [asdict(m) for m in measured]}, indent=1)
    )
    if rec.setting is None:
        console.print(f"no recommendation: {rec.reason}")
        return 1
    console.print(f"recommended: {rec.reason}")
    path = path or root / "overrides.yaml"
    path.write_text(f"# tandem tune, {stamp}: {rec.reason}\n" + yaml.safe_dump(rec.setting.tree(), sort_keys=False))
    console.print(f"overrides: {path}\ntrain with: tandem train --config {config} --config {path}")
    return 0
