"""Checks that need the model and the prompt rows, run before any process starts.

The config alone cannot tell whether ``engine.max_model_len`` fits the model, whether every
prompt leaves room for ``rollout.max_tokens`` of completion, or whether the run directory can
be written. Found later, these are a vLLM traceback inside an actor or a run that dies after
minutes of start-up; found here, each is one line naming the keys and the fix.

The model's config and tokenizer are read from the model directory or the local Hugging Face
cache only: offline, the hub client retries for over a minute, so a hub id not downloaded yet
skips the model checks (its engines download it later) rather than stall the command line.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from launch.config import TandemConfig
from queues.config import DataConfig
from queues.templates import PromptRenderer

TOKENIZE_CHUNK = 4096  # rows per tokenizer call: batched (fast) without holding every row's ids at once


class PreflightError(ValueError):
    """The model, the rows or the output directory cannot work with this config; one line with the fix."""


def preflight(cfg: TandemConfig, model_path: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check the output directory, the context length and every prompt's length; return the rows to train on
    (all of them, or those that fit when ``data.skip_long_prompts``). Raise ``PreflightError`` otherwise."""
    check_output_dir(cfg.run.output_dir)
    check_context_length(cfg.engine.max_model_len, model_path)
    return check_prompt_lengths(cfg, model_path, rows)


def check_output_dir(output_dir: str) -> None:
    """Create ``run.output_dir`` and write (then remove) a file in it."""
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tandem-preflight-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PreflightError(
            f"run.output_dir {out} cannot be created or written ({exc.strerror or exc}); "
            "set run.output_dir to a writable directory"
        ) from None


def model_max_positions(model_path: str) -> int | None:
    """The longest context the model's config allows, or None when the config cannot be read (a hub id
    not in the local cache) or names no limit. RoPE ``linear``/``dynamic`` scaling stretches it by its
    factor, as vLLM does."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("linear", "dynamic"):
        positions = int(positions * float(rope.get("factor") or 1.0))
    return positions


def check_context_length(max_model_len: int, model_path: str) -> None:
    """``engine.max_model_len`` must not exceed the model's ``max_position_embeddings``."""
    positions = model_max_positions(model_path)
    if positions is not None and max_model_len > positions:
        raise PreflightError(
            f"engine.max_model_len = {max_model_len} is above the model's max_position_embeddings = {positions} "
            f"({model_path}); set engine.max_model_len to at most {positions}"
        )


def prompt_lengths(model_path: str, rows: list[dict[str, Any]], data: DataConfig) -> list[int] | None:
    """Token count of each row's prompt as the actors will send it (rendered by ``queues/templates.py``:
    the chat template or the raw text, special tokens as the tokenizer adds them), or None when the
    tokenizer cannot be loaded (a hub id not cached). A row the template cannot render raises here."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None
    renderer = PromptRenderer(tokenizer, data.chat_template, data.system_prompt)
    lengths: list[int] = []
    for start in range(0, len(rows), TOKENIZE_CHUNK):
        lengths.extend(len(ids) for ids in renderer.token_ids_many(rows[start : start + TOKENIZE_CHUNK]))
    return lengths


def check_prompt_lengths(
    cfg: TandemConfig, model_path: str, rows: list[dict[str, Any]], what: str = "data.prompts"
) -> list[dict[str, Any]]:
    """Each prompt must leave ``rollout.max_tokens`` in ``engine.max_model_len``; with ``data.skip_long_prompts``
    the rows that do not are dropped and counted instead. Returns the rows kept."""
    max_model_len, max_tokens = cfg.engine.max_model_len, cfg.rollout.max_tokens
    limit = max_model_len - max_tokens  # the config rule keeps this >= 1
    if not rows:
        return rows
    lengths = prompt_lengths(model_path, rows, cfg.data)
    if lengths is None:
        return rows
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    if not too_long:
        return rows
    budget = f"engine.max_model_len = {max_model_len} - rollout.max_tokens = {max_tokens} = {limit} tokens"
    if not cfg.data.skip_long_prompts:
        first = too_long[0]
        others = f" (and {len(too_long) - 1} more rows)" if len(too_long) > 1 else ""
        raise PreflightError(
            f"the prompt of row {first} (0-based) of {what} is {lengths[first]} tokens, more than the "
            f"{budget} leave{others}; shorten it, raise engine.max_model_len, or set data.skip_long_prompts=true"
        )
    if len(too_long) == len(rows):
        raise PreflightError(
            f"every one of the {len(rows)} prompts of {what} is longer than the {budget} leave, so "
            "data.skip_long_prompts=true leaves nothing to train on; shorten them or raise engine.max_model_len"
        )
    skipped = set(too_long)
    print(
        f"tandem: skipped {len(skipped)} of {len(rows)} prompts of {what} longer than {limit} tokens "
        "(data.skip_long_prompts=true)",
        file=sys.stderr,
        flush=True,
    )
    return [row for i, row in enumerate(rows) if i not in skipped]
