"""Who acts on SIGTERM, and how a run sees Ray's own processes and its disk fail (the parts, on real
processes; whole runs: ``tests/test_real_stop_matrix.py``).

- ``signals_blocked``: a process started inside holds SIGTERM blocked for life (Ray's GCS server and
  raylet are started so), and the thread gets it back after;
- ``ignore_sigterm``: a Ray actor that took SIGTERM began Ray's graceful exit and stopped answering
  (this file shows it on a plain async actor); Tandem's actors ignore it and answer;
- ``RayWatch``: the line for a process of Ray's that ended, and the call it makes once;
- ``is_disk_full``/``disk_full``: a full disk in any of the forms it arrives in, and its one line.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster.process_env import signals_blocked
from cluster.ray_watch import RayWatch, ended, object_store_full
from runtime.disk import disk_full, is_disk_full
from schema.process import ignore_sigterm


def blocked(pid: int | str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("SigBlk")).split()[1], 16)


TERM_BIT = 1 << (signal.SIGTERM - 1)


def test_a_process_started_with_sigterm_blocked_keeps_it_blocked_and_survives_it():
    with signals_blocked(signal.SIGTERM):
        child = subprocess.Popen(["sleep", "30"])
    try:
        assert blocked(child.pid) & TERM_BIT and not blocked("self") & TERM_BIT  # this thread's is back
        child.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert child.poll() is None  # pending, never delivered
    finally:
        child.kill()
        child.wait()


def test_ignore_sigterm_outside_a_ray_worker_changes_nothing():
    before = signal.getsignal(signal.SIGTERM)
    ignore_sigterm()
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_actor_that_took_sigterm_stops_answering_and_tandem_s_actors_do_not(ray_session):
    import ray

    from queues.bounded import RayQueue

    @ray.remote
    class Plain:
        def __init__(self, ignore: bool):
            if ignore:
                ignore_sigterm()

        async def pid(self) -> int:
            return os.getpid()

        async def forever(self) -> None:
            await asyncio.sleep(3600)

    answers = {}
    for ignore in (False, True):
        actor = Plain.remote(ignore)
        pid = ray.get(actor.pid.remote(), timeout=60)
        actor.forever.remote()  # a call still running, as a generation actor's loop always is
        os.kill(pid, signal.SIGTERM)
        time.sleep(1.0)
        try:
            answers[ignore] = ray.get(actor.pid.remote(), timeout=5) == pid
        except ray.exceptions.GetTimeoutError:
            answers[ignore] = False
        ray.kill(actor)
    assert answers == {False: False, True: True}

    queue = RayQueue("prompt", maxsize=4)  # a real Tandem actor: the queues between the driver and the actors
    pid = ray.get(queue._actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
    os.kill(pid, signal.SIGTERM)
    time.sleep(1.0)
    queue.put_many(["x"], timeout=5)
    assert queue.get_batch(1, timeout=5) == ["x"]


def test_ray_watch_says_which_process_ended_and_how_once():
    sleeper = subprocess.Popen(["sleep", "30"])
    watch = RayWatch({"gcs_server": sleeper})
    assert watch.check() is None
    said: list[str] = []

    async def go():
        watching = asyncio.create_task(watch.watch(said.append))
        await asyncio.sleep(0.1)
        sleeper.kill()
        await asyncio.wait_for(watching, 5)

    asyncio.run(go())
    assert said == [
        f"Ray's GCS server (pid {sleeper.pid}) was killed by SIGKILL: the cluster can no longer place, restart or "
        "find its processes"
    ]
    assert watch.check() == said[0]
    assert ended("raylet", 7, 1).startswith("the raylet of the driver's node (pid 7) exited with code 1: Ray can ")


class RayTaskErrorLike(Exception):
    """What Ray hands the driver for a rank's failure: its text is the remote traceback, ``cause`` the error."""

    def __init__(self, cause: BaseException):
        super().__init__("ray::LearnerWorker.save_checkpoint() (pid=1) ...")
        self.cause = cause


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        RayTaskErrorLike(RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed "
                                      "writing file data/3: file write failed")),  # torch.save's
        RayTaskErrorLike(OSError(errno.ENOSPC, "No space left on device")),
    ],
)  # fmt: skip
def test_a_full_disk_is_recognised_in_every_form_it_arrives_in(exc):
    assert is_disk_full(exc)
    try:
        try:
            raise exc
        except Exception as inner:
            raise RuntimeError("while checkpointing") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)


def test_other_errors_are_not_a_full_disk():
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(RayTaskErrorLike(ValueError("bad value")))


def test_the_disk_full_line_names_the_path_the_space_free_and_the_space_needed(tmp_path):
    line = str(disk_full("checkpoint step-4", tmp_path / "checkpoints", 3_800_000))
    assert line.startswith(f"disk full: checkpoint step-4 could not be written to {tmp_path / 'checkpoints'} (")
    assert " MB free on that filesystem; it needs about 3.8 MB); free space there" in line
    assert "\n" not in line  # one line


def test_ray_s_object_store_and_spill_disk_full_are_one_line_each():
    import ray.exceptions

    class Wrapped(Exception):
        def __init__(self, cause):
            super().__init__("ray::publish ...")
            self.cause = cause

    assert "spills to disk and that disk is full" in object_store_full(Wrapped(ray.exceptions.OutOfDiskError()))
    assert object_store_full(ray.exceptions.ObjectStoreFullError()).startswith("Ray's object store is full")
    assert object_store_full(ValueError("x")) is None


def test_sigusr1_says_where_each_of_the_driver_s_tasks_waits():
    from runtime.stopping import StopRequest

    said: list[str] = []

    async def waits_for_a_batch(event: asyncio.Event) -> None:
        await event.wait()

    async def go():
        stop = StopRequest(said.append)
        stop.install()
        event = asyncio.Event()
        task = asyncio.create_task(waits_for_a_batch(event), name="collect")
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.sleep(0.2)
        event.set()
        await task
        stop.uninstall()

    asyncio.run(go())
    (text,) = said
    assert text.startswith("SIGUSR1: the driver waits on")
    assert "collect: waits_for_a_batch (test_stop_signals.py:" in text and "-> wait (locks.py:" in text
