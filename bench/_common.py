"""Driver-side helpers shared by the benchmarks: a local Ray, interleaved rounds, the table.

Only the driver imports this module (Ray workers never see ``bench/``); the actor
classes each benchmark compares live in the benchmark script itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Round:
    """One timed call of one contestant."""

    wall_s: float  # driver-side round trip: submit, run, results back in the driver
    inner_s: float  # time the contestant measured inside its actor (its core work only)
    tokens: int  # tokens processed in the call


def start_ray() -> None:
    import ray

    if not ray.is_initialized():
        # 4 logical CPUs on 2 cores: both contestants exist at once but only one runs at a time.
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)


def timed(call: Callable[[], tuple[int, float]]) -> Round:
    """Run ``call() -> (tokens, inner_s)`` and time its round trip."""
    start = time.perf_counter()
    tokens, inner_s = call()
    return Round(time.perf_counter() - start, inner_s, tokens)


def interleave(a: Callable[[], Round], b: Callable[[], Round], rounds: int) -> tuple[list[Round], list[Round]]:
    """A B A B ...: noise from other work on the machine falls on both sides alike."""
    rounds_a, rounds_b = [], []
    for i in range(rounds):
        rounds_a.append(a())
        rounds_b.append(b())
        print(
            f"  round {i + 1:>{len(str(rounds))}}/{rounds}: A {rounds_a[-1].tokens / rounds_a[-1].wall_s:9.0f} tok/s   "
            f"B {rounds_b[-1].tokens / rounds_b[-1].wall_s:9.0f} tok/s",
            flush=True,
        )
    return rounds_a, rounds_b


def median_rate(rounds: list[Round], inner: bool = False) -> float:
    """Median over rounds of tokens per second (round trip, or in-actor time with ``inner``)."""
    return statistics.median(r.tokens / (r.inner_s if inner else r.wall_s) for r in rounds)


def print_table(names: tuple[str, str], rounds: tuple[list[Round], list[Round]]) -> float:
    """Print one row per contestant; return the ratio A/B of median round-trip tokens/s.

    ``outside s`` is the round trip minus the in-actor time: Ray transfer plus whatever
    the contestant does around its core work."""
    width = max(len(n) for n in names) + 2
    print(
        f"\n{'contestant':<{width}}{'rounds':>7}{'tokens/call':>12}{'median s':>10}{'tok/s':>10}"
        f"{'in-actor tok/s':>16}{'outside s':>11}"
    )
    for name, rs in zip(names, rounds, strict=True):
        tokens = statistics.median(r.tokens for r in rs)
        wall = statistics.median(r.wall_s for r in rs)
        print(
            f"{name:<{width}}{len(rs):>7}{tokens:>12.0f}{wall:>10.3f}{median_rate(rs):>10.0f}"
            f"{median_rate(rs, inner=True):>16.0f}{statistics.median(r.wall_s - r.inner_s for r in rs):>11.3f}"
        )
    paired = statistics.median((a.tokens / a.wall_s) / (b.tokens / b.wall_s) for a, b in zip(*rounds, strict=True))
    print(f"median of per-round A/B ratios (each A beside the B after it): {paired:.2f}")
    return median_rate(rounds[0]) / median_rate(rounds[1])


def synthetic_groups(prompts: int, samples: int, prompt_len: int, lengths, seed: int, sampler_logprob=None) -> list:
    """Scored groups of random tokens (4..55: the tiny vocab minus special tokens) in the form the
    results queue delivers them: random rewards, completion lengths drawn by ``lengths(rng)``,
    sampler log-probs ``sampler_logprob(rng, n)`` (default -4 each)."""
    import numpy as np

    from queues.messages import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(seed)
    groups = []
    for p in range(prompts):
        prompt = rng.integers(4, 56, prompt_len, dtype=np.int32)
        trajs = []
        for _ in range(samples):
            c = int(lengths(rng))
            logprobs = sampler_logprob(rng, c) if sampler_logprob else np.full(c, -4.0)
            trajs.append(
                Trajectory(
                    prompt_token_ids=prompt,
                    completion_token_ids=rng.integers(4, 56, c, dtype=np.int32),
                    completion_mask=np.ones(c, dtype=np.uint8),
                    sampler_logprobs=np.asarray(logprobs, dtype=np.float32),
                    policy_versions=np.zeros(c, dtype=np.int32),
                    reward=float(rng.random()),
                    finish_reason="length",
                    completion_text="",
                )
            )
        groups.append(TrajectoryGroup(prompt_id=p, row={"prompt": ""}, trajectories=trajs, actor_name="bench"))
    return groups
