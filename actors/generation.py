"""The generation actor: one vLLM engine in one Ray actor.

It takes prompt requests from the prompt queue, samples G completions of each with
their logprobs, scores them with the reward function and pushes one
``TrajectoryGroup`` per prompt to the results queue. Before a generate call it fetches the
weights its prompts need from the weight channel (``cluster/channel.py``), loads them into the
engine, resets the prefix cache (cached KV of the old weights would be wrong) and records the
version that every later token is sampled with. The loop ends when the queues are closed.
"""

from __future__ import annotations

import os
import time
from typing import Any

from actors.policy_clock import PolicyClock
from actors.reward_scorer import RewardScorer
from actors.scoring import GroupBuilder, Sample
from actors.spec import (
    ActorSpec,
    ActorTimeouts,
    decode_completions,
    engine_kwargs,
    engine_prompt,
    ready_report,
    request_params,
)
from cluster.channel import WeightReceiver
from cluster.logs import redirect_output
from cluster.timeline import Spans
from queues.bounded import QueueClosed
from queues.messages import PromptRequest, TrajectoryGroup


class GenerationActor:
    """Owns a vLLM engine (``engine``: an already built ``vllm.LLM``-like object, for tests).
    Placement (CPUs/GPUs) is given by ``cluster/``, not here."""

    def __init__(self, spec: ActorSpec, engine: Any = None):
        redirect_output(spec.log_path)
        self.spec = spec
        if engine is None:
            # In-process engine: tensors reach the worker without a serialisation hop.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from vllm import LLM

            engine = LLM(**engine_kwargs(spec))
        self.llm = engine
        self.tokenizer = tokenizer = self.llm.get_tokenizer()
        steps = spec.step_delimiter is not None
        scorer = RewardScorer(spec.reward, steps, model_actors=spec.reward_model_actors)  # its worker processes
        scorer.wait_ready()  # a reward that cannot load in a worker fails the actor's start, naming it
        self.builder = GroupBuilder(
            spec.name, scorer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), spec.step_delimiter
        )
        self.policy = PolicyClock()
        self.spans = Spans(spec.name, spec.timeline)
        self.tensor_parallel = self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        print(
            f"[{spec.name}] engine ready (pid {os.getpid()}, {spec.model_path}, {spec.dtype}, "
            f"tensor parallel {self.tensor_parallel})",
            flush=True,
        )

    def ready(self) -> dict[str, Any]:
        return ready_report(self.spec, self.policy.version, self.tensor_parallel)

    # --- weights -------------------------------------------------------------------
    def load_weights(self, named_tensors: list, version: int) -> int:
        """Load ``(name, tensor)`` pairs as policy ``version``; returns the version."""
        self.llm.collective_rpc("load_named_weights", args=(named_tensors,))
        self.llm.reset_prefix_cache()  # KV computed with the old weights must not be reused
        self.policy.loaded(version)
        return version

    def sync_weights(self, channel: WeightReceiver, min_version: int, timeout: float) -> None:
        """Load the newest published weights; wait (up to ``timeout``) until version >= ``min_version``."""
        start = time.monotonic()
        if self.policy.wants(channel.latest_version(), min_version):
            with self.spans.span("wait_weights", self.policy.version):
                version, named = channel.fetch(min_version, timeout)
            if version > self.policy.version:
                with self.spans.span("load_weights", version):
                    self.load_weights(named, version)
        self.policy.waited(time.monotonic() - start)

    # --- generation ----------------------------------------------------------------
    def generate(self, requests: list[PromptRequest]) -> list[TrajectoryGroup]:
        """Sample ``group_size`` completions per request, score them, return one group each."""
        start = time.monotonic()
        prompts = [engine_prompt(r) for r in requests]
        seed = self.spec.seed * 1_000_003  # + prompt id: reproducible per prompt, the same samples in every run
        params = [request_params(self.spec, r, seed=seed + r.seed_offset) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.monotonic() - start
        waits = [self.policy.take_wait()] + [0.0] * (len(requests) - 1)  # the call's weight time, reported once
        return self.builder.groups(requests, [self._samples(out) for out in outputs], elapsed, waits)

    def _samples(self, output) -> list[Sample]:
        samples = []
        completions = [list(c.token_ids) for c in output.outputs]
        texts = decode_completions(self.tokenizer, completions)
        for completion, ids, text in zip(output.outputs, completions, texts):
            samples.append(
                Sample(
                    prompt_token_ids=list(output.prompt_token_ids),
                    token_ids=ids,
                    logprobs=[step[tok].logprob for tok, step in zip(ids, completion.logprobs)],
                    versions=[self.policy.version] * len(ids),
                    finish_reason="length" if completion.finish_reason == "length" else "stop",
                    text=text,
                )
            )
        return samples

    def completion_logprobs(self, prompt_token_ids: list[int], completion_token_ids: list[int]) -> list[float]:
        """Log-probabilities of a fixed completion under the loaded weights (for checks and tests)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = list(prompt_token_ids) + list(completion_token_ids)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        start = len(prompt_token_ids)
        return [out.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))]

    # --- the actor's loop ----------------------------------------------------------
    def run(self, prompt_queue, results_queue, channel: WeightReceiver, timeouts: ActorTimeouts) -> dict[str, Any]:
        """Generate until the queues close: take prompts, sync weights, generate, push results."""
        per_call = self.spec.rollout.prompts_per_request
        groups_done = 0
        try:
            while True:
                with self.spans.span("wait_prompts"):
                    requests = prompt_queue.get_batch(per_call, timeouts.idle_s, self.spec.name)  # woken by put/close
                if not requests:
                    continue
                self.sync_weights(channel, max(r.min_version for r in requests), timeouts.weights_s)
                with self.spans.span("generate", self.policy.version):
                    groups = self.generate(requests)
                groups[0].spans = self.spans.take()  # the timeline rides to the driver on the results
                results_queue.put_many(groups, timeout=timeouts.data_s)
                groups_done += len(groups)
        except QueueClosed:
            pass  # the run is over
        finally:
            self.builder.close()  # the reward workers end with the loop
        return {
            "name": self.spec.name,
            "groups": groups_done,
            "weight_loads": self.policy.loads,
            "spans": self.spans.take(),
        }

    def stats(self) -> dict[str, float]:
        return self.policy.stats()
