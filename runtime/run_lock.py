"""One writer per run directory: an OS lock on ``RUN_DIR/.lock`` held for the whole run.

Two starts of one run at once (a SLURM requeue racing a retry, a second ``--resume`` typed by hand)
would each train its steps, append to the same records and overwrite the checkpoints and ``model/``.
The first ``tandem train`` takes an exclusive ``flock`` on the run's lock file and writes who holds it
(host, pid, start time); a second start fails at once with one line naming that holder. The kernel
drops the lock when the holder's process ends, however it ends (kill -9 included): no stale lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from datetime import datetime
from pathlib import Path

from schema import ConfigError

LOCK_NAME = ".lock"


class RunDirBusy(ConfigError):
    """Another process holds the run directory."""


class RunLock:
    def __init__(self, root: Path, fd: int | None):
        self.root, self._fd = root, fd

    @classmethod
    def acquire(cls, root: Path) -> RunLock:
        """The run directory's lock, or ``RunDirBusy`` naming who holds it."""
        path = Path(root) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the run directory {root} ({exc.strerror}); check its permissions"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirBusy(
                f"run directory {root} is in use by tandem (pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')}, since {holder.get('since', '?')}): one run writes it at a time; "
                "wait for that run to end or stop it, then start again"
            ) from None
        except OSError as exc:  # NFS without lockd, some FUSE or Lustre mounts: no locks at all
            os.close(fd)
            print(
                f"tandem: warning: the filesystem of {root} does not support locks ({exc.strerror}): a second start "
                "of this run at the same time would not be stopped",
                file=sys.stderr,
                flush=True,
            )
            return cls(Path(root), None)
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.now().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        return cls(Path(root), fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
