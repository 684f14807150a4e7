"""A run tells its user what went wrong: steps without a learning signal are warned about and
recorded in summary.json, evaluation rounds whose reward calls failed are said, and every run
writes logs/driver.log (its console lines, the error that ended it, an unexpected error's
traceback). The training itself is faked: no Ray, no vLLM."""

from __future__ import annotations

import io
import json

import pytest

import launch.train
from launch.run import UnexpectedError, run_training, signal_summary
from observe.live import DriverView, PlainLines, StepStatus
from runtime.collector import Batch
from runtime.health import RunCannotLearn, RunHealth
from runtime.saving import Progress
from runtime.signals import SignalWatch, Silent, no_signal_cause, untrained_cause
from runtime.step_metrics import sample_records, step_metrics
from runtime.supervise import ActorFailed, ActorKeepsFailing
from tests.fakes import make_group


def step(zero_variance_frac: float, reward_mean: float = 0.0, reward_std: float = 0.0) -> dict:
    return {"zero_variance_frac": zero_variance_frac, "reward_mean": reward_mean, "reward_std": reward_std}


# --- the detector ------------------------------------------------------------------------------
def test_no_signal_warns_after_k_steps_in_a_row_once_and_a_step_with_signal_resets_it():
    watch = SignalWatch(steps_in_a_row=3)
    said = [watch.step(i, step(1.0)) for i in range(5)]  # steps 1-5 without signal
    assert said[:2] == [None, None] and said[3:] == [None, None]  # said once, at the 3rd
    assert said[2].startswith("steps 1-3: every group scored alike for 3 steps in a row")
    assert watch.step(5, step(0.5, 0.5, 0.5)) is None  # one group differed: signal, the count restarts
    assert [watch.step(i, step(1.0)) for i in (6, 7)] == [None, None]  # 2 in a row: not yet
    assert watch.step(8, step(1.0)).startswith("steps 7-9:")
    assert watch.no_signal_steps == 8 and len(watch.warnings) == 2


@pytest.mark.parametrize(
    ("steps", "cause"),
    [
        (
            [step(1.0, 0.0)] * 2,
            "all rewards 0.00: the reward never fires; check the answers and the reward with `tandem check-data`",
        ),
        ([step(1.0, 1.0)] * 2, "all rewards 1.00: the task is too easy for the model"),
        ([step(1.0, 0.3)] * 2, "all rewards 0.30: the reward does not depend on the completion"),
        # groups differ from each other (std over the step > 0), each group alike: 1/4 of the groups all 1
        ([step(1.0, 0.25, 0.433)] * 2, "mean reward 0.25, but each prompt's samples scored alike"),
        ([step(1.0, 0.0), step(1.0, 1.0)], "mean reward 0.50, but each prompt's samples scored alike"),
    ],
)
def test_the_cause_tells_a_reward_that_never_fires_from_a_task_too_easy(steps, cause):
    assert no_signal_cause([(s["reward_mean"], s["reward_std"]) for s in steps]).startswith(cause)
    watch = SignalWatch(steps_in_a_row=2)
    warnings = [watch.step(i, s) for i, s in enumerate(steps)]
    assert cause in warnings[1]


def test_summary_says_learned_false_only_when_no_step_had_a_signal():
    quiet = SignalWatch(steps_in_a_row=5)
    for i in range(3):  # fewer steps than K: no warning on the way, but the summary says it
        quiet.step(i, step(1.0, 0.0))
    assert quiet.summary() == {
        "no_signal_steps": 3,
        "eval_reward_errors": 0,
        "warnings": [],
        "learned": False,
        "learned_reason": "no step had a learning signal (every group of all 3 steps scored alike): all rewards "
        "0.00: the reward never fires; check the answers and the reward with `tandem check-data`",
    }
    some = SignalWatch(steps_in_a_row=5)
    for s in (step(1.0), step(0.9, 0.1, 0.3), step(1.0)):
        some.step(0, s)
    assert some.summary() == {"no_signal_steps": 2, "eval_reward_errors": 0, "warnings": []}
    assert SignalWatch().summary() == {"no_signal_steps": 0, "eval_reward_errors": 0, "warnings": []}  # no step


