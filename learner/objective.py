"""The loss of one micro-batch: the method's policy loss, importance weights, a KL term.

Everything is chosen once, when the rank builds its objective from the algorithm section:
the policy loss and its clip parameters from the method, the aggregation weights, whether
truncated importance sampling and a KL loss term apply. The returned callable is pure tensor
arithmetic on one micro-batch's ``CompletionView``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from learner.algorithms import get_kl_estimator, tis_weights, token_weights
from learner.algorithms.rejection import rejection_mask
from learner.config import AlgorithmConfig, TISConfig
from learner.rank_batch import CompletionView
from learner.shard import Normaliser

Objective = Callable[[Tensor, CompletionView, Normaliser, float], tuple[Tensor, dict[str, Tensor]]]


def aggregation_weights(tokens: CompletionView, normaliser: Normaliser, aggregation: str, max_tokens: int) -> Tensor:
    """``[n, T]`` loss weights; the normalisers are the optimizer step's global counts and, for
    ``fixed_length`` (Dr. GRPO), the generation limit ``L_max = rollout.max_tokens``: a constant,
    not the longest completion of the step."""
    return token_weights(
        tokens.completion_mask,
        aggregation,
        num_tokens=normaliser.num_tokens,
        num_sequences=normaliser.num_sequences,
        max_len=max_tokens,
    )


def importance_weights(tis: TISConfig) -> Callable | None:
    """``(learner_logprobs, sampler_logprobs, mask) -> (weights [n, T], metrics)`` of ``tis``, or None."""
    if tis.mode == "none":
        return None
    return partial(tis_weights, cap=tis.cap, level=tis.level, mode=tis.mode, low=tis.low, high=tis.high)


def rejection(tis: TISConfig) -> Callable | None:
    """``(learner_logprobs, sampler_logprobs, mask) -> (keep [n, T], metrics)`` of ``tis.reject``, or None."""
    return partial(rejection_mask, rules=tis.rules()) if tis.reject else None


def build_objective(algorithm: AlgorithmConfig, max_tokens: int) -> Objective:
    """``objective(learner_logprobs [n, T], tokens, normaliser, kl_beta) -> (loss, metrics)``.

    The old policy is the learner's log-probs before this batch's first update: scored up front
    when there are several updates per batch or a KL needs them, otherwise the current
    log-probs, detached (the same values at the only update; the ratio is then 1).
    Truncated importance sampling multiplies the policy term's token weights by
    ``min(pi_old / pi_sampler, C)`` (or masks, or keeps the ratio inside a band): a correction for
    the sampler's staleness that stays fixed across epochs and minibatches, stacked with PPO's own
    ratio to the old policy. Rejection rules (``tis.reject``) multiply them by 0 where the learner
    and the sampler diverge too much, token by token or whole sequences.
    A KL loss term ``beta * sum_t w_t KL_t`` is added when ``kl.placement == "loss"``.
    """
    method = algorithm.method
    clip = algorithm.clip
    params = {} if clip is None else {"eps_low": clip[0], "eps_high": clip[1]}
    if method.dual_clip and algorithm.loss.dual_clip is not None:
        params["dual_clip"] = algorithm.loss.dual_clip
    policy_loss = partial(method.loss, **params)
    weigh = partial(aggregation_weights, aggregation=algorithm.aggregation, max_tokens=max_tokens)
    tis = algorithm.tis
    importance = importance_weights(tis)
    reject = rejection(tis)
    normalize = tis.normalize
    exact = algorithm.kl.in_loss and algorithm.kl.exact  # from both models' logits in the update: tokens.exact_kl
    kl = get_kl_estimator(algorithm.kl.estimator) if algorithm.kl.in_loss and not exact else None

    def objective(learner_logprobs: Tensor, tokens: CompletionView, normaliser: Normaliser, kl_beta: float):
        mask = tokens.completion_mask
        weights = weigh(tokens, normaliser)
        old = tokens.old_logprobs if tokens.old_logprobs is not None else learner_logprobs.detach()
        policy_weights, metrics = weights, {}
        if importance is not None:  # w_t *= min(pi_old / pi_sampler, C) (or a 0/1 mask), fixed across updates
            is_weights, metrics = importance(old, tokens.sampler_logprobs, mask)
            policy_weights = weights * is_weights
        if reject is not None:  # w_t *= 1[every rule keeps the token and its sequence]
            keep, reject_metrics = reject(old, tokens.sampler_logprobs, mask)
            policy_weights = policy_weights * keep
            metrics.update(reject_metrics)
        if normalize:  # w_t / mean(w): the step's mean weight over its trained units (after rejection) is 1
            policy_weights = policy_weights / normaliser.is_mean
        real = mask > 0  # kept_frac: the share of trained tokens the loss still weighs (IS weight, rules: not 0)
        metrics["kept_frac"] = ((policy_weights != 0) & real).sum().to(weights.dtype) / real.sum().clamp(min=1)
        loss, loss_metrics = policy_loss(learner_logprobs, old, tokens.advantages, mask, policy_weights)
        metrics.update(loss_metrics)
        if kl is not None or exact:
            kl_t = tokens.exact_kl if exact else kl(learner_logprobs, tokens.ref_logprobs, mask)  # [n, T]
            loss = loss + kl_beta * (kl_t * weights).sum()  # + beta * sum_t w_t KL_t
            metrics["kl_ref"] = ((kl_t * mask).sum() / mask.sum().clamp(min=1)).detach()
        return loss, metrics

    return objective
