"""``tandem train --config F --resume auto``: which run a repeated command continues (``launch/resume_auto.py``),
on run directories laid out as real runs leave them; nothing trains here (the real three-segment run is in
``tests/test_real_requeue.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.cli import main
from launch.resume_auto import choose, run_dirs
from runtime.run_lock import RunDirBusy, RunLock
from tests.runs import DEMO


def make_run(out: Path, dirname: str, status: str | None = None, steps: int = 0, checkpoint: int | None = None):
    """A run directory as a run leaves it: config.yaml, summary.json when ``status`` is given (none: killed
    with kill -9 before its first summary), and ``checkpoints/step-N`` when ``checkpoint`` is given."""
    root = out / dirname
    root.mkdir(parents=True)
    (root / "config.yaml").write_text("run: {}\n")
    if status is not None:
        (root / "summary.json").write_text(json.dumps({"status": status, "steps": steps}))
    if checkpoint is not None:
        (root / "checkpoints" / f"step-{checkpoint}").mkdir(parents=True)
        (root / "checkpoints" / f".partial-step-{checkpoint + 4}").mkdir()  # half-written: never counts
    return root


def test_the_newest_unfinished_run_of_the_name_is_resumed_and_other_names_are_ignored(tmp_path):
    make_run(tmp_path, "demo-20261201-100000", "stopped (SIGTERM)", 4, checkpoint=4)
    newest = make_run(tmp_path, "demo-20261201-100000-1", "stopped (SIGTERM)", 6, checkpoint=6)  # same second
    make_run(tmp_path, "demo-x-20261202-100000", "stopped (SIGTERM)", 2, checkpoint=2)  # run.name demo-x
    make_run(tmp_path, "other-20261203-100000", "failed", 2, checkpoint=2)
    (tmp_path / "demo-20261204-100000").mkdir()  # no config.yaml: not a run directory
    (tmp_path / "demo-20261205-100000.log").write_text("")
    assert run_dirs(tmp_path, "demo")[0] == newest and len(run_dirs(tmp_path, "demo")) == 2
    choice = choose(tmp_path, "demo", 8)
    assert (choice.action, choice.run_dir) == ("resume", newest)
    assert choice.line == f"--resume auto: resuming {newest} (stopped (SIGTERM); newest checkpoint step 6)"


def test_a_run_killed_with_kill_9_is_unfinished_whatever_its_summary_says(tmp_path):
    killed = make_run(tmp_path, "demo-20261201-100000", checkpoint=4)  # no summary at all
    choice = choose(tmp_path, "demo", 8)
    assert (choice.action, choice.run_dir) == ("resume", killed) and "no summary (killed)" in choice.line
    # killed in a later segment: the summary is the earlier segment's, a stop at step 4
    (killed / "summary.json").write_text(json.dumps({"status": "stopped (SIGTERM)", "steps": 4}))
    assert choose(tmp_path, "demo", 8).action == "resume"
    (killed / "summary.json").write_text('{"status": "compl')  # torn while written
    assert choose(tmp_path, "demo", 8).action == "resume"


def test_a_completed_run_is_not_trained_again_unless_the_command_asks_for_more_steps(tmp_path):
    make_run(tmp_path, "demo-20261201-100000", "stopped (SIGTERM)", 4, checkpoint=4)  # older: not looked at
    done = make_run(tmp_path, "demo-20261202-100000", "completed", 8, checkpoint=8)
    choice = choose(tmp_path, "demo", 8)
    assert (choice.action, choice.run_dir) == ("complete", done)
    assert choice.line == f"--resume auto: {done} completed its 8 steps; nothing to train"
    more = choose(tmp_path, "demo", 12)  # run.steps raised in the command: continue, as --resume DIR run.steps=12
    assert (more.action, more.run_dir) == ("resume", done) and "completed 8 steps, 12 asked" in more.line


def test_no_run_of_the_name_or_none_with_a_checkpoint_starts_a_new_run(tmp_path):
    choice = choose(tmp_path / "missing", "demo", 8)  # run.output_dir not made yet
    assert (choice.action, choice.run_dir) == ("new", None) and "no run named 'demo'" in choice.line
    early = make_run(tmp_path, "demo-20261201-100000", "failed")  # died before its first checkpoint
    make_run(tmp_path, "demo-20261130-100000", "stopped (SIGTERM)", 4, checkpoint=4)  # given up by the later start
    choice = choose(tmp_path, "demo", 8)
    assert (choice.action, choice.run_dir) == ("new", None)
    assert choice.line == (
        f"--resume auto: {early} (the newest run named 'demo') stopped before its first checkpoint; starting a new run"
    )


def test_a_running_run_refuses_a_second_writer_in_one_line(tmp_path):
    running = make_run(tmp_path, "demo-20261201-100000", checkpoint=4)
    lock = RunLock.acquire(running)  # as the running tandem train holds it
    try:
        with pytest.raises(RunDirBusy, match=f"run directory {running} is in use by tandem"):
            choose(tmp_path, "demo", 8)
    finally:
        lock.release()
    assert choose(tmp_path, "demo", 8).action == "resume"  # released: the check let go of it too


def test_the_command_line(tmp_path, capsys):
    assert main(["train", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert err == "tandem: error: --resume auto needs --config FILE.yaml: the run's name and output_dir come from it\n"
    done = make_run(tmp_path, "demo-20261202-100000", "completed", 3, checkpoint=3)
    args = ["train", "--config", str(DEMO), "--resume", "auto", f"run.output_dir={tmp_path}", "run.name=demo"]
    assert main([*args, "run.steps=3"]) == 0  # nothing trains: no Ray, no model needed
    assert capsys.readouterr().err == f"tandem: --resume auto: {done} completed its 3 steps; nothing to train\n"
