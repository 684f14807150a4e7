"""The in-flight generation actor: vLLM's async engine, weights swapped mid-generation.

Used with ``rollout.weight_update: inflight``. Prompts stream in continuously (up to
``rollout.max_inflight_prompts`` at once); every completion streams out token by token
and each token is tagged with the policy version that produced it. When newer weights
are published the actor pauses the engine keeping its requests, loads the weights,
drops all cached KV (running requests are recomputed under the new weights) and
resumes: a long generation never blocks an update.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

from actors.generation import engine_kwargs, redirect_output
from actors.policy_clock import PolicyClock
from actors.rewards import load_reward_function
from actors.scoring import GroupBuilder, Sample
from queues.messages import PromptRequest


def weights_to_bytes(named_tensors: list) -> bytes:
    """Safetensors bytes: the engine runs in its own process and RPC arguments must be plain bytes."""
    from safetensors.torch import save

    return save({name: t.contiguous() for name, t in named_tensors})


class AsyncGenerationActor:
    """An async Ray actor owning an ``AsyncLLM``. Same constructor as ``GenerationActor``."""

    def __init__(
        self,
        name: str,
        model_path: str,
        engine: dict[str, Any],
        rollout: dict[str, Any],
        reward_function: str,
        dtype: str,
        seed: int,
        log_path: str | None = None,
        step_delimiter: str | None = None,
    ):
        redirect_output(log_path)
        self.name, self.model_path, self.engine_cfg, self.rollout = name, model_path, engine, rollout
        self.dtype, self.seed = dtype, seed
        self.reward_function, self.step_delimiter = reward_function, step_delimiter
        self.engine = None
        self.policy = PolicyClock()
        self._update_lock = asyncio.Lock()

    async def ready(self) -> dict[str, Any]:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.engine is None:
            args = AsyncEngineArgs(**engine_kwargs(self.engine_cfg, self.model_path, self.dtype, self.seed))
            self.engine = AsyncLLM.from_engine_args(args)
            tokenizer = self.engine.tokenizer
            self.builder = GroupBuilder(
                self.name,
                load_reward_function(self.reward_function),
                lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                self.step_delimiter,
            )
            self.tensor_parallel = self.engine.vllm_config.parallel_config.tensor_parallel_size
            print(
                f"[{self.name}] async engine ready (pid {os.getpid()}, {self.model_path}, {self.dtype}, "
                f"tensor parallel {self.tensor_parallel})",
                flush=True,
            )
        import ray

        return {
            "name": self.name,
            "pid": os.getpid(),
            "version": self.policy.version,
            "node": ray.get_runtime_context().get_node_id(),
            "tensor_parallel": self.tensor_parallel,
        }

    # --- weights -------------------------------------------------------------------
    async def load_weights(self, named_tensors: list, version: int, mode: str = "keep") -> int:
        """Pause (``keep``: in-flight requests wait; ``wait``: they finish on the old weights),
        load, drop cached KV, resume. Tokens streamed after this returns carry ``version``."""
        async with self._update_lock:
            blob = weights_to_bytes(named_tensors)
            await self.engine.pause_generation(mode=mode, clear_cache=True)
            try:
                await self.engine.collective_rpc("load_weights_blob", args=(blob,))
                await self.engine.reset_prefix_cache()
                self.policy.loaded(version)
            finally:
                await self.engine.resume_generation()
        return version

    async def sync_weights(self, channel, min_version: int, timeout: float, mode: str = "keep") -> None:
        start = time.monotonic()
        latest = await asyncio.to_thread(channel.latest_version)  # a blocking ray.get: off the event loop
        if self.policy.wants(latest, min_version):
            version, named = await asyncio.to_thread(channel.fetch, min_version, timeout)
            if version > self.policy.version:
                await self.load_weights(named, version, mode)
        self.policy.waited(time.monotonic() - start)

    # --- generation ----------------------------------------------------------------
    async def _sample(self, prompt: str) -> Sample:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            max_tokens=self.rollout["max_tokens"],
            min_tokens=self.rollout["min_tokens"],
            temperature=self.rollout["temperature"],
            top_p=self.rollout["top_p"],
            logprobs=0,
            # No per-request seed: in-flight sampling depends on timing anyway, and vLLM 0.32's CPU
            # runner crashes ("CPU Generator does not use offset") when it rewinds a seeded generator
            # for a request that is being recomputed, which is what a weight swap does.
            output_kind=RequestOutputKind.DELTA,
        )
        ids, logprobs, versions, prompt_ids, finish = [], [], [], None, "stop"
        async for out in self.engine.generate(prompt, params, request_id=uuid.uuid4().hex):
            prompt_ids = prompt_ids or list(out.prompt_token_ids)
            delta = out.outputs[0]
            new = list(delta.token_ids)
            ids += new
            logprobs += [step[tok].logprob for tok, step in zip(new, delta.logprobs or [])]
            versions += [self.policy.version] * len(new)  # the weights loaded while these tokens were sampled
            if out.finished:
                finish = "length" if delta.finish_reason == "length" else "stop"
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        return Sample(prompt_ids, ids, logprobs, versions, finish, text)

    async def generate_group(self, request: PromptRequest):
        start = time.monotonic()
        G = self.rollout["group_size"]
        samples = await asyncio.gather(*[self._sample(request.row["prompt"]) for _ in range(G)])
        return self.builder.group(request, list(samples), time.monotonic() - start)

    async def completion_logprobs(self, prompt_token_ids: list[int], completion_token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = list(prompt_token_ids) + list(completion_token_ids)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=ids), params, request_id=uuid.uuid4().hex):
            final = out
        return [final.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt_token_ids), len(ids))]

    # --- the actor's loop ----------------------------------------------------------
    async def run(self, prompt_queue, results_queue, channel, timeouts: dict[str, float]) -> dict[str, Any]:
        """Keep up to ``max_inflight_prompts`` groups generating; swap weights as soon as they appear."""
        cap = self.rollout["max_inflight_prompts"]
        inflight: set[asyncio.Task] = set()
        done_groups = 0
        while not await asyncio.to_thread(channel.is_closed):
            await self.sync_weights(channel, self.policy.version, timeouts["weights_s"])  # newest weights, no waiting
            room = cap - len(inflight)
            requests = await prompt_queue.get_batch_async(room, timeout=0.05) if room > 0 else []
            for request in requests:
                await self.sync_weights(channel, request.min_version, timeouts["weights_s"])
                inflight.add(asyncio.create_task(self.generate_group(request)))
            if not inflight:
                continue
            finished, _ = await asyncio.wait(inflight, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                inflight.discard(task)
                group = task.result()
                group.weight_wait_s = self.policy.take_wait()
                await results_queue.put_many_async([group], timeout=timeouts["data_s"])
                done_groups += 1
        for task in inflight:
            task.cancel()
        self.engine.shutdown()  # stop the engine process now, not in a finaliser at interpreter exit
        return {"name": self.name, "groups": done_groups, "weight_loads": self.policy.loads}

    def stats(self) -> dict[str, float]:
        return self.policy.stats()
