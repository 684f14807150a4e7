"""The prompt source's config section (``data``), next to the queues that carry its rows."""

from __future__ import annotations

from pydantic import Field

from schema import Section


class DataConfig(Section):
    prompts: str = Field(
        description="Prompt rows: a .jsonl, .json, .parquet, .csv or .arrow file, a dataset directory, a Hugging "
        "Face dataset name, or 'builtin:<task>'. Every column reaches the reward function with the row."
    )
    split: str = Field("train", description="Split of a dataset directory or Hugging Face dataset.")
    subset: str | None = Field(None, description="Configuration (subset) of a Hugging Face dataset, e.g. 'main'.")
    prompt_field: str = Field(
        "prompt",
        description="Column holding the prompt text (e.g. 'question' for GSM8K), or a chat message list "
        "(verl / DAPO parquet), read like messages_field. A dotted path reaches into a nested column.",
    )
    answer_field: str = Field(
        "answer",
        description="Column holding the reference answer the reward checks, as row['answer']; a dotted path reaches "
        "into a nested column (e.g. 'reward_model.ground_truth' for verl / DAPO parquet). When set to another "
        "column, rows without a value are dropped at load.",
    )
    messages_field: str = Field(
        "messages",
        description="Column holding a chat conversation ([{role, content}, ...]), used instead of a prompt; a dotted "
        "path reaches into a nested column.",
    )
    system_prompt: str | None = Field(None, description="System message put before every prompt.")
    chat_template: str = Field(
        "auto",
        description="auto: render prompts with the tokenizer's chat template when it has one; none: raw prompt "
        "text; or a path to a .jinja template.",
    )
    num_rows: int = Field(2048, gt=0, description="Rows to generate for a built-in task.")
    shuffle: bool = Field(True, description="Shuffle the rows each epoch (seeded by run.seed).")
    skip_long_prompts: bool = Field(
        False,
        description="Drop (and count) rows whose prompt leaves fewer than rollout.max_tokens tokens in "
        "engine.max_model_len, instead of failing before the run starts.",
    )
