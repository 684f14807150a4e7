"""How a run stops and starts again, without Ray: when a checkpoint is due, what a failure offers the
user, a resume that changes the config, a second signal, and the half-written checkpoint it leaves
(issue 26)."""

from __future__ import annotations

import json
import time

import pytest

from launch.config import load_config
from runtime.checkpoints import CheckpointError, CheckpointStore
from runtime.stopping import StopRequest

# --- when to checkpoint, and what a failure offers -------------------------------------------------
MINIMAL = ["model.path=x", "data.prompts=x", "reward.function=x"]


def test_a_checkpoint_is_due_by_wall_time_since_the_last_one(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from runtime.saving import Progress, RunSaver

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    cfg = load_config(None, [*MINIMAL, "run.checkpoint_every_s=600"])
    saver = RunSaver(cfg.run, SimpleNamespace(root=tmp_path), None, Progress(), dict)
    clock[0] += 599
    assert not saver.time_due()
    clock[0] += 1
    assert saver.time_due()  # 600 s since the start
    saver.last_at = clock[0]  # what a checkpoint sets
    assert not saver.time_due()
    assert load_config(None, MINIMAL).run.checkpoint_every_s == 3600
    off = RunSaver(
        load_config(None, [*MINIMAL, "run.checkpoint_every_s=0"]).run,
        SimpleNamespace(root=tmp_path),
        None,
        Progress(),
        dict,
    )
    clock[0] += 10**6
    assert not off.time_due()


def test_a_failure_before_any_checkpoint_does_not_offer_a_resume(tmp_path):
    from types import SimpleNamespace

    from launch.train import resume_hint
    from runtime.saving import Progress

    run = SimpleNamespace(root=tmp_path)
    assert resume_hint(run, Progress(done=3)) == "no checkpoint yet, so nothing to resume: start the run again"
    hint = resume_hint(run, Progress(done=3, checkpoint=tmp_path / "checkpoints" / "step-2"))
    assert hint == f"checkpoint {tmp_path / 'checkpoints' / 'step-2'}; resume with: tandem train --resume {tmp_path}"


# --- a resume with another config ----------------------------------------------------------------
def test_config_changes_are_dotted_and_only_meaning_ones_need_permission():
    from runtime.saving import changes_meaning, check_config_changes, config_changes

    then = {"rollout": {"group_size": 8, "max_tokens": 64}, "run": {"steps": 60, "seed": 0}, "reward": {"timeout_s": 5}}
    now = {"rollout": {"group_size": 4, "max_tokens": 64}, "run": {"steps": 90, "seed": 0}, "reward": {"timeout_s": 9}}
    assert config_changes(then, now) == [
        ("reward.timeout_s", 5, 9),
        ("rollout.group_size", 8, 4),
        ("run.steps", 60, 90),
    ]
    assert [changes_meaning(k) for k in ("rollout.group_size", "run.steps", "run.seed", "reward.timeout_s")] == [
        True,
        False,
        True,
        False,
    ]
    assert changes_meaning("learner.lr") and changes_meaning("algorithm.name") and changes_meaning("model.path")
    assert not changes_meaning("resources.actors.count") and not changes_meaning("eval.every")
    # found by the review: what one changes after an OOM is free; the staleness bound and the rank count are not
    assert not any(map(changes_meaning, ["reward.workers", "learner.token_budget", "learner.gradient_checkpointing"]))
    assert changes_meaning("run.max_staleness") and changes_meaning("resources.learner.ranks")
    assert config_changes({"run": {"steps": 1}}, {"run": {"steps": 1, "added_later": 2}}) == []  # a new field
    said: list[str] = []
    with pytest.raises(CheckpointError) as refused:
        check_config_changes(then, now, False, said.append)
    assert str(refused.value).startswith("the config changed what the run's steps mean: rollout.group_size 8 -> 4;")
    assert "--allow-changes" in str(refused.value) and not said
    check_config_changes(then, now, True, said.append)
    assert said == [
        "resuming with changed settings: reward.timeout_s 5 -> 9, rollout.group_size 8 -> 4, run.steps 60 -> 90"
    ]
    said.clear()
    check_config_changes(then, {**then, "run": {"steps": 90, "seed": 0}}, False, said.append)  # longer: free
    assert said == ["resuming with changed settings: run.steps 60 -> 90"]


def test_a_resume_that_changes_the_group_size_is_refused_before_anything_starts(tmp_path, tiny_model_dir, capsys):
    from launch.cli import main
    from observe.run_dir import write_config

    cfg = load_config(
        None, [f"model.path={tiny_model_dir}", "data.prompts=builtin:successor", "reward.function=builtin:successor"]
    )
    old = tmp_path / "old-run"  # a run from before configs/ existed, resumed at step 5
    old.mkdir()
    (old / "config.yaml").write_text("old")
    write_config(old, cfg.model_dump(mode="json"), 5)
    assert (old / "configs" / "before-step-5.yaml").read_text() == "old"
    assert (old / "configs" / "from-step-5.yaml").read_text() == (old / "config.yaml").read_text() != "old"
    root = tmp_path / "run"
    root.mkdir()
    write_config(root, cfg.model_dump(mode="json"), 0)
    saved = (root / "config.yaml").read_text()
    assert main(["train", "--resume", str(root), "rollout.group_size=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tandem: error: the config changed what the run's steps mean: rollout.group_size 8 -> 4;")
    assert (root / "config.yaml").read_text() == saved  # the record still says how the steps were trained
    assert sorted(p.name for p in (root / "configs").iterdir()) == ["from-step-0.yaml"]


# --- a second signal, and what it leaves -----------------------------------------------------------
def test_a_second_signal_writes_an_aborted_summary_then_exits(tmp_path, monkeypatch):
    import os
    import signal
    from types import SimpleNamespace

    from launch.run import aborted_summary

    (tmp_path / "metrics.jsonl").write_text('{"reward_mean": 0.5}\n{"reward_mean": 0.7}\n')
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    said: list[str] = []
    stop = StopRequest(said.append, on_abort=aborted_summary(SimpleNamespace(root=tmp_path), time.monotonic(), 0))
    stop._received(signal.SIGINT)
    assert stop.reason == "SIGINT" and not exits and not (tmp_path / "summary.json").exists()
    stop._received(signal.SIGINT)
    assert exits == [130]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "aborted (SIGINT after SIGINT)" and summary["steps"] == 2
    assert "no checkpoint" in summary["error"]


def test_a_second_sigterm_is_the_same_stop_not_an_abort(monkeypatch):
    # scancel signals every process of the job and tandem slurm's script passes its own on: two SIGTERMs
    # for one event must not throw the checkpoint away (found by the review); a Ctrl-C after it still can
    import os
    import signal

    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    said: list[str] = []
    stop = StopRequest(said.append)
    stop._received(signal.SIGTERM)
    stop._received(signal.SIGTERM)
    assert stop.reason == "SIGTERM" and not exits
    assert said[-1] == "SIGTERM again: already checkpointing and stopping (a Ctrl-C stops at once)"
    stop._received(signal.SIGINT)
    assert exits == [130] and said[-1] == "SIGINT after SIGTERM: stopping now, without a checkpoint"


def test_half_written_checkpoints_are_cleared_by_the_next_start(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.begin(4)  # what a second Ctrl-C or kill -9 during a checkpoint leaves
    (tmp_path / "checkpoints" / ".partial-step-4" / "half").write_text("x")
    complete = store.begin(2)
    store.commit(complete, 2, {"step": 2})
    assert store.clear_partials() == [".partial-step-4"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]
