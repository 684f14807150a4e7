"""Importing a user's Python file named in a config (a reward function's, an environment's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_user_file(path_text: str, prefix: str, key: str, error: type[Exception]) -> ModuleType:
    """The module of the file ``path_text`` (relative to the working directory), imported once under a
    name starting with ``prefix``; ``error`` (one line naming ``key``) when it is missing or fails to import."""
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        relative = (
            ""
            if Path(path_text).expanduser().is_absolute()
            else " (a relative path is taken from the directory tandem runs in)"
        )
        raise error(f"{key} file {path} does not exist; check the path before ':'{relative}")
    module_name = f"{prefix}_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise error(f"{key} file {path} failed to import: {type(exc).__name__}: {exc}") from None
    return module
