"""The generation actor: one vLLM engine in one Ray actor.

It takes prompt requests from the prompt queue, runs the rollout of each (``actors/rollout.py``: G
completions with their log-probs and per-token policy versions), scores them with the reward
function and pushes one ``TrajectoryGroup`` per prompt to the results queue, until the queues close.
How prompts are batched and when new weights are loaded is the engine's part, chosen once from
``WEIGHT_UPDATES`` by ``rollout.weight_update``:

- ``between_requests`` (``actors/between_requests.py``): vLLM's ``LLM`` in this process; the
  prompts of one queue call are sampled in one generate call, weights load between calls;
- ``inflight`` (``actors/inflight.py``): vLLM's ``AsyncLLM``; prompts stream in and weights are
  swapped in mid-generation, every token tagged with the version that sampled it.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from actors.between_requests import BetweenRequests
from actors.inflight import InFlight
from actors.policy_clock import PolicyClock
from actors.reward_scorer import RewardScorer
from actors.rollout import ROLLOUTS
from actors.scoring import GroupBuilder
from actors.spec import ActorSpec, ActorTimeouts, EngineChoices, describe_choices, engine_kwargs, ready_report
from cluster.channel import WeightReceiver
from cluster.logs import redirect_output
from cluster.timeline import Spans
from queues.messages import ActorReport, PromptRequest, TrajectoryGroup
from schema.process import ignore_sigterm

WEIGHT_UPDATES = {"between_requests": BetweenRequests, "inflight": InFlight}  # rollout.weight_update


class GenerationActor:
    """An async Ray actor owning one vLLM engine (``engine``: an already built one, for tests).
    Placement (CPUs/GPUs) is given by ``cluster/``, not here; ``ready`` builds the engine."""

    def __init__(self, spec: ActorSpec, engine: Any = None):
        ignore_sigterm()  # a SIGTERM to every process of a job is the driver's to act on
        redirect_output(spec.log_path)
        self.spec = spec
        self.clock = PolicyClock()  # the policy version loaded, and the time spent on weights
        self.spans = Spans(spec.name, spec.timeline)
        self.engine = WEIGHT_UPDATES[spec.rollout.weight_update](spec, self.clock, self.spans, engine)
        self.rollout = ROLLOUTS[spec.rollout.kind](spec, self.spans)  # started with the engine, closed with the loop
        self.builder: GroupBuilder | None = None
        self.choices: EngineChoices | None = None  # what vLLM chose at start (the ready line)
        self.serving: tuple[WeightReceiver, ActorTimeouts] | None = None  # run's channel and deadlines
        self.serving_started = asyncio.Event()

    async def ready(self) -> dict[str, Any]:
        """Build the engine and the reward workers (once); who and where the actor is."""
        if self.builder is None:
            await self.engine.start()
            steps = self.spec.step_delimiter is not None
            scorer = RewardScorer(self.spec.reward, steps, model_actors=self.spec.reward_model_actors)
            await asyncio.to_thread(scorer.wait_ready)  # a reward that cannot load fails the start, naming it
            # so does an environment that cannot load, or a chat template that cannot append turns
            await asyncio.to_thread(self.rollout.start, self.engine.tokenizer)
            tokenizer = self.engine.tokenizer
            decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            self.builder = GroupBuilder(self.spec.name, scorer, decode, self.spec.step_delimiter)
            self.choices = await self.engine.choices()
            pinned = engine_kwargs(self.spec).get("async_scheduling") is False
            print(
                f"[{self.spec.name}] engine ready (pid {os.getpid()}, {self.spec.model_path}, {self.spec.dtype}, "
                f"tensor parallel {self.engine.tensor_parallel}, weights {self.spec.rollout.weight_update}); "
                f"vLLM chose: {describe_choices(self.choices, pinned)}",
                flush=True,
            )
        return ready_report(self.spec, self.clock.version, self.engine.tensor_parallel, self.choices)

    # --- generation ----------------------------------------------------------------
    async def generate(self, requests: list[PromptRequest]) -> list[TrajectoryGroup]:
        """The rollouts of ``requests`` together, scored in one call to the reward workers."""
        start = time.monotonic()
        samples = await asyncio.gather(*[self.rollout(request, self.engine) for request in requests])
        elapsed = time.monotonic() - start
        waits = [self.clock.take_wait()] + [0.0] * (len(requests) - 1)  # the call's weight time, reported once
        with self.spans.span("reward", self.clock.version):  # the rewards' share of the step (bench/step_breakdown.py)
            return self.builder.groups(requests, list(samples), elapsed, waits)

    async def generate_group(self, request: PromptRequest) -> TrajectoryGroup:
        """The rollout of one request, scored without blocking the event loop (groups overlap)."""
        start = time.monotonic()
        with self.spans.span("generate", self.clock.version):  # groups overlap: the report merges them
            samples = await self.rollout(request, self.engine)
            elapsed, wait = time.monotonic() - start, self.clock.take_wait()
            with self.spans.span("reward", self.clock.version):
                return await self.builder.group_async(request, samples, elapsed, wait)  # scored in the workers

    async def completion_logprobs(self, prompt_token_ids: list[int], completion_token_ids: list[int]) -> list[float]:
        """Log-probabilities of a fixed completion under the loaded weights, at temperature 1 (checks, tests)."""
        await self.ready()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = list(prompt_token_ids) + list(completion_token_ids)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = await self.engine.generate_one(TokensPrompt(prompt_token_ids=ids), params)
        return [out.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt_token_ids), len(ids))]

    # --- weights -------------------------------------------------------------------
    async def sync_weights(self, channel: WeightReceiver, min_version: int, timeout: float) -> None:
        """Load the newest published weights, at least ``min_version`` (waiting up to ``timeout``)."""
        await self.ready()
        await self.engine.sync_weights(channel, min_version, timeout)

    async def load_weights(self, named_tensors: list, version: int, mode: str = "keep") -> int:
        """Load ``(name, tensor)`` pairs as policy ``version``. In flight, ``mode`` says what running requests
        do meanwhile (``keep``: wait, then go on with the new weights; ``wait``: finish on the old ones);
        between requests nothing runs during a load."""
        await self.ready()
        return await self.engine.load_weights(named_tensors, version, mode)

    # --- turns with the learner (run.schedule=colocated, actors/sleep.py) ------------
    async def sleep(self) -> None:
        """Start no generation until ``wake``; with a GPU the engine gives its memory back."""
        await self.engine.sleep()

    async def end_turns(self) -> None:
        """The run is over: a loop waiting for the wake returns instead (its prompts are not generated)."""
        self.engine.turns.end()

    async def wake(self, min_version: int) -> int:
        """Generate again, with the newest published weights (at least ``min_version``) loaded first."""
        await self.serving_started.wait()  # the loop's channel: `run` was called before this
        channel, timeouts = self.serving
        return await self.engine.wake(channel, min_version, timeouts.weights_s)

    # --- the actor's loop ----------------------------------------------------------
    async def run(self, prompt_queue, results_queue, channel: WeightReceiver, timeouts: ActorTimeouts) -> ActorReport:
        """Generate until the queues close; the engine's loop decides how prompts and weights interleave."""
        self.serving = (channel, timeouts)
        self.serving_started.set()
        try:
            groups = await self.engine.serve(self, prompt_queue, results_queue, channel, timeouts)
        finally:
            self.builder.close()  # the reward and environment workers end with the loop
            self.rollout.close()
            self.engine.close()  # its adapter files, with learner.lora
        return ActorReport(self.spec.name, groups, self.clock.loads, self.spans.take())

    def stats(self) -> dict[str, float]:
        return self.clock.stats()
