"""The elastic fleet's parts without Ray (``runtime/fleet.py``, ``ActorPool.resize``): the request file, its
watch, and the pool growing, shrinking and handing a leaving actor's prompts back exactly once. On a real
multi-node cluster: ``tests/test_real_fleet.py``."""

from __future__ import annotations

import asyncio
import os

import pytest

from queues.bounded import LocalQueue
from queues.messages import PromptRequest
from queues.prompts import PromptStream
from runtime.admission import Admission, Pace
from runtime.fleet import FLEET_FILE, FleetError, FleetWatch, request_size, requested_size
from runtime.ledger import PromptLedger
from runtime.supervise import ActorPool
from tests.fakes import FakeStarter
from tests.test_recovery_parts import FakeRun

ROWS = [{"prompt": f"p{i}"} for i in range(5)]


def test_a_request_is_written_whole_and_read_back(tmp_path):
    with pytest.raises(FleetError, match="not a run directory"):
        request_size(tmp_path, 2)
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(FleetError, match="at least one"):
        request_size(tmp_path, 0)
    assert requested_size(tmp_path) is None
    request_size(tmp_path, 3)
    assert requested_size(tmp_path) == 3 and not list(tmp_path.glob("*.partial"))
    (tmp_path / FLEET_FILE).write_text('{"actors": "many"}')
    assert requested_size(tmp_path) is None


def test_the_watch_takes_each_new_request_once_and_not_one_from_before_the_start(tmp_path):
    (tmp_path / "config.yaml").write_text("{}")
    request_size(tmp_path, 5)  # a resumed run's old request: the run starts with its config's count
    sizes, said = [], []

    async def resize(size):
        sizes.append(size)

    async def go(refused, stamp):
        watch = FleetWatch(tmp_path, resize, said.append, refused, every_s=0.01)
        task = asyncio.create_task(watch.watch())
        await asyncio.sleep(0.05)
        request_size(tmp_path, 2)
        os.utime(tmp_path / FLEET_FILE, ns=(stamp, stamp))  # a new stamp even within the filesystem's resolution
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(go(None, 1))
    assert sizes == [2] and not said
    asyncio.run(go("run.schedule=colocated: its actors live on the learner's devices", 2))
    assert sizes == [2] and said == ["tandem scale: the fleet cannot change: run.schedule=colocated: its actors "
                                     "live on the learner's devices"]  # fmt: skip


def test_the_pool_grows_then_shrinks_newest_first_handing_back_each_prompt_once():
    async def go():
        ledger = PromptLedger(PromptStream(ROWS * 4, seed=0, shuffle=False))
        prompts, results = LocalQueue("prompt", 100), LocalQueue("results", 100)
        for _ in range(6):
            prompt_id, row = ledger.take()
            prompts.put_many([PromptRequest(prompt_id, row, 0)], timeout=1)
        loop = asyncio.get_running_loop()
        loops = [loop.create_future() for _ in range(4)]
        starter, pace = FakeStarter(loops), Pace(3, 1)
        admission = Admission(ledger, pace, prompts, lambda row: [1], 1.0)
        pool = ActorPool(["old-0"], ["actor-0"], starter, FakeRun(), admission, (prompts, results), max_restarts=1)
        killed = []
        import runtime.supervise as supervise

        supervise._kill = killed.append
        await pool.resize(3)
        assert starter.started == [1, 2] and pool.live == ["actor-0", "actor-1", "actor-2"]
        assert sorted(pool.refs) == ["actor-0", "actor-1", "actor-2"]
        prompts.get_batch(2, 1, taker="actor-2")  # actor-2 holds prompts 0 and 1, actor-1 holds 2
        prompts.get_batch(1, 1, taker="actor-1")
        await pool.resize(1)
        assert killed == ["new-2", "new-1"] and pool.live == ["actor-0"]  # the newest leaves first
        for future, name in ((loops[2], "actor-2"), (loops[1], "actor-1")):  # their loops end: killed
            future.set_exception(RuntimeError("The actor died unexpectedly"))
            await pool.ended(next(f for f, n in pool.loops.items() if n == name))
        assert sorted(ledger.regenerate) == [0, 1, 2] and pace.dropped == 3  # each held prompt once
        assert pool.total_restarts == 0 and sorted(pool.refs) == ["actor-0"]  # not replaced, not waited for
        assert "fleet: 3 -> 1 generation actors (tandem scale)" in pool.run.said
        await pool.resize(2)  # and back: the next free name
        assert starter.started == [1, 2, 3] and pool.live == ["actor-0", "actor-3"]
        for future in loops:
            future.cancel()

    asyncio.run(go())


def test_a_joined_actor_with_nowhere_to_start_again_leaves_the_fleet_instead_of_stopping_the_run():
    class NoRoom(FakeStarter):
        async def start(self, index):
            if self.started:
                raise RuntimeError("actor-1 did not start within 600s (run.startup_timeout_s)")
            return await super().start(index)

    async def go():
        ledger = PromptLedger(PromptStream(ROWS, seed=0, shuffle=False))
        prompts, results = LocalQueue("prompt", 100), LocalQueue("results", 100)
        loop = asyncio.get_running_loop()
        loops = [loop.create_future() for _ in range(2)]
        starter = NoRoom(loops)
        admission = Admission(ledger, Pace(3, 1), prompts, lambda row: [1], 1.0)
        pool = ActorPool(["old-0"], ["actor-0"], starter, FakeRun(), admission, (prompts, results), max_restarts=3)
        import runtime.supervise as supervise

        supervise._kill = lambda actor: None
        await pool.resize(2)
        loops[1].set_exception(RuntimeError("its node was lost"))
        await pool.ended(next(f for f, n in pool.loops.items() if n == "actor-1"))  # returns at once ...
        assert pool.live == ["actor-0", "actor-1"] and len(pool.starting) == 1
        await asyncio.gather(*pool.starting)  # ... and it is started again beside the run: no ActorFailed
        assert pool.live == ["actor-0"] and pool.run.said[-1].endswith("; 1 actor(s) go on")
        assert pool.run.said[-1].startswith("fleet: actor-1 could not be started again (RuntimeError: actor-1 did")
        loops[0].cancel()

    asyncio.run(go())
