"""The architecture's import rules (``[tool.importlinter]`` in pyproject.toml) hold, and they bite:
a deliberately added forbidden import in a copy of the tree is reported as a broken contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schema", "queues", "actors", "learner", "cluster", "runtime", "observe", "launch")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    env = {**os.environ, "PYTHONPATH": str(root)}  # the packages under ``root`` are the ones analysed
    return subprocess.run(
        [exe, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_import_rules_hold():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "10 kept, 0 broken" in out.stdout


@pytest.mark.parametrize(
    ("module", "forbidden", "contract"),
    [
        ("actors/spec.py", "import learner.config", "actors and learner never import each other"),
        ("learner/shard.py", "import actors.config", "actors and learner never import each other"),
        ("queues/messages.py", "import cluster.channel", "queues imports no other part of Tandem"),
        ("schema/__init__.py", "import queues.config", "schema imports no other part of Tandem"),
        ("runtime/ledger.py", "import launch.config", "nothing imports launch"),
        ("observe/report.py", "import launch.train", "nothing imports launch"),
        ("runtime/supervise.py", "import actors.spec", "the loop's runtime imports no role"),
        ("observe/live.py", "import learner.group", "observability imports no role"),
        ("observe/run_stats.py", "import runtime.ledger", "observability imports no role"),
        ("cluster/reaper.py", "import runtime.stopping", "cluster knows no roles"),
        ("launch/train.py", "import launch.deploy.submit", "the training program imports neither"),
        ("launch/deploy/k8s.py", "import launch.tools.export", "deployment and tools never import each other"),
        ("cluster/placement.py", "import launch.plan", "nothing imports launch"),
        ("cluster/logs.py", "import actors.spec", "cluster knows no roles"),
        ("learner/algorithms/kl.py", "import ray", "the math and the config sections import neither"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, forbidden, contract):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{forbidden}  # noqa: E402, F401\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0, out.stdout[-3000:]
    broken = [line for line in out.stdout.splitlines() if line.endswith("BROKEN")]
    assert [line for line in broken if line.startswith(contract)], out.stdout[-3000:]


def test_a_training_run_needs_neither_the_report_nor_tensorboard_installed():
    # matplotlib (the report) and tensorboard (a tracker) are extras: the program that trains imports neither
    script = (
        "import sys; import launch.cli, launch.run, launch.train, launch.assemble, observe.run_dir, observe.trackers; "
        "print(sorted(m for m in ('matplotlib', 'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_reaper_runs_alone_on_the_standard_library():
    """cluster/reaper.py is also the session's watchdog, started as ``python -I -S reaper.py``: isolated,
    no site-packages, not a package member. An import of the project (or of anything installed) there
    leaves every Ray process of a killed driver running (a refactor once did)."""
    import ast

    path = Path(__file__).resolve().parents[1] / "cluster" / "reaper.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported - set(sys.stdlib_module_names)
    done = subprocess.run([sys.executable, "-I", "-S", str(path)], capture_output=True, text=True, timeout=30)
    assert "ModuleNotFoundError" not in done.stderr and "ImportError" not in done.stderr, done.stderr
