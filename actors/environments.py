"""The environment of a multi-turn episode: what a user writes to train a model that acts.

An environment is a class with two methods (``rollout.episode.environment: my_env.py:Calculator``)::

    class Calculator(ToolEnvironment):
        tools = [add]                       # plain functions; their JSON schemas go to the chat template

        def reset(self, row):               # the episode's first messages
            return [{"role": "user", "content": row["prompt"]}]

        def finish(self, row, answer):      # the model answered without a tool call: the episode's reward
            return float(answer.strip() == row["answer"])

``reset(row) -> list[message]`` starts an episode from a dataset row; ``step(action_text) -> StepResult``
takes one model turn's text and gives the next observation (a string: one ``tool`` message, or a list
of messages), a reward for that turn, ``done`` and an ``info`` dict. ``tools`` (optional) are offered
through the chat template's tool support (``apply_chat_template(tools=...)``).

``ToolEnvironment`` is the usual case: its ``step`` parses the model's tool calls
(``actors/tool_calls.py``), runs them and answers with their results; a turn without a call is the
final answer, scored by ``finish``. A malformed call, an unknown tool or a tool that raises is an
observation the model sees (``Error: ...``), counted as a tool error, never a crash.

Environments run in worker processes (``actors/env_pool.py``) with a deadline per step: one that hangs,
crashes or returns something that is not a ``StepResult`` ends its episode with a recorded reason.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.tool_calls import TOOL_CALL_FORMATS

Message = dict[str, Any]


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    observation: str | list[Message] = ""  # str: one "tool" message; a list: messages as they are
    reward: float = 0.0  # this turn's reward (summed over the episode for the 'environment' reward part)
    done: bool = False  # the episode ends after this turn
    info: dict[str, Any] = field(default_factory=dict)  # "tool_calls", "tool_errors" are counted when given

    def messages(self) -> list[Message]:
        if isinstance(self.observation, str):
            return [{"role": "tool", "content": self.observation}] if self.observation else []
        return list(self.observation)


class Environment:
    """The interface (subclass it or write the two methods yourself). One instance lives per episode."""

    tools: list[Callable] = []

    def reset(self, row: dict[str, Any]) -> list[Message]:
        raise NotImplementedError

    def step(self, action_text: str) -> StepResult:
        raise NotImplementedError


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The OpenAI-style schema of a plain function: its name, its docstring's first line, and each
    parameter's JSON type from its annotation (string when unannotated); parameters without a default are
    required. What ``apply_chat_template(tools=...)`` renders."""
    if hasattr(fn, "schema"):
        return fn.schema
    signature = inspect.signature(fn)
    hints = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != "return"}
    properties, required = {}, []
    for name, param in signature.parameters.items():
        if name == "self":  # a method of the environment (it sees the episode's state)
            continue
        hint = hints.get(name, str)
        hint = eval(hint, fn.__globals__) if isinstance(hint, str) else hint  # noqa: S307 (postponed annotations)
        properties[name] = {"type": _JSON_TYPES.get(hint, "string")}
        if param.default is inspect.Parameter.empty:
            required.append(name)
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": fn.__name__, "description": doc, "parameters": parameters}}


def _bound(env: Environment, fn: Callable) -> Callable:
    method = getattr(env, fn.__name__, None)
    return method if getattr(method, "__func__", None) is fn else fn


class ToolEnvironment(Environment):
    """An environment whose actions are tool calls; a turn without one is the final answer."""

    tool_format = "hermes"

    def __init__(self, **args: Any):
        self.args = args
        self.row: dict[str, Any] = {}
        # a tool defined as a method of the environment is called bound to this episode's instance
        self.by_name = {fn.__name__: _bound(self, fn) for fn in self.tools}

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    def finish(self, row: dict[str, Any], answer: str) -> float:
        """The reward of the final answer (0.0 unless overridden; the reward function may score instead)."""
        return 0.0

    def step(self, action_text: str) -> StepResult:
        calls, error = TOOL_CALL_FORMATS[self.tool_format](action_text)
        if error is None and not calls:
            return StepResult(reward=self.finish(self.row, action_text), done=True, info={"tool_calls": 0})
        results, errors = [], 0
        if error is not None:
            results.append(f"Error: {error}")
            errors += 1
        for name, arguments in calls:
            result = self._call(name, arguments)
            errors += result.startswith("Error: ")
            results.append(result)
        return StepResult(
            "\n".join(results), info={"tool_calls": len(calls) + (error is not None), "tool_errors": errors}
        )

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        fn = self.by_name.get(name)
        if fn is None:
            return f"Error: no tool named {name!r}; the tools are {sorted(self.by_name)}"
        try:
            value = fn(**arguments)
        except Exception as exc:  # the model called it wrongly, or the tool failed: the model sees why
            return f"Error: {name} raised {type(exc).__name__}: {exc}"
        return value if isinstance(value, str) else json.dumps(value)
