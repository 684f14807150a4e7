"""What crosses into the async engine's process with new weights (``actors/engine_weights.py``):
handles, not the tensors' bytes, and they rebuild the same values in another process."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from actors.engine_weights import (
    ENGINE_TRANSFERS,
    SharedIfRoom,
    engine_transfer,
    shm_shortfall,
    weights_to_bytes,
    weights_to_handles,
)
from cluster.weights import FlatWeights

REBUILD = """
import pickle, sys, torch
named = pickle.loads(sys.stdin.buffer.read())
print(";".join(f"{n}:{tuple(t.shape)}:{float(t.double().sum()):.1f}" for n, t in named))
"""


def test_auto_shares_with_a_gpu_and_sends_bytes_without():
    named = [("w", torch.zeros(1024))]  # 4 KiB
    auto = engine_transfer("auto", cuda=True)
    auto.free = lambda: 1 << 30
    assert auto.for_weights(named) is ENGINE_TRANSFERS["shared"]
    assert engine_transfer("auto", cuda=False).for_weights(named) is ENGINE_TRANSFERS["bytes"]
    assert engine_transfer("shared", cuda=False).for_weights(named).method == "load_weights_shared"
    assert engine_transfer("bytes", cuda=True).for_weights(named).method == "load_weights_blob"


def test_host_tensors_that_do_not_fit_dev_shm_go_as_bytes_said_once_or_stop_a_named_shared_in_one_line():
    """A container's /dev/shm is 64 MB by default; handles to host tensors copy them there (review B5)."""
    named = [("w", torch.zeros(3 << 20))]  # 12 MiB of host tensors: 24 MiB needed
    said = []
    auto = SharedIfRoom(said.append, free=lambda: 20 << 20)
    assert auto.for_weights(named) is ENGINE_TRANSFERS["bytes"]
    assert auto.for_weights(named) is ENGINE_TRANSFERS["bytes"] and len(said) == 1  # said once
    assert said[0].startswith("weights reach the engine as bytes (a copy per update, slower): /dev/shm has 0.02 GiB")
    assert "docker run --shm-size" in said[0]
    assert SharedIfRoom(said.append, free=lambda: 24 << 20).for_weights(named) is ENGINE_TRANSFERS["shared"]
    with pytest.raises(RuntimeError, match="engine.weight_transfer = shared: /dev/shm has .* set engine.weight_"):
        SharedIfRoom(said.append, free=lambda: 1 << 20, strict=True).for_weights(named)
    gpu_only = [("w", SimpleNamespace(is_cuda=True, numel=lambda: 1 << 30, element_size=lambda: 2))]
    assert shm_shortfall(gpu_only, free=lambda: 0) is None  # CUDA IPC writes nothing to /dev/shm


def test_handles_of_the_ray_channels_read_only_views_rebuild_in_another_process():
    """The real GPU input of the in-flight path: FlatWeights' views of Ray's read-only shared memory."""
    flat = FlatWeights([("a", torch.arange(6.0).to(torch.bfloat16)), ("b", torch.arange(4.0).reshape(2, 2))])
    for entry in flat.entries:
        entry[3].flags.writeable = False  # as Ray's object store hands them out
    blob, keep = weights_to_handles(flat.tensors())
    out = subprocess.run([sys.executable, "-c", REBUILD], input=blob, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == "a:(6,):15.0;b:(2, 2):6.0"


def test_handles_rebuild_the_weights_in_another_process_without_their_bytes():
    big = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB
    view = torch.arange(12.0).reshape(3, 4)[:, 1]  # not contiguous: [1, 5, 9]
    named = [("model.embed.weight", big), ("model.norm.weight", view)]
    blob, keep = weights_to_handles(named)
    assert len(blob) < 2000 < len(weights_to_bytes(named)[0])  # names and handles only
    assert len(keep) == 2  # the caller holds these until the engine has loaded them
    out = subprocess.run([sys.executable, "-c", REBUILD], input=blob, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == "model.embed.weight:(1000000,):499999500000.0;model.norm.weight:(3,):15.0"
