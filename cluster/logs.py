"""Where a process's output goes: every actor and rank writes to its own file in the run directory,
and what lands there stays readable.

vLLM dumps its whole config and the scheduler's batch (every request's token ids) each time a
model step fails: ~10 KB a record, hundreds of them when the engine keeps failing, which buried
the traceback that says why. ``VllmDumpFilter`` keeps the first dump, cut short, and drops the
rest. When a process dies the driver appends what it knows of the death to the process's log
(``append_log``): Ray hands the exception to the caller, not to the log of the process that raised.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time

VLLM_DUMP_LOGGER = "vllm.logging_utils.dump_input"  # vllm/logging_utils/dump_input.py
DEATH_MARK = "stopped; the driver saw this error"  # the header of a death appended to a log
DUMP_CHARS = 600  # a dump record keeps this many characters (the config's head: model, dtype)
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its traceback headers
# the line between two exceptions of a chained traceback
CHAINED = re.compile(r"\n\s*(?:The above exception was the direct cause|During handling of the above)[^\n]*\n")


class VllmDumpFilter(logging.Filter):
    """Cut vLLM's engine-failure dumps: the first dump's records are kept, each cut to ``chars``
    characters; later dumps are dropped, one line saying so. A record that is not part of a dump
    (``Error preparing object to dump`` and its traceback) passes untouched."""

    def __init__(self, chars: int = DUMP_CHARS, dumps: int = 1):
        super().__init__()
        self.chars, self.dumps = chars, dumps
        self.seen = 0  # dumps begun ("Dumping input data ..." records)
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Dumping"):
            return True
        if str(record.msg).startswith("Dumping input data"):
            self.seen += 1
        if self.seen > self.dumps:
            self.dropped += 1
            if self.dropped > 1:
                return False
            record.msg, record.args = "(vLLM's later input dumps are left out: cluster/logs.py)", None
            return True
        text = record.getMessage()
        if len(text) > self.chars:
            text = f"{text[: self.chars]} ... [{len(text) - self.chars} characters cut]"
        record.msg, record.args = text, None
        return True


def quiet_vllm_dumps() -> None:
    """Install ``VllmDumpFilter`` on vLLM's dump logger (before or after vLLM is imported: its
    logging config leaves a child logger's filters alone)."""
    logger = logging.getLogger(VLLM_DUMP_LOGGER)
    if not any(isinstance(f, VllmDumpFilter) for f in logger.filters):
        logger.addFilter(VllmDumpFilter())


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
    quiet_vllm_dumps()


def append_log(path: str | os.PathLike, text: str, stamp: bool = True) -> None:
    """Append ``text`` (ANSI colours removed) to a log file, with the time on its first line.
    Opened and closed per call: the driver writes a few lines a step, after any close."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    text = ANSI.sub("", text).rstrip("\n")
    body = text.lstrip("\n")  # a message's leading blank lines come before its time, not after
    prefix = time.strftime("[%H:%M:%S] ") if stamp else ""
    with open(path, "a", encoding="utf-8") as log:
        log.write(text[: len(text) - len(body)] + prefix + body + "\n")


def last_error_line(path: str | os.PathLike, tail_bytes: int = 8192) -> str | None:
    """The last line of ``path``'s tail that reads like a raised exception (``SomeError: text``),
    after the last death the driver recorded there (``DEATH_MARK``: a replaced process writes on
    in the same log), or None: what a process that died without telling its caller wrote last."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.path.getsize(path) - tail_bytes))
            lines = log.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    marks = [i for i, line in enumerate(lines) if DEATH_MARK in line]
    lines = lines[marks[-1] + 1 :] if marks else lines
    found = [line.strip() for line in lines if EXCEPTION_LINE.match(ANSI.sub("", line))]
    return ANSI.sub("", found[-1]) if found else None


# ``ValueError: x``, ``vllm.v1.engine.exceptions.EngineDeadError: x``, ``torch.OutOfMemoryError``
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*\.)?[A-Z]\w*(Error|Exception|Exit|Interrupt|Fault)\b(:.*)?$")


def exception_lines(traceback_text: str) -> list[str]:
    """The ``Type: message`` line of each exception in a (chained) traceback's text, root cause
    first: the first line after each block's last frame (``  File ...`` and its indented source)."""
    found = []
    for block in re.split(
        r"\n\s*(?:The above exception was the direct cause|During handling of the above)[^\n]*\n", traceback_text
    ):
        lines = ANSI.sub("", block).strip("\n").splitlines()
        frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
        after = lines[frames[-1] + 1 :] if frames else lines
        candidates = [line for line in after if line.strip() and not line.startswith("    ")]
        if frames and candidates:
            found.append(candidates[0].strip())
        elif matching := [line.strip() for line in after if EXCEPTION_LINE.match(line.strip())]:
            found.append(matching[-1])
    return found
