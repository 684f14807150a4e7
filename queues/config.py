"""The base of every config section, and the prompt source's own section.

Each part of Tandem declares its config section next to its code (``learner/config.py``,
``actors/config.py``, ``cluster/config.py``); ``launch/config.py`` only composes them. The
shared base lives here because ``queues/`` is the one package every other part may import.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """A config section: unknown keys are errors, and values are validated when assigned too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(Section):
    prompts: str = Field(
        description='JSONL file of {"prompt": ..., "answer": ...} rows (other fields are passed to the '
        "reward function), or 'builtin:<task>' for a built-in task."
    )
    num_rows: int = Field(2048, gt=0, description="Rows to generate for a built-in task.")
    shuffle: bool = Field(True, description="Shuffle the rows each epoch (seeded by run.seed).")
    skip_long_prompts: bool = Field(
        False,
        description="Drop (and count) rows whose prompt leaves fewer than rollout.max_tokens tokens in "
        "engine.max_model_len, instead of failing before the run starts.",
    )