def test_evaluation_reward_errors_are_said_once():
    watch = SignalWatch()
    assert watch.eval(0, {"eval/reward_errors": 0, "eval/prompts": 8, "eval/samples": 4}) is None
    first = watch.eval(5, {"eval/reward_errors": 12, "eval/prompts": 8, "eval/samples": 4})
    assert first.startswith("eval after step 5: 12 of 32 reward calls failed (scored 0)")
    assert "fix reward.function" in first
    assert watch.eval(10, {"eval/reward_errors": 3, "eval/prompts": 8, "eval/samples": 4}) is None
    assert watch.summary()["eval_reward_errors"] == 15 and watch.summary()["warnings"] == [first]


def test_the_summary_replays_the_run_files(tmp_path):
    lines = [{"step": i, **step(1.0, 1.0)} for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 6, "torn')
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 6, "eval/reward_errors": 2, "eval/prompts": 1}) + "\n")
    summary = signal_summary(tmp_path)
    assert summary["no_signal_steps"] == 6 and summary["learned"] is False
    assert summary["eval_reward_errors"] == 2
    assert [w[:10] for w in summary["warnings"]] == ["steps 1-5:", "eval after"]
    assert "the task is too easy" in summary["warnings"][0]


# --- the driver's view and log -------------------------------------------------------------------
def test_the_driver_view_logs_every_line_and_says_the_watchers_warnings(tmp_path):
    out, log = io.StringIO(), tmp_path / "logs" / "driver.log"
    view = DriverView(PlainLines(out), log, [SignalWatch(steps_in_a_row=2)])
    view.say("starting")
    for i in range(2):
        view.step(StepStatus(i + 1, 10, 1.0, 9.0, step(1.0)), f"step {i + 1}/10 | reward 0.000")
    view.eval({"eval/reward_errors": 1, "eval/prompts": 1, "eval/samples": 1}, "eval after step 2: pass@1 0.000")
    view.close()
    view.say("\ncompleted")  # after close: still logged; the blank line before its time
    shown = out.getvalue().splitlines()
    assert shown[3].startswith("warning: steps 1-2: every group scored alike") and shown[5].startswith("warning: eval")
    logged = log.read_text().splitlines()
    assert [line[11:] for line in logged] == shown  # each line with its time: "[HH:MM:SS] "
    assert logged[-2] == "" and all(line[0] == "[" and line[9:11] == "] " for line in logged[:-2] + logged[-1:])


def fake_training(behaviour):
    """``launch.train.train`` stood in for: ``behaviour(run)`` trains (says, records steps) or raises."""

    async def train(cfg, plan, run, rows, model_path, stop, resume=None, eval_rows=None):
        behaviour(run)
        return Progress(done=cfg.run.steps)

    return train


def run_demo(tmp_path, tiny_model_dir, *extra):
    overrides = [
        f"model.path={tiny_model_dir}",
        f"run.output_dir={tmp_path}",
        "run.steps=3",
        "run.trackers=[jsonl]",
        "data.num_rows=64",
        *extra,
    ]
    result: dict = {}
    try:
        return run_training("configs/demo.yaml", overrides, result=result), result
    finally:
        result["driver_log"] = (tmp_path / result["run_dir"] / "logs" / "driver.log") if "run_dir" in result else None


