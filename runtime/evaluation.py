"""Evaluation on a held-out set: the actors sample it with the current weights, the driver scores it.

Every ``eval.every`` steps (and before the first step and after the last) the held-out prompts go
into the prompt queue as ``purpose="eval"`` requests with ``eval.samples`` completions each at
``eval.temperature``; the actors generate and score them like any prompt, with the weights they
hold (at least the version asked for); the training loop's collector hands their groups here
instead of to the batch. A round is logged when its last group is back: one line in
``RUN_DIR/eval.jsonl``, TensorBoard scalars under ``eval/`` and a progress line.

Metrics of a round of ``m`` prompts, ``n`` samples each, ``c_i`` correct (reward >=
``eval.correct_reward``) for prompt ``i``::

    pass@k = mean_i [ 1 - C(n - c_i, k) / C(n, k) ]     (the unbiased estimator; 1 when n - c_i < k)

for k = 1, 2, 4, ... up to n (pass@1 = mean_i c_i / n), and the mean reward, completion length
and truncated fraction over all m x n completions.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from queues.messages import PromptRequest, TrajectoryGroup
from runtime.collector import settled
from schema import Section


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of ``k`` of the ``n`` samples (``c`` correct) is correct, drawn without
    replacement: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``, then ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def eval_metrics(groups: list[TrajectoryGroup], correct_reward: float) -> dict[str, Any]:
    """The metrics of one round (see the module docstring); keys ``eval/...``."""
    if not groups:
        return {"eval/prompts": 0}
    n = min(len(g.trajectories) for g in groups)
    out: dict[str, Any] = {"eval/prompts": len(groups), "eval/samples": n}
    correct = [sum(t.reward >= correct_reward for t in g.trajectories[:n]) for g in groups]
    for k in ks_for(n):
        out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in correct]))
    trajs = [t for g in groups for t in g.trajectories[:n]]
    out["eval/reward_mean"] = float(np.mean([t.reward for t in trajs]))
    out["eval/completion_len_mean"] = float(np.mean([len(t.completion_token_ids) for t in trajs]))
    out["eval/truncated_frac"] = float(np.mean([t.finish_reason == "length" for t in trajs]))
    out["eval/reward_errors"] = sum(g.reward_errors for g in groups)
    if failed := [t.episode_failure for t in trajs if t.episode_failure]:  # episodes their environment ended
        out["eval/episode_failed"], out["eval/episode_failure"] = len(failed), failed[0]
    versions = [int(np.min(t.policy_versions)) for t in trajs if len(t.policy_versions)]
    out["eval/policy_version"] = min(versions) if versions else 0
    return out


class EvalConfig(Section):
    prompts: str | None = Field(
        None, description="Held-out rows to evaluate on, in any form data.prompts takes (columns mapped the same way)."
    )
    split: str = Field("test", description="Split of eval.prompts when it is a dataset directory or name.")
    subset: str | None = Field(None, description="Configuration of eval.prompts (default: data.subset).")
    prompt_field: str | None = Field(None, description="Prompt column of eval.prompts (default: data.prompt_field).")
    answer_field: str | None = Field(None, description="Answer column of eval.prompts (default: data.answer_field).")
    fraction: float = Field(
        0.0, ge=0, lt=1, description="Hold this fraction of data.prompts out of training and evaluate on it instead."
    )
    max_prompts: int | None = Field(None, gt=0, description="Evaluate on the first N held-out rows only.")
    every: int = Field(
        0,
        ge=0,
        description="Evaluate every N steps; with a held-out set it also runs before step 1 and after the last one.",
    )
    samples: int = Field(4, gt=0, description="Completions per held-out prompt (k of pass@k).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for evaluation (0: greedy).")
    correct_reward: float = Field(
        1.0, description="A completion counts as correct (for pass@k) when its reward is at least this."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if self.prompts and self.fraction:
            raise ValueError("set eval.prompts or eval.fraction, not both")
        if self.every and not self.enabled:
            raise ValueError(
                f"eval.every = {self.every} but there is nothing to evaluate on; set eval.prompts or eval.fraction"
            )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.prompts or self.fraction)


@dataclass
class EvalRound:
    step: int  # steps trained when it was asked for
    ids: set[int]
    groups: list[TrajectoryGroup] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


class Evaluator:
    """Sends the held-out rows through the actors and logs each round's metrics.

    ``put(requests)``: awaits the prompt queue's put; ``render(row)``: the prompt's token ids;
    ``record(step, metrics)``: where a finished round goes."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        config: EvalConfig,
        put: Callable[[list[PromptRequest]], Awaitable],
        render: Callable[[dict[str, Any]], list[int]],
        record: Callable[[int, dict[str, Any]], None],
        chunk: int = 16,
    ):
        self.rows, self.config, self.put, self.record = rows, config, put, record
        self.render = render
        self._token_ids: list[list[int]] | None = None  # rendered once, at the first round
        self.chunk = chunk
        self.rounds: dict[int, EvalRound] = {}  # by round index
        self.owner: dict[int, int] = {}  # prompt id -> round index
        self.sending: list[asyncio.Task] = []
        self.count = 0
        self.results: list[dict[str, Any]] = []

    @property
    def enabled(self) -> bool:
        return bool(self.rows)

    def due(self, done: int, total: int) -> bool:
        """An evaluation belongs after ``done`` steps (of ``total``)."""
        every = self.config.every
        return self.enabled and (done == 0 or done == total or bool(every and done % every == 0))

    def start(self, step: int, version: int) -> None:
        """Queue one round of the held-out set, generated with weights of at least ``version``."""
        index, m = self.count, len(self.rows)
        self.count += 1
        prompt_ids = [-(1 + index * m + i) for i in range(m)]  # negative: never a training prompt id
        requests = [
            PromptRequest(
                prompt_id=pid,
                row=row,
                min_version=version,
                prompt_token_ids=ids,
                purpose="eval",
                samples=self.config.samples,
                temperature=self.config.temperature,
                sample_seed=(1 << 30) + i,  # every round samples row i alike: rounds differ by weights only
            )
            for i, (pid, row, ids) in enumerate(zip(prompt_ids, self.rows, self.token_ids()))
        ]
        self.rounds[index] = EvalRound(step=step, ids=set(prompt_ids))
        self.owner.update({pid: index for pid in prompt_ids})
        self.sending.append(settled(asyncio.ensure_future(self._send(requests))))

    def token_ids(self) -> list[list[int]]:
        """Every held-out prompt's token ids, rendered the first time a round needs them."""
        if self._token_ids is None:
            self._token_ids = [self.render(row) for row in self.rows]
        return self._token_ids

    async def _send(self, requests: list[PromptRequest]) -> None:
        for start in range(0, len(requests), self.chunk):  # in pieces: the prompt queue is bounded
            await self.put(requests[start : start + self.chunk])

    def add(self, group: TrajectoryGroup) -> None:
        """An evaluation group is back; a completed round is recorded."""
        index = self.owner.pop(group.prompt_id, None)
        if index is None:
            return  # a duplicate (a replaced actor's late result)
        rnd = self.rounds[index]
        rnd.groups.append(group)
        if len(rnd.groups) == len(rnd.ids):
            self._finish(index)

    def _finish(self, index: int) -> None:
        rnd = self.rounds.pop(index)
        metrics = eval_metrics(sorted(rnd.groups, key=lambda g: -g.prompt_id), self.config.correct_reward)
        metrics["eval/seconds"] = round(time.monotonic() - rnd.started, 3)
        missing = len(rnd.ids) - len(rnd.groups)
        if missing:
            metrics["eval/missing_prompts"] = missing
        self.results.append({"step": rnd.step, **metrics})
        self.record(rnd.step, metrics)

    @property
    def pending(self) -> bool:
        return bool(self.rounds)

    def check_sending(self) -> None:
        """Raise the error of a failed put (a queue timeout), if one failed."""
        for task in [t for t in self.sending if t.done()]:
            self.sending.remove(task)
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()

    def give_up(self) -> None:
        """Record the unfinished rounds with what arrived (the run is ending)."""
        for task in self.sending:
            task.cancel()
        for index in sorted(self.rounds):
            self._finish(index)


def eval_line(step: int | None, metrics: dict[str, Any]) -> str:
    """The progress line of one round (``step`` None: a saved model's, outside a run)."""
    n = metrics.get("eval/samples", 0)
    k = f" | pass@{n} {metrics[f'eval/pass@{n}']:.3f}" if n > 1 else ""
    return (
        f"eval{'' if step is None else f' after step {step}'}: pass@1 {metrics.get('eval/pass@1', 0):.3f}{k} | reward "
        f"{metrics.get('eval/reward_mean', 0):.3f} | length {metrics.get('eval/completion_len_mean', 0):.1f} "
        f"| {metrics.get('eval/prompts', 0)} prompts x {n} in {metrics.get('eval/seconds', 0):.1f}s"
        + (
            f" | {metrics['eval/episode_failed']} episodes ended by their environment (first: "
            f"{metrics['eval/episode_failure']})"
            if metrics.get("eval/episode_failed")
            else ""
        )
    )
