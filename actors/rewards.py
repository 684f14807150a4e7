"""Reward functions: loading a user's ``file.py:function`` and scoring safely.

A reward function is called as ``fn(prompt, completion, row) -> float``. One that
raises, or returns something that is not a finite number, gives that sample a reward
of 0.0; the error is counted and reported, and the run goes on.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Callable

RewardFn = Callable[[str, str, dict], float]


class RewardSpecError(ValueError):
    """``reward.function`` does not name a loadable function."""


def load_reward_function(spec: str) -> RewardFn:
    """Resolve ``'path/to/file.py:function_name'`` or ``'builtin:<task>'`` to a callable."""
    if spec.startswith("builtin:"):
        from actors.tasks import get_task

        try:
            return get_task(spec.removeprefix("builtin:")).reward
        except KeyError as exc:
            raise RewardSpecError(f"reward.function {spec!r}: {exc.args[0]}") from None
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise RewardSpecError(
            f"reward.function {spec!r} must be 'path/to/file.py:function_name' or 'builtin:<task>'"
        )
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise RewardSpecError(f"reward.function file {path} does not exist; check the path before ':'")
    module_name = f"tandem_reward_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise RewardSpecError(f"reward.function file {path} failed to import: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name]
        raise RewardSpecError(f"{path} has no function {name!r}; functions defined there: {', '.join(found) or 'none'}")
    return fn


def score(fn: RewardFn, prompt: str, completion: str, row: dict[str, Any]) -> tuple[float, str | None]:
    """Call the reward function; return ``(reward, None)`` or ``(0.0, "Error: message")``."""
    try:
        value = fn(prompt, completion, row)
        reward = float(value)
    except Exception as exc:  # a user's function may raise anything; the run goes on
        return 0.0, f"{type(exc).__name__}: {exc}"
    if not math.isfinite(reward):
        return 0.0, f"ValueError: reward function returned {value!r}, not a finite number"
    return reward, None
