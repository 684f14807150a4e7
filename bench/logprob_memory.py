"""Log-prob memory: the learner's log-prob stage, chunked (``learner/logprobs.py``) vs a full log-softmax.

The stage: for ``N`` completion tokens with logits ``[N, V]`` and sampled ids ``[N]``, the forward
of ``log pi(ids)``, the entropy of every row (a metric), and the backward of
``sum(weights * log pi)``. Two contestants on the same seeded logits:

* unchunked: the learner's code before ``a816d94`` (``packed_completion_logprobs`` then),
  rewritten here as the reference: ``log_softmax(logits.float())``, ``gather``, entropy
  ``-(logp.exp() * logp).sum(-1)`` from the same ``logp``, detached;
* chunked: ``token_logprobs(logits, ids, chunk)`` and ``token_entropy(logits, chunk)``, as
  ``packed_completion_logprobs`` calls them now.

Memory: each config runs in its own child process, which reads its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``). The logits are a float32 leaf with ``requires_grad`` (as
on CPU; bf16 logits on a GPU would halve the logits and their gradient, not the fp32 work). The
figure is the memory ABOVE the logits and their gradient, which exist in any scheme: the baseline
is the peak RSS once the logits and a touched gradient-sized buffer exist; the buffer is then
freed (checked: the RSS drops by its size) and the stage runs with ``logits.grad`` unset, so the
gradient the backward returns becomes ``logits.grad`` without a copy and falls inside the
baseline. (Pre-allocating ``logits.grad`` instead would make autograd ADD a freshly computed
``[N, V]`` gradient into it: one more ``[N, V]`` in both schemes, which a model's logits, a
non-leaf whose gradient flows on into the LM head, never pay.) ``extra GB`` = peak - baseline.
Tensors this large are ``mmap``-ed by glibc and returned on free, so the RSS follows them.

Configs whose big fp32 tensors would exceed ``--max-gb`` (~10 GB) in total are skipped and say
so: logits and gradient (``2 N V`` floats) plus, unchunked, two more ``[N, V]`` (the forward holds
``logp``, ``exp(logp)`` and their product before the gradient exists; the backward ``logp``, its
gradient and the logits' gradient), chunked, three ``[chunk, V]`` (as measured). Time: median over
``--repeats`` of the whole stage (forward, entropy, backward), in the same child. One extra child
checks once, at the smallest size, that both give the same log-probs and gradients within 1e-5
(and the entropies within 1e-4).

Goal (issue 11, item 7): the stage's peak memory grows with chunk x vocab, not tokens x vocab,
and is at least 4x lower at 16K tokens. Results: ``bench/results/logprob_memory.json``.

    .venv/bin/python bench/logprob_memory.py [--tokens 1024 4096 16384 --vocab 32768 151936 --chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
FULL_EXTRA = 2  # [N, V] fp32 tensors the full log-softmax holds at its peak besides logits and gradient
CHUNK_EXTRA = 3  # [chunk, V] fp32 tensors the chunked stage holds at its peak (measured)


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _inputs(n: int, v: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 2.0).requires_grad_()
    ids = torch.randint(0, v, (n,), generator=g)
    weights = torch.randn(n, generator=g)
    return logits, ids, weights


def full_stage(logits, ids, weights):
    """The old code: one fp32 log-softmax over all ``[N, V]``, kept for the backward."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    token_logp = torch.gather(logp, 1, ids.unsqueeze(-1)).squeeze(-1)  # [N]
    entropy = (-(logp.exp() * logp).sum(-1)).detach()  # [N]
    del logp
    (weights * token_logp).sum().backward()
    return token_logp.detach(), entropy


def chunked_stage(logits, ids, weights, chunk: int):
    from learner.logprobs import token_entropy, token_logprobs

    token_logp = token_logprobs(logits, ids, chunk)
    entropy = token_entropy(logits, chunk)
    (weights * token_logp).sum().backward()
    return token_logp.detach(), entropy


def _child_measure(scheme: str, n: int, v: int, chunk: int, repeats: int, seed: int) -> dict:
    import torch

    logits, ids, weights = _inputs(n, v, seed)
    buffer = torch.empty_like(logits).fill_(1.0)  # stands in for the gradient: touched, resident
    baseline = _maxrss_bytes()
    rss_with_buffer = _rss_bytes()
    del buffer
    released = rss_with_buffer - _rss_bytes()
    stage = full_stage if scheme == "unchunked" else (lambda z, y, w: chunked_stage(z, y, w, chunk))
    seconds = []
    for _ in range(repeats):
        logits.grad = None
        start = time.perf_counter()
        stage(logits, ids, weights)
        seconds.append(time.perf_counter() - start)
        assert logits.grad is not None and logits.grad.shape == logits.shape
    peak = _maxrss_bytes()
    return {
        "scheme": scheme,
        "tokens": n,
        "vocab": v,
        "chunk": chunk,
        "baseline_gb": baseline / GB,
        "peak_gb": peak / GB,
        "extra_gb": max(0, peak - baseline) / GB,
        "logits_gb": logits.numel() * 4 / GB,
        "buffer_released_gb": released / GB,
        "seconds": statistics.median(seconds),
        "all_seconds": seconds,
        "threads": torch.get_num_threads(),
    }


def _child_check(n: int, v: int, chunk: int, seed: int) -> dict:
    logits, ids, weights = _inputs(n, v, seed)
    full_logp, full_entropy = full_stage(logits, ids, weights)
    full_grad, logits.grad = logits.grad, None
    logp, entropy = chunked_stage(logits, ids, weights, chunk)
    return {
        "tokens": n,
        "vocab": v,
        "chunk": chunk,
        "logp_max_abs_diff": float((logp - full_logp).abs().max()),
        "grad_max_abs_diff": float((logits.grad - full_grad).abs().max()),
        "entropy_max_abs_diff": float((entropy - full_entropy).abs().max()),
    }


