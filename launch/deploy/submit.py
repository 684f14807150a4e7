"""Submit a training run to a running Ray cluster as a Ray job, and the pieces every launcher shares.

``tandem submit`` packages the working directory (Ray's job runtime_env ``working_dir``), runs
``tandem train`` on the cluster's head node and streams its logs back. The SLURM and Kubernetes
launchers (``launch/deploy/slurm.py``, ``launch/deploy/k8s.py``) reuse ``train_command`` and ``check_allocation``
so all three run the same command and refuse the same impossible plans.

Ray is imported inside the functions that talk to a cluster: rendering scripts needs no Ray.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cluster.placement import explain_sum, required_resources
from launch.config import TandemConfig, parse_overrides
from launch.deploy.package import Package, plan_package, staged
from launch.plan import build_plan

TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
PROBE_TIMEOUT_S = 3.0


class LaunchError(ValueError):
    """A launcher argument that cannot work, explained in one line with the fix."""


class SubmitError(RuntimeError):
    """Talking to the Ray cluster failed (unreachable address, job that ran past its deadline)."""


def train_command(
    config_path: str,
    overrides: list[str],
    address_arg: str | None,
    program: str = "tandem",
    resume_auto: bool = False,
) -> str:
    """The shell command that runs training: ``<program> train --config F [--resume auto] [resources.address=A]
    <overrides>``.

    ``address_arg`` is inserted verbatim (the SLURM script passes a shell variable); every user value is quoted.
    ``resume_auto``: the command continues the run an earlier start of it began (a scheduler's requeue or
    retry runs it again; ``launch/resume_auto.py``).
    """
    for key, _ in parse_overrides(overrides):
        if key == "resources.address":
            raise LaunchError("override resources.address is set by the launcher (it knows the cluster); drop it")
    parts = [program, "train", "--config", shlex.quote(config_path)]
    if resume_auto:
        parts += ["--resume", "auto"]
    if address_arg is not None:
        parts.append(address_arg)
    return " ".join(parts + [shlex.quote(o) for o in overrides])


def check_allocation(cfg: TandemConfig, *, machines: int, gpus_each: int, cpus_each: int, unit: str, fix: str) -> None:
    """Raise ``LaunchError`` when the plan's actors and learner ranks cannot fit on ``machines`` x (GPUs, CPUs).

    ``unit`` names a machine in the message ("nodes", "worker pods"); ``fix`` names the launcher flags to raise.
    """
    kinds = build_plan(cfg).kinds
    need = required_resources(kinds)
    for resource, each in (("GPU", gpus_each), ("CPU", cpus_each)):
        field = f"num_{resource.lower()}s"
        have = machines * each
        if need[resource] > have + 1e-9:
            raise LaunchError(
                f"the plan needs {need[resource]:g} {resource}s ({explain_sum(kinds, resource)}) but {machines} "
                f"{unit} x {each} {resource}s = {have:g}; {fix}, or lower resources.actors.count / "
                "resources.learner.ranks"
            )
        # Ray places each process on one machine: a process larger than a machine never starts.
        for kind in kinds:
            if getattr(kind, field) > each + 1e-9:
                raise LaunchError(
                    f"one {kind.label} asks for {getattr(kind, field):g} {resource}s but each of the {unit} "
                    f"has {each}; {fix}, or lower {kind.section}.{field}"
                )


def dashboard_url(address: str) -> str:
    """The job-server URL Ray will use: ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS`` win over ``address``
    (Ray's own rule); a bare ``host:port`` means http."""
    address = os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or address
    return address if "://" in address or address == "auto" else f"http://{address}"


def _probe(url: str) -> None:
    """Fail in seconds, not minutes, when nothing listens at an http(s) address (requests has no connect timeout)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return  # "auto" and ray:// addresses are resolved by Ray itself
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise SubmitError(_unreachable(url, exc)) from None


def _unreachable(url: str, exc: BaseException) -> str:
    return (
        f"no Ray job server at {url} ({type(exc).__name__}: {str(exc).strip() or 'no answer'}); start a cluster with "
        "`ray start --head` (its dashboard listens on port 8265) and pass --address http://<head>:8265"
    )


def _use_auth_token_if_any() -> None:
    """Send this machine's Ray auth token, as ``ray.init(address=...)`` does when ``RAY_AUTH_MODE`` is unset.

    ``ray start`` turns on token auth when a token exists (``~/.ray/auth_token``, written by any earlier
    local ``ray.init()``), but Ray's ``JobSubmissionClient`` sends the token only when ``RAY_AUTH_MODE=token``
    is set: without this, submitting to a cluster started on the same machine is refused with a 401.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token auth
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def build_job(
    config_path: str, overrides: list[str], working_dir: str, includes: list[str] | None = None
) -> tuple[str, Package]:
    """The Ray job: its entrypoint, and the files it ships (``launch/deploy/package.py``). The config travels
    inside the working directory.

    ``python -m launch.cli`` rather than the ``tandem`` script: the job's current directory is the uploaded
    working directory, and ``-m`` puts it first on ``sys.path``, so the uploaded code runs even where an
    older Tandem is installed. ``resources.address=auto`` joins the cluster the job runs in (Ray sets
    ``RAY_ADDRESS`` for the driver; an empty address would try to start a local Ray).
    """
    from launch.config import load_config

    root = Path(working_dir).resolve()
    if not root.is_dir():
        raise LaunchError(f"working dir {working_dir} is not a directory; pass the Tandem checkout to --working-dir")
    config = Path(config_path).resolve()  # relative paths are relative to here, like every local path
    if not config.is_relative_to(root):
        raise LaunchError(f"config {config_path} is outside the working dir {root}; move it inside so it ships")
    config_in_job = str(config.relative_to(root))  # the job runs in the uploaded copy of root
    entrypoint = train_command(config_in_job, overrides, "resources.address=auto", program="python -m launch.cli")
    dumped = load_config(config_path, overrides).model_dump(mode="json")
    try:
        return entrypoint, plan_package(root, config, dumped, includes or [])
    except FileNotFoundError as exc:
        raise LaunchError(str(exc)) from None


def submit(
    address: str,
    config_path: str,
    overrides: list[str],
    *,
    working_dir: str,
    follow: bool = True,
    timeout_s: float | None = None,
    includes: list[str] | None = None,
    dry_run: bool = False,
) -> str:
    """Submit ``tandem train --config F <overrides>`` to the Ray cluster at ``address`` (its dashboard,
    ``http://<head>:8265``) and return the job status: the final one when ``follow`` (logs are streamed
    until the job ends), else the status right after submission. With ``timeout_s`` the job is stopped
    and ``SubmitError`` raised once that many seconds pass. ``dry_run``: print the files that would
    ship, with sizes, and contact no cluster.
    """
    entrypoint, package = build_job(config_path, overrides, working_dir, includes)
    if dry_run:
        print(f"{package.describe()}\nwould run: {entrypoint}", flush=True)
        return "DRY_RUN"
    url = dashboard_url(address)
    _probe(url)
    from ray.exceptions import RayError
    from ray.job_submission import JobSubmissionClient

    _use_auth_token_if_any()
    try:
        client = JobSubmissionClient(url)
    except (ConnectionError, RuntimeError) as exc:
        raise SubmitError(_unreachable(url, exc)) from None
    except RayError as exc:  # AuthenticationError: a missing or wrong token, Ray's message says where to put it
        raise SubmitError(f"the Ray job server at {url} refused the request: {exc}") from None
    with staged(package) as directory:  # Ray packages and uploads it during the call
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": directory})
    print(f"shipped {len(package.files)} files ({sum(package.files.values()) / 1e6:.1f} MB)", flush=True)
    for path, why in sorted(package.left_out.items()):
        print(f"left out: {path} ({why})", flush=True)
    print(f"submitted job {job_id} to {url}: {entrypoint}", flush=True)
    if not follow:
        print(f"follow it with: ray job logs --address {url} --follow {job_id}", flush=True)
        return _status(client, job_id)
    status = follow_job(client, job_id, timeout_s)
    print(f"job {job_id}: {status}", flush=True)
    return status


def follow_job(client: Any, job_id: str, timeout_s: float | None) -> str:
    """Stream the job's logs to stdout until it ends; return its final status. ``client`` is a
    ``JobSubmissionClient`` (or a fake with ``tail_job_logs``, ``get_job_status`` and ``stop_job``)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        asyncio.run(asyncio.wait_for(_print_logs(client, job_id), timeout_s))
        # The log stream can close a moment before the status turns terminal.
        while (status := _status(client, job_id)) not in TERMINAL_STATUSES:
            if deadline is not None and time.monotonic() > deadline:
                raise asyncio.TimeoutError
            time.sleep(1)
        return status
    except asyncio.TimeoutError:
        client.stop_job(job_id)
        raise SubmitError(f"job {job_id} still running after {timeout_s:g}s (the submit timeout); stopped it") from None


async def _print_logs(client: Any, job_id: str) -> None:
    try:
        async for chunk in client.tail_job_logs(job_id):
            print(chunk, end="", flush=True)
    except RuntimeError as exc:  # the stream broke; the status poll still tells how the job ended
        print(f"tandem: log stream of {job_id} ended early ({exc}); waiting for the job to finish", file=sys.stderr)


def _status(client: Any, job_id: str) -> str:
    status = client.get_job_status(job_id)
    return str(getattr(status, "value", status))  # JobStatus is a str enum
