"""Weight updates in flight: vLLM's ``AsyncLLM``, weights swapped mid-generation.

Used with ``rollout.weight_update: inflight``. Prompts stream in continuously (up to
``rollout.max_inflight_prompts`` at once); every completion streams out token by token and each
token is tagged with the policy version that produced it. A watcher waits on the weight channel for
each newer version; when one is published the engine pauses keeping its requests, loads the weights,
drops all cached KV (running requests are recomputed under the new weights) and resumes: a long
generation never blocks an update. Nothing polls: the prompt queue, the weight channel and finished
generations each wake the actor when they have something.

With ``learner.lora`` a version is a LoRA adapter (``actors/adapters.py``) and nothing pauses: a new
version serves the requests that start after it, a running request keeps its adapter to the end, and
all its tokens carry that adapter's version.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

from actors.adapters import Adapters, lora_kwargs
from actors.engine_weights import engine_transfer
from actors.policy_clock import PolicyClock
from actors.rollout import Completion
from actors.sleep import Turns, check_sleep_mode, sleep_kwargs
from actors.spec import (
    REPORT_TIMEOUT_S,
    ActorSpec,
    ActorTimeouts,
    EngineChoices,
    engine_choices,
    engine_kwargs,
    engine_prompt,
    proven_runner_env,
    request_params,
    turn_params,
)
from cluster.channel import ChannelClosed, ChannelFailed, WeightReceiver, WeightsTimeout
from cluster.timeline import Spans
from queues.bounded import QueueClosed
from queues.messages import PromptRequest


class InFlight:
    """The engine of a generation actor whose weights change while it generates (``engine``: an already
    built ``AsyncLLM``-like object, for tests)."""

    def __init__(self, spec: ActorSpec, clock: PolicyClock, spans: Spans, engine: Any = None):
        self.spec, self.clock, self.spans, self.llm = spec, clock, spans, engine
        self._update_lock = asyncio.Lock()
        self.adapters = Adapters(spec.adapter, spec.model_path, spec.name) if spec.adapter else None
        self.turns = Turns(spec.sleep_level)

    async def start(self) -> None:
        if self.llm is None:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            check_sleep_mode(self.spec.sleep_level)
            os.environ.update(proven_runner_env(self.spec, _cuda()))  # read by vLLM here and in its engine
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(self.spec)))
        await self.llm.update_weight_version(str(self.clock.version))  # the label of the first tokens
        self.tokenizer = self.llm.tokenizer
        self.tensor_parallel = self.llm.vllm_config.parallel_config.tensor_parallel_size
        self.transfer = engine_transfer(self.spec.engine.weight_transfer, _cuda())

    async def choices(self) -> EngineChoices:
        """What vLLM chose at start (the ready line): its config, and the first worker's report."""
        try:
            worker = (await self.llm.collective_rpc("engine_report", timeout=REPORT_TIMEOUT_S))[0]
        except Exception:  # noqa: BLE001 - the report says "unknown"; the engine is up either way
            worker = None
        return engine_choices(self.llm.vllm_config, worker)

    # --- sampling -----------------------------------------------------------------------
    async def complete(self, request: PromptRequest) -> tuple[list[int], list[Completion]]:
        """The group's completions, each its own streamed request (weights may change under any of them)."""
        # No per-request seed: in-flight sampling depends on timing anyway, and vLLM 0.32's CPU
        # runner crashes ("CPU Generator does not use offset") when it rewinds a seeded generator
        # for a request that is being recomputed, which is what a weight swap does.
        params = request_params(self.spec, request, seed=None, stream=True, n=1)
        n = request.samples or self.spec.rollout.group_size
        streamed = await asyncio.gather(*[self._stream(engine_prompt(request), params) for _ in range(n)])
        return streamed[0][0], [completion for _, completion in streamed]

    async def sample(self, prompt_ids: list[int], request: PromptRequest, max_tokens: int, salt: int) -> Completion:
        """One turn of an episode, streamed (weights may change under it, each token tagged)."""
        from vllm.inputs import TokensPrompt

        params = turn_params(self.spec, request, max_tokens, seed=None, stream=True)
        return (await self._stream(TokensPrompt(prompt_token_ids=list(prompt_ids)), params))[1]

    async def _stream(self, prompt, params) -> tuple[list[int], Completion]:
        ids, logprobs, prompt_ids, finish, spans = [], [], None, "stop", None
        version = lora = None
        if self.adapters is not None:  # the current adapter, kept to the request's end
            version = self.clock.version
            lora = self.adapters.request(version)
            self.adapters.using(version)
        try:
            async for out in self.llm.generate(prompt, params, request_id=uuid.uuid4().hex, **lora_kwargs(lora)):
                prompt_ids = prompt_ids or list(out.prompt_token_ids)
                delta = out.outputs[0]
                new = list(delta.token_ids)
                ids += new
                logprobs += [step[tok].logprob for tok, step in zip(new, delta.logprobs or [])]
                if out.finished:
                    finish = "length" if delta.finish_reason == "length" else "stop"
                    spans = getattr(delta, "weight_versions", None)
        finally:
            if version is not None:
                self.adapters.using(version, -1)
        if version is None:
            return prompt_ids, Completion(ids, logprobs, token_versions(spans, len(ids)), finish)
        await self._retire_adapters()
        return prompt_ids, Completion(ids, logprobs, [version] * len(ids), finish)

    async def generate_one(self, prompt, params):
        """One finished output for ``prompt`` (checks and tests)."""
        final, version = None, self.clock.version
        lora = self.adapters.request(version) if self.adapters is not None else None
        if lora is not None:
            self.adapters.using(version)
        try:
            async for out in self.llm.generate(prompt, params, request_id=uuid.uuid4().hex, **lora_kwargs(lora)):
                final = out
        finally:
            if lora is not None:
                self.adapters.using(version, -1)
        return final

    async def _retire_adapters(self) -> None:
        for lora_id in self.adapters.retire():
            await self.llm.remove_lora(lora_id)

    def close(self) -> None:
        if self.adapters is not None:
            self.adapters.close()

    # --- weights ------------------------------------------------------------------------
    async def load_weights(self, named_tensors: list, version: int, mode: str = "keep") -> int:
        """Pause (``keep``: in-flight requests wait; ``wait``: they finish on the old weights),
        load, drop cached KV, resume. Tokens streamed after this returns carry ``version``.
        A version not newer than the loaded one is skipped (the watcher and a prompt may race)."""
        async with self._update_lock:
            return await self._load(named_tensors, version, mode)

    async def _load(self, named_tensors: list, version: int, mode: str, asleep: bool = False) -> int:
        """``load_weights`` with the update lock held. ``asleep``: into an engine whose scheduler ``sleep``
        paused and whose cache it cleared (``wake``), so nothing pauses, resets or resumes here."""
        if version <= self.clock.version:
            return self.clock.version
        wall = time.time()
        if self.adapters is not None:  # nothing pauses: requests from now on use the new adapter
            request = await asyncio.to_thread(self.adapters.write, version, named_tensors)  # files only
            self.adapters.activate(version, request)  # on the loop, with the clock: no request between
            self.clock.loaded(version)
            await self._retire_adapters()
            self.spans.add("load_weights", wall, time.time(), version)
            return version
        start = time.monotonic()
        transfer = self.transfer.for_weights(named_tensors)
        packed, keep = transfer.pack(named_tensors)  # `keep`: what the handles point at
        if not asleep:
            await self.llm.pause_generation(mode=mode, clear_cache=True)
        try:
            await self.llm.collective_rpc(transfer.method, args=(packed,))
            if not asleep:
                await self.llm.reset_prefix_cache()
            # while paused: the engine labels every token it samples from now on with this version
            await self.llm.update_weight_version(str(version))
            self.clock.loaded(version)
        finally:
            del keep
            if not asleep:
                await self.llm.resume_generation()
        self.clock.waited(time.monotonic() - start)
        self.spans.add("load_weights", wall, time.time(), version)
        return version

    async def sync_weights(self, channel: WeightReceiver, min_version: int, timeout: float, mode: str = "keep"):
        """Make sure weights of at least ``min_version`` are loaded, waiting up to ``timeout``."""
        if min_version <= self.clock.version:
            return
        start = time.monotonic()
        with self.spans.span("wait_weights", self.clock.version):
            version, named = await asyncio.to_thread(channel.fetch, min_version, timeout)  # off the event loop
        self.clock.waited(time.monotonic() - start)  # the wait; load_weights counts the load itself
        await self.load_weights(named, version, mode)

    async def _follow_weights(self, channel: WeightReceiver, timeout: float) -> None:
        """Load every newer version as soon as it is published, until the channel closes; a broken
        channel (``ChannelFailed``) ends the watcher with its error."""
        while True:
            start = time.monotonic()
            try:
                version, named = await asyncio.to_thread(channel.fetch, self.clock.version + 1, timeout)
            except ChannelClosed:
                return
            except ChannelFailed:
                raise
            except WeightsTimeout:
                if time.monotonic() - start < timeout / 2:
                    raise  # not a quiet window but a channel that answers at once: never spin on it
                continue  # nothing newer within the window: the learner is still training
            await self.load_weights(named, version)

    # --- turns with the learner (run.schedule=colocated, actors/sleep.py) ----------------
    async def sleep(self) -> None:
        """Start no generation and load no weights until ``wake``; the running requests (a held-out
        round's) are paused and kept, and with a GPU the engine frees its memory at the spec's level."""
        if not self.turns.awake.is_set():
            return
        self.turns.awake.clear()
        await self._update_lock.acquire()  # held until the wake: the watcher's next load waits for it
        with self.spans.span("sleep", self.clock.version):
            if self.turns.level:  # the engine's own sleep pauses its scheduler, keeping the requests
                await self.llm.sleep(self.turns.level, **sleep_kwargs(self.llm.sleep))
            else:
                await self.llm.pause_generation(mode="keep", clear_cache=True)

    async def wake(self, channel: WeightReceiver, min_version: int, timeout: float) -> int:
        """The weights' memory back, the newest version (at least ``min_version``) loaded into it, then the
        KV cache (an adapter is loaded once the engine is whole); the kept requests and new ones go on.
        Returns the version loaded (an awake engine, e.g. before the first phase, loads as its prompts ask)."""
        if self.turns.awake.is_set():
            return self.clock.version
        level = self.turns.level
        newest = max(min_version, await asyncio.to_thread(channel.latest_version))  # what the wake loads
        with self.spans.span("wake", min_version):
            try:
                if level:
                    await self.llm.wake_up(["weights"])
                if self.adapters is None and newest > self.clock.version:
                    version, named = await asyncio.to_thread(channel.fetch, newest, timeout)
                    await self._load(named, version, "keep", asleep=True)  # the update lock is ours
                if level:
                    await self.llm.wake_up(["kv_cache"])  # fully awake: the scheduler resumes
                else:
                    await self.llm.resume_generation()
            finally:
                self._update_lock.release()
            if self.adapters is not None:
                await self.sync_weights(channel, newest, timeout)
        self.turns.awake.set()
        return self.clock.version

    # --- the actor's loop ---------------------------------------------------------------
    async def serve(self, actor, prompt_queue, results_queue, channel: WeightReceiver, timeouts: ActorTimeouts) -> int:
        """Keep up to ``max_inflight_prompts`` groups generating until the queues close, while a watcher
        swaps weights in as soon as they are published; returns the groups pushed."""
        cap = self.spec.rollout.max_inflight_prompts
        inflight: set[asyncio.Task] = set()
        freed = asyncio.Event()  # a generation finished: room for another prompt
        broke = asyncio.Event()  # a generation failed: the loop raises its error
        failures: list[BaseException] = []
        pushed = 0

        async def generate_and_push(request: PromptRequest) -> None:
            nonlocal pushed
            group = await actor.generate_group(request)
            group.spans = self.spans.take()  # the timeline rides to the driver on the results
            try:
                await results_queue.put_many_async([group], timeout=timeouts.data_s)
                pushed += 1
            except QueueClosed:
                pass  # the run ended while this group was generating

        def finished(task: asyncio.Task) -> None:
            """Done-callback of every generation and of the weight watcher: an error stops the loop."""
            inflight.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())
                broke.set()
            freed.set()

        watcher = asyncio.create_task(self._follow_weights(channel, timeouts.weights_s))
        watcher.add_done_callback(finished)  # it ends quietly when the channel closes
        failed = asyncio.create_task(broke.wait())
        try:
            while True:
                while len(inflight) >= cap and not failures:
                    freed.clear()
                    await freed.wait()
                if failures:
                    raise failures[0]
                intake = asyncio.create_task(
                    prompt_queue.get_batch_async(cap - len(inflight), timeouts.idle_s, self.spec.name)
                )
                # the whole wait is recorded, also beside running generations: the report counts as
                # idle only the part no generate span covers (the last groups of a step finish, then
                # the actor waits for the next step's prompts)
                waiting = time.time()
                await asyncio.wait({intake, failed}, return_when=asyncio.FIRST_COMPLETED)
                self.spans.add("wait_prompts", waiting, time.time())
                if failures:
                    intake.cancel()
                    raise failures[0]
                try:
                    requests = await intake
                except QueueClosed:
                    return pushed  # the run is over
                await self.turns.awake.wait()  # colocated: prompts taken during training wait for the wake
                if self.turns.ended:
                    return pushed  # the run ended while this actor slept
                for request in requests:
                    await self.sync_weights(channel, request.min_version, timeouts.weights_s)
                    task = asyncio.create_task(generate_and_push(request))
                    inflight.add(task)
                    task.add_done_callback(finished)
        finally:
            pending = [watcher, failed, *inflight]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)  # their requests end before the engine does
            self.llm.shutdown()  # stop the engine process now, not in a finaliser at interpreter exit


def token_versions(spans, n: int) -> list[int]:
    """The policy version of each of ``n`` sampled tokens, from the engine's own record: vLLM's engine
    core labels every step's outputs with the weight version set while it was paused
    (``update_weight_version``), and a finished output carries them as spans ``[start, end)``. Reading
    the actor's clock when a token is read instead would be right only by event-loop ordering: tokens
    sampled before a swap but read after it would be stamped with the new version."""
    if n == 0:
        return []
    if not spans:
        raise RuntimeError(
            "the engine returned no weight-version spans for a finished completion; this vLLM does not label "
            "tokens with their weights (vLLM >= 0.32 does), so in-flight updates cannot tag tokens"
        )
    versions = [0] * n
    for span in spans:
        versions[span.start : span.end] = [int(span.version)] * (min(span.end, n) - span.start)
    if spans[0].start != 0 or spans[-1].end != n:
        raise RuntimeError(f"the engine's weight-version spans cover [{spans[0].start}, {spans[-1].end}) of {n} tokens")
    return versions


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
