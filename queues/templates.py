"""Prompt rows to the token ids the sampler sees: chat templates, raw text, a system prompt.

The driver renders each prompt once, to token ids, and the actors hand those ids to vLLM as they
are (``TokensPrompt``): the ids the learner trains on are the ids the sampler saw, with no
second tokenisation (that could drift: a BOS added twice, a space merged differently).

``data.chat_template``:

* ``auto`` (default): a tokenizer that has a chat template renders
  ``[system?] + messages`` with ``apply_chat_template(add_generation_prompt=True)``; one without
  renders the raw prompt text as vLLM would tokenise a plain string (``tokenizer(text)``);
* ``none``: always the raw prompt text (rows given as ``messages`` cannot be rendered so);
* a path to a ``.jinja`` file: that template replaces the tokenizer's own.

A row without ``messages`` becomes one user message holding its prompt. With raw text a
``data.system_prompt`` is put before the prompt, followed by a blank line.

``auto`` on a tokenizer without a template falls back to raw text silently here (the renderer runs in
every actor); ``fallback_note`` is the one line the start-up checks and ``tandem check-data`` print
about it, because a chat model's base checkpoint without a template is a common, quiet mistake.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from queues.prompts import DatasetError

RENDER_CHUNK = 2048  # rows per batched tokenizer call


class PromptRenderer:
    """Renders rows for one tokenizer; ``uses_template`` says whether a chat template is used and
    ``template`` which one: ``"tokenizer"`` (its own), ``"file"`` (``data.chat_template``'s) or ``"none"``."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str | None = None):
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.template_file: Path | None = None
        if chat_template not in ("auto", "none"):
            path = Path(chat_template).expanduser()
            if path.suffix != ".jinja" or not path.is_file():
                raise DatasetError(
                    f"data.chat_template {chat_template!r} is not 'auto', 'none' or an existing .jinja file; "
                    "fix the path or use auto"
                )
            tokenizer.chat_template = path.read_text()
            self.template_file = path
        self.uses_template = chat_template != "none" and bool(getattr(tokenizer, "chat_template", None))
        self.mode = chat_template

    @property
    def template(self) -> str:
        """``"file"``, ``"tokenizer"`` or ``"none"`` (raw text): where the prompts' template comes from."""
        if not self.uses_template:
            return "none"
        return "file" if self.template_file is not None else "tokenizer"

    def describe(self) -> str:
        """The template in words, for a person checking what the sampler will see."""
        return {
            "file": f"the chat template of {self.template_file} (data.chat_template)",
            "tokenizer": f"the chat template of the tokenizer of {self._model_name()}",
            "none": "raw text, no chat template"
            + (" (data.chat_template=none)" if self.mode == "none" else " (the tokenizer has none)"),
        }[self.template]

    def fallback_note(self) -> str | None:
        """One line when ``auto`` found no template and falls back to raw text; None otherwise."""
        if self.mode != "auto" or self.uses_template:
            return None
        return (
            f"data.chat_template=auto: the tokenizer of {self._model_name()} has no chat template; prompts are "
            "sent as raw text (set data.chat_template to a .jinja file to use one)"
        )

    def _model_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or "the model")

    @classmethod
    def load(cls, model_path: str, chat_template: str = "auto", system_prompt: str | None = None) -> PromptRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path), chat_template, system_prompt)

    def messages(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The conversation the template renders: the system prompt, then the row's messages (or prompt)."""
        chat = list(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
        if self.system_prompt and not any(m["role"] == "system" for m in chat):
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        return chat

    def text(self, row: dict[str, Any]) -> str:
        """The prompt as text: the rendered template (for logs and checks) or the raw prompt."""
        if self.uses_template:
            return self.tokenizer.apply_chat_template(self.messages(row), add_generation_prompt=True, tokenize=False)
        return f"{self.system_prompt}\n\n{row['prompt']}" if self.system_prompt else row["prompt"]

    def token_ids(self, row: dict[str, Any]) -> list[int]:
        return self.token_ids_many([row])[0]

    def token_ids_many(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        """Token ids of each row's prompt, in batched tokenizer calls."""
        if not self.uses_template:
            self._check_raw(rows)
            out: list[list[int]] = []
            for start in range(0, len(rows), RENDER_CHUNK):
                texts = [self.text(r) for r in rows[start : start + RENDER_CHUNK]]
                out.extend(self.tokenizer(texts, return_attention_mask=False)["input_ids"])
            return [list(ids) for ids in out]
        out = []
        for start in range(0, len(rows), RENDER_CHUNK):
            chats = [self.messages(r) for r in rows[start : start + RENDER_CHUNK]]
            rendered = self.tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=True)
            ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
            out.extend(list(x) for x in ids)
        return out

    def _check_raw(self, rows: list[dict[str, Any]]) -> None:
        chat = next((i for i, r in enumerate(rows) if r.get("messages")), None)
        if chat is None:
            return
        why = "data.chat_template is none" if self.mode == "none" else "the model's tokenizer has no chat template"
        raise DatasetError(
            f"row {chat} is a chat (messages) but {why}; set data.chat_template to auto with a chat model, "
            "or to a .jinja template file"
        )
