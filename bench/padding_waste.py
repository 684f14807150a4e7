"""Padding waste: padded micro-batches vs sequence packing, on a long-tailed length mix.

RL completions are long-tailed: most are short, a few run to the length limit. Padded
batching pays for every sequence at the length of the longest one in its micro-batch;
packing (``learner/packing.py``) concatenates sequences into one row per micro-batch.
Both sides are measured on the tensors the learner would really build, for the same
seeded batch, split over the same data-parallel ranks:

* (a) padded batching (what Tandem did before packing: split by COUNT,
  ``--micro-batch-size`` sequences per micro-batch), each micro-batch laid out by the
  padded reference the tests check packing against (``tests/reference_batch.py``);
  token slots = ``input_ids.numel()``.
  (a') the same micro-batch size after sorting by length: the best padding can do.
* (b) packed: ``plan_micro_batches`` with ``--token-budget``, each micro-batch laid out
  by ``pack_range``. Two waste figures, honestly separate:
  - padding inside rows: slots of the packed rows that hold no sequence token. Zero by
    construction, apart from the 2-token dummies that stand in for empty micro-batches
    (ranks must run equally many micro-batches), which are counted as waste here;
  - unused budget: ``1 - tokens / (micro-batches x budget)``, what would be wasted if
    every micro-batch were padded to the fixed shape ``[1, budget]`` (e.g. for static
    shapes / CUDA graphs). The learner does not do that; rows have their own length.

waste = 1 - real tokens / token slots. The goal: packing's padding inside rows <= 2 %.

A second view, dense attention: a kernel that applies a mask (sdpa with a 4D mask,
eager) computes all L^2 query-key pairs of a row, although only sum_i len_i^2 are
needed (counting full squares for both sides, so the causal half cancels). Packing
saves token slots (embedding, MLP, LM head: linear in tokens) regardless; its attention
saving needs a varlen kernel (flash-attention with ``position_ids``, see the module doc
of ``learner/packing.py``).

    .venv/bin/python bench/padding_waste.py [--sequences 512 --token-budget 8192 --ranks 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from learner.packing import pack_range, plan_micro_batches  # noqa: E402
from tests.reference_batch import TrainSequence, pad_sequences, token_shard  # noqa: E402

PAD = 0


def long_tail_sequences(n: int, seed: int, max_completion: int, tail: float) -> list[TrainSequence]:
    """Prompts of 16-64 tokens; completions 32-128 tokens, except a fraction ``tail`` drawn
    log-uniformly from [128, 2 x limit] and cut at the limit (so part of the tail sits
    exactly at the limit, like length-truncated samples)."""
    g = random.Random(seed)
    seqs = []
    for _ in range(n):
        p = g.randint(16, 64)
        if g.random() < tail:
            c = min(max_completion, int(128 * (2 * max_completion / 128) ** g.random()))
        else:
            c = g.randint(32, 128)
        seqs.append(
            TrainSequence(
                prompt_token_ids=[4] * p,
                completion_token_ids=[5] * c,
                completion_mask=[1] * c,
                advantages=[0.0] * c,
                sampler_logprobs=[0.0] * c,
                policy_versions=[0] * c,
            )
        )
    return seqs


def pack_sequences(seqs: list[TrainSequence], pad_id: int, **kwargs):
    """One packed micro-batch of ``seqs``, as a rank packs it."""
    return pack_range(token_shard(seqs), 0, len(seqs), pad_id, **kwargs)


def padded_figures(micro_batches: list[list[TrainSequence]]) -> tuple[int, int, int, int]:
    """(micro-batches, token slots, real tokens, dense attention pairs) of padded layout."""
    slots = real = pairs = 0
    for micro in micro_batches:
        batch = pad_sequences(micro, PAD)
        slots += batch.input_ids.numel()  # b x L
        real += int(batch.attention_mask.sum())
        pairs += batch.input_ids.size(0) * batch.input_ids.size(1) ** 2  # b x L^2
    return len(micro_batches), slots, real, pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=512, help="sequences in the training step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-completion", type=int, default=4096, help="the completion length limit")
    parser.add_argument("--tail", type=float, default=0.1, help="fraction of long completions")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel learner ranks")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per padded micro-batch")
    parser.add_argument("--token-budget", type=int, default=8192, help="tokens per packed micro-batch")
    args = parser.parse_args()

    seqs = long_tail_sequences(args.sequences, args.seed, args.max_completion, args.tail)
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in seqs]
    total = sum(lengths)
    q = statistics.quantiles(lengths, n=10)
    print(
        f"{len(seqs)} sequences (seed {args.seed}), prompt + completion tokens: total {total}, "
        f"median {statistics.median(lengths):.0f}, p90 {q[8]:.0f}, max {max(lengths)}; "
        f"at the limit: {sum(len(s.completion_token_ids) == args.max_completion for s in seqs)}; "
        f"{args.ranks} ranks"
    )

    # Padded batching: each rank takes an even share by COUNT, in arrival order, cut into
    # micro-batches of a fixed number of sequences, each padded to its longest.
    per_rank = len(seqs) // args.ranks
    in_order = [seqs[r * per_rank : (r + 1) * per_rank] for r in range(args.ranks)]
    padded = padded_figures(
        [
            share[i : i + args.micro_batch_size]
            for share in in_order
            for i in range(0, len(share), args.micro_batch_size)
        ]
    )
    by_len = sorted(seqs, key=lambda s: len(s.prompt_token_ids) + len(s.completion_token_ids))
    sorted_micro = [by_len[i : i + args.micro_batch_size] for i in range(0, len(by_len), args.micro_batch_size)]
    padded_sorted = padded_figures(sorted_micro)

    plan = plan_micro_batches(lengths, args.ranks, args.token_budget)
    rows = [pack_sequences([seqs[i] for i in micro], PAD, mask_dtype=None) for rank in plan for micro in rank[0]]
    packed_slots = sum(r.input_ids.numel() for r in rows)
    packed_real = sum(sum(r.seq_lens) for r in rows)
    packed_pairs = sum(r.input_ids.size(1) ** 2 for r in rows)
    dummies = sum(r.is_dummy for r in rows)
    # Tandem's CPU default (learner.pack_row_tokens empty): rows as long as the micro-batch's longest sequence
    multi = [
        pack_sequences(
            [seqs[i] for i in micro], PAD, mask_dtype=None if len(micro) < 2 else torch.bool, row_tokens=None
        )
        for rank in plan
        for micro in rank[0]
        if micro
    ]
    multi_slots = sum(r.input_ids.numel() for r in multi)
    budget_slots = sum(max(args.token_budget, r.input_ids.size(1)) for r in rows)  # an over-budget row is its own
    needed_pairs = sum(n * n for n in lengths)
    assert padded[2] == padded_sorted[2] == packed_real == total  # every side holds every token once

    def line(name: str, micro: int, slots: int, real: int) -> None:
        print(f"{name:<58} {micro:>6} {slots:>12} {real:>12} {1 - real / slots:>8.3f}")

    print(f"\n{'layout':<58} {'micro':>6} {'slots':>12} {'real':>12} {'waste':>8}")
    line(f"(a)  padded, {args.micro_batch_size} seqs/micro, arrival order", padded[0], padded[1], padded[2])
    line(f"(a') padded, {args.micro_batch_size} seqs/micro, sorted by length", *padded_sorted[:3])
    line(f"(b)  packed, budget {args.token_budget}: padding inside rows", len(rows), packed_slots, packed_real)
    line("(b)  packed, if padded to [1, budget]: unused budget", len(rows), budget_slots, packed_real)
    line("(c)  packed in rows of the longest sequence (CPU default)", len(multi), multi_slots, packed_real)

    per_rank = [sum(lengths[i] for micro in rank[0] for i in micro) for rank in plan]
    print(
        f"\npacked plan: tokens per rank {per_rank} (max - min {max(per_rank) - min(per_rank)}, "
        f"longest sequence {max(lengths)}); micro-batches per rank {len(plan[0][0])}, "
        f"of which empty (2-token dummies) {dummies} in all"
    )
    print(
        f"dense attention pairs wasted (L^2 computed vs sum len^2 needed): "
        f"padded {1 - needed_pairs / padded[3]:.3f}, sorted {1 - needed_pairs / padded_sorted[3]:.3f}, "
        f"packed with a 4D mask {1 - needed_pairs / packed_pairs:.3f}, packed with varlen flash-attention 0.000"
    )
    print(
        f"\nRATIO token slots packed / padded: {packed_slots / padded[1]:.3f} (one row per micro-batch), "
        f"{multi_slots / padded[1]:.3f} (rows of the longest sequence)"
    )
    print(f"padding in rows of the longest sequence: {100 * (1 - packed_real / multi_slots):.2f}% of token slots")
    inside = 1 - packed_real / packed_slots
    print(f"GOAL packing padding inside rows <= 2%: {100 * inside:.2f}% {'PASS' if inside <= 0.02 else 'FAIL'}")


if __name__ == "__main__":
    main()
