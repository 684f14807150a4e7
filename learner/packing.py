"""Sequence packing: padding-free micro-batches, balanced by tokens over data-parallel ranks.

Padded batching lays a micro-batch out as ``[b, L]`` rows padded to the longest sequence;
with long-tailed completion lengths (most short, a few at the length limit) most of those
slots are padding. Packing instead concatenates a micro-batch's sequences into ONE row
``[1, sum_i len_i]`` with no padding inside, and keeps them from seeing each other with

* ``position_ids`` restarting at 0 at every sequence (RoPE sees each sequence alone), and
* a block-diagonal causal attention mask: token ``q`` may attend to key ``k`` iff both
  belong to the same sequence and ``k <= q``.

How the mask reaches the model (transformers 5.19, Qwen2, checked on CPU with ``sdpa``
and ``eager``; ``tests/test_packing.py`` holds packed == unpadded to 1e-5):

* default: an explicit 4D additive mask ``[1, 1, L, L]`` (0 where attending, the dtype's
  most negative value elsewhere) as ``attention_mask``. transformers returns a 4D mask
  unchanged (``masking_utils._preprocess_mask_arguments``); ``eager`` adds it to the
  scores and ``sdpa`` passes it as ``attn_mask``, so one format serves both.
  ``mask_dtype=torch.bool`` gives the boolean form (``sdpa`` only, 1 byte per pair).
* ``mask_dtype=None``: no mask tensor; transformers detects the packing from the
  position resets and builds the block mask itself (``sdpa``/``eager``) or runs varlen
  kernels (``flash_attention_2``, no ``L x L`` tensor at all). It does so ONLY when
  ``attention_mask is None`` and there is no KV cache, so the call MUST pass
  ``use_cache=False``: with the default cache the detection is silently skipped and
  sequences attend across each other (max logit error 0.85 on the tiny model), so
  ``PackedInputs.model_inputs()`` always passes it. The form follows the rank's kernel
  (``learner/attention.py``): for ``sdpa`` the mask transformers builds from position ids
  is as dense as ours, so only ``flash_attention_2`` goes without one.
* a micro-batch of ONE sequence gets no mask in any form: transformers then runs plain
  causal attention (``sdpa``'s ``is_causal``, without an ``[L, L]`` tensor): faster and smaller
  than under the boolean block mask (a 16K-token response on the CPU: ``bench/README.md``).

Micro-batch planning (``plan_micro_batches``) assigns sequences to ranks longest-first
onto the least-loaded rank (LPT, Graham 1969: max - min rank tokens <= longest
sequence), then into micro-batches of at most ``token_budget`` tokens per rank by
first-fit decreasing, and pads every rank to the same number of micro-batches.

Sequences come from a ``TokenShard`` (flat arrays, ``learner/shard.py``); ``pack_range`` packs
a contiguous range of them. The completion-side tensors (mask, advantages, log-probs) are not
part of a packed micro-batch: they live in the rank's ``[n, T]`` table (``learner/rank_batch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner.logprobs import token_entropy, token_kl, token_logprobs
from learner.shard import TokenShard

# ---------------------------------------------------------------------------------------
# planning
# ---------------------------------------------------------------------------------------


def plan_micro_batches(
    lengths: list[int], ranks: int, token_budget: int, minibatches: int = 1
) -> list[list[list[list[int]]]]:
    """Assign sequence indices to ranks and token-bounded micro-batches.

    ``lengths[i]`` is sequence i's prompt + completion token count. Returns
    ``plan[rank][minibatch][micro] -> sorted list of sequence indices`` (the nesting of
    ``RankShard.micro_sizes[m][k]``):

    * minibatch m holds the contiguous index range ``[m n / M, (m+1) n / M)`` (sizes differ
      by at most 1), one optimizer step each;
    * within a minibatch, sequences go longest-first to the rank with the fewest tokens so
      far (ties: lower index first, lower rank first), which keeps
      ``max_r tokens_r - min_r tokens_r <= max_i len_i``;
    * within a rank, first-fit decreasing: each sequence (longest first) joins the first
      micro-batch it fits in (``sum len <= token_budget``), else opens a new one. A sequence
      longer than the budget opens its own micro-batch and nothing joins it;
    * every rank gets the same number of micro-batches in a minibatch (at least 1): ranks
      with fewer get EMPTY micro-batches ``[]`` appended. The learner must still run a
      forward and a backward for an empty micro-batch, because ZeRO gathers parameters in
      forward and reduces gradients in backward collectively: an empty range packs to a
      2-token dummy whose completion mask is 0, so its loss weights and gradients are 0.

    Deterministic: the same arguments give the same plan.
    """
    if ranks < 1 or token_budget < 1 or minibatches < 1:
        raise ValueError(
            f"ranks, token_budget and minibatches must be >= 1, got {ranks}, {token_budget}, {minibatches}"
        )
    if len(lengths) < minibatches:
        raise ValueError(f"{len(lengths)} sequences cannot fill {minibatches} minibatches")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence needs at least one token")
    n = len(lengths)
    plan: list[list[list[list[int]]]] = [[] for _ in range(ranks)]
    for m in range(minibatches):
        chunk = range(m * n // minibatches, (m + 1) * n // minibatches)
        per_rank = _balance_over_ranks(chunk, lengths, ranks)
        bins = [_first_fit_decreasing(members, lengths, token_budget) for members in per_rank]
        n_micro = max(1, max(len(b) for b in bins))
        for r in range(ranks):
            plan[r].append(bins[r] + [[] for _ in range(n_micro - len(bins[r]))])
    return plan


def _longest_first(indices, lengths: list[int]) -> list[int]:
    return sorted(indices, key=lambda i: (-lengths[i], i))


def _balance_over_ranks(indices, lengths: list[int], ranks: int) -> list[list[int]]:
    """LPT: each sequence, longest first, to the least-loaded rank. Members stay longest-first."""
    loads = [0] * ranks
    members: list[list[int]] = [[] for _ in range(ranks)]
    for i in _longest_first(indices, lengths):
        r = min(range(ranks), key=lambda k: (loads[k], k))
        members[r].append(i)
        loads[r] += lengths[i]
    return members


def _first_fit_decreasing(longest_first: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Bins of total length <= budget (an over-budget sequence alone in its bin)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in longest_first:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


# ---------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------


@dataclass
class PackedInputs:
    """A micro-batch of n sequences packed back to back into R rows of Lr tokens: what the
    model sees, and where each completion token sits in the packed rows.

    ``completion_*`` are ``[n, T]`` (``T`` = longest completion in the micro-batch), laid out like
    the rank's completion table rows ``rows``; logits come out as ``[R, Lr, V]``, or ``[1, N, V]`` at the
    scored positions only (``learner/head.py``): read them with ``packed_completion_logprobs``.
    """

    input_ids: torch.Tensor  # [R, Lr] the sequences' prompt + completion tokens back to back
    position_ids: torch.Tensor  # [R, Lr] 0, 1, ..., len_i - 1 for each sequence
    attention_mask: torch.Tensor | None  # [R, 1, Lr, Lr] block-diagonal causal (additive or bool), or None
    seq_lens: list[int]  # len_i of each real sequence ([] for the dummy)
    completion_index: torch.Tensor  # [n, T] flat position in the packed rows of each completion token
    completion_valid: torch.Tensor  # [n, T] bool, True where the slot holds a completion token
    completion_ids: torch.Tensor  # [n, T] completion tokens (0 in padding)
    rows: slice  # the sequences' rows in the rank's completion table (empty for the dummy)
    is_dummy: bool = False  # the zero-weight stand-in for an empty micro-batch
    released: bool = False  # its pass is over and its mask dropped (``release``): it may not run again

    @property
    def width(self) -> int:
        """T: the completion table columns this micro-batch covers."""
        return self.completion_valid.size(1)

    @property
    def logit_positions(self) -> torch.Tensor:
        """``[N]`` flat positions in the ``[R * Lr]`` rows whose output predicts a completion token
        (``p - 1``), in row-major order of ``completion_valid``: where the LM head runs."""
        return self.completion_index[self.completion_valid] - 1

    def logits_to_keep(self) -> torch.Tensor | int:
        """``logits_to_keep=`` for the model: the predicting positions when there is one row, else 0
        (all positions: ``[R, Lr, V]``). ``learner/head.py`` keeps only them in any layout."""
        return self.logit_positions if self.input_ids.size(0) == 1 else 0

    def release(self) -> None:
        """Drop the block mask (``[R, 1, Lr, Lr]``, the largest tensor here) once the pass is over."""
        self.attention_mask, self.released = None, True

    @property
    def completion_lengths(self) -> list[int]:
        """Completion token count of each real sequence ([] for the dummy)."""
        return [] if self.is_dummy else self.completion_valid.sum(1).tolist()

    def model_inputs(self) -> dict[str, torch.Tensor | bool | None]:
        """Keyword arguments for a Hugging Face causal LM (or its base model); ``use_cache=False``
        matters without a 4D mask (see the module docstring) and is what training wants."""
        if self.released:
            raise RuntimeError("this packed micro-batch was released after its pass: pack it again (RankBatch.pack)")
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
            "use_cache": False,
        }


def block_causal_mask(row_seq_lens: list[list[int]], dtype: torch.dtype, device: torch.device | str = "cpu"):
    """Mask ``[R, 1, Lr, Lr]`` with ``allowed[r, q, k] = (seq(q) == seq(k)) and (k <= q)`` in row r.

    Rows are right-padded to ``Lr``; a padding position attends only to itself (a fully
    masked query row would make softmax NaN). A float ``dtype`` gives the additive form
    (0 where allowed, ``finfo(dtype).min`` elsewhere; ``sdpa`` and ``eager``);
    ``torch.bool`` gives ``allowed`` itself (``sdpa`` only, a quarter of the memory).
    """
    Lr = max(sum(lens) for lens in row_seq_lens)
    seq_of = torch.full((len(row_seq_lens), Lr), -1, dtype=torch.long, device=device)  # [R, Lr]
    for r, lens in enumerate(row_seq_lens):
        seq_of[r, : sum(lens)] = torch.repeat_interleave(
            torch.arange(len(lens), device=device), torch.tensor(lens, device=device)
        )
    pos = torch.arange(Lr, device=device)
    same = (seq_of[:, :, None] == seq_of[:, None, :]) & (seq_of[:, :, None] >= 0)  # [R, Lr, Lr]
    allowed = (same & (pos[None, None, :] <= pos[None, :, None])) | torch.eye(Lr, dtype=torch.bool, device=device)
    if dtype == torch.bool:
        return allowed[:, None]  # [R, 1, Lr, Lr]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def assign_rows(seq_lens: list[int], row_tokens: int | None) -> list[list[int]]:
    """First-fit-decreasing of sequences into rows of at most ``row_tokens`` tokens
    (``None``: the longest sequence's length, so attention work stays near the padded
    case while padding all but disappears). Returns sequence indices per row."""
    capacity = max(row_tokens or 0, max(seq_lens))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i)):
        for r, free in enumerate(room):
            if seq_lens[i] <= free:
                rows[r].append(i)
                room[r] -= seq_lens[i]
                break
        else:
            rows.append([i])
            room.append(capacity - seq_lens[i])
    return rows


def pack_range(
    tokens: TokenShard,
    start: int,
    stop: int,
    pad_id: int,
    device: torch.device | str = "cpu",
    mask_dtype: torch.dtype | None = torch.float32,
    row_tokens: int | None = 0,
) -> PackedInputs:
    """Pack sequences ``start .. stop - 1`` of ``tokens`` back to back into rows ``[R, Lr]``.

    ``row_tokens = 0`` packs everything into one row (best with a varlen attention kernel);
    ``None`` makes rows as long as the longest sequence; a number caps rows at that many
    tokens. Sequence i's completion token t sits at flat position ``r_i * Lr + s_i + p_i + t``
    (row r_i, offset s_i in its row), which is what ``completion_index`` holds. ``mask_dtype``
    is the dtype of the 4D mask (the model's activation dtype for the additive form,
    ``torch.bool`` for ``sdpa`` only), or ``None`` to let transformers build it from
    ``position_ids`` (one row only). An empty range (an empty planned micro-batch) gives a
    zero-weight dummy of two pad tokens, marked ``is_dummy``.
    """
    if start == stop:
        return _dummy(pad_id, device)
    po, co = tokens.prompt_offsets, tokens.completion_offsets
    prompt_lens = np.diff(po[start : stop + 1])  # [n]
    comp_lens = np.diff(co[start : stop + 1])  # [n]
    if (prompt_lens == 0).any():
        raise ValueError("packing needs a non-empty prompt: the first completion token is predicted from it")
    seq_lens = (prompt_lens + comp_lens).tolist()
    n = stop - start
    rows = [list(range(n))] if row_tokens == 0 else assign_rows(seq_lens, row_tokens)
    if mask_dtype is None and len(rows) > 1:
        raise ValueError("position_ids-only packing (mask_dtype=None) needs a single row")
    Lr = max(sum(seq_lens[i] for i in row) for row in rows)
    input_ids = np.full((len(rows), Lr), pad_id, dtype=np.int64)  # [R, Lr]
    position_ids = np.zeros((len(rows), Lr), dtype=np.int64)  # [R, Lr]
    first = np.zeros(n, dtype=np.int64)  # flat position of each sequence's first completion token
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            j = start + i
            p, c = int(prompt_lens[i]), int(comp_lens[i])
            input_ids[r, offset : offset + p] = tokens.prompt_ids[po[j] : po[j + 1]]
            input_ids[r, offset + p : offset + p + c] = tokens.completion_ids[co[j] : co[j + 1]]
            position_ids[r, offset : offset + p + c] = np.arange(p + c)
            first[i] = r * Lr + offset + p
            offset += p + c
    T = int(comp_lens.max())
    t = np.arange(T)[None]  # [1, T]
    valid = t < comp_lens[:, None]  # [n, T]
    index = np.where(valid, first[:, None] + t, 0)  # [n, T]; flat positions
    comp_ids = np.zeros((n, T), dtype=np.int64)
    comp_ids[valid] = tokens.completion_ids[co[start] : co[stop]]  # row-major order of valid = flat order
    row_lens = [[seq_lens[i] for i in row] for row in rows]
    # One sequence needs no block mask: without one transformers runs plain causal attention
    # (sdpa's is_causal: its flash kernel, no [L, L] tensor), which is what a long response gets.
    mask = None if mask_dtype is None or n == 1 else block_causal_mask(row_lens, mask_dtype, device)
    to = lambda x: torch.from_numpy(x).to(device)  # noqa: E731
    return PackedInputs(
        to(input_ids), to(position_ids), mask, seq_lens, to(index), to(valid), to(comp_ids), slice(start, stop)
    )


def _dummy(pad_id: int, device) -> PackedInputs:
    """Two pad tokens, the second a completion token the table gives mask 0 (see ``RankBatch.view``)."""
    return PackedInputs(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long, device=device),
        position_ids=torch.arange(2, device=device)[None],
        attention_mask=None,  # one sequence: plain causal attention
        seq_lens=[],
        completion_index=torch.ones((1, 1), dtype=torch.long, device=device),
        completion_valid=torch.ones((1, 1), dtype=torch.bool, device=device),
        completion_ids=torch.full((1, 1), pad_id, dtype=torch.long, device=device),
        rows=slice(0, 0),
        is_dummy=True,
    )


# ---------------------------------------------------------------------------------------
# reading the packed outputs
# ---------------------------------------------------------------------------------------


def packed_at_completion(per_position: torch.Tensor, batch: PackedInputs) -> torch.Tensor:
    """Outputs that predict each completion token: ``[R, Lr, ...] -> [n, T, ...]``.

    The completion token at row position p is predicted by position ``p - 1`` (for a critic:
    the state before that token). Padding slots read position 0; mask them.
    """
    prev = (batch.completion_index - 1).clamp(min=0)  # [n, T] flat positions
    flat = per_position.reshape(1, -1, *per_position.shape[2:])  # [1, R * Lr, ...]
    return flat[0, prev]  # [n, T, ...]


def _predicting(logits: torch.Tensor, batch: PackedInputs, min_tokens: int, stop_ids: tuple[int, ...]):
    """The ``[N, V]`` logits of the N predicting positions, and the stop-token ban before ``min_tokens``."""
    valid = batch.completion_valid  # [n, T]
    n_keep = int(valid.sum())
    if logits.shape[:2] == batch.input_ids.shape:
        picked = logits.reshape(-1, logits.size(-1))[batch.logit_positions]  # [N, V] from the flat rows
    elif logits.size(1) == n_keep:
        picked = logits[0]  # [N, V]
    else:
        raise ValueError(f"logits cover {logits.size(1)} positions; expected L={batch.input_ids.size(1)} or N={n_keep}")
    ban = None
    if min_tokens > 0 and stop_ids:
        position = torch.arange(valid.size(1), device=valid.device).expand_as(valid)  # [n, T] completion index
        ban = (position[valid] < min_tokens, torch.tensor(stop_ids, device=picked.device))  # ([N], [S])
    return picked, ban


def packed_completion_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    batch: PackedInputs,
    mask: torch.Tensor,
    chunk: int = 1024,
    temperature: float = 1.0,
    min_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """``[n, T]`` exact KL(pi || pi_ref) over the vocabulary at every completion position (``kl.estimator:
    exact``), from both models' logits for the same micro-batch (``learner/logprobs.py`` ``token_kl``),
    zero on padding and where ``mask`` is 0."""
    valid = batch.completion_valid
    picked, ban = _predicting(logits, batch, min_tokens, stop_ids)
    ref_picked, _ = _predicting(ref_logits, batch, min_tokens, stop_ids)
    kl = token_kl(picked, ref_picked, chunk, temperature, ban)  # [N] fp32
    zeros = torch.zeros(valid.shape, dtype=kl.dtype, device=kl.device)
    return zeros.masked_scatter(valid, kl) * mask.to(zeros.dtype)


def packed_completion_logprobs(
    logits: torch.Tensor,
    batch: PackedInputs,
    mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    chunk: int = 1024,
    temperature: float = 1.0,
    min_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
):
    """log pi(token) of every completion token: ``[n, T]`` (and the entropy ``[n, T]`` of each
    predicting distribution when ``with_entropy``), zero on padding and where ``mask`` is 0.
    ``pi = softmax(logits / temperature)``, with ``stop_ids`` impossible at the first ``min_tokens``
    completion positions: the distribution the actors sampled from.

    ``logits`` is ``[R, Lr, V]`` (the full rows) or ``[1, N, V]`` (the model was called with
    ``logits_to_keep=batch.logit_positions``). The log-softmax runs over the N predicting
    positions only, never over the prompt or a padded ``[n, T, V]`` block, and ``chunk`` of them
    at a time (``learner/logprobs.py``): no fp32 ``[N, V]`` tensor is kept for the backward.
    """
    valid = batch.completion_valid  # [n, T]
    picked, ban = _predicting(logits, batch, min_tokens, stop_ids)
    token_logp = token_logprobs(picked, batch.completion_ids[valid], chunk, temperature, ban)  # [N] fp32
    zeros = torch.zeros(valid.shape, dtype=token_logp.dtype, device=token_logp.device)
    keep = valid.to(zeros.dtype) if mask is None else mask.to(zeros.dtype)
    out = zeros.masked_scatter(valid, token_logp) * keep  # [n, T]
    if not with_entropy:
        return out
    return out, (zeros.masked_scatter(valid, token_entropy(picked, chunk, temperature, ban)) * keep)