def _run_child(*args) -> dict:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def needed_gb(scheme: str, n: int, v: int, chunk: int) -> float:
    """Estimated memory of the stage's big fp32 tensors: logits + gradient + the scheme's own."""
    nv = n * v * 4
    own = FULL_EXTRA * nv if scheme == "unchunked" else CHUNK_EXTRA * min(chunk, n) * v * 4
    return (2 * nv + own) / GB


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        kind, *rest = sys.argv[2:]
        if kind == "check":
            n, v, chunk, seed = map(int, rest)
            print(json.dumps(_child_check(n, v, chunk, seed)))
        else:
            n, v, chunk, repeats, seed = map(int, rest)
            print(json.dumps(_child_measure(kind, n, v, chunk, repeats, seed)))
        return

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384], help="completion tokens N")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936], help="vocabulary sizes V")
    parser.add_argument("--chunk", type=int, default=1024, help="rows per chunk of the chunked side")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the stage per config (median)")
    parser.add_argument("--max-gb", type=float, default=10.5, help="skip a config needing more GB than this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "logprob_memory.json"))
    args = parser.parse_args()

    started = time.perf_counter()
    n0, v0 = min(args.tokens), min(args.vocab)
    check = _run_child("check", n0, v0, args.chunk, args.seed)
    check["ok"] = check["logp_max_abs_diff"] < 1e-5 and check["grad_max_abs_diff"] < 1e-5
    check["entropy_ok"] = check["entropy_max_abs_diff"] < 1e-4
    print(
        f"check at N={n0}, V={v0}, chunk={args.chunk}: max |diff| log-prob {check['logp_max_abs_diff']:.2e}, "
        f"gradient {check['grad_max_abs_diff']:.2e}, entropy {check['entropy_max_abs_diff']:.2e}: "
        f"{'OK' if check['ok'] and check['entropy_ok'] else 'MISMATCH'}",
        flush=True,
    )

    rows = []
    for v in sorted(args.vocab):
        for n in sorted(args.tokens):
            row = {"tokens": n, "vocab": v}
            for scheme in ("unchunked", "chunked"):
                need = needed_gb(scheme, n, v, args.chunk)
                if need > args.max_gb:
                    row[scheme] = {"skipped": f"would need {need:.1f} GB"}
                    print(f"N={n:>6} V={v:>6} {scheme:>9}: skipped: would need {need:.1f} GB", flush=True)
                    continue
                row[scheme] = _run_child(scheme, n, v, args.chunk, args.repeats, args.seed)
                r = row[scheme]
                print(
                    f"N={n:>6} V={v:>6} {scheme:>9}: extra {r['extra_gb']:6.3f} GB  {r['seconds']:6.2f} s  "
                    f"(peak RSS {r['peak_gb']:.2f} GB, logits {r['logits_gb']:.2f} GB, "
                    f"buffer released {r['buffer_released_gb']:.2f} GB)",
                    flush=True,
                )
            rows.append(row)

    def cell(row, scheme, key, fmt):
        r = row[scheme]
        if "skipped" in r:
            return f"skipped: {r['skipped']}" if key == "extra_gb" else "-"
        return format(r[key], fmt)

    print(f"\nchunk = {args.chunk}; extra = peak RSS above the fp32 logits and their gradient\n")
    print("| N | V | unchunked extra GB | chunked extra GB | ratio | unchunked s | chunked s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        both = "skipped" not in row["unchunked"] and "skipped" not in row["chunked"]
        row["ratio"] = row["unchunked"]["extra_gb"] / max(row["chunked"]["extra_gb"], 1e-9) if both else None
        ratio = f"{row['ratio']:.1f}x" if both else "-"
        print(
            f"| {row['tokens']} | {row['vocab']} | {cell(row, 'unchunked', 'extra_gb', '.3f')} | "
            f"{cell(row, 'chunked', 'extra_gb', '.3f')} | {ratio} | "
            f"{cell(row, 'unchunked', 'seconds', '.2f')} | {cell(row, 'chunked', 'seconds', '.2f')} |"
        )

    n_goal, v_goal = 16384, 32768
    goal_row = next((r for r in rows if r["tokens"] == n_goal and r["vocab"] == v_goal), None)
    goal = None
    if goal_row is not None and goal_row["ratio"] is not None:
        goal = {"tokens": n_goal, "vocab": v_goal, "ratio": goal_row["ratio"], "met": goal_row["ratio"] >= 4.0}
        print(
            f"\nGOAL (>= 4x lower at {n_goal} tokens, V={v_goal}): {goal_row['ratio']:.1f}x: "
            f"{'MET' if goal['met'] else 'NOT MET'}"
        )
    for v in sorted(args.vocab):
        chunked = [
            (r["tokens"], r["chunked"]["extra_gb"]) for r in rows if r["vocab"] == v and "extra_gb" in r["chunked"]
        ]
        print(f"chunked extra at V={v} over N: " + ", ".join(f"{n}: {gb:.3f} GB" for n, gb in chunked))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": " ".join([".venv/bin/python", "bench/logprob_memory.py", *sys.argv[1:]]),
                "machine": platform.platform(),
                "python": platform.python_version(),
                "chunk": args.chunk,
                "repeats": args.repeats,
                "max_gb": args.max_gb,
                "check": check,
                "goal": goal,
                "rows": rows,
                "wall_s": time.perf_counter() - started,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
