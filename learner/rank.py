"""One data-parallel rank's part of a training step, on whichever models this process holds.

The calls of a step, in order (``learner/group.py`` makes them):

    score(shard)                 pack the shard once and keep it; the forward passes that must
                                 precede any update (old and reference log-probs, the critic's values)
    summarise(beta, *imports)    take what separately placed models scored for this shard; KL_t;
                                 token rewards; the estimator's per-sequence summary
    expand(per_sequence)         per-token advantages (and critic targets) from the batch-wide reduction
    train(whitening, beta, *imports)  every epoch, every minibatch: forward/backward per micro-batch,
                                 then one optimizer step of each model this rank trains

Only per-sequence arrays and a few sums go back to the driver. The models are DeepSpeed
engines (or anything with the same ``__call__``/``backward``/``step`` surface: the fast tests
use plain torch), built by ``learner/worker.py``; nothing here knows about Ray or DeepSpeed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from learner.algorithms import get_kl_estimator, masked_moments, value_loss, whiten
from learner.algorithms.importance import weight_sums
from learner.config import AlgorithmConfig
from learner.estimators import TokenRewards
from learner.head import scored_logits
from learner.objective import aggregation_weights, build_objective, importance_weights, rejection
from learner.packing import PackedInputs, packed_at_completion, packed_completion_kl, packed_completion_logprobs
from learner.rank_batch import RankBatch
from learner.returns import token_rewards
from learner.shard import Exports, RankAdvantages, RankShard, RankSummary

EXTREMES = ("_max", "_min")  # metrics that are a step's extreme, not its token-weighted mean
# an update's phases, timed on the host (learner/time_<phase>_s; the rest of learner_seconds is packing and
# bookkeeping). With a GPU a phase ends when its kernels are queued, so time moves to the next call that waits.
PHASES = ("forward", "backward", "critic", "optimizer")


def _parameters(model) -> list:
    return list(getattr(model, "module", model).parameters())


def discard_gradients(model) -> None:
    """Skip the update of non-finite gradients. A DeepSpeed ZeRO optimizer (stages 1-3) does so
    itself inside ``step()``: its gradient norm is not finite, so it applies nothing and clears its
    partitioned buffers (calling ``step`` keeps its bookkeeping right). Otherwise (ZeRO-0, a plain
    optimiser) the gradients are dropped here."""
    stage = getattr(model, "zero_optimization_stage", None)
    if callable(stage) and stage() > 0:
        model.step()
        return
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        optimizer.zero_grad()
    for p in _parameters(model):
        p.grad = None


def agree_all(ok: bool, device: torch.device) -> bool:
    """``ok`` on every rank of the default group: a MAX all-reduce of ``0`` (ok) or ``1``. The flag lives
    on ``device``, the rank's compute device: NCCL's group serves only ``cuda`` tensors (a CPU flag
    fails there with "No backend type associated with device type cpu"), gloo's the CPU ones."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0.0


@dataclass
class Models:
    """What one process holds: ``policy`` and ``critic`` train, ``reference`` is frozen."""

    policy: Any = None  # engine over a causal LM
    critic: Any = None  # engine over learner.critic.ValueModel
    reference: Any = None  # a plain module in eval mode


@dataclass(frozen=True)
class Sampled:
    """The distribution the actors sampled from, which the ranks score (old, reference and trained
    log-probs, entropy): ``softmax(z / temperature)`` with the stop tokens impossible before
    ``min_tokens`` (``learner/logprobs.py``)."""

    temperature: float = 1.0  # rollout.temperature
    min_tokens: int = 0  # rollout.min_tokens
    stop_ids: tuple[int, ...] = ()  # the tokens the engine stops on: the tokenizer's EOS and the generation config's


@dataclass
class Layout:
    """How this rank packs: the pad token, where tensors go, the attention mask form."""

    pad_id: int
    device: torch.device
    mask_dtype: torch.dtype | None  # bool for sdpa, the activation dtype for eager
    row_tokens: int | None  # learner.pack_row_tokens
    logprob_chunk: int = 1024  # learner.logprob_chunk_tokens
    sampled: Sampled = field(default_factory=lambda: Sampled())  # the distribution the actors sampled from


