"""The tuner's choice, on two synthetic workloads, and its settings grid (``launch/tools/tune.py``).

A workload here is the seconds one step's generation and training take on one process each.
Its measurements follow the pipeline's arithmetic: generation splits over the actors and
training over the learner ranks; at k = 0 a step is generation then training, at k >= 1 the two
overlap and a step takes the longer of them; each version of staleness adds off-policy error.
(The real probe, on the real stack, is ``tests/test_real_tune_report.py``.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.config import load_config
from launch.tools.tune import Measurement, Setting, Thresholds, probe_settings, recommend, splits, table

BASE = [
    "model.path=m",
    "data.prompts=p.jsonl",
    "reward.function=builtin:echo",
]


def config(actors: int = 2, ranks: int = 2, **cpus):
    extra = [f"resources.{kind}.num_cpus={n}" for kind, n in cpus.items()]
    return load_config(None, [*BASE, f"resources.actors.count={actors}", f"resources.learner.ranks={ranks}", *extra])


@dataclass(frozen=True)
class Workload:
    generate_s: float  # one step's generation on one actor
    train_s: float  # one step's training on one rank
    tokens: int = 1000  # trained tokens per step

    def measure(self, s: Setting) -> Measurement:
        gen, train = self.generate_s / s.actors, self.train_s / s.ranks
        if s.schedule == "colocated":  # taking turns, the learner's threads on all the cores
            train /= s.learner_cpus
        step = gen + train if s.max_staleness == 0 or s.schedule == "colocated" else max(gen, train)
        learner_wait = gen if s.max_staleness == 0 or s.schedule == "colocated" else max(gen - train, 0.0)
        actor_wait = train if s.max_staleness == 0 or s.schedule == "colocated" else max(train - gen, 0.0)
        return Measurement(
            s,
            tokens_per_s=self.tokens / step,
            learner_idle=learner_wait / step,
            actor_idle=actor_wait / step,
            mismatch_kl=0.002 * s.max_staleness,
            tis_truncated_frac=0.004 * s.max_staleness,
        )


def probe(workload: Workload, cfg, ks=(0, 1, 2, 4), schedules=("overlapped",)) -> list[Measurement]:
    settings = probe_settings(cfg, list(ks), ["between_requests", "inflight"])
    return [workload.measure(s) for s in settings if s.schedule in schedules]


def test_splits_keep_what_the_config_reserves():
    assert splits(config(2, 2)) == [(1, 3), (2, 2), (3, 1)]
    assert splits(config(1, 1)) == [(1, 1)]  # the demo's two cores: one split
    assert splits(config(1, 1, learner=2)) == [(1, 1)]  # a rank costs 2 of the 3 CPUs
    assert splits(config(2, 1, learner=2)) == [(2, 1)]


def test_the_grid_skips_inflight_updates_at_k0_and_probes_colocated_on_cpus():
    settings = probe_settings(config(1, 1), [0, 1, 2], ["between_requests", "inflight"])
    grid = [(0, "between_requests"), (1, "between_requests"), (1, "inflight"), (2, "between_requests"), (2, "inflight")]
    assert [(s.max_staleness, s.weight_update, s.schedule) for s in settings] == [
        *((k, mode, "overlapped") for k, mode in grid),
        *((k, mode, "colocated") for k, mode in grid),
    ]
    # colocated: one engine per core, the rank on both cores
    assert {(s.actors, s.ranks, s.learner_cpus) for s in settings if s.schedule == "colocated"} == {(2, 1, 2.0)}
    assert Setting(2, "inflight", 1, 3).overrides() == [
        "run.max_staleness=2",
        "run.schedule=overlapped",
        "rollout.weight_update=inflight",
        "resources.actors.count=1",
        "resources.learner.ranks=3",
    ]
    assert Setting(1, "between_requests", 2, 1, "colocated", 2.0).overrides()[-1] == "resources.learner.num_cpus=2"
    # a colocated config's own cores are shared: not counted twice
    colocated = load_config(None, [*BASE, "run.schedule=colocated", "resources.actors.count=2",
                                   "resources.learner.num_cpus=2"])  # fmt: skip
    assert splits(colocated) == [(1, 1)] and (2, 1, "colocated") in {
        (s.actors, s.ranks, s.schedule) for s in probe_settings(colocated, [0], ["between_requests"])
    }
    # on GPUs the colocated schedule is not built: not probed
    gpu = load_config(None, [*BASE, "resources.actors.num_gpus=1", "resources.learner.num_gpus=1"])
    assert {s.schedule for s in probe_settings(gpu, [0, 1], ["between_requests"])} == {"overlapped"}


def test_where_both_sides_are_slow_on_one_core_taking_turns_on_two_wins():
    both = ("overlapped", "colocated")
    rec = recommend(probe(Workload(generate_s=4.0, train_s=3.0), config(1, 1), schedules=both))
    assert rec.setting.schedule == "colocated" and rec.setting.actors == 2  # 2 + 1.5 s a step, not max(4, 3)
    assert "take turns" in rec.reason
    # generation-bound: overlapping hides the 1 s of training, two engines halve the 8 s (4.5 s against 8)
    rec = recommend(probe(Workload(generate_s=8.0, train_s=1.0), config(1, 1), schedules=both))
    assert rec.setting.schedule == "colocated"
    rec = recommend(probe(Workload(generate_s=2.0, train_s=2.0), config(1, 1), schedules=both))
    assert rec.setting.schedule == "colocated" and rec.setting.max_staleness == 0  # as fast as overlapped k = 1


def test_where_generation_dominates_it_gives_generation_more_actors():
    rec = recommend(probe(Workload(generate_s=6.0, train_s=1.0), config(2, 2)))
    assert rec.setting.actors == 3 and rec.setting.ranks == 1  # more actors than the 2 configured
    assert rec.setting.max_staleness >= 1  # generation overlaps training
    assert "Generation dominates" in rec.reason and "synchronous" in rec.reason


def test_the_speedup_is_against_the_configured_split():
    measured = probe(Workload(generate_s=6.0, train_s=1.0), config(2, 2))
    rec = recommend(measured, configured=(2, 2))
    assert "synchronous training (k=0, between requests, 2:2)" in rec.reason
    assert "synchronous training (k=0, between requests, 1:3)" in recommend(measured).reason  # no split given


def test_where_training_dominates_it_gives_the_learner_the_cores():
    rec = recommend(probe(Workload(generate_s=1.0, train_s=6.0), config(2, 2)))
    assert rec.setting.actors == 1 and rec.setting.ranks == 3  # fewer actors than the 2 configured
    assert rec.setting.max_staleness <= 1  # and no more staleness than the overlap needs
    assert "Training dominates" in rec.reason


def test_with_one_split_a_gain_within_the_noise_keeps_k_small():
    """Training dominates so much that overlapping generation gains under 10%: k = 0 stays."""
    rec = recommend(probe(Workload(generate_s=0.3, train_s=6.0), config(1, 1)))
    assert (rec.setting.max_staleness, rec.setting.weight_update) == (0, "between_requests")
    # generation dominates as much: overlap pays, and the smallest k that gives it is chosen
    rec = recommend(probe(Workload(generate_s=6.0, train_s=3.0), config(1, 1)))
    assert (rec.setting.max_staleness, rec.setting.weight_update) == (1, "between_requests")


def test_a_setting_over_the_thresholds_is_never_recommended_however_fast():
    measured = probe(Workload(generate_s=6.0, train_s=3.0), config(1, 1))
    for m in measured:
        if m.setting.max_staleness >= 1:
            m.mismatch_kl = 0.5  # far off-policy
    rec = recommend(measured)
    assert rec.setting.max_staleness == 0
    rendered = table(rec, Thresholds())
    assert rendered.row_count == len(measured)


def test_failed_probes_and_no_eligible_setting_give_no_recommendation():
    failed = [Measurement(Setting(0, "between_requests", 1, 1), error="out of memory")]
    assert recommend(failed).setting is None and "failed" in recommend(failed).reason
    far = [Measurement(Setting(1, "inflight", 1, 1), tokens_per_s=10.0, dropped_frac=0.9)]
    assert recommend(far).setting is None and "--staleness" in recommend(far).reason


@pytest.mark.parametrize(
    "bad", [["--staleness", "0,x"], ["--modes", "sometimes"], ["--steps", "2"], ["--out", "/no/such/dir/o.yaml"]]
)
def test_bad_tune_arguments_fail_in_one_line(bad, tmp_path, capsys):
    from launch.cli import main

    job = tmp_path / "job.yaml"
    job.write_text("model: {path: m}\ndata: {prompts: p.jsonl}\nreward: {function: builtin:echo}\n")
    assert main(["tune", "--config", str(job), *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error: --")


def test_the_command_probes_in_turn_survives_a_failed_probe_and_stops_on_ctrl_c(tmp_path, monkeypatch, capsys):
    """``run_tune`` end to end with each probe's training replaced by a written run directory:
    a probe that raises is a table row, a probe stopped by a signal ends the probing, and the
    recommendation and its overrides file come from the probes that finished."""
    import launch.run
    from launch.tools.tune import run_tune
    from tests.report_runs import write_run

    calls = []

    def fake_training(config, overrides, result=None):
        calls.append(overrides)
        values = dict(o.split("=", 1) for o in overrides)
        if len(calls) == 2:
            raise RuntimeError("out of memory\nmore detail")
        if len(calls) == 3:
            return 130  # Ctrl-C: the probe stopped cleanly
        result["run_dir"] = str(write_run(Path(values["run.output_dir"]) / values["run.name"]))
        return 0

    monkeypatch.setattr(launch.run, "run_training", fake_training)
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{path: m}}\ndata: {{prompts: p.jsonl}}\nreward: {{function: builtin:echo}}\n"
                   f"run: {{output_dir: {tmp_path / 'runs'}}}\n")  # fmt: skip
    strict = Thresholds()  # the synthetic run truncates 10% and drops 25%: over the defaults
    assert run_tune(str(job), [], 4, None, "0", "between_requests", strict) == 1
    assert "no recommendation: no probed setting kept" in capsys.readouterr().out
    calls.clear()
    lenient = Thresholds(tis_truncated_frac=0.2, dropped_frac=0.5)
    assert run_tune(str(job), [], 4, None, "0,1,2,4", "between_requests", lenient) == 0
    printed = capsys.readouterr().out
    assert len(calls) == 3  # the fourth setting was never probed
    assert all("run.save_final=false" in c and "run.steps=4" in c and "eval.every=0" in c for c in calls)
    assert "k=1, between requests, 1:1 failed: out of memory; log:" in printed
    assert "interrupted: the recommendation is of the 2 finished probe(s)" in printed
    root = max((tmp_path / "runs").glob("tune-run-*"), key=lambda p: p.stat().st_mtime)
    measured = json.loads((root / "tune.json").read_text())["measurements"]
    assert [m["error"] is None for m in measured] == [True, False]
    assert measured[0]["tokens_per_s"] > 0
    cfg = load_config([str(job), str(root / "overrides.yaml")])
    assert (cfg.run.max_staleness, cfg.resources.actors.count) == (0, 1)


def test_a_setting_that_gave_up_prompts_is_not_recommended_however_fast():
    """In flight, a long-tail completion older than k at every try is given up (runtime/admission.py): that
    setting trains the short completions only, so its speed is not the job's."""
    measured = probe(Workload(generate_s=6.0, train_s=3.0), config(1, 1), ks=(0, 2))
    for m in measured:
        if m.setting.weight_update == "inflight":
            m.tokens_per_s *= 10
            m.starved = 3
    rec = recommend(measured)
    assert rec.setting.weight_update == "between_requests"
    inflight = next(m for m in measured if m.setting.weight_update == "inflight")
    assert inflight.over(Thresholds()) == ["3 prompt(s) too stale at every try (their long completions go untrained)"]
