"""What a step records: its metrics line, the trackers' distributions and sample completions.

Staleness of a token = the learner's policy version when it trains on it (the step
index) minus the version that generated it.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from runtime.collector import Batch


def step_metrics(batch: Batch, learner: dict[str, float], step_seconds: float) -> dict[str, Any]:
    trajs = [t for g in batch.groups for t in g.trajectories]
    rewards = [t.reward for t in trajs]
    n = len(trajs)
    mean = sum(rewards) / n
    total_tokens = sum(t.num_tokens for t in trajs)
    hist = {str(s): c for s, c in sorted(batch.staleness.items())}
    tokens = sum(batch.staleness.values())
    return {
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "completion_len_mean": sum(len(t.completion_token_ids) for t in trajs) / n,
        "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / n,
        "reward_errors": sum(g.reward_errors for g in batch.groups),
        **reward_part_means(trajs),
        **episode_metrics(trajs),
        "staleness_mean": sum(int(s) * c for s, c in batch.staleness.items()) / max(tokens, 1),
        "staleness_max": max(batch.staleness, default=0),
        "staleness_hist": hist,
        "dropped_stale": batch.dropped,
        **starved_metrics(batch),
        "filtered_groups": batch.filtered,
        # the collapse signal: the share of collected groups whose rewards were all equal
        "zero_variance_frac": batch.zero_variance / max(len(batch.groups) + batch.filtered, 1),
        "learner_wait_s": batch.wait_s,
        "actor_weight_wait_s": sum(g.weight_wait_s for g in batch.groups),
        "step_seconds": step_seconds,
        "tokens_per_s": total_tokens / step_seconds if step_seconds > 0 else 0.0,
        **{f"learner/{k}": v for k, v in learner.items()},
        "trained_tokens": trained_tokens(learner),
    }


def starved_metrics(batch: Batch) -> dict[str, Any]:
    """Prompts given up this step, too stale at every try (``Admission.too_stale``): how many, and the
    oldest age and mean completion length of their last groups (absent when none)."""
    if not batch.starved:
        return {}
    return {
        "starved_prompts": len(batch.starved),
        "starved_age_max": max(age for _, age, _ in batch.starved),
        "starved_len_mean": sum(length for _, _, length in batch.starved) / len(batch.starved),
    }


def trained_tokens(learner: dict[str, float]) -> float:
    """The completion tokens the step's loss weighed: the learner's masked-in tokens (an episode its
    environment failed, an overlong completion under ``mask_truncated``, a tool's output: masked out) times
    the share whose weight the importance-sampling rules left non-zero (``kept_frac``: ``tis.reject``,
    ``tis.mode`` mask or band)."""
    return float(learner.get("tokens", 0.0)) * float(learner.get("kept_frac", 1.0))


STALENESS_SAMPLE = 65536  # at most this many per-token staleness values a step reach the histograms


def step_distributions(batch: Batch) -> dict[str, np.ndarray]:
    """The step's distributions for the trackers' histograms: per-token staleness, each completion's
    reward and each completion's length in tokens."""
    trajs = [t for g in batch.groups for t in g.trajectories]
    return {
        "hist/staleness": staleness_sample(batch.staleness, STALENESS_SAMPLE),
        "hist/reward": np.array([t.reward for t in trajs], dtype=np.float64),
        "hist/completion_len": np.array([len(t.completion_token_ids) for t in trajs], dtype=np.int64),
    }


def staleness_sample(counts: collections.Counter, cap: int) -> np.ndarray:
    """Per-token staleness values from the ``{age: tokens}`` histogram: all of them up to ``cap``
    tokens, else ``cap`` in proportion (largest remainders), every age seen at least once so the
    maximum shows. {0: 3M, 1: 1M, 5: 10}, cap 1000 -> 750 x 0, 250 x 1, 1 x 5."""
    ages = np.array(sorted(counts), dtype=np.int64)
    tokens = np.array([counts[a] for a in ages.tolist()], dtype=np.int64)
    total = int(tokens.sum())
    if total > cap:
        share = tokens * cap / total
        kept = np.floor(share).astype(np.int64)
        kept[np.argsort(kept - share)[: cap - int(kept.sum())]] += 1  # the largest remainders round up
        tokens = np.maximum(kept, 1)
    return np.repeat(ages, tokens)


def reward_part_means(trajs: list) -> dict[str, float]:
    """``reward/<name>``: the mean raw value of each reward part over the step's completions."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for name, value in (t.reward_parts or {}).items():
            values.setdefault(name, []).append(value)
    return {f"reward/{name}": sum(v) / len(v) for name, v in values.items()}


def episode_metrics(trajs: list) -> dict[str, float]:
    """``episode/...`` of multi-turn steps: model turns, tool calls and tool errors per episode, the share
    of episodes each end reason ended, and the share of an episode's wall time spent in its environment."""
    episodes = [t.episode for t in trajs if t.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    failures = [f for t in trajs if (f := t.episode_failure)]
    out = {
        "episode/failed": len(failures),  # ended by their environment (EPISODE_FAILURES): no token trained
        **({"episode_failure": failures[0]} if failures else {}),  # the first one's "<end>: <detail>"
        "episode/turns_mean": sum(e["model_turns"] for e in episodes) / n,
        "episode/tool_calls_mean": sum(e["tool_calls"] for e in episodes) / n,
        "episode/tool_errors_mean": sum(e["tool_errors"] for e in episodes) / n,
        "episode/environment_time_frac": sum(e["environment_s"] for e in episodes)
        / max(sum(e["environment_s"] + e["generate_s"] for e in episodes), 1e-9),
    }
    for end, count in sorted(collections.Counter(e["end"] for e in episodes).items()):
        out[f"episode/end_{end}_frac"] = count / n
    return out


def sample_records(batch: Batch, step: int, count: int) -> list[dict[str, Any]]:
    """Up to ``count`` completions of the step for ``samples.jsonl``: one from each group in turn; when the
    step had an episode its environment failed and none is among them, the first such one takes the last
    place (its ``end`` and ``detail`` say what failed)."""
    groups = batch.groups
    picked = []
    for i in range(min(count, sum(len(g.trajectories) for g in groups))):
        group = groups[i % len(groups)]
        if i // len(groups) < len(group.trajectories):
            picked.append((group, group.trajectories[i // len(groups)]))
    failed = next(((g, t) for g in groups for t in g.trajectories if t.episode_failure), None)
    if picked and failed and not any(t.episode_failure for _, t in picked):
        picked[-1] = failed
    return [_sample_record(group, traj, step) for group, traj in picked]


def _sample_record(group, traj, step: int) -> dict[str, Any]:
    version = int(np.min(traj.policy_versions)) if len(traj.policy_versions) else step
    return {
        "step": step,
        "prompt_id": group.prompt_id,
        "prompt": group.row.get("prompt"),
        "completion": traj.completion_text,
        "reward": traj.reward,
        "policy_version": version,
        "staleness": step - version,
        "finish_reason": traj.finish_reason,
        # an episode turn by turn: model text and environment text apart, how it ended, and why when it failed
        **(
            {"turns": traj.episode["turns"], "end": traj.episode["end"], "detail": traj.episode.get("detail")}
            if traj.episode
            else {}
        ),
    }
