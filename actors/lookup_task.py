"""The built-in ``lookup`` task: an answer a model can only know by calling a tool.

For the tools example (``tandem example tools``). A row asks for the code of a key; each row's code is
random, so a model that does not call ``lookup`` scores 1 in 1000 by chance. An episode::

    user       "code of k37?"
    assistant  '<tool_call>{"name": "lookup", "arguments": {"key": "k37"}}</tool_call>'
    tool       "512"                     (the row's code; another key: "Error: no key ...")
    assistant  "512"                     -> reward 1.0 (the environment's ``finish``)

``LookupEnvironment`` is ``builtin:lookup`` (``rollout.episode.environment``); the rows are the data
task ``builtin:lookup``. ``TOOLS_CHAT_TEMPLATE`` is ChatML with tools, shaped like Qwen2.5's (tool
results in a user turn inside ``<tool_response>``), with the tools listed by signature to keep a tiny
model's context short.
"""

from __future__ import annotations

import json
import random

from actors.environments import ToolEnvironment

TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}"
    "{%- for t in tools %}{{- ' ' + t.function.name + '(' + (t.function.parameters.properties | list | join(', ')) "
    "+ ')' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def lookup_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows: a key ``k0``-``k99`` and a random three-digit code, the same for the same ``seed``."""
    rng = random.Random(seed * 9173 + 11)
    rows = []
    for _ in range(n):
        key, code = f"k{rng.randrange(100)}", f"{rng.randrange(1000):03d}"
        rows.append({"prompt": f"code of {key}?", "key": key, "answer": code, "task": "lookup"})
    return rows


def tool_call_text(name: str, arguments: dict) -> str:
    """A call as the ``hermes`` format writes it (the warm-start's demonstrations)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def lookup_reward(prompt: str, completion: str, row: dict | None = None) -> float:
    """As a single-turn reward (the data task's): the completion is the code. Episodes are scored by the
    environment (``reward.function: environment``)."""
    return float(row is not None and completion.strip() == row["answer"])


class LookupEnvironment(ToolEnvironment):
    """``lookup(key)`` answers the row's code for the row's key; the final answer is scored exactly."""

    def lookup(self, key: str) -> str:
        """The code of a key."""
        if key != self.row.get("key"):
            raise KeyError(f"no key {key!r}")
        return self.row["answer"]

    tools = [lookup]

    def finish(self, row: dict, answer: str) -> float:
        return float(answer.strip() == row["answer"])


BUILTIN_ENVIRONMENTS = {"lookup": LookupEnvironment}
