"""vLLM's per-sequence work on the CPU: what each sampling option costs in generation tokens/s.

One in-process ``vllm.LLM`` on the tiny model (as a generation actor holds it: eager, dynamo off,
pinned to core 0 with one OpenMP thread; unpinned, vLLM on CPU starts a second OpenMP thread and
uses 1.3-1.6 cores, which a Ray actor with one CPU never has), one step of 16 prompts x 8
completions forced to exactly ``--tokens`` tokens, once per variant per round, the variants
interleaved so the machine's load falls on all:

  actor (before)  : per-prompt seeds, the sampled token's logprob, vLLM detokenises (the actors until
                    2026-12-02)
  actor (now)     : the same without vLLM's detokenisation; the completions are decoded once with
                    ``actors.spec.decode_completions`` (timed in)
  + unseeded      : no per-prompt seed (not reproducible; what the in-flight actor does)
  + no logprobs   : no logprob returned (what TIS needs: a lower bound, not an option)
  + flat logprobs : vLLM's ``flat_logprobs`` container instead of a dict per position

Printed: the best tokens/s over rounds and the ratio to ``actor (before)``.
Run: .venv/bin/python bench/sampling_options.py [--tokens 128 --rounds 3 --model DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

VARIANTS = {
    "actor (before)": {"detokenize": True},
    "actor (now)": {},
    "+ unseeded": {"seed": None},
    "+ no logprobs": {"seed": None, "logprobs": None},
    "+ flat logprobs": {"flat_logprobs": True},
}
PROMPTS, GROUP = 16, 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a tiny model directory (built there if missing)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.vllm_one_core import one_core_engine, pin_to_one_core

    pin_to_one_core(0)  # before building the model imports torch
    from actors.tiny_model import build_tiny_model

    model = str(build_tiny_model(args.model or os.path.join(tempfile.mkdtemp(), "tiny"), max_positions=4096))
    L = args.tokens
    llm = one_core_engine(model, L + 64)
    from vllm import SamplingParams

    from actors.spec import decode_completions

    tokenizer = llm.get_tokenizer()
    prompts = [f"next {i % 10}:" for i in range(PROMPTS)]

    def params(options: dict) -> list:
        base = {"seed": 0, "logprobs": 0, "detokenize": False, "flat_logprobs": False, **options}
        seed = base.pop("seed")
        return [
            SamplingParams(
                n=GROUP, max_tokens=L, min_tokens=L, ignore_eos=True, temperature=1.0,
                seed=None if seed is None else seed + i, **base,
            )
            for i in range(PROMPTS)
        ]  # fmt: skip

    def step(options: dict) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params(options), use_tqdm=False)
        if not options.get("detokenize", False):
            for out in outputs:
                decode_completions(tokenizer, [list(c.token_ids) for c in out.outputs])  # as the actor does
        seconds = time.perf_counter() - start
        assert all(len(c.token_ids) == L for out in outputs for c in out.outputs)
        return PROMPTS * GROUP * L / seconds

    step(VARIANTS["actor (now)"])  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name, options in VARIANTS.items():
            rates[name].append(step(options))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items()), flush=True)
    base = max(rates["actor (before)"])
    print(f"\n{PROMPTS} prompts x {GROUP} completions x {L} tokens, best of {args.rounds} round(s)")
    print(f"{'variant':18s} {'tok/s':>8s} {'ratio':>6s}")
    for name, values in rates.items():
        print(f"{name:18s} {max(values):8.0f} {max(values) / base:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
