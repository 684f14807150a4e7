"""The LM head on the scored positions only, whatever the attention kernel and row layout.

A causal LM's forward ends ``logits = post(lm_head(hidden[:, keep, :]))``: ``hidden`` is ``[R, Lr, H]``,
``keep`` its ``logits_to_keep`` (the same positions in EVERY row: a slice or one index vector) and
``post`` what the model type does after the head, element by element (Gemma2/3's
``cap * tanh(z / cap)``, Granite's ``z / logits_scaling``, Cohere's ``z * logit_scale``; nothing for
Qwen2 and Llama). A micro-batch of several rows (``sdpa``/``eager`` with ``learner.pack_row_tokens``)
scores different positions in each row, which ``logits_to_keep`` cannot say, so it used to compute
``[R, Lr, V]`` logits for every position: ~10 GB in bf16 at 32K tokens and a 152K vocabulary, then
a gathered ``[N, V]`` copy and both gradients.

``scored_logits`` calls the model as before (the DeepSpeed engine, so ZeRO-3's gathering hooks,
autocast and a PEFT wrapper all see an ordinary forward) and, for that one call, puts a forward
pre-hook on the model's output embedding (``get_output_embeddings()``: the ``lm_head``, tied to the
input embedding or not, or PEFT's wrapper of it) that hands it only the ``N`` scored rows:

    lm_head([R, Lr, H]) -> lm_head(hidden.flatten(0, 1)[positions][None])      # [1, N, V]

so the model's own ``post`` runs on ``[1, N, V]`` and the result is the varlen path's: logits only
where a completion token is predicted, for every layout. The backward of the row selection writes
``[R * Lr, H]`` (hidden-sized), never a vocabulary-sized tensor. A model whose forward does not pass
the ``[R, Lr, H]`` hidden states to its output embedding is refused in one line.

What remains is the varlen path's cost: the ``[1, N, V]`` logits and their gradient, ``2 N V b`` bytes
(the memory plan's ``logits_bytes``, ``cluster/memory.py``). A head applied
``learner.logprob_chunk_tokens`` rows at a time, recomputed in the backward, would remove them; it is
not done here: under ZeRO-3 every chunk would gather the head's weight again, and the model type's
``post`` would have to be written out per model type.
"""

from __future__ import annotations

from torch import Tensor, nn

from learner.packing import PackedInputs


def output_head(model) -> nn.Module:
    """The module that writes the logits: ``get_output_embeddings()`` of the causal LM inside a
    DeepSpeed engine (``.module``) or a PEFT model (which forwards the call to its base model)."""
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise ValueError(
            f"{type(inner).__name__} has no output embedding (get_output_embeddings() is None): "
            "the learner trains causal LMs with an lm_head"
        )
    return head


def scored_logits(model, micro: PackedInputs) -> Tensor:
    """``[1, N, V]`` logits of the ``N`` positions that predict a completion token
    (``micro.logit_positions``, row-major), from one forward of ``model`` over the packed rows;
    the same values as the full ``[R, Lr, V]`` logits at those positions."""
    positions = micro.logit_positions  # [N] flat positions in the [R * Lr] rows
    rows = tuple(micro.input_ids.shape)  # (R, Lr)
    seen: list[tuple[int, ...]] = []

    def pick(module, args, kwargs):
        hidden = args[0] if args else None
        shape = tuple(hidden.shape) if isinstance(hidden, Tensor) else ()
        seen.append(shape)
        if shape[:2] != rows:  # not the rows we packed: leave it, and refuse below
            return None
        picked = hidden.reshape(-1, hidden.size(-1))[positions]  # [N, H]
        return (picked[None], *args[1:]), kwargs  # [1, N, H]

    head = output_head(model)
    handle = head.register_forward_pre_hook(pick, with_kwargs=True)
    try:
        # logits_to_keep=0: the head gets every row's hidden states, of which the hook keeps N
        logits = model(**micro.model_inputs(), logits_to_keep=0).logits
    finally:
        handle.remove()
    n = positions.numel()
    if len(seen) != 1 or seen[0][:2] != rows or tuple(logits.shape[:2]) != (1, n):
        name = type(getattr(model, "module", model)).__name__
        raise ValueError(
            f"{name}: its forward called the output embedding with {seen or 'nothing'} instead of the "
            f"[R, Lr, H] = {[*rows, 'H']} hidden states once (logits {tuple(logits.shape)}), so the learner "
            "cannot compute the head on the scored positions only; use a causal LM whose head reads the "
            "last hidden states (Qwen2, Llama, Gemma, ...)"
        )
    return logits
