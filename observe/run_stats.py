"""A finished (or running) run directory, read back: its metrics, evaluation rounds, timeline spans,
config and summary, and the numbers ``tandem report`` and ``tandem tune`` compare runs by.

Idle time comes from two sources. The learner's is in the metrics: ``learner_wait_s`` of a step
over its ``step_seconds``. An actor's comes from the timeline (``observe/timeline_stats.py``): the
time its lane spends in ``wait_prompts`` or ``wait_weights`` while none of its ``generate`` or
``load_weights`` spans runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from observe.timeline_stats import actor_idle
from schema import ConfigError


@dataclass
class RunData:
    """One run directory, loaded. Every list is in file order; a missing file gives an empty one."""

    path: Path  # the run directory
    metrics: list[dict[str, Any]]  # metrics.jsonl: one dict per step ("step", "reward_mean", ...)
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval.jsonl: one dict per evaluation round
    spans: list[dict[str, Any]] = field(default_factory=list)  # timeline.jsonl: process, kind, start, end, version
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml, the resolved config
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json (empty while the run is going)

    @property
    def name(self) -> str:
        return self.path.name


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file; ``[]`` when it is missing. A torn last line (a run still writing,
    or killed mid-line) is left out; a bad line anywhere else is an error."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ConfigError(f"{path}:{number}: not a JSON line; repair or remove that line") from None
    return records


def load_run(path: str | Path) -> RunData:
    """Read a run directory. Raises ``ConfigError`` when ``path`` has no metrics.jsonl or no step yet."""
    root = Path(path)
    if not (root / "metrics.jsonl").is_file():
        raise ConfigError(f"{root}: not a run directory (no metrics.jsonl); give a RUN_DIR that tandem train printed")
    metrics = read_jsonl(root / "metrics.jsonl")
    if not metrics:
        raise ConfigError(f"{root}: the run has no steps yet (metrics.jsonl is empty); report it after its first step")
    config = yaml.safe_load((root / "config.yaml").read_text()) if (root / "config.yaml").is_file() else {}
    summary = json.loads((root / "summary.json").read_text()) if (root / "summary.json").is_file() else {}
    return RunData(root, metrics, read_jsonl(root / "eval.jsonl"), read_jsonl(root / "timeline.jsonl"), config, summary)


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over the records that have a finite number for it."""
    pairs = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    pairs = [(s, v) for s, v in pairs if math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


# --- the run in numbers -------------------------------------------------------------------------
def _config(config: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        config = config.get(key) if isinstance(config, dict) else None
    return config


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(num: list[float], den: list[float]) -> float | None:
    return sum(num) / sum(den) if den and sum(den) > 0 else None


def run_summary(run: RunData) -> dict[str, Any]:
    """The run in numbers. Rates and idle shares are of the steady state, the steps after the first
    (the first includes the engines' warm-up), unless there is only one. A number the run did not
    record is ``None``. Keys:

    ``name``, ``path``, ``status`` (summary.json, ``None`` while running), ``steps`` (lines in
    metrics.jsonl), ``method`` (algorithm.name), ``schedule``, ``max_staleness``, ``weight_update``, ``actors``,
    ``learner_ranks``, ``startup_s`` and ``wall_s`` (summary.json), ``mean_step_s`` (mean
    step_seconds), ``tokens_per_s`` (prompt + completion tokens over seconds, summed over the steps),
    ``trained_tokens_per_s`` (the same of the completion tokens the loss trains on), ``learner_idle``
    (sum of learner_wait_s over sum of step_seconds), ``actor_idle`` (the actors' mean idle fraction
    from the timeline, ``idle_fractions``; ``None`` without one), ``reward_final`` (mean reward_mean of
    the last 10% of steps), ``eval_pass1_final`` (pass@1 of the last evaluation round),
    ``staleness_mean`` (token-weighted over all steps), ``groups`` (groups trained, one per prompt
    id), ``dropped_stale`` and ``filtered_groups`` (totals over all steps), ``tis_truncated_frac`` and
    ``tis_mismatch_kl`` (means over all steps).
    """
    metrics = run.metrics
    steady = metrics[1:] if len(metrics) > 1 else metrics
    seconds = [m["step_seconds"] for m in steady if isinstance(m.get("step_seconds"), (int, float))]
    tokens = [m.get("tokens_per_s", 0.0) * m["step_seconds"] for m in steady if "step_seconds" in m]
    trained = [_trained_tokens(m) for m in steady if "step_seconds" in m]
    waits = [m.get("learner_wait_s", 0.0) for m in steady if "step_seconds" in m]
    tenth = max(1, len(metrics) // 10)
    hist: dict[int, float] = {}
    for m in metrics:
        for staleness, count in (m.get("staleness_hist") or {}).items():
            hist[int(staleness)] = hist.get(int(staleness), 0) + count
    last_eval = series(run.evals, "eval/pass@1")[1]
    return {
        "name": run.name,
        "path": str(run.path),
        "status": run.summary.get("status"),
        "steps": len(metrics),
        "method": _config(run.config, "algorithm.name"),
        "schedule": _config(run.config, "run.schedule") or "overlapped",
        "max_staleness": _config(run.config, "run.max_staleness"),
        "weight_update": _config(run.config, "rollout.weight_update"),
        "actors": _config(run.config, "resources.actors.count"),
        "learner_ranks": _config(run.config, "resources.learner.ranks"),
        "startup_s": run.summary.get("startup_s"),
        "wall_s": run.summary.get("wall_s"),
        "mean_step_s": _mean(seconds),
        "tokens_per_s": _ratio(tokens, seconds),
        "trained_tokens_per_s": _ratio(trained, seconds),
        "learner_idle": _ratio(waits, seconds),
        "actor_idle": actor_idle(run.spans),
        "reward_final": _mean(series(metrics[-tenth:], "reward_mean")[1]),
        "eval_pass1_final": last_eval[-1] if last_eval else None,
        "staleness_mean": _ratio([s * c for s, c in hist.items()], list(hist.values())),
        "groups": sum(len(m.get("prompt_ids") or []) for m in metrics),
        "dropped_stale": sum(m.get("dropped_stale", 0) for m in metrics),
        "starved_prompts": sum(m.get("starved_prompts", 0) for m in metrics),
        "filtered_groups": sum(m.get("filtered_groups", 0) for m in metrics),
        "tis_truncated_frac": _mean(series(metrics, "learner/tis_truncated_frac")[1]),
        "tis_mismatch_kl": _mean(series(metrics, "learner/tis_mismatch_kl")[1]),
    }


def _trained_tokens(metrics: dict[str, Any]) -> float:
    """The completion tokens a step trained on: the learner's count, else the staleness histogram's."""
    if isinstance(metrics.get("learner/tokens"), (int, float)):
        return metrics["learner/tokens"]
    return sum((metrics.get("staleness_hist") or {}).values())
