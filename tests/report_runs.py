"""A synthetic run directory for the report's tests, in the formats ``tandem train`` writes:
metrics.jsonl, eval.jsonl, timeline.jsonl, config.yaml and summary.json.

The timeline is small enough to check by hand (seconds from T0)::

    driver     wait_data [0, 4] v0, [5, 6] v1, [8, 8.5] v2      -> step windows [0, 5), [5, 8), [8, 10]
    learner-0  score [4, 4.2], train [4.2, 4.8], publish [4.8, 5]; train [6.2, 7.8]; train [8.5, 9.5]
    actor-0    wait_prompts [0, 1]; generate [1, 4] and [2, 5] (in flight: overlapping);
               wait_weights [4.5, 5.5] (the first 0.5 s under generation); load_weights [5.5, 6];
               generate [6, 9] and [7, 10]
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

T0 = 1_796_000_000.0
SPANS = [
    ("driver", "wait_data", 0, 4, 0),
    ("driver", "wait_data", 5, 6, 1),
    ("driver", "wait_data", 8, 8.5, 2),
    ("learner-0", "score", 4, 4.2, 1),
    ("learner-0", "train", 4.2, 4.8, 1),
    ("learner-0", "publish", 4.8, 5, 1),
    ("learner-0", "train", 6.2, 7.8, 2),
    ("learner-0", "train", 8.5, 9.5, 3),
    ("actor-0", "wait_prompts", 0, 1, None),
    ("actor-0", "generate", 1, 4, 0),
    ("actor-0", "generate", 2, 5, 0),
    ("actor-0", "wait_weights", 4.5, 5.5, 0),
    ("actor-0", "load_weights", 5.5, 6, 1),
    ("actor-0", "generate", 6, 9, 1),
    ("actor-0", "generate", 7, 10, 1),
]
# tokens_per_s counts prompt + completion tokens, the histogram (and learner/tokens) the completions only
# step: (step_seconds, learner_wait_s, tokens_per_s, reward_mean, staleness_hist, dropped_stale, tis_truncated_frac)
STEPS = [
    (5.0, 4.0, 150.0, 0.1, {"0": 500}, 0, 0.0),
    (3.0, 1.0, 300.0, 0.3, {"0": 300, "1": 300}, 2, 0.1),
    (2.0, 0.5, 500.0, 0.5, {"1": 600, "2": 200}, 1, 0.2),
]


def spans(t0: float = T0) -> list[dict]:
    return [
        {"process": p, "kind": k, "start": t0 + start, "end": t0 + end, "version": v} for p, k, start, end, v in SPANS
    ]


def metrics_line(step: int, row: tuple) -> dict:
    seconds, wait, tokens_per_s, reward, hist, dropped, tis_truncated = row
    return {
        "step": step,
        "elapsed_s": 10.0 + sum(s[0] for s in STEPS[: step + 1]),
        "reward_mean": reward,
        "reward_std": 0.2,
        "completion_len_mean": 40.0 + step,
        "truncated_frac": 0.25,
        "reward_errors": 0,
        "reward/correct": reward,
        "staleness_mean": sum(int(s) * c for s, c in hist.items()) / sum(hist.values()),
        "staleness_max": max(int(s) for s in hist),
        "staleness_hist": hist,
        "dropped_stale": dropped,
        "filtered_groups": 1 if step == 0 else 0,
        "zero_variance_frac": 0.1,
        "learner_wait_s": wait,
        "actor_weight_wait_s": 0.2,
        "step_seconds": seconds,
        "tokens_per_s": tokens_per_s,
        "learner/tis_rho_mean": 1.0,
        "learner/tis_rho_max": 1.5 + step,
        "learner/tis_truncated_frac": tis_truncated,
        "learner/tis_mismatch_kl": 0.01 * step,
        "learner/tis_ess": 0.99,
        "learner/tokens": float(sum(hist.values())),
        "learner/loss": 0.5,
        "learner/entropy": 2.0,
        "learner/approx_kl": 0.001,
        "learner/learner_seconds": seconds - wait,
        "learner/lr": 1e-5,
        "actor_restarts": 0,
        "duplicates": 0,
        "prompt_ids": [4 * step + i for i in range(4)],
        "filtered_prompt_ids": [],
    }


def write_run(root: Path, timeline: bool = True, evals: bool = True, torn: bool = False) -> Path:
    """Write the synthetic run into ``root`` (created); ``torn`` leaves half a line at the end of metrics.jsonl."""
    root.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(metrics_line(step, row)) for step, row in enumerate(STEPS)]
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n" + ('{"step": 3, "reward_me' if torn else ""))
    rounds = [{"step": 0, "eval/pass@1": 0.2, "eval/pass@2": 0.3}, {"step": 3, "eval/pass@1": 0.4, "eval/pass@2": 0.5}]
    (root / "eval.jsonl").write_text(
        "".join(json.dumps({"elapsed_s": 1.0, **r}) + "\n" for r in rounds) if evals else ""
    )
    if timeline:
        (root / "timeline.jsonl").write_text("".join(json.dumps(span) + "\n" for span in spans()))
    config = {
        "algorithm": {"name": "grpo"},
        "run": {"max_staleness": 2, "timeline": timeline},
        "rollout": {"weight_update": "inflight"},
        "resources": {"actors": {"count": 1}, "learner": {"ranks": 1}},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "summary.json").write_text(json.dumps({"status": "completed", "startup_s": 12.5, "wall_s": 30.0}))
    return root
