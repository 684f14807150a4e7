"""The long tail under in-flight updates: a prompt whose groups are too stale at every try is given up and said,
not generated forever (each try costs a long generation) and trained never without a word."""

from __future__ import annotations

import asyncio

from queues.bounded import LocalQueue
from queues.prompts import PromptStream
from runtime.admission import STALE_TRIES, Admission, Pace
from runtime.collector import BatchCollector
from runtime.ledger import PromptLedger
from runtime.signals import SignalWatch
from runtime.step_metrics import step_metrics
from tests.fakes import make_group


def _admission(rows: int = 8) -> Admission:
    ledger = PromptLedger(PromptStream([{"prompt": f"p{i}"} for i in range(rows)], seed=0, shuffle=False))
    return Admission(ledger, Pace(2, 1), LocalQueue("prompt", 16), lambda row: [1], 1.0)


def test_a_prompt_too_stale_at_every_try_is_given_up_and_a_new_one_takes_its_place():
    async def go():
        admission = _admission()
        for _ in range(3):
            admission.ledger.take()  # prompts 0, 1, 2 out
        verdicts = []
        for _ in range(STALE_TRIES):
            verdicts.append(await admission.too_stale(make_group(0, [0.0, 1.0], version=0)))
            if not verdicts[-1]:
                assert admission.ledger.take()[0] == 0  # generated again first
        return admission, verdicts

    admission, verdicts = asyncio.run(go())
    assert verdicts == [False] * (STALE_TRIES - 1) + [True]
    assert not admission.ledger.is_outstanding(0)  # given up: done, trained by no step, never generated again
    assert admission.ledger.take()[0] == 3  # the next new prompt, not 0
    assert admission.pace.dropped == STALE_TRIES  # every drop freed a place
    assert not admission.stale_tries  # a given-up prompt's count is let go


def test_the_collector_records_a_given_up_prompt_and_the_step_metrics_count_it():
    async def go():
        admission = _admission()
        for _ in range(4):
            admission.ledger.take()
        admission.stale_tries[0] = STALE_TRIES - 1  # its first try was already too stale
        q = LocalQueue("results", maxsize=10)
        long, short = make_group(0, [0.0, 1.0], version=0), make_group(1, [0.0, 1.0], version=3)
        q.put_many([long, short, make_group(2, [1.0, 0.0], version=3)], timeout=1)
        batch = await BatchCollector(q, {}, None, 5, admission=admission).collect(2, step=3, max_staleness=1)
        return batch, long

    batch, long = asyncio.run(go())
    assert [g.prompt_id for g in batch.groups] == [1, 2] and batch.dropped == 1
    length = sum(len(t.completion_token_ids) for t in long.trajectories) / len(long.trajectories)
    assert batch.starved == [(0, 3, length)]
    metrics = step_metrics(batch, {"tokens": 1.0}, 1.0)
    assert (metrics["starved_prompts"], metrics["starved_age_max"], metrics["starved_len_mean"]) == (1, 3, length)
    assert "starved_prompts" not in step_metrics(
        batch.__class__(groups=batch.groups, step=3, dropped=0, wait_s=0), {"tokens": 1.0}, 1.0
    )


def test_given_up_prompts_are_said_once_with_the_staleness_that_would_train_them():
    watch = SignalWatch()
    base = {"reward_std": 0.5, "completion_len_mean": 40.0, "trained_tokens": 10.0}
    assert watch.step(0, base) is None
    warning = watch.step(1, {**base, "starved_prompts": 2, "starved_age_max": 7, "starved_len_mean": 380.0})
    assert warning.startswith("step 2: 2 prompt(s) given up, their groups too stale to train at every try")
    assert "up to 7 versions old" in warning and "380 tokens long against 40 trained" in warning
    assert "run.max_staleness >= 7" in warning
    assert watch.step(2, {**base, "starved_prompts": 1, "starved_age_max": 9, "starved_len_mean": 300.0}) is None
    summary = watch.summary()
    assert summary["starved_prompts"] == 3 and summary["warnings"] == [warning]


def test_given_up_prompts_are_said_on_a_step_that_also_trained_nothing():
    """A long tail cut and masked (algorithm.shaping.mask_truncated) can train 0 tokens in the step that gives
    prompts up: both are said."""
    watch = SignalWatch()
    metrics = {"reward_std": 0.5, "completion_len_mean": 40.0, "trained_tokens": 0.0, "truncated_frac": 1.0}
    said = watch.step(0, {**metrics, "starved_prompts": 2, "starved_age_max": 4, "starved_len_mean": 300.0})
    first, second = said.split("\n")
    assert first.startswith("step 1: 2 prompt(s) given up") and second.startswith("step 1 trained 0 tokens")


def test_a_prompt_trained_or_left_out_forgets_its_stale_tries():
    async def go():
        admission = _admission()
        for _ in range(2):
            admission.ledger.take()
        for prompt in (0, 1):
            await admission.too_stale(make_group(prompt, [0.0, 1.0], version=0))
            admission.ledger.take()
        admission.trained([make_group(0, [0.0, 1.0], version=1)])
        await admission.no_signal(make_group(1, [1.0, 1.0], version=1))
        return admission

    assert not asyncio.run(go()).stale_tries
