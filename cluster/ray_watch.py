"""Ray's own processes, watched: a run whose Ray is dying says so at once, in one line.

Two of Ray's processes matter to a run beyond its own actors:
  - the GCS server keeps the cluster's tables (nodes, actors, placement groups). Without it nothing
    can be placed, restarted or looked up, while calls between processes already connected still
    go through: a run went on at a third of its speed for a minute, until Ray aborted the driver
    ("Failed to connect to GCS within 60 seconds") with nothing saved. Its learner still holds a
    good state, so the run stops as for a signal (the step finishes, then checkpoint and model)
    and fails with the line here;
  - the raylet of the driver's node starts and tends that node's workers: when it ends, they end too,
    though not at once (a learner rank answered for seconds more). The run stops the same way, and
    when a rank is gone first the line still names the raylet, not the rank whose call failed.

A local session's GCS server and raylet are this process's children (``ray.init`` started them):
whether they ended is a ``poll()``, checked every ``LOCAL_EVERY_S``. On a cluster
(``resources.address``) the GCS answers a key lookup every ``PING_EVERY_S``; ``PING_MISSES`` lookups
in a row without an answer within ``PING_TIMEOUT_S`` mean it is gone, 20-30 s after its last answer (a
worker node's raylet is a lost node: ``runtime/supervise.py``; the raylet of the driver's node is not
watched there). Ray's processes wait ``gcs_rpc_server_reconnect_timeout_s`` for a dead GCS server before
they abort: 600 s in a local session and in ``tandem slurm``'s cluster, Ray's default 60 s on a cluster
started otherwise (set ``RAY_gcs_rpc_server_reconnect_timeout_s`` for its ``ray start``), which leaves a
step and a checkpoint 30 s. A GCS server that restarts (KubeRay's GCS fault tolerance) within 20 s is not
a death.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

LOCAL_EVERY_S = 0.5
PING_EVERY_S, PING_TIMEOUT_S, PING_MISSES = 5.0, 10.0, 2

WHAT = {
    "gcs_server": (
        "Ray's GCS server",
        "the cluster can no longer place, restart or find its processes",
    ),
    "raylet": (
        "the raylet of the driver's node",
        "Ray can start nothing more on that node, and the run's processes there end with it",
    ),
}


class RayDied(RuntimeError):
    """One of Ray's own processes ended under the run; the message says which and what it means."""


def object_store_full(exc: BaseException | None) -> str | None:
    """The line for Ray's object store found full (``ObjectStoreFullError``) or its spilling disk full
    (``OutOfDiskError``) anywhere in ``exc``'s chain; None for anything else."""
    import ray.exceptions

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ray.exceptions.OutOfDiskError):
            return (
                "Ray's object store spills to disk and that disk is full (Ray's session folder, under /tmp/ray or "
                "ray.init's _temp_dir): free space there"
            )
        if isinstance(exc, ray.exceptions.ObjectStoreFullError):
            return (
                "Ray's object store is full and could not spill (weights and batches pass through it): give the "
                "node more memory, or free what holds objects (a smaller rollout.prompts_per_step, fewer weight "
                "versions in flight: run.max_staleness)"
            )
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else (exc.__cause__ or exc.__context__)
    return None


def ended(name: str, pid: int | None, returncode: int | None) -> str:
    """The line for Ray's process ``name`` that ended with ``returncode`` (a negative one: a signal)."""
    what, meaning = WHAT[name]
    process = f"{what} (pid {pid})" if pid else what
    if returncode is None:
        how = "stopped answering"
    elif returncode < 0:
        how = f"was killed by {_signal_name(-returncode)}"
    else:
        how = f"exited with code {returncode}"
    return f"{process} {how}: {meaning}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class RayWatch:
    """``check()``: what of Ray's own processes has ended, in words (``ended``), or None. ``watch(on_death)``
    calls ``on_death`` once with that line when it happens."""

    def __init__(self, local: dict | None, gcs_client=None):
        self.local = local or {}  # process name -> subprocess.Popen (a local session's)
        self.gcs_client = gcs_client  # a cluster's: looked up every PING_EVERY_S
        self.death: str | None = None

    @classmethod
    def of_session(cls) -> RayWatch:
        """The watch of this driver's Ray: its children's processes when it started Ray, else the GCS."""
        import ray

        node = getattr(ray._private.worker, "_global_node", None)
        started = node.all_processes if node is not None else {}  # empty when joining a cluster
        local = {name: started[name][0].process for name in WHAT if started.get(name)}
        return cls(local) if local else cls(None, ray._private.worker.global_worker.gcs_client)

    def check(self) -> str | None:
        """The first of the local processes found ended (the GCS server first: the raylet follows it)."""
        if self.death is None:
            for name, process in self.local.items():
                if process.poll() is not None:
                    self.death = ended(name, process.pid, process.returncode)
                    break
        return self.death

    async def watch(self, on_death: Callable[[str], None]) -> None:
        """Until cancelled, or until Ray's process ends: then ``on_death(line)``, once."""
        if self.local:
            while self.check() is None:
                await asyncio.sleep(LOCAL_EVERY_S)
        elif self.gcs_client is not None:
            misses, answered = 0, time.monotonic()
            while misses < PING_MISSES:
                await asyncio.sleep(PING_EVERY_S)
                if await self._answers():
                    misses, answered = 0, time.monotonic()
                else:
                    misses += 1
            silent = time.monotonic() - answered
            self.death = f"Ray's GCS server did not answer for {silent:.0f} s: {WHAT['gcs_server'][1]}"
        else:
            return
        on_death(self.death)

    async def _answers(self) -> bool:
        try:
            await asyncio.wait_for(
                asyncio.to_thread(self.gcs_client.internal_kv_exists, b"tandem", None, timeout=PING_TIMEOUT_S),
                PING_TIMEOUT_S + 1,
            )
            return True
        except Exception:
            return False