def test_a_completed_run_without_signal_writes_driver_log_and_says_it_learned_nothing(
    tmp_path, tiny_model_dir, monkeypatch
):
    def trains_on_alike_groups(run):
        run.say("training 3 steps")
        for i in range(3):
            run.step(i, {**step(1.0), "tokens_per_s": 10.0, "staleness_mean": 0.0, "staleness_max": 0})

    monkeypatch.setattr(launch.train, "train", fake_training(trains_on_alike_groups))
    code, result = run_demo(tmp_path, tiny_model_dir)
    assert code == 0
    summary = json.loads((tmp_path / result["run_dir"] / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["learned"] is False and summary["no_signal_steps"] == 3
    log = result["driver_log"].read_text()
    assert "training 3 steps" in log and "step    3/3 | reward 0.000" in log
    assert "completed in" in log  # the final lines too
    assert "warning: no step had a learning signal" in log and "the reward never fires" in log


def test_an_unexpected_error_puts_its_traceback_in_driver_log(tmp_path, tiny_model_dir, monkeypatch):
    def breaks(run):
        run.say("training 3 steps")
        raise KeyError("lost")

    monkeypatch.setattr(launch.train, "train", fake_training(breaks))
    with pytest.raises(UnexpectedError, match=r"KeyError: 'lost'; full traceback: .*driver\.log"):
        run_demo(tmp_path, tiny_model_dir)
    (run_dir,) = tmp_path.iterdir()
    log = (run_dir / "logs" / "driver.log").read_text()
    assert "training 3 steps" in log and "error: KeyError: 'lost'" in log
    assert "Traceback (most recent call last)" in log and 'raise KeyError("lost")' in log
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(("error", "attempts"), [(ActorKeepsFailing, 1), (ActorFailed, 2)])
def test_an_actor_that_keeps_failing_is_not_resumed_and_its_error_is_in_driver_log(
    tmp_path, tiny_model_dir, monkeypatch, error, attempts
):
    """run.max_restarts resumes from a checkpoint after a process failure, but not when the same
    error killed the actors twice: it would meet it again."""
    calls = []

    def dies(run):
        calls.append(1)
        raise error("actor-0 stopped: RuntimeError: boom")

    monkeypatch.setattr(launch.train, "train", fake_training(dies))
    monkeypatch.setattr("runtime.checkpoints.CheckpointStore.newest", lambda store, say: ("ckpt", {"step": 0}))
    with pytest.raises(error, match="boom"):
        run_demo(tmp_path, tiny_model_dir, "run.max_restarts=1")
    assert len(calls) == attempts
    (run_dir,) = tmp_path.iterdir()
    assert "error: actor-0 stopped: RuntimeError: boom" in (run_dir / "logs" / "driver.log").read_text()


def test_a_run_cut_at_the_length_limit_is_told_to_raise_max_tokens():
    # the new user's GSM8K run: rewards 0 and 96-100% of completions cut at the default 16 tokens; the
    # reward is not what is wrong (check-data scores the gold answers 1), the answers never fit
    watch = SignalWatch(steps_in_a_row=2)
    cut = {"zero_variance_frac": 1.0, "reward_mean": 0.0, "reward_std": 0.0, "truncated_frac": 0.97}
    warnings = [watch.step(i, cut) for i in range(2)]
    assert (
        "97% of completions were cut at rollout.max_tokens" in warnings[1] and "raise rollout.max_tokens" in warnings[1]
    )
    assert "check the answers" not in warnings[1]
    assert no_signal_cause([(0.0, 0.0, 0.2)]).startswith("all rewards 0.00: the reward never fires")


# --- steps that train nothing, episodes their environment failed -------------------------------
def _episode_batch(ends: list[str], detail: str = "ValueError: observation must be a string") -> Batch:
    """One group of episodes ending as ``ends`` ("done", "error", ...): failed ones train no token."""
    group = make_group(0, [0.0] * len(ends))
    for traj, end in zip(group.trajectories, ends):
        failed = end in ("error", "timeout", "lost")
        traj.episode = {
            "turns": [],
            "model_turns": 1,
            "end": end,
            "detail": detail if failed else None,
            "tool_calls": 0,
            "tool_errors": 0,
            "environment_s": 0.1,
            "generate_s": 0.1,
        }
        if failed:
            traj.completion_mask = traj.completion_mask * 0
    return Batch(groups=[group], step=0, dropped=0, wait_s=0.0)


def _learner(batch: Batch, **extra) -> dict:
    return {"tokens": float(sum(t.completion_mask.sum() for g in batch.groups for t in g.trajectories)), **extra}


def test_a_step_whose_every_episode_failed_says_so_with_the_environments_error():
    batch = _episode_batch(["error", "error", "timeout"])
    metrics = step_metrics(batch, _learner(batch), 1.0)
    assert metrics["trained_tokens"] == 0 and metrics["episode/failed"] == 3
    cause = untrained_cause(metrics)
    assert cause.startswith("every episode was ended by its environment (timeout 33%, error 67%)")
    assert "first: error: ValueError: observation must be a string" in cause and "samples.jsonl" in cause
    watch = SignalWatch()
    warning = watch.step(4, metrics)
    assert warning.startswith("step 5 trained 0 tokens: every episode was ended by its environment")
    assert watch.step(5, metrics).startswith("step 6 trained 0 tokens")  # said every step, kept once
    summary = watch.summary()
    assert summary["empty_steps"] == 2 and len(summary["warnings"]) == 1 and summary["learned"] is False
    assert summary["learned_reason"].startswith("no step trained a token (all 2): every episode was ended")
    # the samples say what failed, even when the sampled completions would not have shown it
    records = sample_records(batch, step=0, count=1)
    assert records[0]["end"] in ("error", "timeout") and records[0]["detail"].startswith("ValueError")


def test_some_failed_episodes_are_said_once_per_text_and_ride_on_the_progress_line(tmp_path):
    from observe.run_dir import RunLog

    said = []
    health = RunHealth(lr=1e-3, max_error_steps=3, max_nonfinite_steps=3, say=said.append)
    batch = _episode_batch(["done", "lost", "done", "done"], detail="its environment worker was replaced")
    health.check(2, batch.groups, {})
    health.check(3, batch.groups, {})
    assert said == [
        "step 3: 1 of 4 episodes were ended by their environment (lost 1) and train no token; "
        "lost: its environment worker was replaced"
    ]
    metrics = step_metrics(batch, _learner(batch), 1.0)
    assert (
        untrained_cause(metrics) is None and metrics["episode_failure"] == "lost: its environment worker was replaced"
    )
    out = io.StringIO()
    run = RunLog(tmp_path, 5, stream=out, config={"run": {"trackers": ["jsonl"], "live": False}})
    run.step(0, metrics)
    assert out.getvalue().rstrip().endswith("| 1 episodes failed")


def test_steps_that_train_nothing_stop_the_run_after_max_empty_steps_with_the_cause():
    health = RunHealth(lr=1e-3, max_error_steps=3, max_nonfinite_steps=3, say=print, max_empty_steps=3)
    batch = _episode_batch(["done", "done"])
    rejected = step_metrics(
        batch,
        _learner(batch, reject_token_frac=1.0, reject_token_k2_frac=1.0, reject_seq_frac=1.0, kept_frac=0.0),
        1.0,
    )
    trained = step_metrics(batch, _learner(batch, reject_token_frac=0.86, kept_frac=0.14), 1.0)
    assert rejected["trained_tokens"] == 0 and trained["trained_tokens"] > 0
    health.trained(0, rejected)
    health.trained(1, rejected)
    health.trained(2, trained)  # a step that trained something ends the streak
    health.trained(3, rejected)
    health.trained(4, rejected)
    with pytest.raises(
        RunCannotLearn,
        match=r"no token was trained for 3 steps in a row \(run.max_empty_steps\): "
        r"algorithm.tis.reject rejected all 6 tokens of the step \(by rule: token_k2 100%\)",
    ):
        health.trained(5, rejected)


def test_without_signal_the_cause_names_failed_episodes_and_rejected_tokens_before_the_reward():
    failed = Silent(0.0, 0.0, failed_frac=0.75, failure="timeout: step took longer than 10 s")
    assert no_signal_cause([failed, failed]).startswith("75% of episodes were ended by their environment")
    assert "timeout: step took longer" in no_signal_cause([failed])
    rejected = Silent(0.0, 0.0, rejected_frac=0.86)
    assert no_signal_cause([rejected]).startswith("algorithm.tis.reject rejected 86% of the tokens")
    assert "the reward never fires" in no_signal_cause([Silent(0.0, 0.0, failed_frac=0.2, rejected_frac=0.3)])
    metrics = {
        "zero_variance_frac": 1.0,
        "reward_mean": 0.0,
        "reward_std": 0.0,
        "episode/end_done_frac": 0.25,
        "episode/end_error_frac": 0.75,
        "episode_failure": "error: boom",
        "trained_tokens": 4.0,
    }
    watch = SignalWatch(steps_in_a_row=1)
    assert "75% of episodes were ended by their environment and train no token (first: error: boom)" in watch.step(
        0, metrics
    )


def test_rules_and_masking_that_together_leave_no_weight_are_named_together():
    # half the tokens rejected by a rule, the other half masked by tis.mode: no factor is 1, the union is all
    both = {"trained_tokens": 0.0, "learner/tokens": 100.0, "learner/reject_token_frac": 0.5,
            "learner/reject_token_k3_frac": 0.5, "learner/tis_masked_frac": 0.5}  # fmt: skip
    cause = untrained_cause(both)
    assert cause.startswith("algorithm.tis.reject (50% of tokens, by rule: token_k3 50%) and algorithm.tis.mode")
    masked = {"trained_tokens": 0.0, "learner/tokens": 100.0, "learner/tis_masked_frac": 1.0}
    assert untrained_cause(masked).startswith("importance sampling's algorithm.tis.mode gave all 100 tokens")


def test_a_step_whose_failed_episodes_and_cut_completions_train_nothing_says_both():
    mixed = {"trained_tokens": 0.0, "learner/tokens": 0.0, "episode/end_error_frac": 0.5,
             "episode/end_length_frac": 0.5, "episode/failed": 4, "episode_failure": "error: boom",
             "truncated_frac": 0.5}  # fmt: skip
    cause = untrained_cause(mixed)
    assert cause.startswith("50% of the episodes were ended by its environment (error 50%)")
    assert "(the rest were cut at rollout.max_tokens and masked)" in cause and "every episode" not in cause


def test_a_step_that_trained_nothing_breaks_a_stretch_without_signal():
    watch = SignalWatch(steps_in_a_row=3)
    empty = {"trained_tokens": 0.0, "learner/tokens": 0.0, "truncated_frac": 1.0}
    said = [watch.step(i, s) for i, s in enumerate([step(1.0), step(1.0), empty, step(1.0), step(1.0)])]
    assert not any(w and "scored alike" in w for w in said)  # 2, then 2: never 3 in a row


def test_dynamic_sampling_at_its_limit_names_failed_episodes_instead_of_the_task():
    said = []
    health = RunHealth(lr=1e-3, max_error_steps=3, max_nonfinite_steps=3, say=said.append)
    health.oversample_reached(0, 3, 16, _episode_batch(["error", "error", "done"]).groups)
    assert said[0].endswith("(2 of the batch's 3 episodes were ended by their environment (first: error: "
                            "ValueError: observation must be a string))")  # fmt: skip
    plain = RunHealth(lr=1e-3, max_error_steps=3, max_nonfinite_steps=3, say=said.append)
    plain.oversample_reached(0, 3, 16, [make_group(0, [1.0, 1.0])])
    assert said[1].endswith("(too easy or too hard a task?)")
