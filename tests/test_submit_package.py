"""What ``tandem submit`` ships (issue 26, item 8): an allowlist (what git tracks, the config and the
files it names, explicit includes), never the credentials a working directory collects; ``--dry-run``
lists the exact files with sizes. Tested on a checkout full of bait files."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from launch.cli import main
from launch.deploy.package import plan_package, staged
from launch.deploy.submit import LaunchError, build_job

# Bait: credentials of every kind a working directory collects, none tracked by git.
BAIT = [
    ".git-credentials",
    ".kube/config",
    ".docker/config.json",
    ".config/gcloud/application_default_credentials.json",
    ".npmrc",
    ".pypirc",
    ".htpasswd",
    "secrets/db-password.txt",
    "service-account.json",
    "gcp-key.json",
    "hf_token.txt",
    "prod.env",
    ".env",
    ".ssh/id_ed25519",
    ".aws/credentials",
    "notes/scratch.txt",  # not a secret, just not part of the job: untracked, unnamed
    ".venv/bin/python",
    "runs/demo-20250101/metrics.jsonl",
]
ROOT = Path(__file__).resolve().parents[1]
TRACKED = ["launch/cli.py", "actors/rewards.py", "configs/grpo.yaml", "README.md", "pyproject.toml"]
CONFIG = {
    "model": {"path": "Qwen/Qwen2.5-0.5B"},
    "data": {"prompts": "data/train.jsonl"},  # untracked: named by the config, so it ships
    "reward": {"function": "rewards/mine.py:score"},  # the file part of file.py:function
    "eval": {"prompts": "data/heldout"},  # a folder
}


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path) -> Path:
    root = tmp_path / "work"
    for name in TRACKED + BAIT + ["data/train.jsonl", "rewards/mine.py", "data/heldout/part-0.jsonl"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"contents of {name}\n")
    (root / "configs" / "job.yaml").write_text(yaml.safe_dump(CONFIG))
    (root / "deploy.env").write_text("TOKEN=committed by mistake\n")
    git(root, "init", "-q")
    git(root, "add", *TRACKED, "deploy.env")
    return root


def test_the_package_is_tracked_files_the_config_and_what_it_names_never_the_bait(checkout):
    _, package = build_job(str(checkout / "configs" / "job.yaml"), [], str(checkout))
    assert sorted(package.files) == sorted(
        TRACKED + ["configs/job.yaml", "data/train.jsonl", "rewards/mine.py", "data/heldout/part-0.jsonl"]
    )
    assert not set(package.files) & set(BAIT)
    # tracked, but named like a secret: left out, and said
    assert package.left_out == {"deploy.env": "looks like a secret; --include it to ship it"}
    assert package.files["README.md"] == len("contents of README.md\n")
    with staged(package) as directory:  # what Ray packages: exactly these files
        shipped = sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*") if p.is_file())
        assert shipped == sorted(package.files)
        assert (Path(directory) / "rewards" / "mine.py").read_text() == "contents of rewards/mine.py\n"
    assert not Path(directory).exists()


# Tracked, so only the secret-name filter can keep them out (found by the review: the untracked bait
# above is kept out by the allowlist alone), in any case of letters.
TRACKED_SECRETS = ["HF_TOKEN.txt", "gcp-key.json", "conf/.npmrc", "secrets/db.txt", "keys/client_secret_1.json",
                   ".vault-token", "kaggle.json", "gcp-credentials.json", "api_keys.yaml", "prod.tfvars"]  # fmt: skip
# Tracked files that only look like secrets to a careless pattern: they ship.
LOOKALIKES = ["tokenizer.json", "special_tokens_map.json", "data/max_tokens.txt", "launch/credentials_check.py",
              "tests/test_secrets.py", "rewards/secret_sauce.py", "keys.py", "data/answer_key.json"]  # fmt: skip


def test_tracked_secrets_are_left_out_and_lookalikes_ship(checkout, tmp_path):
    for name in TRACKED_SECRETS + LOOKALIKES:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text("x\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "id_like").write_text("SECRET=1\n")
    (checkout / "data" / "notes.txt").symlink_to(outside / "id_like")  # a tracked link to outside
    git(checkout, "add", *TRACKED_SECRETS, *LOOKALIKES, "data/notes.txt")
    config = {**CONFIG, "eval": {"prompts": str(outside / "id_like")}}  # a file the cluster reads in place
    package = plan_package(checkout, checkout / "configs" / "job.yaml", config, [])
    assert not set(package.files) & set(TRACKED_SECRETS)
    assert all(package.left_out[name] == "looks like a secret; --include it to ship it" for name in TRACKED_SECRETS)
    assert set(LOOKALIKES) <= set(package.files)
    assert package.left_out["data/notes.txt"] == "a link to outside the working directory"
    assert "data/notes.txt" not in package.files
    assert package.left_out[str(outside / "id_like")].startswith("named by the config, outside the working directory")
    with_folder = plan_package(checkout, checkout / "configs" / "job.yaml", CONFIG, ["secrets"])
    assert "secrets/db.txt" in with_folder.files  # a folder named by --include ships whole


def test_includes_add_files_and_a_secret_ships_only_when_named(checkout):
    config = checkout / "configs" / "job.yaml"
    package = plan_package(checkout, config, CONFIG, ["notes", "deploy.env"])
    assert "notes/scratch.txt" in package.files and "deploy.env" in package.files and not package.left_out
    with pytest.raises(LaunchError, match="--include nowhere: no such file or folder inside"):
        build_job(str(config), [], str(checkout), ["nowhere"])


def test_without_git_tandems_own_tree_ships(checkout):
    import shutil

    shutil.rmtree(checkout / ".git")
    package = plan_package(checkout, checkout / "configs" / "job.yaml", CONFIG, [])
    assert {"launch/cli.py", "actors/rewards.py", "configs/grpo.yaml", "pyproject.toml"} <= set(package.files)
    assert "README.md" not in package.files and not set(package.files) & set(BAIT)


def test_dry_run_prints_the_exact_list_with_sizes_and_contacts_nothing(checkout, capsys, monkeypatch):
    monkeypatch.chdir(checkout)
    code = main(
        ["submit", "--config", "configs/job.yaml", "--address", "http://127.0.0.1:1", "--working-dir", ".", "--dry-run"]
    )
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    listed = [line.split()[-1] for line in out if line.strip() and line.split()[0].replace(",", "").isdigit()]
    assert sorted(listed[:-1]) == sorted(
        TRACKED + ["configs/job.yaml", "data/train.jsonl", "rewards/mine.py", "data/heldout/part-0.jsonl"]
    )
    assert any(line.strip().startswith(f"{len('contents of README.md') + 1}  README.md") for line in out)
    assert any(line.endswith(f"bytes in 9 files from {checkout}") for line in out)
    assert "left out: deploy.env (looks like a secret; --include it to ship it)" in out
    assert out[-1].startswith("would run: python -m launch.cli train --config configs/job.yaml")


def test_a_job_outside_git_ships_every_package_pyproject_installs():
    # the split of launch/ added schema/, runtime/ and observe/: a job packed without git lacked them
    import tomllib

    from launch.deploy.package import TANDEM_PACKAGES

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(TANDEM_PACKAGES) == sorted({name.split(".")[0] for name in packages})
