"""The learner's own collective (every rank agrees its update was finite) runs on the device the
group's backend serves. On GPUs DeepSpeed's group is NCCL, which serves only ``cuda`` tensors: a flag
made on the CPU crashed every multi-GPU run at its first update (issue 26, item 2).

Without a GPU the GPU device map is emulated: torch's fake backend registered for ``cuda`` only, and
fake ``cuda`` tensors (``FakeTensorMode``: device metadata, no memory). A collective on a CPU tensor
then fails here as it does under NCCL. Two real gloo processes check the agreement itself.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GPU_MAP = """
import torch, torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.testing._internal.distributed.fake_pg import FakeStore
from types import SimpleNamespace
from learner.rank import RankStep, agree_all

dist.init_process_group(backend="cuda:fake", store=FakeStore(), rank=0, world_size=2)  # NCCL's device map
assert dist.get_backend_config() == "cuda:fake"
with FakeTensorMode(allow_non_fake_inputs=True):
    for device in ("cuda", "cpu"):
        try:
            agree_all(True, torch.device(device))
        except DataDependentOutputException:
            print(device, "reduced")  # the collective ran; only the fake flag's value cannot be read
        except RuntimeError as exc:
            print(device, "refused:", exc)
    step = object.__new__(RankStep)  # the learner's own call, on a rank whose device is cuda:0
    step.world_size, step.layout = 2, SimpleNamespace(device=torch.device("cuda", 0))
    try:
        step._all_finite(False)
    except DataDependentOutputException:
        print("rank step reduced")
"""

TWO_RANKS = """
import sys, torch, torch.distributed as dist
from learner.rank import agree_all

rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
print(agree_all(True, torch.device("cpu")), agree_all(rank == 0, torch.device("cpu")), flush=True)
dist.destroy_process_group()
"""


def _python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_finite_flag_is_reduced_on_the_ranks_device_under_the_gpu_device_map():
    proc = _python(GPU_MAP)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    lines = out.splitlines()
    assert lines[0] == "cuda reduced"
    # what the old code did (a flag on the CPU) fails here as it did on a user's GPUs
    assert lines[1] == "cpu refused: No backend type associated with device type cpu"
    assert lines[2] == "rank step reduced"  # RankStep's update agreement uses its layout's device


def test_two_ranks_agree_only_when_every_rank_is_finite(tmp_path):
    procs = [_python(TWO_RANKS, str(rank), str(tmp_path / "store")) for rank in range(2)]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert [out.strip() for out, _ in results] == ["True False", "True False"]
