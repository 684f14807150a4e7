"""The process environment for the length of a block, then put back: variables, and the signals a
process started meanwhile inherits blocked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` in ``os.environ`` for the duration (what starts or is built meanwhile reads them);
    each previous value, or its absence, is restored after."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def signals_blocked(*signals: int) -> Iterator[None]:
    """``signals`` blocked in this thread for the duration: a process started meanwhile inherits the
    mask through ``exec`` and keeps them pending, never delivered, for its whole life (SIGKILL is
    never blocked); this thread gets them again after."""
    import signal

    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
