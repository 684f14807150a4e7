"""Placement: which Ray resources each process gets, from the ``resources`` config section.

Nothing else in Tandem names CPUs or GPUs; actors are created with
``Actor.options(**placement).remote(**params)``. ``check_fits`` compares the plan with
what the cluster offers before anything starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Compiled kernels (vLLM's first logprobs call) are cached across runs here.
INDUCTOR_CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "inductor"


class PlacementError(RuntimeError):
    """The plan asks for more than the cluster has."""


def generation_actor_options(actors: dict[str, Any], index: int, engine: dict[str, Any]) -> dict[str, Any]:
    """Ray options for generation actor ``index``."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in the actor's process: weights pass directly
        "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not actors["num_gpus"]:
        # vLLM on CPU ignores Ray's CPU accounting and would pin every engine to core 0.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
        env["VLLM_CPU_KVCACHE_SPACE"] = str(engine["kv_cache_gib"])
    return {
        "num_cpus": actors["num_cpus"],
        "num_gpus": actors["num_gpus"],
        "runtime_env": {"env_vars": env},
    }


def learner_rank_options(learner: dict[str, Any]) -> dict[str, Any]:
    """Ray options for one learner rank."""
    env = {"OMP_NUM_THREADS": str(max(1, int(learner["num_cpus"]))), "TOKENIZERS_PARALLELISM": "false"}
    if not learner["num_gpus"]:
        env["DS_ACCELERATOR"] = "cpu"
    return {"num_cpus": learner["num_cpus"], "num_gpus": learner["num_gpus"], "runtime_env": {"env_vars": env}}


def required_resources(resources: dict[str, Any]) -> dict[str, float]:
    a, learner = resources["actors"], resources["learner"]
    return {
        "CPU": a["count"] * a["num_cpus"] + learner["ranks"] * learner["num_cpus"],
        "GPU": a["count"] * a["num_gpus"] + learner["ranks"] * learner["num_gpus"],
    }


def check_fits(resources: dict[str, Any], available: dict[str, float]) -> None:
    """Raise ``PlacementError`` explaining what does not fit."""
    need = required_resources(resources)
    for kind, amount in need.items():
        have = available.get(kind, 0.0)
        if amount > have + 1e-9:
            a, learner = resources["actors"], resources["learner"]
            raise PlacementError(
                f"{amount:g} {kind}s asked ({a['count']} actors x {a['num_' + kind.lower() + 's']:g} + "
                f"{learner['ranks']} learner ranks x {learner['num_' + kind.lower() + 's']:g}), {have:g} available: "
                f"reduce resources.actors.count or resources.learner.ranks, or the per-process num_{kind.lower()}s"
            )


def local_ray_cpus(resources: dict[str, Any]) -> int:
    """CPUs a local Ray should advertise: the machine's cores, or the plan's need if larger
    (small CPU runs oversubscribe cores on purpose; the processes are mostly idle in turn)."""
    if resources.get("local_num_cpus"):
        return int(resources["local_num_cpus"])
    need = required_resources(resources)["CPU"]
    return max(os.cpu_count() or 1, int(-(-need // 1)))
