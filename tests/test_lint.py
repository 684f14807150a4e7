"""The code passes the project's ruff configuration (pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    out = subprocess.run(
        [ruff, "check", str(ROOT), "--exclude", ".venv", "--output-format", "concise"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:]
