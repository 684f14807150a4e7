"""What crosses into the async engine's process with new weights (``actors/engine_weights.py``):
handles, not the tensors' bytes, and they rebuild the same values in another process."""

from __future__ import annotations

import subprocess
import sys

import torch

from actors.engine_weights import ENGINE_TRANSFERS, engine_transfer, weights_to_bytes, weights_to_handles

REBUILD = """
import pickle, sys, torch
named = pickle.loads(sys.stdin.buffer.read())
print(";".join(f"{n}:{tuple(t.shape)}:{float(t.double().sum()):.1f}" for n, t in named))
"""


def test_auto_shares_with_a_gpu_and_sends_bytes_without():
    assert engine_transfer("auto", cuda=True) is ENGINE_TRANSFERS["shared"]
    assert engine_transfer("auto", cuda=False) is ENGINE_TRANSFERS["bytes"]
    assert engine_transfer("shared", cuda=False).method == "load_weights_shared"
    assert engine_transfer("bytes", cuda=True).method == "load_weights_blob"


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
