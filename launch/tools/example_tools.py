"""``tandem example tools``: a model that must call a tool, trained with multi-turn GRPO on the CPU.

1. build the tiny chat model with the tool template (``actors/lookup_task.py``) and warm-start it on
   demonstrated episodes of the ``lookup`` task: each model turn of a demonstration (the call, then
   the answer after the tool's response) is one supervised pair, its prompt the episode's ids so far,
   built with the same deltas the rollout appends (``actors/episode.py``);
2. train it with GRPO on episodes (``configs/examples/tools.yaml``: ``rollout.kind: multi_turn``, the
   ``builtin:lookup`` environment, ``reward.function: environment``) with a held-out evaluation:
   the eval success before the first step and after the last are printed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

TOOLS_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "examples" / "tools.yaml"
SFT_ROWS_SEED = 2000  # warm-start rows: not the RL rows (seed 0) nor the eval rows
SFT_MARKER = "warm-start.json"
# The copying of the key and the code is learnt between 500 supervised steps (eval success 0.000) and 800
# (0.76, loss 0.011): a sharp turn, as in the math example. GRPO is left the rest.
TOOLS_SFT_STEPS = 800


def demonstration_pairs(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Two (prompt ids, turn ids) pairs per row: the tool call, and the answer after the tool's response."""
    from actors.environments import tool_schema
    from actors.episode import TurnRenderer
    from actors.lookup_task import LookupEnvironment, tool_call_text

    renderer = TurnRenderer(tokenizer, [tool_schema(fn) for fn in LookupEnvironment.tools])
    eos, pairs = tokenizer.eos_token_id, []
    for row in rows:
        prompt = renderer.prompt([{"role": "user", "content": row["prompt"]}])
        call = renderer.encode(tool_call_text("lookup", {"key": row["key"]}))
        delta = renderer.delta(call + [eos], [{"role": "tool", "content": row["answer"]}])
        pairs.append((prompt, call))
        pairs.append((prompt + call + [eos] + delta, renderer.encode(row["answer"])))
    return pairs


def prepare_tools_model(
    root: str | Path, steps: int = TOOLS_SFT_STEPS, seed: int = 0, say: Callable[[str], None] = print
) -> Path:
    """The warm-started tiny tool-calling chat model under ``root`` (built once per ``steps`` and ``seed``)."""
    from transformers import AutoTokenizer

    from actors.lookup_task import TOOLS_CHAT_TEMPLATE, lookup_rows
    from actors.tiny_model import build_tiny_model
    from learner.sft import warm_start

    root = Path(root).expanduser()
    out = root / f"sft-{steps}-seed{seed}"
    if (out / SFT_MARKER).is_file():
        return out
    base = build_tiny_model(root / "base", chat=True, chat_template=TOOLS_CHAT_TEMPLATE, seed=seed)
    pairs = demonstration_pairs(AutoTokenizer.from_pretrained(base), lookup_rows(2000, seed=SFT_ROWS_SEED + seed))
    say(f"warm-starting {base} with {steps} supervised steps on demonstrated tool calls ...")
    result = warm_start(base, out, pairs, steps=steps, seed=seed)
    say(f"warm-start: loss {result.first_loss:.2f} -> {result.last_loss:.3f} in {result.seconds:.0f}s; model: {out}")
    (out / SFT_MARKER).write_text(json.dumps(result.__dict__))
    return out


def run_tools_example(overrides: list[str], sft_steps: int = TOOLS_SFT_STEPS) -> int:
    from launch.run import run_training

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    model = prepare_tools_model("~/.cache/tandem/models/tiny-tools", sft_steps, say=say)
    result: dict = {}
    code = run_training(TOOLS_CONFIG, [f"model.path={model}", *overrides], result=result)
    run_dir = Path(result.get("run_dir", "."))
    eval_file = run_dir / "eval.jsonl"
    rounds = [json.loads(x) for x in eval_file.read_text().splitlines() if x.strip()] if eval_file.is_file() else []
    if code != 0 or not rounds:
        return code or 1
    curve = ", ".join(f"{r['eval/reward_mean']:.3f}@{r['step']}" for r in rounds)
    say(f"eval success (mean reward) by step: {curve}")
    return 0
