"""Where a process's output goes: every actor and rank writes to its own file in the run directory."""

from __future__ import annotations

import os
import sys


def redirect_output(log_path: str | None) -> None:
    """Send this process's stdout/stderr (vLLM's and DeepSpeed's logs too) to ``log_path``."""
    if not log_path:
        return
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
