"""Regenerate the README's config reference from the typed config: ``python -m launch.docs``."""

from __future__ import annotations

import re
from pathlib import Path

from launch.config import config_reference

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"<!-- config-reference:start -->\n.*?\n<!-- config-reference:end -->", re.S)


def main() -> None:
    text = README.read_text()
    new = f"<!-- config-reference:start -->\n{config_reference()}\n<!-- config-reference:end -->"
    README.write_text(BLOCK.sub(lambda _: new, text))


if __name__ == "__main__":
    main()
