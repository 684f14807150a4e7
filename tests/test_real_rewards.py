"""builtin:math on the real stack, in both actor modes: its reward calls do not fail.

math-verify times itself with signal.alarm, which fails off a main thread: called on the in-flight
actor's event loop it failed on every sample. In the reward workers it works in both modes. The run
sums three parts (math, a format pattern every completion matches, the task's own reward) so the
weighted sum and the per-part metrics are checked on real trajectories too.
"""

from __future__ import annotations

import json

import pytest

from tests.runs import DEMO, read_metrics, run_dir, train

pytestmark = pytest.mark.slow

PARTS = (
    "reward.functions=[{function: 'builtin:math'}, {function: 'builtin:format', weight: 0.5}, "
    "{function: 'builtin:successor', weight: 0.25, name: task}]"
)


@pytest.mark.parametrize(("k", "weight_update"), [(1, "between_requests"), (2, "inflight")])
def test_builtin_math_scores_without_errors_in_both_actor_modes(k, weight_update, tiny_model_dir, tmp_path, capsys):
    code = train(
        DEMO,
        tiny_model_dir,
        tmp_path,
        "run.steps=3",
        f"run.max_staleness={k}",
        f"rollout.weight_update={weight_update}",
        "rollout.prompts_per_step=8",
        "reward.function=null",
        PARTS,
        "reward.format_pattern=.*",
        "reward.workers=1",
    )
    assert code == 0, capsys.readouterr().out
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 3
    for m in metrics:
        assert m["reward_errors"] == 0  # math-verify ran in every call
        assert 0.0 <= m["reward/math"] <= 1.0 and m["reward/format"] == 1.0
        # reward = 1 x math + 0.5 x format + 0.25 x task, averaged over the step's completions
        assert m["reward_mean"] == pytest.approx(m["reward/math"] + 0.5 + 0.25 * m["reward/task"], abs=1e-9)
    samples = [json.loads(line) for line in (run_dir(tmp_path) / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reward"] >= 0.5 for s in samples)  # the format part reached every completion
