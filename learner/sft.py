"""Supervised warm-start: next-token training on (prompt, completion) token ids.

RL from a random-init model only works on tasks whose answers it samples by chance (the demo's
one-digit successor). A task with multi-step, ``\\boxed{}``-terminated answers, or one that needs a
tool called with the right arguments, needs the format first; this loop gives it, as a real run would
start from an instruct model. It trains in one process with plain torch (no DeepSpeed: the model is tiny
and the step is not the point), on the completion tokens only, with the tokenizer's EOS appended::

    loss = - sum_{t in completion} log p(x_t | x_<t) / #completion tokens      (per batch)

and writes the result as a Hugging Face directory (config, weights, tokenizer).

Two schedules. A fixed number of ``steps`` (warm-up 20 steps, then a linear decay to 0.1 of ``lr``).
Or, with ``target_loss``, until it converges: a skill such as copying a key out of the prompt is learnt
in a sharp turn whose step depends on the seed and on the machine's float kernels (the tools example's
old 800 steps ended past the turn here and before it on another machine), so a fixed count that sits
near the turn learns on one machine and not on another. The rate then stays at ``lr`` until the mean loss of the
last ``WINDOW`` steps is below ``target_loss``, then decays over a settling stretch (a tenth of the steps
taken, at least ``WINDOW``), and ``steps`` is only the limit: a run that does not converge within it raises
``WarmStartFailed``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WINDOW = 50  # steps whose mean loss is compared with target_loss
WARMUP = 20


class WarmStartFailed(RuntimeError):
    """The loss did not reach its target within the step limit; the message says where it stopped."""


@dataclass
class WarmStart:
    steps: int  # steps taken
    first_loss: float
    last_loss: float  # mean over the last 10% of steps
    seconds: float
    converged_at: int | None = None  # target_loss: the step where the window's mean first fell below it


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    pairs: list[tuple[list[int], list[int]]],
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    target_loss: float | None = None,
    progress: Callable[[int, float], None] | None = None,
    every: int = 100,
) -> WarmStart:
    """Train ``model_dir`` on ``pairs`` of (prompt ids, completion ids); save to ``out_dir``. ``steps``:
    the number of steps, or with ``target_loss`` the most it may take (module docstring). ``progress(step,
    mean loss of the last WINDOW steps)`` is called every ``every`` steps."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    losses, start, converged, last = [], time.monotonic(), None, steps
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * _rate(step, steps if target_loss is None else None, converged, last)
        loss = _loss(model, [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)], eos, pad)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        window = sum(losses[-WINDOW:]) / len(losses[-WINDOW:])
        if progress is not None and (step + 1) % every == 0:
            progress(step + 1, window)
        if target_loss is not None and converged is None and len(losses) >= WINDOW and window < target_loss:
            converged = step + 1
            last = min(steps, converged + max(WINDOW, converged // 10))  # settle: a tenth more, decaying
        if step + 1 >= last:
            break
    if target_loss is not None and converged is None:
        raise WarmStartFailed(
            f"the warm-start did not converge: mean loss {window:.3f} after {len(losses)} steps, target "
            f"{target_loss:g}; allow more steps (`tandem example NAME --sft-steps N`), or check the demonstrations"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tail = losses[-max(1, len(losses) // 10) :]
    return WarmStart(len(losses), losses[0], sum(tail) / len(tail), time.monotonic() - start, converged)


def _rate(step: int, fixed: int | None, converged: int | None, last: int) -> float:
    """The learning rate's factor: a linear warm-up, then a fixed schedule's linear decay to 0.1, or (to a
    target) 1 until converged and a linear decay to 0.1 over the settling steps."""
    warmup = min(1.0, (step + 1) / WARMUP)
    if fixed is not None:
        return warmup * max(0.1, 1 - step / fixed)
    if converged is None:
        return warmup
    return warmup * max(0.1, 1 - (step - converged) / max(last - converged, 1))


def _loss(model, batch: list[tuple[list[int], list[int]]], eos: int, pad: int):
    """The mean next-token loss over the completions (and their EOS) of one padded batch."""
    import torch

    rows = [(p + c + [eos], len(p)) for p, c in batch]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        mask[i, : len(ids)] = 1
    return model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
