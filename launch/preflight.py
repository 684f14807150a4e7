"""Checks that need the model and the prompt rows, run before any process starts.

The config alone cannot tell whether ``engine.max_model_len`` fits the model, whether every
prompt leaves room for ``rollout.max_tokens`` of completion, whether the rows carry the answer the
reward needs, or whether the run directory can be written. Found later, these are a vLLM traceback
inside an actor or a run that dies after minutes of start-up (or, for a missing answer, after three
steps of failed rewards); found here, each is one line naming the keys and the fix.

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

from actors.config import RewardConfig
from launch.config import TandemConfig
from queues.config import DataConfig
from queues.templates import PromptRenderer

TOKENIZE_CHUNK = 4096  # rows per tokenizer call: batched (fast) without holding every row's ids at once
# Rewards known to read row["answer"]: without it every one of their calls fails (after start-up, steps
# of zero reward). A user's function may need it too, but only its own code can say so.
NEEDS_ANSWER = ("builtin:math",)


class PreflightError(ValueError):
    """The model, the rows or the output directory cannot work with this config; one line with the fix."""


def preflight(
    cfg: TandemConfig, model_path: str, rows: list[dict[str, Any]], tools: list[dict] | None = None
) -> list[dict[str, Any]]:
    """Check the output directory, the context length, the rows' answers, every prompt's length and that an
    episode's tools reach the model; return the rows to train on (all of them, or those that fit when
    ``data.skip_long_prompts``). Raise ``PreflightError`` otherwise. ``data.chat_template=auto`` falling
    back to raw text is said in one line. ``tools``: the environment's, when its start-up check ran already."""
    check_output_dir(cfg.run.output_dir)
    check_context_length(cfg.engine.max_model_len, model_path)
    check_gpu_memory(cfg, model_path)
    check_answers(cfg.reward, cfg.data, rows)
    renderer = load_renderer(model_path, cfg.data)
    note = renderer.fallback_note() if renderer is not None else None
    if note:
        print(f"tandem: {note}", file=sys.stderr, flush=True)
    rows = check_prompt_lengths(cfg, model_path, rows, renderer=renderer)
    check_episode_tools(cfg, model_path, tools, rows, renderer)
    return rows


def load_episode_tokenizer(model_path: str, data: DataConfig) -> tuple[Any, str] | None:
    """The tokenizer an episode is rendered with on the actors (``data.chat_template``'s file replacing its
    template, as ``launch/build.py`` passes it) and that template in words; None offline (not cached)."""
    from launch.build import episode_template

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None
    text = episode_template(data.chat_template)
    if text is None:
        return tokenizer, f"the chat template of the tokenizer of {model_path}"
    tokenizer.chat_template = text
    return tokenizer, f"the chat template {data.chat_template} (data.chat_template)"


def check_episode_tools(
    cfg: TandemConfig,
    model_path: str,
    tools: list[dict] | None = None,
    rows: list[dict[str, Any]] = (),
    renderer: PromptRenderer | None = None,
) -> None:
    """A multi-turn run whose environment offers tools needs a chat template that renders them: one that
    ignores them (ChatML) trains a model to call tools it never sees. The tools come from the environment
    class, loaded in a child process with its deadline (``actors/env_pool.py check_environment``)."""
    if cfg.rollout.kind != "multi_turn":
        return
    from actors.env_pool import check_environment
    from actors.episode_prompt import tools_header_tokens, tools_problem

    loaded = load_episode_tokenizer(model_path, cfg.data)
    if loaded is None:
        return
    tokenizer, template = loaded
    if tools is None:
        tools = check_environment(cfg.rollout.episode).tools
    if problem := tools_problem(tokenizer, tools, cfg.rollout.episode.environment, template):
        raise PreflightError(problem)
    if rows and renderer is not None:
        check_episode_room(cfg, tools_header_tokens(tokenizer, tools), prompt_lengths("", rows, cfg.data, renderer))


def check_episode_room(cfg: TandemConfig, header: int, lengths: list[int]) -> None:
    """Every episode's prompt carries the tools (``header`` tokens) besides its row's prompt: one that leaves
    the episode less than a model turn of ``engine.max_model_len`` ends by length before it can answer. All
    rows so: ``PreflightError``; some: a warning line."""
    turn = cfg.rollout.episode.turn_max_tokens or cfg.rollout.max_tokens
    context = cfg.engine.max_model_len
    short = sum(1 for n in lengths if context - (n + header) < turn)
    if not short:
        return
    line = (
        f"{short} of {len(lengths)} episode prompts (the row's prompt and the environment's tools, {header} tokens) "
        f"leave less than one model turn (rollout.episode.turn_max_tokens = {turn}) of engine.max_model_len = "
        f"{context}: those episodes end by length before they answer"
    )
    if short == len(lengths):
        raise PreflightError(f"{line}; raise engine.max_model_len or shorten the tools' descriptions")
    print(f"tandem: warning: {line}", file=sys.stderr, flush=True)


def row_functions(reward: RewardConfig, row: dict[str, Any]) -> list[str]:
    """The function each function part calls on ``row`` (the choice the reward workers make)."""
    return [part.function_for(row) for part in reward.function_parts]


def has_answer(row: dict[str, Any]) -> bool:
    return row.get("answer") is not None and str(row["answer"]).strip() != ""


