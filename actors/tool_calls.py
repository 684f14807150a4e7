"""Tool calls in a model's text, in its family's format (``rollout.episode.tool_format``).

A parser maps one model turn's text to ``(calls, error)``: ``calls`` the ``(name, arguments)`` pairs
found, in order; ``error`` a one-line description of a block that could not be read (the model sees it
as the call's answer). No call and no error means the turn is a final answer.

``hermes``: what Qwen2.5, Qwen3, Hermes and most chat templates' tool support write::

    <tool_call>
    {"name": "lookup", "arguments": {"key": "k7"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

Call = tuple[str, dict[str, Any]]
HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[list[Call], str | None]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (an unclosed last block is read
    to the end of the turn: a stop string may have cut its closing tag)."""
    calls: list[Call] = []
    for match in HERMES_BLOCK.finditer(text):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return calls, f"the tool call {body[:80]!r} is not JSON ({exc.msg} at character {exc.pos})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return calls, f'the tool call {body[:80]!r} has no "name"'
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return calls, f"the arguments of {call['name']!r} are not a JSON object"
        if not isinstance(arguments, dict):
            return calls, f"the arguments of {call['name']!r} are not a JSON object"
        calls.append((call["name"], arguments))
    return calls, None


TOOL_CALL_FORMATS: dict[str, Callable[[str], tuple[list[Call], str | None]]] = {"hermes": parse_hermes}
