"""The process group under the distributed weight channel, and its deadline-bounded broadcast.

The group lives beside DeepSpeed's default group: it is built directly from a ``TCPStore``
(``ray.util.collective`` cannot be used when a learner rank is a member: it reuses the rank's
already-initialised default group and its rendezvous times out).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.process_env import environment


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` only (127.0.0.1 for a local run, the node's cluster address on
    a cluster), for ``bound_store``."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def bound_store(sock: socket.socket, world_size: int | None, timeout: timedelta, **options) -> dist.TCPStore:
    """The server side of a ``TCPStore`` on ``sock`` (``listening_socket``). torch's own server listens
    on every interface, unauthenticated; handed a bound socket it listens where that one does. The
    store owns the socket from here on."""
    host, port = sock.getsockname()[:2]
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach(), **options)


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


# NCCL's watchdog tears the whole process down when an operation misses its timeout (torch's default,
# TORCH_NCCL_ASYNC_ERROR_HANDLING=3): a stalled actor would end learner rank 0 before the push's own
# deadline could raise the error naming it. 2 aborts the weight group's communicator only, and the
# waiting call raises. A ProcessGroupNCCL reads the variable when it is built, so it is set around the
# weight group's construction alone: DeepSpeed's group on the same rank keeps torch's default.
NCCL_ERRORS_RAISE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def build_group(backend: str, store, rank: int, world_size: int, timeout_s: float, publisher_host: str):
    """A process group of its own over ``store`` (not the default group DeepSpeed uses)."""
    prefixed = dist.PrefixStore("group", store)
    if backend == "gloo":
        # Bind gloo to the interface that reaches the publisher (GLOO_SOCKET_IFNAME overrides), not
        # to whatever this host's name resolves to, which may be a loopback address on another node.
        interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
        options = dist.ProcessGroupGloo._Options()
        options._devices = [
            dist.ProcessGroupGloo.create_device(interface=interface)
            if interface
            else dist.ProcessGroupGloo.create_device(hostname=address_towards(publisher_host))
        ]
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("weights backend 'nccl' needs a CUDA build of torch; use 'gloo' on CPU")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        with environment(NCCL_ERRORS_RAISE):  # this group's own error mode; DeepSpeed's group keeps torch's
            return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"unknown process-group backend {backend!r}; use 'gloo' or 'nccl'")


def device_of(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def broadcast_all(group, buffers: Iterable[torch.Tensor], deadline: float, in_flight: int | None = None) -> None:
    """Broadcast every buffer from rank 0, each operation and each wait bounded by ``deadline``.

    ``in_flight``: at most this many operations outstanding while the next buffer is taken from
    ``buffers`` (a packer that reuses a ring of ``in_flight + 1`` buffers may overwrite the oldest:
    its operation has finished). None: all queued together (receivers' buffers are all their own)."""
    works: list = []
    for buf in buffers:
        if buf.numel() == 0:
            continue
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, left(deadline)
        works.append(group.broadcast([buf], opts))
        while in_flight is not None and len(works) > in_flight:
            _wait(works.pop(0), deadline)
    for work in works:
        _wait(work, deadline)


def _wait(work, deadline: float) -> None:
    if not work.wait(left(deadline)):
        raise TimeoutError("broadcast did not finish before the deadline")


def left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def abort(group) -> None:
    """Drop a group after a failure so no half-finished operation lingers."""
    _end(group, ("abort", "shutdown"))


def release(group) -> None:
    """End a group after its last operation: torch's NCCL group dropped without ``shutdown`` (or
    ``abort``) warns and can hang at exit."""
    _end(group, ("shutdown", "abort"))


def _end(group, methods: tuple[str, ...]) -> None:
    for method in methods:
        try:
            getattr(group, method)()
            return
        except Exception:
            continue


_SOURCE_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ")  # gloo's "[.../pair.cc:537] "
_LIBRARY_ADVICE = " This is typically caused by"  # gloo's closing paragraph ("... GLHF! ")


def short(exc: BaseException) -> str:
    """The cause of a failure in one short line: the first line of its text, without the library's
    source location and its closing advice."""
    text = str(exc).strip().splitlines()
    first = _SOURCE_LOCATION.sub("", text[0] if text else "").split(_LIBRARY_ADVICE)[0]
    return f"{type(exc).__name__}: {first}"[:300]


def wait_keys(store, keys: list[str], timeout_s: float) -> bool:
    """Block until every key is set (the store wakes the waiter: no polling); False at the deadline."""
    try:
        store.wait(keys, timedelta(seconds=max(0.001, timeout_s)))
        return True
    except dist.DistStoreError as exc:
        if "timeout" in str(exc).lower():
            return False
        raise
