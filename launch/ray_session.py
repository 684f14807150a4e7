"""The run's Ray: started (a local session) or joined (``resources.address``), watched for the run's
processes only, and stopped so that none outlives the command.

A local session is marked for the watchdog (``cluster/reaper.py``), listens on loopback only, keeps Ray's
cluster token private, starts Ray's GCS server and raylet with SIGTERM blocked (only the driver acts on a
SIGTERM to every process of a job), and gives a dead GCS server's survivors ``GCS_GONE_S`` before Ray
aborts them (``cluster/ray_watch.py`` stops the run first).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import signal
import threading
import time
from pathlib import Path

from cluster import reaper
from cluster.placement import PlacementError, check_fits, local_ray_cpus
from cluster.process_env import signals_blocked
from launch.config import TandemConfig
from launch.plan import Plan


def start_ray(cfg: TandemConfig, plan: Plan, log_to_driver: bool = False, wait_s: float = 0.0) -> None:
    """Join ``resources.address`` or start a local Ray, then check the plan fits: at once, or (``wait_s``,
    a restart after a lost node) once the cluster has room again, within ``wait_s``."""
    import ray

    if ray.is_initialized():
        return
    kinds = plan.kinds
    # ray.init sets its own SIGTERM handler (sys.exit), which would replace the run's clean stop
    # (runtime/stopping.py): a preemption's SIGTERM must checkpoint like Ctrl-C, so ours is put back.
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        _init_ray(cfg, kinds, log_to_driver)
    finally:
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
    _quiet_worker_deaths()  # a cluster's worker deaths too
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            check_fits(kinds, ray.available_resources())
            return
        except PlacementError as exc:
            if time.monotonic() > deadline:
                raise
            if not said:
                print(f"tandem: waiting up to {wait_s:.0f}s for the cluster to have room again: {exc}", flush=True)
                said = True
            time.sleep(2.0)


def _private_token() -> None:
    """Ray writes its cluster token (``~/.ray/auth_token``) readable by every user of the machine:
    anyone holding it can run code in the cluster. Only its owner may read it."""
    path = Path.home() / ".ray" / "auth_token"
    try:
        if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except OSError:
        pass  # no token file (authentication off): nothing to protect


LOCAL_SESSIONS: list[str] = []  # the session folders of the local Rays this process started


def remove_local_sessions() -> None:
    """Delete the session folders (Ray's logs and spilled objects, under /tmp/ray) of the local Rays this
    process started and has shut down: a finished run's own logs are in its run directory, and the
    folders of run after run would fill the disk. A failed run keeps its folder for Ray's own logs."""
    import ray

    if ray.is_initialized():
        return
    while LOCAL_SESSIONS:
        session = Path(LOCAL_SESSIONS.pop())
        shutil.rmtree(session, ignore_errors=True)
        latest = session.parent / "session_latest"
        if latest.is_symlink() and not latest.exists():
            latest.unlink(missing_ok=True)


# a local Ray's processes that hold no run state, killed before Ray's shutdown (which kills the rest)
SIDE_PROCESSES = ("monitor", "dashboard", "log_monitor")  # what the driver's disconnect does not talk to


def stop_ray() -> None:
    """``ray.shutdown``. A local session's processes hold SIGTERM blocked (``_init_ray``), so Ray's own
    shutdown would wait a second for each before its SIGKILL: Ray's side processes are killed first, and
    once the driver has disconnected, Ray's shutdown kills the run's workers (done by now), the raylet and
    the GCS server without a SIGTERM (``_kill_at_once``). The command returns with no process of the run left."""
    import ray

    if not ray.is_initialized():
        return
    node = getattr(ray._private.worker, "_global_node", None)
    for name in SIDE_PROCESSES if node is not None else ():
        for info in node.all_processes.get(name, []):
            if info.process.poll() is None:
                info.process.kill()
                info.process.wait()
    if node is not None:  # the workers, the raylet and the GCS server: killed in Ray's shutdown, at once
        node.kill_all_processes = functools.partial(_kill_at_once, node, node.kill_all_processes)
    ray.shutdown()  # its disconnect joins the thread that prints the GCS server's news before anything dies


def _kill_at_once(node, kill_all_processes, check_alive: bool = True, allow_graceful: bool = False, wait=False):
    """Ray's ``Node.kill_all_processes``, called by ``ray.shutdown`` once the driver has disconnected: first
    every process below the raylet (the run's workers and the raylet's agents: none outlives the command),
    then Ray's own, with no SIGTERM first (the session's processes hold it blocked, and Ray gave each a second
    to answer it). The disconnect needs the raylet and the GCS server alive, and the raylet ends with its
    agents: killed before it, they cost it a 5-second timeout at the end of every run."""
    for info in node.all_processes.get("raylet", []):
        _kill_below(info.process.pid)
    return kill_all_processes(check_alive=check_alive, allow_graceful=False, wait=wait)


def _kill_below(pid: int, wait_s: float = 5.0) -> None:
    """SIGKILL every process below ``pid`` and wait for them (a raylet's workers outlived it by seconds)."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for process in below:
        try:
            process.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + wait_s
    while below and time.monotonic() < deadline:
        # a killed worker is gone once it is a zombie: the raylet, not this process, reaps it, when it next
        # looks (psutil's wait_procs waited for that reaping: seconds at the end of every run)
        below = [p for p in below if _running(p)]
        if below:
            time.sleep(0.02)


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


WORKER_DIED = "A worker died or was killed while executing a task"  # the raylet's paragraph begins so
GCS_TASK_EVENTS = 10_000  # tasks whose events the GCS server keeps (the newest; Ray's default: 100,000)
GCS_GONE_S = 600  # a local session's processes wait this long for a dead GCS server before Ray aborts them
RAYLET_DIED = "Raylet is terminated"  # ... and Ray's 20-line dump of a dead raylet's log (cluster/ray_watch.py says it)


def _quiet_worker_deaths() -> None:
    """At every worker death the raylet prints a ~700-character paragraph of possible causes on the
    driver's console, and at a raylet's death the last 20 lines of its log; the run says what died, what
    happened and where its log is in one line of its own (``runtime/supervise.py``,
    ``cluster/ray_watch.py``), so those are left out. Ray's other messages pass."""
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "tandem_filter", False):
        return

    def printer(data, ignore_prefix: bool):
        lines = data.get("lines", [])
        if data.get("pid") == "raylet" and any(WORKER_DIED in line or RAYLET_DIED in line for line in lines):
            return None
        return original(data, ignore_prefix)

    printer.tandem_filter = True
    ray_worker.print_to_stdstream = printer


