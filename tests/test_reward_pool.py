"""The reward worker pool with real worker processes: a call past reward.timeout_s is abandoned and
counted, a reward that raises or a worker that exits scores 0 with its reason and the next call works,
builtin:math runs (its signal.alarm timeouts need a main thread), an event loop keeps running while
rewards are computed, and no worker outlives its pool or its actor."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from actors.config import RewardConfig
from actors.reward_pool import RewardPool

REWARDS = """
import os
import time


def reward(prompt, completion, row):
    if completion == "hang":
        time.sleep(3600)
    if completion == "raise":
        raise RuntimeError("bad completion")
    if completion == "exit":
        os._exit(3)
    if completion == "slow":
        time.sleep(0.5)
    return float(len(completion))
"""


@pytest.fixture
def reward_file(tmp_path) -> str:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return f"{path}:reward"


def _pool(spec: str, **kw) -> RewardPool:
    pool = RewardPool(RewardConfig(function=spec, **kw))
    pool.wait_ready()
    return pool


def _rewards(pool: RewardPool, completions: list[str]):
    scores = pool.score(["p"] * len(completions), completions, [{}] * len(completions))
    return [s.parts[0] for s in scores], [s.error for s in scores]


def test_a_hanging_call_is_abandoned_within_the_deadline_counted_and_the_next_call_works(reward_file):
    pool = _pool(reward_file, timeout_s=1.0)
    try:
        (old,) = pool._idle
        start = time.monotonic()
        values, errors = _rewards(pool, ["ab", "hang"])
        took = time.monotonic() - start
        assert values == [0.0, 0.0]  # the whole call is abandoned: every sample of it scores 0
        assert errors[0] == errors[1]
        assert errors[0].startswith("TimeoutError: reward call took longer than reward.timeout_s = 1 s")
        assert 1.0 <= took < 1.0 + 5.0  # the deadline, plus killing the worker
        assert old.proc.exitcode is not None and pool.replaced == 1  # killed and replaced
        assert _rewards(pool, ["abc"]) == ([3.0], [None])  # the replacement answers
    finally:
        pool.close()


def test_a_reward_that_hangs_on_every_call_costs_one_deadline_per_batch_not_one_per_call(reward_file):
    # 8 calls of one step, 2 workers, a reward that hangs on everything: one call at a time per worker
    # took 4 deadlines (a run stopped after 13 minutes); now the first two time out side by side and the
    # six that waited behind them are not attempted. The next batch is tried again.
    pool = _pool(reward_file, timeout_s=1.0, workers=2)
    try:
        calls = [(["p"], ["hang"], [{}])] * 8
        start = time.monotonic()
        scores = pool.score_many(calls)
        took = time.monotonic() - start
        errors = [call[0].error for call in scores]
        assert sum(e.startswith("TimeoutError: reward call took longer") for e in errors) == 2
        assert (
            sum(e.startswith("TimeoutError: not attempted: the last 2 reward calls each ran past") for e in errors) == 6
        )
        assert took < 2 * 1.0 + 5.0  # one deadline (and the kills), not four
        pool.wait_ready()  # the replacements have loaded
        assert _rewards(pool, ["abc"]) == ([3.0], [None])  # a later call is tried, and a good one answers
        mixed = pool.score_many([(["p"], ["ab"], [{}]), (["p"], ["hang"], [{}]), (["p"], ["abcd"], [{}])])
        assert [c[0].parts[0] for c in mixed] == [2.0, 0.0, 4.0]  # one hang alone spoils nothing else
    finally:
        pool.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_one_hang_never_costs_the_calls_queued_behind_it(reward_file, workers):
    # found by the review: with one worker (the default) a single hang made every call queued behind it
    # "not attempted"; it takes max(2, workers) timeouts in a row now
    pool = _pool(reward_file, timeout_s=1.0, workers=workers)
    try:
        calls = [(["p"], ["hang"], [{}])] + [(["p"], ["ab" * (i + 1)], [{}]) for i in range(4)]
        scores = pool.score_many(calls)
        assert scores[0][0].error.startswith("TimeoutError: reward call took longer")
        assert [s[0].parts[0] for s in scores[1:]] == [2.0, 4.0, 6.0, 8.0] and all(
            s[0].error is None for s in scores[1:]
        )
    finally:
        pool.close()


def test_a_reward_that_raises_scores_zero_with_its_error_and_a_worker_that_exits_is_replaced(reward_file):
    pool = _pool(reward_file)
    try:
        assert _rewards(pool, ["ab", "raise"]) == ([2.0, 0.0], [None, "RuntimeError: bad completion"])
        assert pool.replaced == 0  # an exception is the reward's, not the worker's
        values, errors = _rewards(pool, ["ab", "exit"])
        assert values == [0.0, 0.0]
        assert errors[0].startswith("RewardWorkerDied: the reward worker (pid ") and "exited with code 3" in errors[0]
        assert pool.replaced == 1
        assert _rewards(pool, ["abcd"]) == ([4.0], [None])
    finally:
        pool.close()


def test_builtin_math_runs_in_the_worker_with_its_alarm_timeouts():
    pool = _pool("builtin:math")
    try:
        completions = [r"\boxed{\frac{1}{2}}", r"\boxed{0.4}", "no answer"]
        scores = pool.score(["p"] * 3, completions, [{"answer": "0.5"}] * 3)
        assert [(s.parts, s.error) for s in scores] == [([1.0], None), ([0.0], None), ([0.0], None)]
    finally:
        pool.close()


def test_an_event_loop_keeps_running_while_its_rewards_are_computed(reward_file):
    pool = _pool(reward_file, workers=2)

    async def go():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        start = time.monotonic()
        first, second = await asyncio.gather(
            pool.score_async(["p"], ["slow"], [{}]), pool.score_async(["p"], ["slow"], [{}])
        )
        took = time.monotonic() - start
        ticker.cancel()
        return first[0].parts, second[0].parts, ticks, took

    try:
        first, second, ticks, took = asyncio.run(go())
        assert first == second == [4.0]
        assert ticks >= 20  # ~50 ticks of 10 ms fit in the 0.5 s the rewards took: the loop was free
        assert took < 0.95  # two workers: the two calls ran at once (0.5 s, not 1.0 s)
    finally:
        pool.close()


def test_close_ends_every_worker_and_a_closed_pool_scores_errors(reward_file):
    pool = _pool(reward_file, workers=2)
    workers = list(pool._all)
    pool.close()
    assert all(w.proc.exitcode is not None for w in workers)
    values, errors = _rewards(pool, ["ab"])
    assert values == [0.0] and errors[0].startswith("RuntimeError: the reward pool is closed")


def test_a_worker_ends_when_its_actor_dies_without_closing_the_pool(reward_file, tmp_path):
    """The actor's process is SIGKILLed (as ray.kill does): its workers notice within a second or two."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from actors.config import RewardConfig
        from actors.reward_pool import RewardPool

        if __name__ == "__main__":
            pool = RewardPool(RewardConfig(function={reward_file!r}))
            pool.wait_ready()
            print(" ".join(str(w.proc.pid) for w in pool._all), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return " Z " not in stat  # a zombie has exited
