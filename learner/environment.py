"""The environment a learner process needs (a policy or critic rank, or a reference actor)."""

from __future__ import annotations


def rank_env(num_cpus: float, num_gpus: float) -> dict[str, str]:
    """One torch thread per reserved core (more made a step 2.5x slower on 2 cores, with spikes:
    the deepspeed launcher does not set it), and DeepSpeed's CPU accelerator without a GPU."""
    env = {"OMP_NUM_THREADS": str(max(1, int(num_cpus))), "TOKENIZERS_PARALLELISM": "false"}
    if not num_gpus:
        env["DS_ACCELERATOR"] = "cpu"
    return env
