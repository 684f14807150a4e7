"""Log-probabilities and entropies of sampled tokens, computed in chunks of tokens.

For the ``N`` predicting positions of a micro-batch with logits ``z`` (``[N, V]``) and sampled
tokens ``y`` (``[N]``):

    log pi(y_i) = z_{i, y_i} - logsumexp_v z_{i, v}
    H_i         = logsumexp_v z_{i, v} - sum_v p_{i, v} z_{i, v},    p_i = softmax(z_i)

A full ``log_softmax`` would hold an fp32 ``[N, V]`` tensor for the backward pass (at 16K tokens and
a 152K vocabulary, 10 GB). Here the forward pass keeps only the per-token ``logsumexp`` (``[N]``)
and walks the logits ``chunk`` rows at a time in fp32; the backward pass recomputes each chunk's
softmax from it:

    d log pi(y_i) / d z_{i, v} = 1[v = y_i] - p_{i, v}

so the log-prob stage's extra memory is ``chunk x V`` floats, whatever ``N`` is. The entropy is a
metric (no gradient), computed chunk by chunk under ``no_grad``.

Sampling temperature ``tau``: the actors sample from ``softmax(z / tau)`` and report that
distribution's log-probs, so the learner scores the same one, ``z -> z / tau`` chunk by chunk
(no second ``[N, V]`` tensor), and the gradient carries the factor:

    d log pi_tau(y_i) / d z_{i, v} = (1[v = y_i] - p_tau_{i, v}) / tau

``rollout.min_tokens``: the sampler cannot stop before it, because the engine sets the stop tokens'
logits to -inf at those positions before sampling (and before it reports log-probs). ``banned``
(``[N]`` bool, the positions before ``min_tokens``) and ``stop_ids`` do the same here, so the
distribution scored is the one sampled: ``pi(y) = softmax(z / tau with z_stop = -inf)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _scaled(logits: Tensor, start: int, end: int, temperature: float, ban: tuple[Tensor, Tensor] | None) -> Tensor:
    """fp32 ``z / tau`` of rows ``start:end``, with the stop tokens at -inf where they were banned."""
    z = logits[start:end].float() / temperature  # z / tau
    if ban is not None:
        banned, stop_ids = ban
        rows = banned[start:end].nonzero().squeeze(1)  # [r] positions before min_tokens in this chunk
        if rows.numel():
            z[rows[:, None], stop_ids[None, :]] = float("-inf")  # z_stop = -inf: the sampler could not stop
    return z


class _ChunkedTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, chunk: int, temperature: float, ban) -> Tensor:
        out = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.size(0), chunk):
            z = _scaled(logits, start, start + chunk, temperature, ban)
            lse[start : start + chunk] = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, ids[start : start + chunk, None]).squeeze(1)
            out[start : start + chunk] = picked - lse[start : start + chunk]  # log pi_tau(y) = z_y/tau - lse(z/tau)
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk, ctx.temperature, ctx.ban = chunk, temperature, ban
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, ids, lse = ctx.saved_tensors
        tau = ctx.temperature
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.size(0), ctx.chunk):
            end = start + ctx.chunk
            scaled = grad[start:end, None] / tau  # grad / tau
            g = _scaled(logits, start, end, tau, ctx.ban) - lse[start:end, None]  # one [c, V] buffer, in place:
            g.exp_().mul_(-scaled)  # -p_tau * grad / tau (0 on banned stop tokens)
            g.scatter_add_(1, ids[start:end, None], scaled)  # + 1[v = y] * grad / tau
            grad_logits[start:end] = g
        return grad_logits, None, None, None, None


def token_logprobs(
    logits: Tensor,
    ids: Tensor,
    chunk: int = 1024,
    temperature: float = 1.0,
    ban: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``[N]`` fp32 ``log pi_tau(ids_i)`` from ``[N, V]`` logits, ``pi_tau = softmax(z / temperature)``,
    ``chunk`` rows at a time (see above); differentiable with respect to ``logits``. ``chunk <= 0``:
    all rows at once. ``ban``: ``([N] bool, [S] stop token ids)``: those tokens cannot be sampled at
    those positions (``rollout.min_tokens``)."""
    if logits.size(0) == 0:
        return logits.new_zeros(0, dtype=torch.float32)
    step = chunk if chunk > 0 else logits.size(0)
    return _ChunkedTokenLogprob.apply(logits, ids, step, float(temperature), ban)


@torch.no_grad()
def token_entropy(
    logits: Tensor, chunk: int = 1024, temperature: float = 1.0, ban: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """``[N]`` fp32 entropy of each row's ``softmax(z / temperature)`` (banned stop tokens excluded, as
    in ``token_logprobs``), ``chunk`` rows at a time (no gradient)."""
    out = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
    step = chunk if chunk > 0 else max(logits.size(0), 1)
    for start in range(0, logits.size(0), step):
        z = _scaled(logits, start, start + step, temperature, ban)
        lse = torch.logsumexp(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        out[start : start + step] = lse - (p * z.masked_fill(p == 0, 0.0)).sum(-1)  # 0 * -inf counts 0
    return out


class _ChunkedExactKL(torch.autograd.Function):
    """``KL_i = sum_v p_v (log p_v - log q_v)`` with ``p = softmax(z_i / tau)``, ``q = softmax(r_i / tau)``;
    the gradient with respect to the policy's logits, recomputed chunk by chunk in the backward pass:

        d KL_i / d z_{i, v} = p_v (log p_v - log q_v - KL_i) / tau
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ref_logits: Tensor, chunk: int, temperature: float, ban) -> Tensor:
        out = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.size(0), chunk):
            logp, logq, p = _pair(logits, ref_logits, start, start + chunk, temperature, ban)
            out[start : start + chunk] = torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)
        ctx.save_for_backward(logits, ref_logits, out)
        ctx.chunk, ctx.temperature, ctx.ban = chunk, temperature, ban
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, ref_logits, kl = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.size(0), ctx.chunk):
            end = start + ctx.chunk
            logp, logq, p = _pair(logits, ref_logits, start, end, ctx.temperature, ctx.ban)
            g = torch.where(p > 0, p * (logp - logq - kl[start:end, None]), 0.0)
            grad_logits[start:end] = g * (grad[start:end, None] / ctx.temperature)
        return grad_logits, None, None, None, None


def _pair(logits: Tensor, ref_logits: Tensor, start: int, end: int, temperature: float, ban):
    """fp32 ``log p``, ``log q`` and ``p`` of rows ``start:end`` (banned stop tokens at probability 0)."""
    logp = torch.log_softmax(_scaled(logits, start, end, temperature, ban), dim=-1)
    logq = torch.log_softmax(_scaled(ref_logits, start, end, temperature, ban), dim=-1)
    return logp, logq, logp.exp()


def token_kl(
    logits: Tensor,
    ref_logits: Tensor,
    chunk: int = 1024,
    temperature: float = 1.0,
    ban: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``[N]`` fp32 exact KL(pi_tau || pi_ref_tau) over the whole vocabulary at each of the ``N`` positions,
    from ``[N, V]`` logits of the policy (differentiable) and of the reference (constants), ``chunk`` rows
    at a time: the extra memory is a few ``chunk x V`` buffers, whatever ``N`` is. ``ban`` as in
    ``token_logprobs``: both distributions are the ones the sampler's rules allow."""
    if logits.size(0) == 0:
        return logits.new_zeros(0, dtype=torch.float32)
    step = chunk if chunk > 0 else logits.size(0)
    return _ChunkedExactKL.apply(logits, ref_logits.detach(), step, float(temperature), ban)
