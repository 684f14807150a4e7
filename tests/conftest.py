"""Shared fixtures: the tiny model (built once per session) and a Ray session for slow tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from actors.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for one test module (4 logical CPUs: the processes take turns on 2 cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
