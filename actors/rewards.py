"""Reward functions: loading a user's ``file.py:function`` and scoring safely.

A reward function is called as ``fn(prompt, completion, row)`` and returns a float, or,
for process supervision, a list of floats: one per reasoning step of the completion
(steps are separated by ``algorithm.estimator.step_delimiter``). One that raises, or returns
something else, gives that sample a reward of 0.0; the error is counted and reported,
and the run goes on. ``check_reward_function`` loads a user's file in a child process before
the run starts, so one that exits or hangs while it is imported fails in one line.
"""

from __future__ import annotations

import inspect
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.builtin_rewards import BUILTIN_REWARDS
from actors.config import RewardConfig
from actors.user_files import import_user_file

RewardFn = Callable[[str, str, dict], float]


class RewardSpecError(ValueError):
    """``reward.function`` does not name a loadable function."""


def load_reward_function(spec: str, cfg: RewardConfig | None = None) -> RewardFn:
    """Resolve ``'path/to/file.py:function_name'`` or ``'builtin:<name>'`` to a callable. A builtin is a
    reward of ``actors/builtin_rewards.py`` (built from ``cfg``, the reward section) or a data task's."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name in BUILTIN_REWARDS:
            return BUILTIN_REWARDS[name](cfg or RewardConfig(function=spec))
        from actors.tasks import BUILTIN_TASKS, get_task

        if name in BUILTIN_TASKS:
            return get_task(name).reward
        raise RewardSpecError(
            f"reward.function {spec!r}: unknown built-in task {name!r}; built-in rewards: "
            f"{', '.join(sorted(BUILTIN_REWARDS))}; tasks: {', '.join(sorted(BUILTIN_TASKS))}"
        )
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise RewardSpecError(f"reward.function {spec!r} must be 'path/to/file.py:function_name' or 'builtin:<task>'")
    module = import_user_file(path_text, "tandem_reward", "reward.function", RewardSpecError)
    path, module_name = Path(module.__file__), module.__name__
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name]
        raise RewardSpecError(f"{path} has no function {name!r}; functions defined there: {', '.join(found) or 'none'}")
    return fn


# What the child process of ``check_reward_function`` runs: load the spec, then say it got there.
_CHECK_MARK, _CHECK_OK = "tandem-reward-check-error: ", "tandem-reward-check-ok"
_CHECK_SCRIPT = f"""
import sys
from actors.rewards import RewardSpecError, load_reward_function
try:
    load_reward_function(sys.argv[1])
except RewardSpecError as exc:
    print({_CHECK_MARK!r} + str(exc), file=sys.stderr, flush=True)
    sys.exit(1)
