"""The built-in ``arith`` task: multi-step addition in chat format, answered in ``\\boxed{}``.

For the math example (``tandem example math``): a tiny model is first warm-started with
supervised steps on worked solutions, then trained with GRPO and ``builtin:math``. A row::

    prompt   "7+4+3+4+4+3+2"                       (6 to 10 operands, each 1-9)
    solution "7+4=11\\n11+3=14\\n...\\n25+2=27\\n\\boxed{27}"  (one line per addition: 45-90 tokens)
    answer   "27"

Measured on the 2-layer, hidden-128 tiny model (char-level tokenizer, batch 32, lr 3e-3): the
format is learnt within 200 supervised steps, the sums between about 400 and 600 (a sharp turn
whose place depends on the seed and on the CPU's float kernels: held-out pass@1 at temperature 1 was
0.09 after 400 steps, 0.12 after 550, 0.81 after 600 and 0.91 after 700). The example warm-starts until
the loss converges, on solutions of which a quarter box a careless answer (``launch/tools/example.py``),
and leaves GRPO to learn to box the last sum exactly (0.785 -> 0.953 in 80 steps,
``configs/examples/math.yaml``).
The rows never need the hub and every character is in the tiny model's vocabulary.
"""

from __future__ import annotations

import random
import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def arith_row(rng: random.Random, min_terms: int = 6, max_terms: int = 10) -> dict:
    terms = [rng.randint(1, 9) for _ in range(rng.randint(min_terms, max_terms))]
    lines, total = [], terms[0]
    for term in terms[1:]:
        lines.append(f"{total}+{term}={total + term}")
        total += term
    solution = "\n".join(lines) + f"\n\\boxed{{{total}}}"
    return {"prompt": "+".join(map(str, terms)), "answer": str(total), "solution": solution, "task": "arith"}


def arith_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows, the same for the same ``seed``."""
    rng = random.Random(seed * 7717 + 3)
    return [arith_row(rng) for _ in range(n)]


def arith_reward(prompt: str, completion: str, row: dict | None = None) -> float:
    """1.0 when the last ``\\boxed{}`` of the completion (or, with none, the whole stripped completion) is
    the answer exactly, else 0.0: a plain check for users without math-verify; the example scores with
    ``builtin:math``."""
    if row is None:
        return 0.0
    found = BOXED.findall(completion)
    given = found[-1] if found else completion
    return float(given.strip() == str(row["answer"]))
