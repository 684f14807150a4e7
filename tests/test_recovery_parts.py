"""The parts that make a run recoverable, without Ray: the prompt ledger, checkpoint files, the
actor pool's replacement of a dead actor, the clean-stop clock, the health checks, and a skipped
non-finite update on a real ``RankStep``."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from launch.config import ConfigError, load_config, parse_duration
from queues.bounded import LocalQueue
from queues.messages import PromptRequest
from queues.prompts import PromptStream
from runtime.admission import Admission, Pace
from runtime.checkpoints import CheckpointError, CheckpointStore, problem
from runtime.collector import Batch
from runtime.health import RunCannotLearn, RunHealth
from runtime.ledger import PromptLedger
from runtime.step_metrics import sample_records
from runtime.stopping import StopRequest
from runtime.supervise import ActorFailed, ActorPool
from tests.fakes import FakeStarter, make_group

ROWS = [{"prompt": f"p{i}"} for i in range(5)]


# --- the prompt ledger ---------------------------------------------------------------------
def test_prompt_ids_are_positions_in_the_data_order():
    stream = PromptStream(ROWS, seed=3)
    order = [r["prompt"] for _, r in zip(range(12), stream)]
    assert [stream.row(i)["prompt"] for i in range(12)] == order  # the same rows, by position
    assert sorted(order[:5]) == sorted(order[5:10]) == [f"p{i}" for i in range(5)]  # whole epochs
    assert order[:5] != order[5:10]  # each epoch its own shuffle


def test_the_ledger_regenerates_what_was_not_trained_and_ignores_duplicates():
    ledger = PromptLedger(PromptStream(ROWS, seed=0))
    assert [ledger.take()[0] for _ in range(4)] == [0, 1, 2, 3]
    assert ledger.trained(1) and ledger.trained(2)
    assert not ledger.trained(1) and ledger.duplicates == 1  # a second result of prompt 1
    ledger.again([3, 1])  # 1 is trained already: not generated again
    assert ledger.take()[0] == 3 and ledger.take()[0] == 4
    assert ledger.state()["pending"] == [0, 3, 4] and ledger.state()["next_id"] == 5

    resumed = PromptLedger.restore(PromptStream(ROWS, seed=0), json.loads(json.dumps(ledger.state())))
    assert ledger.trained(0)  # trained in the old process after the checkpoint: irrelevant to the restored one
    assert [resumed.take()[0] for _ in range(4)] == [0, 3, 4, 5]  # the pending ones first, then new ones
    ledger.again([4])
    assert ledger.trained(4)  # its late first result arrives before it is generated again ...
    assert ledger.take()[0] == 5  # ... so it is not handed out a second time


# --- checkpoint files ------------------------------------------------------------------------
def _write(store: CheckpointStore, step: int, payload: bytes = b"weights") -> None:
    partial = store.begin(step)
    (partial / "deepspeed").mkdir()
    (partial / "deepspeed" / "model.pt").write_bytes(payload * 100)
    store.commit(partial, step, {"step": step})


def test_checkpoints_are_atomic_pruned_and_checked(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (2, 4, 6):
        _write(store, step)
    assert [p.name for p in store.all()] == ["step-6", "step-4"]  # the oldest was pruned
    partial = store.begin(8)  # a crash while writing step 8 leaves only a partial directory
    (partial / "x").write_text("half")
    path, state = store.newest(print)
    assert path.name == "step-6" and state == {"step": 6}
    assert problem(path) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    store = CheckpointStore(tmp_path, keep=3)
    _write(store, 2)
    _write(store, 4)
    weights = tmp_path / "checkpoints" / "step-4" / "deepspeed" / "model.pt"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:10])
    elif damage == "flip":
        weights.write_bytes(b"X" + weights.read_bytes()[1:])
    else:
        weights.unlink()
    said = []
    path, state = store.newest(said.append)
    assert path.name == "step-2" and state["step"] == 2
    assert "step-4" in said[0] and "model.pt" in said[0] and "step-2" in said[0]


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        CheckpointStore(tmp_path, keep=1).newest(print)


# --- replacing a dead actor ------------------------------------------------------------------
class FakeRun:
    def __init__(self):
        self.said = []

    def say(self, text):
        self.said.append(text)

    def log_path(self, name):
        return f"/logs/{name}.log"


def test_a_dead_actors_prompts_are_generated_again_and_it_is_replaced():
    async def go():
        ledger = PromptLedger(PromptStream(ROWS * 4, seed=0, shuffle=False))
        prompts, results = LocalQueue("prompt", 100), LocalQueue("results", 100)
        for _ in range(6):
            prompt_id, row = ledger.take()
            prompts.put_many([PromptRequest(prompt_id, row, 0)], timeout=1)
        prompts.get_batch(3, 1, taker="actor-0")  # actor-0 takes prompts 0, 1, 2 ...
        results.put_many([make_group(1, [1.0, 0.0])], timeout=1)  # ... pushes prompt 1's group ...
        ledger.trained(0)  # ... and prompt 0 was trained; then it dies holding prompt 2
        dead = asyncio.get_running_loop().create_future()
        dead.set_exception(RuntimeError("The actor died unexpectedly"))
        forever = asyncio.get_running_loop().create_future()
        starter, pace = FakeStarter([dead, forever]), Pace(3, 1)
        admission = Admission(ledger, pace, prompts, lambda row: [1], 1.0)
        pool = ActorPool(["old-0"], ["actor-0"], starter, FakeRun(), admission, (prompts, results), max_restarts=1)
        pool_kill = []
        import runtime.supervise as supervise

        supervise._kill = pool_kill.append
        (loop,) = list(pool.loops)
        await asyncio.sleep(0)
        await pool.ended(loop)
        assert list(ledger.regenerate) == [2] and pace.dropped == 1  # only the prompt it still held
        assert starter.started == [0] and pool.actors == ["new-0"] and pool_kill == ["old-0"]
        assert pool.total_restarts == 1 and "restart 1 of 1" in pool.run.said[0]
        assert "/logs/actor-0.log" in pool.run.said[0]
        dead2 = asyncio.get_running_loop().create_future()
        dead2.set_exception(RuntimeError("died again"))
        pool.loops = {dead2: "actor-0"}
        with pytest.raises(ActorFailed, match="replaced 1 time"):  # past the limit
            await pool.ended(dead2)
        forever.cancel()

    asyncio.run(go())


# --- a clean stop, and runs that cannot learn --------------------------------------------------
def test_time_limits_parse_and_stop_before_running_out():
    assert parse_duration("90") == 90 and parse_duration("1:30:00") == 5400 and parse_duration("1-00:00:00") == 86400
    with pytest.raises(ConfigError, match="run.time_limit"):
        load_config(None, ["model.path=x", "data.prompts=x", "reward.function=x", "run.time_limit=soon"])

    async def go():
        said = []
        plenty = StopRequest(said.append, time_limit_s=3600)
        assert not plenty.time_is_short(step_s=5, checkpoint_s=5) and not plenty.requested
        short = StopRequest(said.append, time_limit_s=100, started=time.monotonic() - 70)
        assert short.time_is_short(step_s=10, checkpoint_s=5)  # 30 s left < 1.5 x 10 + 2 x 5 + 10
        assert short.reason == "time_limit" and short.exit_code == 0 and short.event.is_set()

    asyncio.run(go())


def test_failing_rewards_are_said_once_and_stop_the_run_when_every_call_fails():
    said = []
    health = RunHealth(lr=1e-3, max_error_steps=2, max_nonfinite_steps=3, say=said.append)
    flaky = [make_group(0, [1.0, 0.0])]
    flaky[0].reward_errors, flaky[0].first_reward_error = 1, "KeyError: 'answer'"
    health.check(0, flaky, {})
    health.check(1, flaky, {})
    assert len(said) == 1 and "1 of 2 reward calls failed" in said[0] and "KeyError" in said[0]
    broken = [make_group(0, [0.0, 0.0])]
    broken[0].reward_errors, broken[0].first_reward_error = 2, "ZeroDivisionError: division by zero"
    health.check(2, broken, {})
    with pytest.raises(RunCannotLearn, match="every reward call failed for 2 steps.*ZeroDivisionError"):
        health.check(3, broken, {})


@pytest.mark.parametrize(
    ("lr", "reward", "cause"), [(1000.0, 1.0, "learner.lr = 1000"), (1e-5, 1e30, "rewards too large")]
)
def test_non_finite_steps_in_a_row_stop_the_run_naming_the_likely_cause(lr, reward, cause):
    said = []
    health = RunHealth(lr=lr, max_error_steps=3, max_nonfinite_steps=2, say=said.append)
    groups = [make_group(0, [reward, 0.0])]
    health.check(0, groups, {"nonfinite_updates": 1, "updates": 1})
    health.check(1, groups, {"nonfinite_updates": 0, "updates": 1})  # a good step ends the streak
    health.check(2, groups, {"nonfinite_updates": 1, "updates": 1})
    with pytest.raises(RunCannotLearn, match=cause):
        health.check(3, groups, {"nonfinite_updates": 1, "updates": 1})
    assert health.nonfinite_total == 3 and "skipped" in said[0]


def test_a_non_finite_loss_skips_the_update_and_is_counted(tiny_model_dir):
    from tests.test_learner_group import fake_group, step

    group = fake_group(tiny_model_dir)
    rank = group.workers[0]._target
    before = {n: p.detach().clone() for n, p in rank.models.policy.module.named_parameters()}
    poisoned = [make_group(p, [float("nan"), 1.0, 0.0, 1.0], completion_len=4) for p in range(4)]
    metrics = step(group, poisoned)
    after = dict(rank.models.policy.module.named_parameters())
    assert metrics["nonfinite_updates"] == 1 and metrics["updates"] == 1
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing applied
    assert all(p.grad is None for p in after.values())  # and nothing left to leak into the next update
    metrics = step(group, [make_group(p, [1.0, 0.0, 1.0, 0.0], completion_len=4) for p in range(4)])
    assert metrics["nonfinite_updates"] == 0  # the next good step trains
    assert any(not torch.equal(before[n], p) for n, p in rank.models.policy.module.named_parameters())


def test_samples_come_from_different_groups():
    batch = Batch(groups=[make_group(p, [0.5, 1.0]) for p in range(3)], step=4, dropped=0, wait_s=0.0)
    records = sample_records(batch, step=4, count=4)
    assert [r["prompt_id"] for r in records] == [0, 1, 2, 0]
    assert {"prompt", "completion", "reward", "policy_version", "staleness", "finish_reason"} <= set(records[0])
    assert records[0]["staleness"] == 4 - records[0]["policy_version"]


def test_a_policy_that_became_uniform_stops_the_run_but_one_that_starts_near_uniform_does_not():
    import math

    top = math.log(64)
    said = []
    diverged = RunHealth(lr=1000.0, max_error_steps=3, max_nonfinite_steps=2, say=said.append)
    groups = [make_group(0, [1.0, 0.0])]
    diverged.check(0, groups, {"entropy": 0.99 * top, "uniform_entropy": top})  # a random init: near ln V
    diverged.check(1, groups, {"entropy": top, "uniform_entropy": top})
    with pytest.raises(RunCannotLearn, match="uniform over its vocabulary.*learner.lr = 1000"):
        diverged.check(2, groups, {"entropy": top, "uniform_entropy": top})
    assert "uniform" in said[0]
    from_start = RunHealth(lr=1e-3, max_error_steps=3, max_nonfinite_steps=2, say=said.append)
    for step in range(4):  # uniform from the first step (nothing was learned yet): not a divergence
        from_start.check(step, groups, {"entropy": top, "uniform_entropy": top})


def test_lora_on_a_policy_that_starts_near_uniform_is_warned_once():
    """A random-init model's first entropy is near ln V; its head and embeddings, frozen under LoRA, stay
    random: the run says so at its first step (and only with LoRA, and only when near uniform)."""
    import math

    top, said = math.log(64), []
    groups = [make_group(0, [1.0, 0.0])]
    random_init = RunHealth(lr=1e-3, max_error_steps=3, max_nonfinite_steps=2, say=said.append, lora=True)
    random_init.check(0, groups, {"entropy": 0.99 * top, "uniform_entropy": top})
    random_init.check(1, groups, {"entropy": 0.99 * top, "uniform_entropy": top})
    assert len(said) == 1 and said[0].startswith("warning: learner.lora on a policy that starts near uniform")
    assert "entropy 4.12 of ln V = 4.16" in said[0] and "output head and embeddings stay frozen" in said[0]
    warm = RunHealth(lr=1e-3, max_error_steps=3, max_nonfinite_steps=2, say=said.append, lora=True)
    warm.check(0, groups, {"entropy": 0.3 * top, "uniform_entropy": top})  # a warm-started model
    full = RunHealth(lr=1e-3, max_error_steps=3, max_nonfinite_steps=2, say=said.append)
    full.check(0, groups, {"entropy": 0.99 * top, "uniform_entropy": top})  # no LoRA: the head trains
    assert len(said) == 1


def test_lora_says_what_trains_and_what_a_publish_sends(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from learner.config import LoraConfig
    from learner.lora import describe_lora, lora_summary, with_lora

    lora = LoraConfig(rank=8, alpha=16)
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    summary = lora_summary(model)
    # the tiny Qwen2 (hidden 128, 2 layers, intermediate 256, 4 heads x 32, 2 KV heads): per layer r (in + out)
    # for q 8(128+128), k 8(128+64), v 8(128+64), o 8(128+128), gate 8(128+256), up 8(128+256), down 8(256+128)
    per_layer = 8 * (256 + 192 + 192 + 256 + 384 + 384 + 384)
    assert summary["trainable"] == 2 * per_layer == 32768 and summary["adapter_bytes"] == 4 * 32768
    line = describe_lora(lora, summary)
    assert line.startswith("LoRA: rank 8, alpha 16 on all-linear: 0.03M trainable of ")
    assert "output head and embeddings stay frozen; each publish sends 0.13 MB of adapters" in line
    assert lora_summary(model, "bfloat16")["adapter_bytes"] == 2 * 32768  # what a bfloat16 run publishes


def test_lora_dropout_is_warned_before_the_run():
    from launch.config import load_config

    base = ["model.path=m", "data.prompts=p", "reward.function=f"]
    cfg = load_config(None, [*base, "learner.lora={rank: 8, dropout: 0.05}"])
    assert any(w.startswith("learner.lora.dropout = 0.05: the sampler (vLLM) has no dropout") for w in cfg.warnings)
    assert not any("dropout" in w for w in load_config(None, [*base, "learner.lora={rank: 8}"]).warnings)
