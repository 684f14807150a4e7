"""The environment a generation actor's process needs: what vLLM reads at start-up.

Placement (``cluster/placement.py``) reserves the resources; this says how vLLM must be told
about them, which only the actors know.
"""

from __future__ import annotations

import os
from pathlib import Path

from actors.config import ActorPlacement, EngineConfig

# Compiled kernels (vLLM's first logprobs call) are cached across runs here.
INDUCTOR_CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "inductor"


def reward_model_env(num_cpus: float) -> dict[str, str]:
    """A reward model actor: one torch thread per reserved core (as a learner rank)."""
    return {"OMP_NUM_THREADS": str(max(1, int(num_cpus))), "TOKENIZERS_PARALLELISM": "false"}


def actor_env(placement: ActorPlacement, index: int, engine: EngineConfig) -> dict[str, str]:
    """Environment variables of generation actor ``index``."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in the actor's process: weights pass directly
        "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not placement.num_gpus:
        # vLLM on CPU ignores Ray's CPU accounting and would pin every engine to core 0;
        # a tensor-parallel engine takes one core per shard ("0|1").
        tp, cores = placement.tensor_parallel, os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str((index * tp + j) % cores) for j in range(tp))
        env["VLLM_CPU_KVCACHE_SPACE"] = str(engine.kv_cache_gib)
        if engine.enforce_eager:
            # an eager engine still torch.compiles vLLM's sampled-token rank (2-3 s of every start on a
            # CPU, for a number Tandem never reads); with dynamo off that function runs eagerly
            env["TORCHDYNAMO_DISABLE"] = "1"
    return env
