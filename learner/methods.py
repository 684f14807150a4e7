"""The policy-gradient methods Tandem carries, chosen once by ``algorithm.name``.

A ``Method`` names how rewards become advantages (``learner/returns.py``), which
per-token policy loss the ranks minimise (``learner/algorithms/policy_losses.py``),
how token losses are averaged, its default clip range, and whether it needs a critic.

| method        | advantages                         | loss      | aggregation  |
| ------------- | ---------------------------------- | --------- | ------------ |
| reinforce     | reward-to-go - batch-mean baseline | vanilla   | token_mean   |
| rloo          | leave-one-out group baseline       | ppo_clip  | token_mean   |
| grpo          | (r - mean) / (std + eps) per group | ppo_clip  | token_mean   |
| grpo_process  | per-step rewards, group-normalised | ppo_clip  | token_mean   |
| dr_grpo       | r - group mean (no std)            | ppo_clip  | fixed_length |
| gspo          | as grpo                            | gspo      | seq_mean     |
| cispo         | as grpo                            | cispo     | token_mean   |
| ppo           | GAE(gamma, lambda) with a critic   | ppo_clip  | token_mean   |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from learner.algorithms import get_kl_estimator, get_policy_loss, tis_weights, token_weights


@dataclass(frozen=True)
class Method:
    advantage: str  # estimator name in learner/returns.py
    loss: str  # policy loss name in learner/algorithms/policy_losses.py
    aggregation: str  # token_mean | seq_mean | fixed_length
    clip: tuple[float, float]  # default (eps_low, eps_high)
    needs_critic: bool = False


METHODS: dict[str, Method] = {
    "reinforce": Method("reinforce", "vanilla_pg", "token_mean", (0.2, 0.2)),
    "rloo": Method("rloo", "ppo_clip", "token_mean", (0.2, 0.2)),
    "grpo": Method("grpo", "ppo_clip", "token_mean", (0.2, 0.2)),
    "grpo_process": Method("grpo_process", "ppo_clip", "token_mean", (0.2, 0.2)),
    "dr_grpo": Method("dr_grpo", "ppo_clip", "fixed_length", (0.2, 0.2)),
    "gspo": Method("grpo", "gspo", "seq_mean", (3e-4, 4e-4)),
    "cispo": Method("grpo", "cispo", "token_mean", (1.0, 0.2)),
    "ppo": Method("gae", "ppo_clip", "token_mean", (0.2, 0.2), needs_critic=True),
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(METHODS)}")
    return METHODS[name]


def aggregation_of(algorithm: dict[str, Any]) -> str:
    return algorithm.get("loss_aggregation") or get_method(algorithm["name"]).aggregation


def build_objective(algorithm: dict[str, Any]):
    """``objective(learner_logprobs [b,T], batch, minibatch, kl_beta) -> (loss, metrics)``.

    The old policy is the learner's log-probs before this batch's first update (computed
    up front when there are several updates per batch; otherwise the current log-probs,
    detached, which makes the ratio 1 and the loss the plain policy gradient).
    Truncated importance sampling multiplies the policy term's token weights by
    ``min(pi_learner / pi_sampler, C)`` (or masks), correcting for the sampler's staleness;
    it stacks with PPO's own ratio against the old policy. A KL loss term
    ``beta * sum_t w_t KL_t`` is added when ``kl.placement == "loss"``.
    """
    method = get_method(algorithm["name"])
    policy_loss = get_policy_loss(method.loss)
    aggregation = aggregation_of(algorithm)
    eps_low = algorithm["clip_eps_low"] if algorithm["clip_eps_low"] is not None else method.clip[0]
    eps_high = algorithm["clip_eps_high"] if algorithm["clip_eps_high"] is not None else method.clip[1]
    clip = {} if method.loss == "vanilla_pg" else {"eps_low": eps_low, "eps_high": eps_high}
    if algorithm.get("dual_clip") is not None and method.loss == "ppo_clip":
        clip["dual_clip"] = algorithm["dual_clip"]
    tis = algorithm["tis"]
    kl = algorithm["kl"]
    kl_in_loss = kl["placement"] == "loss"
    kl_estimator = get_kl_estimator(kl["estimator"]) if kl_in_loss else None

    def objective(learner_logprobs, batch, minibatch, kl_beta: float):
        weights = token_weights(
            batch.completion_mask,
            aggregation,
            num_tokens=minibatch.num_tokens,
            num_sequences=minibatch.num_sequences,
            max_len=minibatch.max_len,
        )
        old = batch.old_logprobs if batch.old_logprobs is not None else learner_logprobs.detach()
        policy_weights, metrics = weights, {}
        if tis["mode"] != "none":  # correct for the sampler's (stale) policy: w_t *= min(rho_t, C) or a 0/1 mask
            is_weights, metrics = tis_weights(
                learner_logprobs.detach(),
                batch.sampler_logprobs,
                batch.completion_mask,
                cap=tis["cap"],
                level=tis["level"],
                mode=tis["mode"],
            )
            policy_weights = weights * is_weights
        loss, loss_metrics = policy_loss(
            learner_logprobs, old, batch.advantages, batch.completion_mask, policy_weights, **clip
        )
        metrics.update(loss_metrics)
        if kl_in_loss:
            kl_t = kl_estimator(learner_logprobs, batch.ref_logprobs, batch.completion_mask)  # [b, T]
            loss = loss + kl_beta * (kl_t * weights).sum()  # + beta * sum_t w_t KL_t
            n = batch.completion_mask.sum().clamp(min=1)
            metrics["kl_ref"] = ((kl_t * batch.completion_mask).sum() / n).detach()
        return loss, metrics

    return objective


def value_weights(batch, minibatch, algorithm: dict[str, Any]) -> torch.Tensor:
    """The critic's loss uses the same aggregation and normalisers as the policy."""
    return token_weights(
        batch.completion_mask,
        aggregation_of(algorithm),
        num_tokens=minibatch.num_tokens,
        num_sequences=minibatch.num_sequences,
        max_len=minibatch.max_len,
    )
