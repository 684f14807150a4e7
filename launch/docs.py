"""Regenerate the config reference in ``docs/configuration.md`` from the typed config: ``python -m launch.docs``."""

from __future__ import annotations

import re
from pathlib import Path

from launch.config import config_reference

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BLOCK = re.compile(r"<!-- config-reference:start -->\n.*?\n<!-- config-reference:end -->", re.S)


def main() -> None:
    text = REFERENCE.read_text()
    new = f"<!-- config-reference:start -->\n{config_reference()}\n<!-- config-reference:end -->"
    REFERENCE.write_text(BLOCK.sub(lambda _: new, text))


if __name__ == "__main__":
    main()
