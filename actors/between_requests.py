"""Weight updates between requests: vLLM's ``LLM`` in the actor's process, a batch per call.

The prompts an actor takes from the queue in one call (up to ``rollout.prompts_per_request``) are
sampled in one ``generate`` call; before it, the weights those prompts need are fetched from the
weight channel and loaded (``load_named_weights``: in this process the tensors pass as they are), and
the prefix cache is reset (cached KV of the old weights would be wrong). Every token of a call is
sampled with one version. With ``learner.lora`` a version is a LoRA adapter (``actors/adapters.py``):
the call names the current one, and the older ones are removed when it is loaded. All engine calls
run on one thread of their own: vLLM binds its CPU threads in the thread that builds it, and the
actor's event loop stays free to answer.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.adapters import Adapters, lora_kwargs
from actors.policy_clock import PolicyClock
from actors.rollout import Completion
from actors.sleep import Turns, check_sleep_mode
from actors.spec import (
    REPORT_TIMEOUT_S,
    ActorSpec,
    ActorTimeouts,
    EngineChoices,
    engine_choices,
    engine_kwargs,
    engine_prompt,
    request_params,
    turn_params,
)
from cluster.channel import WeightReceiver
from cluster.timeline import Spans
from queues.bounded import QueueClosed
from queues.messages import PromptRequest


def _build_llm(spec: ActorSpec):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: tensors load without a hop
    from vllm import LLM

    return LLM(**engine_kwargs(spec))


def _completion(completion, version: int) -> Completion:
    ids = list(completion.token_ids)
    logprobs = [step[tok].logprob for tok, step in zip(ids, completion.logprobs)]
    finish = "length" if completion.finish_reason == "length" else "stop"
    return Completion(ids, logprobs, [version] * len(ids), finish)


class BetweenRequests:
    """The engine of a generation actor whose weights change only between generate calls
    (``engine``: an already built ``vllm.LLM``-like object, for tests)."""

    def __init__(self, spec: ActorSpec, clock: PolicyClock, spans: Spans, engine: Any = None):
        self.spec, self.clock, self.spans, self.llm = spec, clock, spans, engine
        self.thread = ThreadPoolExecutor(1, thread_name_prefix=f"{spec.name}-engine")
        self.pending: list[tuple[Any, Any, asyncio.Future]] = []  # (prompt, params, answer) of the next generate call
        self.calls: set[asyncio.Task] = set()
        self.engine_free = asyncio.Lock()  # held by the generate call running: the next one gathers meanwhile
        self.seed = spec.seed * 1_000_003  # + prompt id: reproducible per prompt, the same samples in every run
        self.adapters = Adapters(spec.adapter, spec.model_path, spec.name) if spec.adapter else None
        self.turns = Turns(spec.sleep_level)

    async def on_engine(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the engine's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, functools.partial(fn, *args, **kwargs))

    async def start(self) -> None:
        if self.llm is None:
            check_sleep_mode(self.spec.sleep_level)
            self.llm = await self.on_engine(_build_llm, self.spec)
        self.tokenizer = self.llm.get_tokenizer()
        self.tensor_parallel = self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size

    async def choices(self) -> EngineChoices:
        """What vLLM chose at start (the ready line): its config, and the first worker's report."""
        try:
            worker = (await self.on_engine(self.llm.collective_rpc, "engine_report", timeout=REPORT_TIMEOUT_S))[0]
        except Exception:  # noqa: BLE001 - the report says "unknown"; the engine is up either way
            worker = None
        return engine_choices(self.llm.llm_engine.vllm_config, worker)

    # --- sampling -----------------------------------------------------------------------
    async def complete(self, request: PromptRequest) -> tuple[list[int], list[Completion]]:
        """Completions of ``request``, sampled in one generate call with every request made in the same
        turn of the event loop (the rollouts of a batch start together)."""
        params = request_params(self.spec, request, seed=self.seed + request.seed_offset)
        out = await self._enqueue(engine_prompt(request), params)
        version = self.clock.version  # weights change only between calls, and none ran since this one
        return list(out.prompt_token_ids), [_completion(c, version) for c in out.outputs]

    async def sample(self, prompt_ids: list[int], request: PromptRequest, max_tokens: int, salt: int) -> Completion:
        """One turn of an episode, batched with the turns and requests made in the same turn of the loop."""
        from vllm.inputs import TokensPrompt

        seed = self.seed + request.seed_offset * 7919 + salt
        out = await self._enqueue(
            TokensPrompt(prompt_token_ids=list(prompt_ids)), turn_params(self.spec, request, max_tokens, seed)
        )
        return _completion(out.outputs[0], self.clock.version)

    async def _enqueue(self, prompt, params):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((prompt, params, future))
        if len(self.pending) == 1:
            loop.call_soon(self._start_call)
        return await future

    def _start_call(self) -> None:
        self.calls.add(task := asyncio.ensure_future(self._generate_pending()))  # held until it ends
        task.add_done_callback(self.calls.discard)

    async def _generate_pending(self) -> None:
        """One generate call for every pending prompt; any error reaches every waiting rollout. A call waits
        for the one running: the episode turns that become ready meanwhile, one by one as their tool calls
        return, join it and reach the engine together (the engine could not start them sooner)."""
        try:
            await self.engine_free.acquire()
        except asyncio.CancelledError:  # no call will take the pending turns now: they fail, none waits forever
            batch, self.pending = self.pending, []
            for _, _, future in batch:
                if not future.done():
                    future.cancel()
            raise
        try:
            batch, self.pending = self.pending, []
            await self._generate(batch)
        finally:
            self.engine_free.release()

    async def _generate(self, batch: list) -> None:
        try:
            outputs = await self.on_engine(
                self.llm.generate,
                [p for p, _, _ in batch],
                [params for _, params, _ in batch],
                use_tqdm=False,
                **self.lora(),
            )
            if len(outputs) != len(batch):
                raise RuntimeError(f"the engine returned {len(outputs)} outputs for {len(batch)} prompts")
        except BaseException as exc:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future), out in zip(batch, outputs, strict=True):
            if not future.done():
                future.set_result(out)

    async def generate_one(self, prompt, params):
        """One finished output for ``prompt`` (checks and tests)."""
        return (await self.on_engine(self.llm.generate, [prompt], params, use_tqdm=False, **self.lora()))[0]

    def close(self) -> None:
        if self.adapters is not None:
            self.adapters.close()

    def lora(self) -> dict:
        """The generate call's adapter argument: the current version's (none with full weights, or at
        version 0 of an adapter run)."""
        return lora_kwargs(self.adapters.request() if self.adapters is not None else None)

    # --- weights ------------------------------------------------------------------------
    def _load(self, named_tensors: list, version: int, reset: bool = True) -> None:
        if self.adapters is not None:  # an adapter: written for the engine to load; the older ones go
            self.adapters.add(version, named_tensors)
            for lora_id in self.adapters.retire():
                self.llm.llm_engine.remove_lora(lora_id)
        else:
            self.llm.collective_rpc("load_named_weights", args=(named_tensors,))
        if reset:  # (an engine waking from sleep has no cache yet: its sleep dropped it)
            self.llm.reset_prefix_cache()  # KV computed with the old weights must not be reused

    async def load_weights(self, named_tensors: list, version: int, mode: str = "keep", reset: bool = True) -> int:
        """Load ``(name, tensor)`` pairs as policy ``version`` (no request runs meanwhile, whatever ``mode``)."""
        await self.on_engine(self._load, named_tensors, version, reset)
        self.clock.loaded(version)
        return version

    async def sync_weights(self, channel: WeightReceiver, min_version: int, timeout: float, reset: bool = True) -> None:
        """Load the newest published weights; wait (up to ``timeout``) until version >= ``min_version``."""
        start = time.monotonic()
        if self.clock.wants(await asyncio.to_thread(channel.latest_version), min_version):
            with self.spans.span("wait_weights", self.clock.version):
                version, named = await asyncio.to_thread(channel.fetch, min_version, timeout)
            if version > self.clock.version:
                with self.spans.span("load_weights", version):
                    await self.load_weights(named, version, reset=reset)
        self.clock.waited(time.monotonic() - start)

    # --- turns with the learner (run.schedule=colocated, actors/sleep.py) ----------------
    async def sleep(self) -> None:
        """Generate nothing until ``wake``; free the engine's memory at the spec's level, once the generate
        call still running (a held-out round's) has ended and its groups are pushed."""
        async with self.turns.asleep():
            if self.turns.level:  # (the span: only what the engine does, not the wait for a running call)
                with self.spans.span("sleep", self.clock.version):
                    # the default pause mode ("abort"): nothing runs now (the in-process engine refuses only "wait")
                    await self.on_engine(self.llm.sleep, self.turns.level)

    async def wake(self, channel: WeightReceiver, min_version: int, timeout: float) -> int:
        """The weights' memory back, the newest version (at least ``min_version``) loaded into it, then the
        KV cache (an adapter is loaded once the engine is whole); generation may start again. Returns the
        version loaded (an awake engine, e.g. before the first phase, loads as its prompts ask)."""
        if self.turns.awake.is_set():
            return self.clock.version
        level = self.turns.level
        with self.spans.span("wake", min_version):
            if level:
                await self.on_engine(self.llm.wake_up, ["weights"])
            if self.adapters is None:
                await self.sync_weights(channel, min_version, timeout, reset=not level)
            if level:
                await self.on_engine(self.llm.wake_up, ["kv_cache"])
            if self.adapters is not None:
                await self.sync_weights(channel, min_version, timeout)
        self.turns.awake.set()
        return self.clock.version

    # --- the actor's loop ---------------------------------------------------------------
    async def serve(self, actor, prompt_queue, results_queue, channel: WeightReceiver, timeouts: ActorTimeouts) -> int:
        """Take prompts, sync weights, generate, push, until the queues close; returns the groups pushed."""
        per_call, pushed = self.spec.rollout.prompts_per_request, 0
        try:
            while True:
                with self.spans.span("wait_prompts"):  # woken by a put or the queue's close
                    requests = await prompt_queue.get_batch_async(per_call, timeouts.idle_s, self.spec.name)
                if not requests:
                    continue
                async with self.turns.turn():  # colocated: prompts taken during training wait for the wake
                    await self.sync_weights(channel, max(r.min_version for r in requests), timeouts.weights_s)
                    with self.spans.span("generate", self.clock.version):
                        groups = await actor.generate(requests)
                groups[0].spans = self.spans.take()  # the timeline rides to the driver on the results
                await results_queue.put_many_async(groups, timeout=timeouts.data_s)
                pushed += len(groups)
        except QueueClosed:
            return pushed  # the run is over
