"""The prompt an episode starts from, and whether its chat template shows the model the tools.

An episode's prompt is ``reset(row)``'s messages, after ``data.system_prompt`` when they hold no system
message, rendered once by the chat template with the environment's tools (``actors/episode.py``). A
template with no ``tools`` branch (ChatML, most base models' templates) renders the same text with or
without them: the model is trained to call tools it is never shown, and nothing fails. The check renders
one message both ways and compares; the start-up checks and ``tandem check-data`` run it.
"""

from __future__ import annotations

from typing import Any

PROBE = [{"role": "user", "content": "U"}]  # any message: a template that renders tools shows them for it


def with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """``messages`` with ``system_prompt`` first unless they begin with a system message (as ``MultiTurn``
    starts an episode)."""
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """The names in ``tool_schema`` schemas (``{"type": "function", "function": {"name": ...}}``)."""
    return [str(t.get("function", t).get("name", "?")) for t in tools]


def tools_problem(tokenizer, tools: list[dict[str, Any]], environment: str, template: str) -> str | None:
    """One line when ``tools`` are offered but the tokenizer's chat template (``template``, in words) does
    not render them, or cannot render a conversation at all; None when it shows them (or there are none)."""
    if not tools:
        return None
    offered = f"rollout.episode.environment {environment!r} offers the tools {', '.join(tool_names(tools))}"
    fix = (
        "use a chat template with a tools branch (data.chat_template=path.jinja, e.g. the model family's own), "
        "or a model built by `tandem tiny-model --chat DIR`"
    )
    try:
        with_tools = tokenizer.apply_chat_template(PROBE, tools=tools, add_generation_prompt=True, tokenize=False)
        without = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # no template at all, or one that raises on this conversation
        why = " ".join(str(exc).split())[:200]
        return f"{offered}, but {template} cannot render a conversation ({type(exc).__name__}: {why}); {fix}"
    if with_tools != without:
        return None
    return (
        f"{offered}, but {template} ignores tools (a prompt renders the same with and without them), so the model "
        f"would never see them; {fix}"
    )


def tools_header_tokens(tokenizer, tools: list[dict[str, Any]]) -> int:
    """The tokens the template spends on ``tools`` in every episode's prompt (one message rendered with and
    without them); 0 without tools or a template that cannot render them."""
    if not tools:
        return 0
    try:
        with_tools = tokenizer.apply_chat_template(PROBE, tools=tools, add_generation_prompt=True, tokenize=False)
        without = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False)
    except Exception:
        return 0
    count = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in (with_tools, without)]
    return max(count[0] - count[1], 0)
