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
TORCH_WRITER = "inline_container.cc"  # torch.save's writer: a short write says "unexpected pos" there


class DiskFull(RuntimeError):
    """A write of the run failed for want of space; the message names the path and the space."""


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or anything it was raised from or wraps, is a full disk or quota."""
    return bool(_errnos(exc) & set(FULL_ERRNOS)) or any(text in _texts(exc) for text in FULL_TEXTS)


def quota(exc: BaseException | None) -> bool:
    """Whether the full disk in ``exc`` is a user's quota (EDQUOT), not the filesystem."""
    return "Disk quota exceeded" in _texts(exc) or errno.EDQUOT in _errnos(exc)


def torch_write_failed(exc: BaseException | None) -> bool:
    """Whether ``exc`` is (or wraps) a failure of torch's file writer: a short write on a full disk, among
    others. Only with too little room left does it mean a full disk."""
    return TORCH_WRITER in _texts(exc)


def _chain(exc: BaseException | None):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else (exc.__cause__ or exc.__context__)


def _texts(exc: BaseException | None) -> str:
    return "\n".join(str(e) for e in _chain(exc))


def _errnos(exc: BaseException | None) -> set[int]:
    return {e.errno for e in _chain(exc) if isinstance(e, OSError)}


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


def size_text(n: int | None) -> str:
    """Bytes in MB, or GB from 10 GB on."""
    if n is None:
        return "?"
    return f"{n / 1e9:.1f} GB" if n >= 10e9 else f"{n / 1e6:.1f} MB"


def disk_full(what: str, path: Path, need: int | None = None, at_least: bool = False, in_quota: bool = False):
    """The one line: ``what`` could not be written to ``path``, with the space free there now and ``need``
    (bytes: the last checkpoint's size, or ``at_least`` what was written before the disk filled). A user's
    quota (EDQUOT) is named as such: the filesystem's free space says nothing of it."""
    needs = f"; it needs {'more than' if at_least else 'about'} {size_text(need)}" if need else ""
    if in_quota:
        return DiskFull(
            f"disk quota exceeded: {what} could not be written to {path}{needs}; free space within your quota "
            "(`quota -s`, on Lustre `lfs quota -h -u $USER PATH`) or put run.output_dir elsewhere"
        )
    return DiskFull(
        f"disk full: {what} could not be written to {path} ({size_text(free_bytes(path))} free on that "
        f"filesystem{needs}); free space there, or put run.output_dir on a larger disk"
    )