print({_CHECK_OK!r}, flush=True)
"""


def check_reward_function(spec: str, timeout_s: float) -> None:
    """Raise ``RewardSpecError`` (one line) unless ``spec`` loads; a file that exits or hangs while it is
    imported cannot take the caller with it, because a ``file.py:function`` spec is imported in a child
    process that is killed after ``timeout_s`` seconds. ``builtin:`` specs are resolved here."""
    if spec.startswith("builtin:"):
        load_reward_function(spec)
        return
    root = str(Path(__file__).resolve().parents[1])  # the child imports this module from the same checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHECK_SCRIPT, spec],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,  # one process group: a timeout kills whatever the file started too
    )
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        raise RewardSpecError(
            f"reward.function {spec!r} did not finish importing within {timeout_s:g} s (reward.import_timeout_s); "
            "move slow or blocking work out of the file's top level, or raise reward.import_timeout_s"
        ) from None
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    marked = [line.removeprefix(_CHECK_MARK) for line in lines if line.startswith(_CHECK_MARK)]
    if marked:
        raise RewardSpecError(marked[-1])
    if child.returncode == 0 and _CHECK_OK in out.splitlines():
        return
    code = child.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    last = f" ({lines[-1]})" if lines else ""
    raise RewardSpecError(
        f"reward.function {spec!r} {how} while being imported{last}; a reward file must not exit at import "
        "time: put such code under `if __name__ == '__main__':`"
    )


def check_rewards(cfg: RewardConfig) -> None:
    """``check_reward_function`` on every function of the reward (each part's, and those its ``by_source``
    names), and that a local ``reward.model.path`` is a model directory (the model loads as its actor starts)."""
    for spec in dict.fromkeys(spec for part in cfg.function_parts for spec in part.specs):
        check_reward_function(spec, cfg.import_timeout_s)
    if cfg.model is not None:
        path = Path(cfg.model.path).expanduser()
        local = path.exists() or cfg.model.path.startswith((".", "/", "~")) or cfg.model.path.count("/") > 1
        if local and not (path / "config.json").is_file():
            raise RewardSpecError(
                f"reward.model.path {cfg.model.path} is not a Hugging Face model directory (no config.json); "
                "point it at a sequence-classification model"
            )


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        child.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a grandchild that left the group still holds the pipes
        child.kill()


def score(fn: RewardFn, prompt: str, completion: str, row: dict[str, Any]) -> tuple[float, str | None]:
    """Call the reward function; return ``(reward, None)`` or ``(0.0, "Error: message")``."""
    reward, steps, error = score_steps(fn, prompt, completion, row)
    if steps is not None:
        return 0.0, "ValueError: reward function returned a list; a float was expected"
    return reward, error


def score_steps(
    fn: RewardFn, prompt: str, completion: str, row: dict[str, Any]
) -> tuple[float, list[float] | None, str | None]:
    """Like ``score`` but a list of step rewards is allowed: ``(sum, steps, None)``."""
    try:
        value = fn(prompt, completion, row)
    except Exception as exc:  # a user's function may raise anything; the run goes on
        return 0.0, None, f"{type(exc).__name__}: {exc}"
    return as_reward(value)


def as_reward(value: Any) -> tuple[float, list[float] | None, str | None]:
    """A reward function's return value checked: ``(reward, steps, None)`` for a finite float or a list
    of finite floats (steps; reward is their sum), else ``(0.0, None, "ValueError: ...")``."""
    try:
        steps = [float(v) for v in value] if isinstance(value, (list, tuple)) else None
        reward = sum(steps) if steps is not None else float(value)
    except Exception as exc:  # not a number: e.g. None or a string
        return 0.0, None, f"{type(exc).__name__}: {exc}"
    if not math.isfinite(reward) or (steps is not None and not all(math.isfinite(v) for v in steps)):
        return 0.0, None, f"ValueError: reward function returned {value!r}, not finite numbers"
    return reward, steps, None


def step_end_tokens(token_ids: list[int], decode: Callable[[list[int]], str], delimiter: str) -> list[int]:
    """Index of the token that completes each step of the decoded completion.

    Steps end after each ``delimiter`` (or after every character when it is ''), and at
    the end of the text if the last step has no delimiter. Tokens after the last step's text that
    decode to nothing (EOS, other special tokens) belong to the last step: the decision to stop is
    credited like the step it ends, as with a single score. Costs O(T) decodes of prefixes.
    """
    text = decode(token_ids)
    if delimiter == "":
        ends = list(range(1, len(text) + 1))
    else:
        ends, pos = [], 0
        while (found := text.find(delimiter, pos)) != -1:
            pos = found + len(delimiter)
            ends.append(pos)
        if pos < len(text):
            ends.append(len(text))
    # a prefix that ends inside a multi-byte character decodes to replacement characters (one per byte
    # with byte-fallback tokenizers): count only the characters it completes
    prefix_lengths = [len(decode(token_ids[: i + 1]).rstrip("\ufffd")) for i in range(len(token_ids))]
    out, i = [], 0
    for end in ends:
        while i < len(prefix_lengths) - 1 and prefix_lengths[i] < end:
            i += 1
        out.append(i)
    if out:
        out[-1] = len(token_ids) - 1  # the last step owns the trailing EOS
    return out
