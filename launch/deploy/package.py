"""What ``tandem submit`` uploads: a list of files decided by inclusion, shown before it goes.

A working directory holds more than a job needs, and some of it must never leave the machine: git
and cloud credentials, registry and package-index logins, tokens, dotenv files. A deny list misses
the next such name, so the upload is built from what is known to belong:

- the files git tracks under the working directory (a checkout without git: Tandem's own tree);
- the config, and the files its ``data``, ``eval`` and ``reward`` sections name inside the working
  directory (a prompts file, a dataset folder, ``rewards/mine.py:score``), tracked or not;
- what the user names with ``--include``.

Even so, a file whose name looks like a secret (``SECRET_NAMES``) is left out and said, unless the
user named it (``--include``, a file or a folder, or the config). A link to outside the working
directory is left out; a file the config names outside it is said (the job reads it at that path).
The chosen files are linked (or copied) into a staging directory, which is what Ray packages;
``--dry-run`` prints the list with sizes and uploads nothing.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Names (of a file, or of any folder above it; matched without regard to case) never shipped unless the
# user names them: in --include, or as a file the config reads.
SECRET_NAMES = (
    ".env", ".env.*", "*.env", ".envrc", ".netrc", ".git-credentials", ".npmrc", ".pypirc", ".htpasswd",
    ".pgpass", ".s3cfg", ".boto", ".vault-token", "*.pem", "*.key", "*.p12", "*.pfx", "*.ppk", "*.tfvars",
    "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "credentials", "credentials*.json", "*credentials.json",
    "*-credentials*.json", "*service-account*.json", "*service_account*.json", "*-key.json", "*api_key*",
    "*api-key*", "*apikey*", "application_default_credentials.json", "kaggle.json", "token", "*_token",
    "*token.txt", "*.token", "kubeconfig", "secret", "secrets", "secret.*", "secrets.*", "*.secret",
    "client_secret*.json", ".ssh", ".aws", ".kube", ".docker", "gcloud", ".azure", ".huggingface", ".git",
)  # fmt: skip
# Never shipped, whatever git says: environments, run directories, caches.
LOCAL_STATE = (".venv", "venv", "runs", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", ".mypy_cache",
               ".import_linter_cache", "*.egg-info")  # fmt: skip
# What a job needs outside git: every top-level package (pyproject.toml's [tool.setuptools] packages; a test
# keeps them equal), the shipped configs and pyproject.toml
TANDEM_PACKAGES = ("schema", "queues", "actors", "learner", "cluster", "runtime", "observe", "launch")
TANDEM_TREE = (*TANDEM_PACKAGES, "configs", "pyproject.toml")
SCANNED_SECTIONS = ("data", "eval", "reward")  # where a config names files the job reads


@dataclass
class Package:
    root: Path
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes, shipped
    left_out: dict[str, str] = field(default_factory=dict)  # relative path -> why not

    def describe(self) -> str:
        lines = [f"{size:>12,}  {path}" for path, size in sorted(self.files.items())]
        total = sum(self.files.values())
        lines.append(f"{total:>12,}  bytes in {len(self.files)} files from {self.root}")
        lines += [f"left out: {path} ({why})" for path, why in sorted(self.left_out.items())]
        return "\n".join(lines)


def _matches(relative: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(part.lower(), pattern) for part in Path(relative).parts for pattern in patterns)


def tracked_files(root: Path) -> list[str] | None:
    """Files git tracks under ``root``, relative to it; None when ``root`` is not in a git checkout."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached"], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    files = [name for name in done.stdout.decode().split("\0") if name and (root / name).is_file()]
    return files or None  # an untracked folder inside some other checkout: as without git


def _tree(root: Path, top: str) -> list[str]:
    base = root / top
    if base.is_file():
        return [top]
    return [str(p.relative_to(root)) for p in sorted(base.rglob("*")) if p.is_file()] if base.is_dir() else []


def referenced_files(config: dict[str, Any], root: Path) -> tuple[list[str], list[str]]:
    """Files the config's data, eval and reward sections name (a value, or the file part of
    ``file.py:function``): those inside ``root`` (relative), and those outside it (as given)."""
    inside: list[str] = []
    outside: list[str] = []

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list):
            for item in value:
                visit(item)
        elif isinstance(value, str) and value:
            for candidate in {value, value.rsplit(":", 1)[0]}:
                path = (root / candidate).resolve() if not os.path.isabs(candidate) else Path(candidate).resolve()
                if not path.exists() or path == root:
                    continue
                if path.is_relative_to(root):
                    inside.extend(_tree(root, str(path.relative_to(root))))
                else:
                    outside.append(candidate)

    for section in SCANNED_SECTIONS:
        visit(config.get(section))
    return inside, outside


def plan_package(root: Path, config: Path, dumped: dict[str, Any], includes: list[str]) -> Package:
    """The files ``tandem submit`` ships from ``root`` (see the module docstring)."""
    package = Package(root)
    tracked = tracked_files(root)
    base = tracked if tracked is not None else [f for top in TANDEM_TREE for f in _tree(root, top)]
    config_named, outside = referenced_files(dumped, root)
    named = {str(config.relative_to(root)), *config_named}  # the user named these: they ship
    for include in includes:
        path = (root / include).resolve()
        if not path.exists() or not path.is_relative_to(root):
            raise FileNotFoundError(f"--include {include}: no such file or folder inside {root}")
        named.update(_tree(root, str(path.relative_to(root))))
    for relative in dict.fromkeys([*named, *base]):
        target = (root / relative).resolve()
        if not target.is_relative_to(root):
            package.left_out[relative] = "a link to outside the working directory"
        elif relative not in named and _matches(relative, SECRET_NAMES):
            package.left_out[relative] = "looks like a secret; --include it to ship it"
        elif relative in named or not _matches(relative, LOCAL_STATE):
            package.files[relative] = target.stat().st_size
    for path in outside:
        package.left_out[path] = "named by the config, outside the working directory: the job reads it at that path"
    return package


@contextmanager
def staged(package: Package) -> Iterator[str]:
    """A temporary directory holding exactly the package's files (hard links where possible)."""
    with tempfile.TemporaryDirectory(prefix="tandem-submit-") as directory:
        for relative in package.files:
            target = Path(directory) / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(package.root / relative, target)
            except OSError:
                shutil.copy2(package.root / relative, target)
        yield directory
