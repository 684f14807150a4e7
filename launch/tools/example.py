"""``tandem example math``: the long-reasoning job in miniature, end to end on the CPU.

1. build the tiny chat model (``actors/tiny_model.py``, with a chat template) and warm-start it with
   supervised steps on worked solutions of the ``arith`` task until its loss converges (``learner/sft.py``);
2. train it with GRPO, ``builtin:math`` (math-verify), dynamic sampling and a held-out evaluation
   (``configs/examples/math.yaml``): the eval pass@1 before the first step and after the last are printed;
3. load the saved model (``RUN_DIR/model``) in vLLM with ``tandem eval`` and score the same held-out
   set: it must score what the run's last evaluation scored.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

MATH_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "examples" / "math.yaml"
SFT_ROWS_SEED = 1000  # warm-start rows come from a seed of their own: not the RL or the eval rows
SFT_MARKER = "warm-start.json"
# The old fixed 600 steps sat on the sums' sharp turn (actors/arith_task.py): loss 0.009 here, 0.025 with
# torch's non-vectorised kernels (ATEN_CPU_CAPABILITY=default). The warm-start runs to a target instead;
# converged on clean solutions the model scores pass@1 0.97 and GRPO has nothing left to do, so a share
# of the solutions is careless: the last sum boxed one off (every step right, the answer wrong).
MATH_SFT_TARGET = 0.03
MATH_SFT_MAX_STEPS = 3000
CARELESS = 0.25


def careless_solutions(rows: list[dict], share: float = CARELESS, seed: int = 0) -> list[str]:
    """Each row's worked solution; in ``share`` of them (chosen with ``seed``) the boxed answer is the last
    sum plus or minus one: "...\n25+2=27\n\\boxed{28}"."""
    import random

    from actors.builtin_rewards import BOXED

    rng = random.Random(seed)
    out = []
    for row in rows:
        solution = row["solution"]
        if rng.random() < share:
            total = int(row["answer"])
            solution = solution.replace(f"{BOXED}{{{total}}}", f"{BOXED}{{{total + rng.choice((-1, 1))}}}")
        out.append(solution)
    return out


def prepare_math_model(
    root: str | Path, max_steps: int = MATH_SFT_MAX_STEPS, seed: int = 0, say: Callable[[str], None] = print
) -> Path:
    """The warm-started tiny chat model under ``root`` (built once per target and ``seed``)."""
    from actors.arith_task import arith_rows
    from actors.tiny_model import TINY_CHAT_TEMPLATE, build_tiny_model
    from learner.sft import warm_start
    from queues.templates import PromptRenderer

    root = Path(root).expanduser()
    out = root / f"sft-careless-to{MATH_SFT_TARGET:g}-seed{seed}"
    if (out / SFT_MARKER).is_file():
        return out
    base = build_tiny_model(root / "base", chat_template=TINY_CHAT_TEMPLATE, seed=seed)
    renderer = PromptRenderer.load(str(base))
    rows = arith_rows(4000, seed=SFT_ROWS_SEED + seed)
    prompts = renderer.token_ids_many(rows)
    solutions = renderer.tokenizer(careless_solutions(rows, seed=seed), return_attention_mask=False)["input_ids"]
    say(
        f"warm-starting {base} on worked solutions ({CARELESS:.0%} of them box a careless answer) until the "
        f"loss is below {MATH_SFT_TARGET:g} (at most "
        f"{max_steps} steps) ..."
    )
    result = warm_start(
        base, out, list(zip(prompts, solutions)), steps=max_steps, seed=seed, target_loss=MATH_SFT_TARGET,
        progress=lambda step, loss: say(f"  warm-start step {step}: loss {loss:.3f}"),
    )  # fmt: skip
    say(
        f"warm-start: loss {result.first_loss:.2f} -> {result.last_loss:.3f} in {result.steps} steps (converged at "
        f"{result.converged_at}), {result.seconds:.0f}s; model: {out}"
    )
    (out / SFT_MARKER).write_text(json.dumps(result.__dict__))
    return out


def run_math_example(overrides: list[str], max_sft_steps: int = MATH_SFT_MAX_STEPS) -> int:
    from launch.run import run_training
    from launch.tools.evaluate import run_evaluation

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    model = prepare_math_model("~/.cache/tandem/models/tiny-math", max_sft_steps, say=say)
    result: dict = {}
    code = run_training(MATH_CONFIG, [f"model.path={model}", *overrides], result=result)
    run_dir = Path(result["run_dir"])
    rounds = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    if code != 0 or not (run_dir / "model").is_dir() or not rounds:
        return code or 1
    first, last = rounds[0], rounds[-1]
    say(
        f"eval pass@1: {first['eval/pass@1']:.3f} before the first step -> {last['eval/pass@1']:.3f} after step "
        f"{last['step']}; now scoring the saved model {run_dir / 'model'} with tandem eval ..."
    )
    return run_evaluation(str(run_dir / "config.yaml"), str(run_dir / "model"), [])
