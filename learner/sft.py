"""Supervised warm-start: a few steps of next-token training on (prompt, completion) token ids.

RL from a random-init model only works on tasks whose answers it samples by chance (the demo's
one-digit successor). A task with multi-step, ``\\boxed{}``-terminated answers needs the format
first; this loop gives it, as a real run would start from an instruct model. It trains in one
process with plain torch (no DeepSpeed: the model is tiny and the step is not the point), on
the completion tokens only, with the tokenizer's EOS appended::

    loss = - sum_{t in completion} log p(x_t | x_<t) / #completion tokens      (per batch)

and writes the result as a Hugging Face directory (config, weights, tokenizer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class WarmStart:
    steps: int
    first_loss: float
    last_loss: float  # mean over the last 10% of steps
    seconds: float


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    pairs: list[tuple[list[int], list[int]]],
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> WarmStart:
    """Train ``model_dir`` on ``pairs`` of (prompt ids, completion ids) for ``steps`` steps; save to ``out_dir``."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    losses, start = [], time.monotonic()
    for _ in range(steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        rows = [(p + c + [eos], len(p)) for p, c in batch]
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, n_prompt) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
            mask[i, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tail = losses[-max(1, steps // 10) :]
    return WarmStart(steps, losses[0], sum(tail) / len(tail), time.monotonic() - start)
