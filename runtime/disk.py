"""A full disk, said in one line: what could not be written where, the space free there, and what it needed.

A disk fills during a checkpoint more than anywhere (it is the largest write of a run). The error
arrives in many forms: ``OSError`` ENOSPC or EDQUOT from Python, torch's ``file write failed`` from a
rank's ``torch.save`` (wrapped by Ray in a ``RayTaskError`` whose ``cause`` is the original), and again
from every later write (driver.log, summary.json). ``is_disk_full`` recognises them all; the
checkpoint's partial directory is removed before the line is said, which gives its space back for
summary.json; the previous checkpoint is whole and a resume after freeing space is exact.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "file write failed")


class DiskFull(RuntimeError):
    """A write of the run failed for want of space; the message names the path and the space."""


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or anything it was raised from or wraps, is a full disk or quota."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        if any(text in str(exc) for text in FULL_TEXTS):
            return True
        cause = getattr(exc, "cause", None)  # a Ray task's original error
        exc = cause if isinstance(cause, BaseException) else (exc.__cause__ or exc.__context__)
    return False


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    for parent in (path, *path.parents):
        try:
            return shutil.disk_usage(parent).free
        except OSError:
            continue
    return None


def tree_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (0 when it is gone)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def disk_full(what: str, path: Path, need: int | None = None) -> DiskFull:
    """The one line: ``what`` could not be written to ``path``, with the space free there now and ``need``
    (bytes, when known: the last checkpoint's size)."""
    needs = f"; it needs about {_mb(need)}" if need else ""
    return DiskFull(
        f"disk full: {what} could not be written to {path} ({_mb(free_bytes(path))} free on that filesystem"
        f"{needs}); free space there, or put run.output_dir on a larger disk"
    )
