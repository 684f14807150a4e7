"""Generation throughput: Tandem's generation actor vs bare vLLM, side by side in one run.

A: a ``GenerationActor`` created as Tandem creates it (``ray.remote(GenerationActor)``
   with the launcher's options and ``ActorSpec``), timed around ``generate(requests)``: vLLM
   sampling with logprobs, building one ``TrajectoryGroup`` per prompt, scoring with
   ``bench/_reward.py:reward`` and shipping the groups back to the driver.
B: a plain Ray actor with the same options (resources, environment, core pin) holding
   ``vllm.LLM`` with the same engine settings, timed around ``llm.generate`` with the same
   prompts and the same per-prompt sampling seeds, returning only a token count.

Both sample the same tokens (the script checks the counts match), so the ratio is pure
overhead. Rounds alternate A B A B; the table gives medians. Read the last line:
``RATIO generation actor / bare vLLM`` (round-trip tokens/s, goal >= 0.95). The
``in-actor tok/s`` column shows where a gap comes from: A's in-actor time covers only
its ``llm.generate`` call, so round trip vs in-actor is A's conversion, scoring and
transfer cost.

    .venv/bin/python bench/generation_throughput.py [--prompts 32 --group-size 8 --max-tokens 64 --rounds 9]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from _common import Round, interleave, print_table, start_ray, timed

BENCH_DIR = Path(__file__).resolve().parent


class BareVLLM:
    """vLLM with nothing around it: the baseline the generation actor is measured against."""

    def __init__(self, model_path: str, engine, dtype: str, seed: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=engine.max_model_len,
            enforce_eager=engine.enforce_eager,
            kv_cache_memory_bytes=engine.kv_cache_gib << 30,
        )

    def ready(self) -> bool:
        return True

    def generate(self, prompts: list[str], seeds: list[int], rollout) -> tuple[int, float]:
        """Returns (generated tokens, seconds inside llm.generate)."""
        import time

        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=rollout.group_size,
                max_tokens=rollout.max_tokens,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                logprobs=0,
                seed=seed,
            )
            for seed in seeds
        ]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outputs for c in o.outputs), seconds


def make_requests(n: int, seed: int):
    """``n`` addition prompts ("12+345=") with their answers, as the prompt queue would send them."""
    from queues.messages import PromptRequest

    rng = random.Random(seed)
    requests = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        requests.append(PromptRequest(prompt_id=i, row={"prompt": f"{a}+{b}=", "answer": str(a + b)}, min_version=0))
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per generate call")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="longest completion")
    parser.add_argument("--rounds", type=int, default=9, help="timed calls per contestant (A B A B ...)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache" / "tandem" / "models" / "tiny-qwen2"))
    args = parser.parse_args()

    import ray

    from actors.generation import GenerationActor
    from actors.spec import ActorSpec
    from actors.tiny_model import build_tiny_model
    from cluster.placement import ray_options
    from launch.config import TandemConfig
    from launch.plan import actor_environment, build_plan

    model_path = str(build_tiny_model(args.model_dir).resolve())
    cfg = TandemConfig.model_validate(
        {
            "model": {"path": model_path, "dtype": args.dtype},
            "data": {"prompts": "bench"},
            "reward": {"function": f"{BENCH_DIR / '_reward.py'}:reward"},
            "rollout": {
                "group_size": args.group_size,
                "max_tokens": args.max_tokens,
                "prompts_per_request": args.prompts,
            },
        }
    )
    engine, rollout = cfg.engine, cfg.rollout
    options = ray_options(build_plan(cfg).actors, actor_environment(cfg, 0))  # same core for both
    seed = cfg.run.seed

    start_ray()
    log_dir = tempfile.mkdtemp(prefix="bench-gen-")
    spec = ActorSpec(
        name="actor-0",
        model_path=model_path,
        engine=engine,
        rollout=rollout,
        reward=cfg.reward,
        dtype=args.dtype,
        seed=seed,
        log_path=os.path.join(log_dir, "actor-0.log"),
    )
    actor = ray.remote(GenerationActor).options(**options).remote(spec)
    bare = ray.remote(BareVLLM).options(**options).remote(model_path, engine, args.dtype, seed)
    ray.get([actor.ready.remote(), bare.ready.remote()])

    requests = make_requests(args.prompts, seed)
    prompts = [r.row["prompt"] for r in requests]
    seeds = [seed * 1_000_003 + r.prompt_id for r in requests]  # GenerationActor.sampling_params' seeds

    def run_actor() -> tuple[int, float]:
        groups = ray.get(actor.generate.remote(requests))
        tokens = sum(len(t.completion_token_ids) for g in groups for t in g.trajectories)
        return tokens, groups[0].generate_seconds

    def run_bare() -> tuple[int, float]:
        return ray.get(bare.generate.remote(prompts, seeds, rollout))

    print(f"warm-up (the first logprobs generate compiles an op); logs in {log_dir}", flush=True)
    for _ in range(2):
        run_actor(), run_bare()

    print(
        f"{args.rounds} rounds of {args.prompts} prompts x {args.group_size} completions, "
        f"max_tokens {args.max_tokens}, {args.dtype}",
        flush=True,
    )
    rounds: tuple[list[Round], list[Round]] = interleave(lambda: timed(run_actor), lambda: timed(run_bare), args.rounds)
    ratio = print_table(("generation actor (A)", "bare vLLM (B)"), rounds)
    same = {r.tokens for r in rounds[0]} == {r.tokens for r in rounds[1]}
    print(f"same sampled token counts on both sides: {'yes' if same else 'NO (ratio compares different work)'}")
    print(f"RATIO generation actor / bare vLLM: {ratio:.2f} (goal >= 0.95)")
    ray.shutdown()


if __name__ == "__main__":
    main()