class RankStep:
    def __init__(self, models: Models, algorithm: AlgorithmConfig, layout: Layout, max_tokens: int, world_size: int):
        self.models, self.algorithm, self.layout = models, algorithm, layout
        self.max_tokens, self.world_size = max_tokens, world_size
        self.objective = build_objective(algorithm, max_tokens) if models.policy is not None else None
        self.reject = rejection(algorithm.tis)
        self.estimator = algorithm.method.estimator(algorithm)
        self.kl = get_kl_estimator(algorithm.kl.sampled_estimator) if algorithm.kl.enabled else None
        self.exact_kl = algorithm.kl.enabled and algorithm.kl.exact  # the reference's logits in every update
        # the old policy is scored up front when it differs from the current one at some update, or a KL needs it
        # (or the importance weights' batch mean)
        self.needs_old = models.policy is not None and (
            algorithm.kl.enabled or algorithm.updates_per_batch > 1 or algorithm.tis.normalize
        )
        self.vocab = 1
        self.batch: RankBatch | None = None
        self.phase_s: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # the last update's (train)
        self.tokens: TokenRewards | None = None

    # --- the forward passes -----------------------------------------------------------------
    def _forward(self, model, micro: PackedInputs) -> torch.Tensor:
        """``[1, N, V]`` logits at the scored positions only, in any row layout (``learner/head.py``)."""
        return scored_logits(model, micro)

    def _logprobs(self, model, micro: PackedInputs, mask: torch.Tensor, with_entropy: bool = False, logits=None):
        logits = self._forward(model, micro) if logits is None else logits
        self.vocab = logits.shape[-1]
        chunk, sampled = self.layout.logprob_chunk, self.layout.sampled
        return packed_completion_logprobs(
            logits, micro, mask, with_entropy, chunk, sampled.temperature, sampled.min_tokens, sampled.stop_ids
        )

    def _exact_kl(self, logits: torch.Tensor, micro: PackedInputs, view) -> torch.Tensor:
        """``[n, T]`` KL(pi || pi_ref) over the vocabulary (``kl.estimator: exact``): one reference forward."""
        with torch.no_grad():
            ref_logits = self._forward(self.models.reference, micro)
        sampled = self.layout.sampled
        return packed_completion_kl(
            logits, ref_logits, micro, view.completion_mask, self.layout.logprob_chunk,
            sampled.temperature, sampled.min_tokens, sampled.stop_ids,
        )  # fmt: skip

    def _values(self, micro: PackedInputs, mask: torch.Tensor) -> torch.Tensor:
        return packed_at_completion(self.models.critic(**micro.model_inputs()), micro).float() * mask  # [n, T]

    def _scorers(self) -> dict:
        """Table column -> how to compute it for a micro-batch, for what must be scored before updating."""
        m, out = self.models, {}
        if self.needs_old:
            out["old_logprobs"] = lambda micro, mask: self._logprobs(m.policy, micro, mask)
        if m.reference is not None:
            out["ref_logprobs"] = lambda micro, mask: self._logprobs(m.reference, micro, mask)
        if m.critic is not None:
            out["old_values"] = self._values
        return out

    def _trainable(self) -> list:
        return [model for model in (self.models.policy, self.models.critic) if model is not None]

    # --- the step ---------------------------------------------------------------------------
    def score(self, shard: RankShard) -> Exports:
        """Pack the shard and score it. A process without the policy (a separate critic or
        reference) returns what it scored, for the policy rank of the same shard."""
        lay = self.layout
        batch = RankBatch(shard, lay.pad_id, lay.device, lay.mask_dtype, lay.row_tokens)
        scorers = self._scorers()
        for name in scorers:  # a rank with no sequences still has (empty) columns to report
            batch.add_column(name)
        if scorers:
            for model in self._trainable():
                model.eval()
            with torch.no_grad():
                for micro in batch.packed(batch.micro_batches()):
                    # every sampled token, trained or not: a masked completion's KL still counts in its reward
                    mask = batch.part("completion_tokens", micro)
                    for name, scorer in scorers.items():
                        batch.write(name, micro, scorer(micro, mask))
        exported = {} if self.models.policy is not None else {name: batch.export_flat(name) for name in scorers}
        exports = Exports(**exported)
        self.batch = batch if self._trainable() else None  # a reference-only process keeps nothing
        return exports

    def _import(self, imports: tuple[Exports, ...]) -> None:
        for exports in imports:
            for name, flat in exports.columns():
                self.batch.import_flat(name, flat)

    def summarise(self, kl_beta: float, *imports: Exports) -> RankSummary:
        """Token rewards and the estimator's per-sequence summary; ``imports`` are the separate
        critic's and reference's ``score`` results for this shard."""
        self._import(imports)
        batch, kl_cfg = self.batch, self.algorithm.kl
        mask = batch.column("completion_mask")  # [n, T] trained tokens
        completion = batch.column("completion_tokens")  # [n, T] every sampled token, trained or not
        # the KL of every sampled token: a completion that trains no token keeps its -beta KL in its reward,
        # as it keeps its task reward, so the baselines of the rows that do train are what they were unmasked
        kl = self.kl(batch.column("old_logprobs"), batch.column("ref_logprobs"), completion) if self.kl else None
        rewards = token_rewards(batch.rewards, kl if kl_cfg.in_reward else None, completion, kl_beta)
        step_rewards, step_end = batch.step_rewards() if self.algorithm.method.per_step_rewards else (None, None)
        self.tokens = TokenRewards(rewards, mask, batch.column("old_values"), step_rewards, step_end, completion)
        per_sequence = {name: v.numpy() for name, v in self.estimator.summarise(self.tokens).items()}
        kl_sum = float((kl * mask).sum()) if kl is not None else 0.0
        is_sums = self._importance_sums() if self.algorithm.tis.normalize else None
        return RankSummary(per_sequence, kl_sum, float(mask.sum()), is_sums)

    def _importance_sums(self) -> list[tuple[float, float]]:
        """``tis.normalize``: each minibatch's (sum, count) of the importance weights on this rank, after
        the rejection rules (a rejected token weighs 0 but still counts)."""
        weigh, reject = importance_weights(self.algorithm.tis), self.reject
        level, sums = self.algorithm.tis.level, []
        for micro_batches in self.batch.minibatches:
            total = count = 0.0
            for micro in micro_batches:
                view = self.batch.view(micro)
                weights, _ = weigh(view.old_logprobs, view.sampler_logprobs, view.completion_mask)
                if reject is not None:
                    weights = weights * reject(view.old_logprobs, view.sampler_logprobs, view.completion_mask)[0]
                part, n = weight_sums(weights, view.completion_mask, level)
                total, count = total + part, count + n
            sums.append((total, count))
        return sums

    def expand(self, per_sequence: dict[str, np.ndarray]) -> tuple[RankAdvantages, Exports]:
        """Advantages (and critic targets) of this rank's tokens; returns their moments for whitening,
        and the critic targets when the critic trains in another process."""
        tokens = self.tokens
        advantages, returns = self.estimator.expand(tokens, {k: torch.from_numpy(v) for k, v in per_sequence.items()})
        self.batch.set("advantages", advantages)
        exports = Exports()
        if returns is not None:
            self.batch.set("returns", returns)
            if self.models.critic is None:
                exports.returns = self.batch.export_flat("returns")
        return RankAdvantages(masked_moments(advantages, tokens.mask).numpy()), exports

    def train(
        self, whitening: np.ndarray | None, kl_beta: float, *imports: Exports, is_means: list[float] | None = None
    ) -> dict[str, float]:
        """Every epoch, every minibatch: forward/backward its micro-batches, one optimizer step
        (of the policy and/or the critic). ``whitening``: the whole batch's advantage moments;
        ``is_means``: each minibatch's mean importance weight over every rank (``tis.normalize``).
        Returns token-weighted mean metrics; ``loss`` is this rank's share of the global policy
        loss (summed over minibatches and epochs)."""
        start = time.monotonic()
        self._import(imports)
        batch, policy = self.batch, self.models.policy
        totals: dict[str, float] = {"loss": 0.0}
        if policy is not None:
            mask = batch.column("completion_mask")
            if whitening is not None:
                batch.set("advantages", whiten(batch.column("advantages"), mask, moments=torch.from_numpy(whitening)))
            # |A| of the advantages trained on (after whitening); token-weighted over ranks like the rest
            advantage_abs = float((batch.column("advantages").abs() * mask).sum()) / max(float(mask.sum()), 1.0)
        get_lr = getattr(policy, "get_lr", None)
        lr = float(get_lr()[0]) if callable(get_lr) else None  # the rate of this step's first update
        tokens, skipped, updates = 0, 0, 0
        extremes: dict[str, float] = {}  # *_max / *_min metrics: the largest / smallest of any micro-batch
        for model in self._trainable():
            model.train()
        self.phase_s = dict.fromkeys(PHASES, 0.0)  # host wall time per phase of the update (the step's breakdown)
        for _ in range(batch.epochs):
            for index, (normaliser, micro_batches) in enumerate(zip(batch.normalisers, batch.minibatches, strict=True)):
                if is_means is not None:
                    normaliser = dataclasses.replace(normaliser, is_mean=is_means[index])
                finite = True
                for micro in batch.packed(micro_batches):  # packed one at a time (learner/rank_batch.py)
                    view = batch.view(micro)
                    n = float(view.completion_mask.sum())
                    tokens += int(n)
                    metrics = {}
                    if policy is not None:
                        loss, metrics = self._policy_backward(micro, view, normaliser, kl_beta)
                        totals["loss"] += loss
                        finite = finite and math.isfinite(loss)
                    if self.models.critic is not None:
                        started = time.perf_counter()
                        metrics.update(self._critic_backward(micro, view, normaliser))
                        self.phase_s["critic"] += time.perf_counter() - started
                        finite = finite and math.isfinite(metrics["value_loss_share"])
                    for key, value in metrics.items():  # token-weighted, summed across micro-batches
                        if key.endswith(EXTREMES):  # the step's extreme over its micro-batches with tokens
                            if n > 0:
                                pick = max if key.endswith("_max") else min
                                extremes[key] = pick(extremes.get(key, float(value)), float(value))
                        else:
                            totals[key] = totals.get(key, 0.0) + float(value) * n
                updates += 1
                stepping = time.perf_counter()
                if self._all_finite(finite):
                    for model in self._trainable():
                        model.step()
                else:  # a non-finite loss or gradient on any rank: no rank applies this update
                    skipped += 1
                    for model in self._trainable():
                        discard_gradients(model)
                self.phase_s["optimizer"] += time.perf_counter() - stepping
        out = {k: (v if k == "loss" else v / max(tokens, 1)) for k, v in totals.items()} | extremes
        out["tokens"] = tokens / batch.epochs
        out["nonfinite_updates"] = float(skipped)
        out["updates"] = float(updates)
        if policy is not None:
            out["advantage_abs_mean"] = advantage_abs
        out["seconds"] = time.monotonic() - start
        out |= {f"time_{phase}_s": seconds for phase, seconds in self.phase_s.items()}
        grad_norm = policy.get_global_grad_norm() if policy is not None and skipped < updates else None
        if lr is not None:
            out["lr"] = lr
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        self.batch = self.tokens = None  # the step is over
        return out

    def _all_finite(self, finite: bool) -> bool:
        """This rank's losses were finite and so are its local gradients; agreed over the ranks
        (every rank calls it at every update, so the collective lines up)."""
        if finite:
            grads = [p.grad for model in self._trainable() for p in _parameters(model) if p.grad is not None]
            finite = not grads or bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())
        return agree_all(finite, self.layout.device) if self.world_size > 1 else finite

    def _policy_backward(self, micro: PackedInputs, view, normaliser, kl_beta: float) -> tuple[float, dict]:
        """The policy's loss share on ``micro`` and its backward; the logits (``[1, N, V]``) and the
        graph die with this call, before the next micro-batch is packed."""
        started = time.perf_counter()
        logits = self._forward(self.models.policy, micro)
        logprobs, entropy = self._logprobs(self.models.policy, micro, view.completion_mask, True, logits)
        if self.exact_kl:
            view = dataclasses.replace(view, exact_kl=self._exact_kl(logits, micro, view))
        loss, metrics = self.objective(logprobs, view, normaliser, kl_beta)
        forward = time.perf_counter()
        # DeepSpeed averages gradients over ranks; the loss is already a share of the
        # global sum, so scale by world size to make the reduced gradient the global one.
        self.models.policy.backward(loss * self.world_size, scale_wrt_gas=False)
        self.phase_s["forward"] += forward - started
        self.phase_s["backward"] += time.perf_counter() - forward
        metrics["entropy"] = entropy.sum() / max(float(view.completion_mask.sum()), 1.0)
        metrics["uniform_entropy"] = math.log(self.vocab)  # ln V: a policy that says nothing
        return float(loss.detach()), metrics

    def _critic_backward(self, micro: PackedInputs, view, normaliser) -> dict[str, float]:
        values = packed_at_completion(self.models.critic(**micro.model_inputs()), micro).float()  # [n, T]
        weights = aggregation_weights(view, normaliser, self.algorithm.aggregation, self.max_tokens)
        clip = self.algorithm.critic.value_clip
        loss, metrics = value_loss(
            values,
            view.returns,
            view.completion_mask,
            weights,
            old_values=view.old_values if clip else None,
            clip=clip,
        )
        self.models.critic.backward(loss * self.world_size, scale_wrt_gas=False)
        return {"value_loss_share": float(loss.detach()), **{f"critic_{k}": v for k, v in metrics.items()}}
