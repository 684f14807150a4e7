"""vLLM on the CPU: compiled (torch.compile) vs eager engine, start-up and steady generation.

Each contestant is a fresh child process holding one in-process ``vllm.LLM`` on the tiny model
(as a generation actor holds it, ``engine.enforce_eager`` true or false), generating a step of
16 prompts x 8 completions forced to exactly ``--tokens`` tokens with logprobs, ``--calls`` times.
The children alternate (eager, compiled, eager, compiled, ...) so the machine's load falls on both.

Printed per mode: engine start-up s, the first call's s (it compiles the logprob op), the median
tokens/s of the later calls, and the run length after which compiled mode would have paid back
its longer start-up (``inf`` when it is not faster once started). The default for
``engine.enforce_eager`` follows from these figures (bench/README.md, "Engine modes").
Run: .venv/bin/python bench/engine_modes.py [--tokens 128 --calls 4 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(mode: str, tokens: int, calls: int, model: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process, as the actor runs it
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.monotonic()
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=mode == "eager",
        kv_cache_memory_bytes=1 << 30,
        max_model_len=tokens + 64,
        seed=0,
    )
    startup = time.monotonic() - start
    prompts = [TokensPrompt(prompt_token_ids=[5 + i % 20, 6, 7, 8, 9, 10]) for i in range(16)]
    params = SamplingParams(n=8, max_tokens=tokens, min_tokens=tokens, logprobs=0, temperature=1.0)
    seconds = []
    for _ in range(calls):
        t = time.monotonic()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.monotonic() - t)
    print("RESULT " + json.dumps({"startup_s": startup, "call_s": seconds, "tokens": 16 * 8 * tokens}), flush=True)


def measure(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--tokens", str(args.tokens), "--calls", str(args.calls)]
    proc = subprocess.run([*cmd, "--model", args.model], cwd=ROOT, capture_output=True, text=True, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{mode} child failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    result = json.loads(line[len("RESULT ") :])
    later = result["call_s"][1:]
    print(f"  {mode:<9} start {result['startup_s']:5.1f}s  first call {result['call_s'][0]:5.1f}s  "
          f"later {statistics.median(later):5.2f}s/call", flush=True)  # fmt: skip
    first = result["call_s"][0]
    return {"startup_s": result["startup_s"], "first_s": first, "later_s": later, "tokens": result["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=str(Path.home() / ".cache/tandem/models/tiny-qwen2-4k"))
    parser.add_argument("--child", choices=["eager", "compiled"])
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.tokens, args.calls, args.model)
    from actors.tiny_model import build_tiny_model

    build_tiny_model(args.model, max_positions=4096)  # a no-op when it exists
    runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds}", flush=True)
        for mode in runs:
            runs[mode].append(measure(mode, args))
    summary = {}
    for mode, results in runs.items():
        later = [s for r in results for s in r["later_s"]]
        summary[mode] = {
            "startup_s": statistics.median(r["startup_s"] + r["first_s"] for r in results),
            "tok_s": results[0]["tokens"] / statistics.median(later),
        }
    print(f"\n{'mode':<9} {'start + first call s':>21} {'steady tok/s':>13}")
    for mode, s in summary.items():
        print(f"{mode:<9} {s['startup_s']:>21.1f} {s['tok_s']:>13.0f}")
    eager, compiled = summary["eager"], summary["compiled"]
    ratio = compiled["tok_s"] / eager["tok_s"]
    extra = compiled["startup_s"] - eager["startup_s"]
    # compiled pays back `extra` seconds once it has generated the same tokens faster for long enough
    gain = 1 / eager["tok_s"] - 1 / compiled["tok_s"]  # seconds saved per token
    breakeven = extra / gain / eager["tok_s"] if gain > 0 else float("inf")  # in seconds of eager generation
    print(f"\nRATIO compiled / eager steady tokens/s: {ratio:.2f}x; compiled starts {extra:+.1f}s later; "
          f"break-even after {breakeven:.0f}s of generation")  # fmt: skip


if __name__ == "__main__":
    main()
