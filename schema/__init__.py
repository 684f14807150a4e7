"""The base every config section is built on, and the error a bad config raises.

Neutral ground: every part of Tandem may import it, and it imports no other part. Each part declares its
own sections next to its code (``queues/config.py``, ``actors/config.py``, ``learner/config.py``,
``cluster/config.py``, ``runtime/``, ``observe/``); ``launch/config.py`` composes them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, and values are validated when assigned too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config problem, explained in one line that names the field and the fix."""