def _init_ray(cfg: TandemConfig, kinds, log_to_driver: bool) -> None:
    import ray

    source = str(Path(__file__).resolve().parents[1])  # Ray's workers import Tandem from this checkout
    if cfg.resources.address:
        env = {"env_vars": {"PYTHONPATH": source}}
        ray.init(address=cfg.resources.address, log_to_driver=log_to_driver, runtime_env=env)
    else:
        from ray._private import ray_constants

        # Ray's servers bind to 127.0.0.1 only when the node address is loopback, and ray.init turns
        # even an explicit _node_ip_address="127.0.0.1" into the routable address unless clusters are
        # off: switched off for the call, a local Ray cannot be reached from other machines.
        clusters, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
        token = secrets.token_hex(8)
        # A local Ray's processes inherit PYTHONPATH from here instead of a job runtime env: the
        # workers Ray starts with the node then serve the queue actors (a runtime env would need
        # new ones, each started through Ray's runtime-env setup, seconds of start-up on 2 cores).
        python_path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        # Token authentication is Ray's default for a local cluster: its warning saying so at every
        # start is noise around the lines that matter.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        try:
            # SIGTERM blocked in every process Ray starts (as Ray blocks SIGINT in them): a SIGTERM to the
            # process group or to every process of a job (a pod stop, scancel) reaches only the driver,
            # which stops them in order after the checkpoint (runtime/stopping.py); SIGKILL still ends them.
            with reaper.marked_environment(token, PYTHONPATH=python_path), signals_blocked(signal.SIGTERM):
                ray.init(
                    num_cpus=local_ray_cpus(kinds, cfg.resources.local_num_cpus),
                    log_to_driver=log_to_driver,
                    include_dashboard=False,
                    # a dead GCS server aborts every Ray process after this long: room for the driver to
                    # finish the step, checkpoint and stop (cluster/ray_watch.py) instead of Ray's default 60 s
                    _system_config={
                        "gcs_rpc_server_reconnect_timeout_s": GCS_GONE_S,
                        # the GCS server keeps each task's events for Ray's state API: 100,000 by default,
                        # ~2 KB each, ~40 MB per 1,000 steps of the demo until then (bench/soak.py)
                        "task_events_max_num_task_in_gcs": GCS_TASK_EVENTS,
                    },
                )
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = clusters
        _private_token()
        # a watchdog that ends the session's processes if this process dies without ray.shutdown
        node = ray._private.worker._global_node
        LOCAL_SESSIONS.append(node.get_session_dir_path())
        gcs = node.all_processes.get(ray_constants.PROCESS_TYPE_GCS_SERVER)
        raylet = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET)
        reaper.start_watchdog(
            token,
            node.get_session_dir_path(),
            gcs[0].process.pid if gcs else None,
            raylet[0].process.pid if raylet else None,
        )
