"""Nothing of a local run listens beyond loopback (issue 26, item 7). Ray is started on 127.0.0.1;
the learner group's rendezvous store and the distributed weight channel's store are torch TCPStores,
which listen on every interface unless handed a bound socket. A real run with two learner ranks and
the distributed channel; once it trains, every listening TCP socket of its processes (this process
and its descendants: Ray's, vLLM's, the ranks') is listed and none may be a wildcard address. Ray's
cluster token (``~/.ray/auth_token``), which lets its holder run code in the cluster, is the owner's
alone (Ray writes it 0644). The finished run's Ray session folder (under /tmp/ray) is removed.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.runs import DEMO, train

pytestmark = pytest.mark.slow
WILDCARD = {"0.0.0.0", "::"}


def _address(hexaddr: str, v6: bool) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if v6:
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four host-order words
        return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)


def listening_sockets() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket of this network namespace."""
    found = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                found[int(fields[9])] = _address(fields[1], v6)
    return found


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def listeners_of(pids: set[int]) -> list[tuple[int, str, int, str]]:
    """(pid, address, port, command) of each listening socket the processes ``pids`` hold."""
    sockets, out = listening_sockets(), []
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:60]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in sockets:
                out.append((pid, *sockets[int(link[8:-1])], command))
    return out


def test_a_local_run_listens_on_loopback_only_and_keeps_its_token_private(tmp_path, tiny_model_dir, capfd):
    seen: list = []

    def look() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = list(tmp_path.glob("*/metrics.jsonl"))
            if metrics and len(metrics[0].read_text().splitlines()) >= 2:  # the stores and groups are up
                seen.extend(listeners_of(descendants(os.getpid())))
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=look, daemon=True)
    watcher.start()
    overrides = ["run.steps=6", "resources.learner.ranks=2", "weights.backend=distributed"]
    sessions = set(Path("/tmp/ray").glob("session_2*"))
    assert train(DEMO, tiny_model_dir, tmp_path, *overrides) == 0
    assert set(Path("/tmp/ray").glob("session_2*")) <= sessions  # the finished run's Ray folder is removed
    watcher.join(timeout=10)
    assert len({pid for pid, *_ in seen}) >= 5, seen  # the driver, Ray's servers, the actor, two ranks
    assert any("LearnerWorker" in command for *_, command in seen), seen
    wide = [entry for entry in seen if entry[1] in WILDCARD]
    assert not wide, f"listening on every interface: {wide}"
    assert all(address in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, address, _, _ in seen), seen
    token = Path.home() / ".ray" / "auth_token"  # Ray's cluster token: only its owner may read it
    assert token.is_file() and token.stat().st_mode & 0o077 == 0, oct(token.stat().st_mode)
    assert "Token authentication is enabled" not in capfd.readouterr().err  # Ray's line at every start
