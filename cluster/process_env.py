"""Variables set in this process's environment for the length of a block, then put back."""

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
