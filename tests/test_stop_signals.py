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

        def child_ends_on_sigterm(self) -> int:  # what a user's code starts here ends on SIGTERM as usual
            child = subprocess.Popen(["sleep", "30"])
            time.sleep(0.2)
            child.terminate()
            return child.wait(timeout=10)

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
        if ignore:
            assert ray.get(actor.child_ends_on_sigterm.remote(), timeout=30) == -signal.SIGTERM
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
    assert "B free on that filesystem; it needs about 3.8 MB); free space there" in line
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
        os.kill(os.getpid(), signal.SIGUSR1)  # outside the loop: every thread's stack on stderr, not the end

    asyncio.run(go())
    (text,) = said
    assert text.startswith("SIGUSR1: the driver waits on")
    assert "collect: waits_for_a_batch (test_stop_signals.py:" in text and "-> wait (locks.py:" in text


def _a_worker_with_a_pool(parent: int, out) -> None:
    """A reward worker's process (``become_worker``) whose user code runs a ``multiprocessing.Pool``."""
    import multiprocessing

    from actors.worker_process import become_worker

    become_worker(parent)
    os.kill(os.getpid(), signal.SIGTERM)  # the job's SIGTERM: the worker goes on
    time.sleep(0.2)
    started = time.monotonic()
    with multiprocessing.get_context("fork").Pool(2) as pool:  # its exit sends SIGTERM to the pool's processes
        squares = pool.map(abs, [-1, -2, -3])
    out.put((squares, time.monotonic() - started))


def test_a_reward_worker_survives_sigterm_and_its_users_pool_still_ends():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    worker = ctx.Process(target=_a_worker_with_a_pool, args=(os.getpid(), out))
    worker.start()
    try:
        squares, took = out.get(timeout=60)
    finally:
        worker.join(30)
        if worker.is_alive():
            worker.kill()
    assert squares == [1, 2, 3] and took < 10 and worker.exitcode == 0


def test_a_rank_that_dies_mid_checkpoint_is_not_a_full_disk_but_a_short_write_without_room_is(tmp_path, monkeypatch):
    from runtime import saving
    from runtime.saving import RunSaver

    checkpoints = tmp_path / "checkpoints"
    partial, previous = checkpoints / ".partial-step-4", checkpoints / "step-2"
    for folder, size in ((partial, 2_000_000), (previous, 5_000_000)):
        folder.mkdir(parents=True)
        with (folder / "model_states.pt").open("wb") as f:
            f.truncate(size)  # sparse: the size without the disk
    monkeypatch.setattr(saving, "free_bytes", lambda path: 1_500_000)  # 1.5 + 2.0 MB of room < 5 MB
    died = Exception("The actor died unexpectedly before finishing this task")  # a rank killed mid-write
    assert RunSaver._full(died, partial, "checkpoint step-4", [previous]) is None and partial.is_dir()
    short = RayTaskErrorLike(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2386112 vs 23"))
    monkeypatch.setattr(saving, "free_bytes", lambda path: 50_000_000)  # room enough: not the disk
    assert RunSaver._full(short, partial, "checkpoint step-4", [previous]) is None
    monkeypatch.setattr(saving, "free_bytes", lambda path: 1_500_000)
    full = RunSaver._full(short, partial, "checkpoint step-4", [previous])
    assert str(full).startswith(f"disk full: checkpoint step-4 could not be written to {checkpoints} (")
    assert "; it needs about 5.0 MB)" in str(full) and not partial.exists()  # its space given back
    partial.mkdir()
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    line = str(RunSaver._full(quota, partial, "checkpoint step-2", []))  # a first checkpoint: no size known
    assert line.startswith("disk quota exceeded: checkpoint step-2 could not be written to ") and "lfs quota" in line


def test_the_raylets_killed_workers_count_as_gone_before_the_raylet_reaps_them():
    """stop_ray kills the raylet's workers, and the raylet reaps them when it next looks: waiting for the
    reaping (psutil's wait_procs) held every run's end for seconds. A killed worker is gone as a zombie."""
    import subprocess
    import sys
    import time

    import psutil

    from launch.ray_session import _kill_below

    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"  # never reaps its child
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = psutil.Process(parent.pid).children()
        start = time.monotonic()
        _kill_below(parent.pid, wait_s=30.0)
        assert time.monotonic() - start < 15  # not the 30 s the zombie would have held it
        assert child.status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by its parent
    finally:
        parent.kill()
        parent.wait()