def answer_problem(reward: RewardConfig, data: DataConfig, rows: list[dict[str, Any]], what: str) -> str | None:
    """One line when a reward that reads ``row["answer"]`` meets rows without one, naming the field and
    the fix and listing the columns a row has; None when every such row has an answer."""
    missing, need = [], None
    for i, row in enumerate(rows):
        needs = next((f for f in row_functions(reward, row) if f in NEEDS_ANSWER), None)
        if needs is not None and not has_answer(row):
            missing.append(i)
            need = need or needs
    if not missing:
        return None
    row = rows[missing[0]]
    guess = _answer_column(row)
    return (
        f"reward {need} needs each row's answer, but {len(missing)} of {len(rows)} rows of {what} have none "
        f"(first: row {missing[0]}, 0-based; data.answer_field = {data.answer_field!r}); its columns are: "
        f"{', '.join(row)}; set data.answer_field to the column holding the reference answer"
        + (f" (e.g. data.answer_field={guess})" if guess else "")
        + (" or drop the rows without one" if len(missing) < len(rows) else "")
    )


ANSWER_NAMES = ("answer", "ground_truth", "solution", "final_answer", "target", "label", "output", "response")


def _answer_column(row: dict[str, Any]) -> str | None:
    """A column (or a dotted path into a nested one, verl's ``reward_model.ground_truth``) that is
    probably the answer, to name in the fix; None when no name looks like one."""
    for name in ANSWER_NAMES:
        for column, value in row.items():
            if isinstance(value, dict) and name in value:
                return f"{column}.{name}"
            if column == name and value is not None:
                return column
    return None


def check_answers(reward: RewardConfig, data: DataConfig, rows: list[dict[str, Any]], what: str = "data.prompts"):
    """``answer_problem`` as a ``PreflightError``."""
    problem = answer_problem(reward, data, rows, what)
    if problem:
        raise PreflightError(problem)


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


def local_gpu_bytes() -> int | None:
    """The smallest GPU of this machine, in bytes, from ``nvidia-smi`` (no CUDA context in the driver); None
    without one."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
        return min(int(float(x)) for x in out.split()) << 20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def check_gpu_memory(cfg: TandemConfig, model_path: str, device: int | None = None) -> None:
    """A run with GPUs: each GPU's predicted peak (``tandem plan``'s memory table, ``cluster/memory.py``) must fit
    the device: this machine's GPU, else (a driver without one) 80 GiB, and then only a warning line."""
    res = cfg.resources
    if not (res.learner.num_gpus or res.actors.num_gpus):
        return
    from cluster.memory import GIB, MemoryPlanError, shape_of
    from launch.plan import check_memory, dense_attention, model_shape

    try:
        from transformers import AutoConfig

        shape = shape_of(AutoConfig.from_pretrained(model_path, local_files_only=True))
    except (OSError, ValueError, KeyError, AttributeError):
        shape = model_shape(cfg, model_path)
    if shape is None:
        return
    device = device or local_gpu_bytes()
    try:
        check_memory(cfg, shape, device or 80 * GIB, dense_attention(cfg))
    except MemoryPlanError as exc:
        if device is None:
            print(f"tandem: warning: {exc} (80 GiB GPUs assumed: this machine has none to ask)", file=sys.stderr)
            return
        raise PreflightError(f"{exc} (tandem plan prints the table)") from None


def check_context_length(max_model_len: int, model_path: str) -> None:
    """``engine.max_model_len`` must not exceed the model's ``max_position_embeddings``."""
    positions = model_max_positions(model_path)
    if positions is not None and max_model_len > positions:
        raise PreflightError(
            f"engine.max_model_len = {max_model_len} is above the model's max_position_embeddings = {positions} "
            f"({model_path}); set engine.max_model_len to at most {positions}"
        )


def load_renderer(model_path: str, data: DataConfig) -> PromptRenderer | None:
    """The prompt renderer the actors will use, from the model directory or the local cache only; None
    when the tokenizer cannot be loaded offline (a hub id not cached yet)."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None
    return PromptRenderer(tokenizer, data.chat_template, data.system_prompt)


def prompt_lengths(
    model_path: str, rows: list[dict[str, Any]], data: DataConfig, renderer: PromptRenderer | None = None
) -> list[int] | None:
    """Token count of each row's prompt as the actors will send it (rendered by ``queues/templates.py``:
    the chat template or the raw text, special tokens as the tokenizer adds them), or None when the
    tokenizer cannot be loaded (a hub id not cached). A row the template cannot render raises here."""
    renderer = renderer or load_renderer(model_path, data)
    if renderer is None:
        return None
    lengths: list[int] = []
    for start in range(0, len(rows), TOKENIZE_CHUNK):
        lengths.extend(len(ids) for ids in renderer.token_ids_many(rows[start : start + TOKENIZE_CHUNK]))
    return lengths


def check_prompt_lengths(
    cfg: TandemConfig,
    model_path: str,
    rows: list[dict[str, Any]],
    what: str = "data.prompts",
    renderer: PromptRenderer | None = None,
) -> list[dict[str, Any]]:
    """Each prompt must leave ``rollout.max_tokens`` in ``engine.max_model_len``; with ``data.skip_long_prompts``
    the rows that do not are dropped and counted instead. Returns the rows kept."""
    max_model_len, max_tokens = cfg.engine.max_model_len, cfg.rollout.max_tokens
    limit = max_model_len - max_tokens  # the config rule keeps this >= 1
    if not rows:
        return rows
    lengths = prompt_lengths(model_path, rows, cfg.data, renderer)
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
