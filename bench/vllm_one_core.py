"""Tandem's ceiling on a machine where one vLLM engine generates: that engine alone, on one core.

A Tandem run's generation actor is one ``vllm.LLM`` on one core (Ray gives it one CPU, one OpenMP
thread, ``VLLM_CPU_OMP_THREADS_BIND`` pins it). Its steps cannot come faster than that engine makes a
step's completions, however well the learner overlaps. This script measures that rate with nothing
around it: the engine in this process, pinned to core ``--core`` with one OpenMP thread (left to
itself vLLM on CPU starts a second OpenMP thread and uses 1.3-1.6 cores), the actor's sampling
parameters (``actors.spec.sampling_params``: per-prompt seeds, the sampled token's logprob, token ids
only, each finished completion decoded once), 16 prompts x 8 completions per step, forced to L tokens.

Prints one ``RESULT {json}`` line: each step's end (``time.monotonic``), so a caller computes steps/s
as it does for a run. ``bench/vs_trl.py`` runs it as its ``vllm-1core`` contestant.
Run: .venv/bin/python bench/vllm_one_core.py --model DIR --length 128 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP = 16, 8


def pin_to_one_core(core: int = 0) -> None:
    """This process on ``core`` alone with one OpenMP thread, as a CPU generation actor runs. Call it
    before anything imports torch: its OpenMP library reads the thread count once, when it loads."""
    os.sched_setaffinity(0, {core})
    os.environ.update(
        OMP_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND=str(core),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # as in the actor: the engine in this process
        TORCHDYNAMO_DISABLE="1",  # as an eager actor (actors/environment.py)
        TOKENIZERS_PARALLELISM="false",
    )


def one_core_engine(model: str, max_model_len: int):
    """An in-process ``vllm.LLM`` with the actor's engine settings (after ``pin_to_one_core``)."""
    from vllm import LLM

    return LLM(
        model=model,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        max_model_len=max_model_len,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an existing tiny model directory")
    parser.add_argument("--length", type=int, required=True, help="completion tokens L (min = max = L)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--core", type=int, default=0)
    args = parser.parse_args()
    pin_to_one_core(args.core)  # first: nothing has imported torch yet
    L = args.length
    llm = one_core_engine(args.model, L + 64)
    sys.path.insert(0, str(ROOT))
    from actors.config import RolloutConfig
    from actors.spec import decode_completions, sampling_params

    rollout = RolloutConfig(prompts_per_step=PROMPTS, group_size=GROUP, max_tokens=L, min_tokens=L)
    tokenizer = llm.get_tokenizer()
    step_end, lengths = [], []
    for step in range(args.steps):
        prompts = [f"next {(step * PROMPTS + i) % 10}:" for i in range(PROMPTS)]
        params = [sampling_params(rollout, GROUP, seed=step * PROMPTS + i) for i in range(PROMPTS)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for out in outputs:
            ids = [list(c.token_ids) for c in out.outputs]
            decode_completions(tokenizer, ids)
            lengths += [len(x) for x in ids]
        step_end.append(time.monotonic())
    threads = len(os.listdir(f"/proc/{os.getpid()}/task")) if os.path.isdir("/proc") else None
    print("RESULT " + json.dumps({"step_end": step_end, "lengths": lengths, "threads": threads}), flush=True)


if __name__ == "__main__":
    main()
