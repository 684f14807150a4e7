"""The generation actor: one vLLM engine in one Ray actor.

It takes prompt requests from the prompt queue, samples G completions of each with
their logprobs, scores them with the reward function and pushes one
``TrajectoryGroup`` per prompt to the results queue. Between generate calls it pulls
the newest weights from the weight channel, loads them into the engine, resets the
prefix cache (cached KV of the old weights would be wrong) and records the version
that every later token is sampled with.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from actors.policy_clock import PolicyClock
from actors.rewards import load_reward_function
from actors.scoring import GroupBuilder, Sample
from queues.messages import PromptRequest, TrajectoryGroup


def redirect_output(log_path: str | None) -> None:
    """Send this process's stdout/stderr (vLLM's and DeepSpeed's logs too) to ``log_path``."""
    if not log_path:
        return
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def engine_kwargs(engine: dict[str, Any], model_path: str, dtype: str, seed: int | None) -> dict[str, Any]:
    """vLLM engine arguments from the ``engine`` config section (plus ``tensor_parallel_size``,
    which placement decides), shared by the sync and the in-flight actor."""
    import torch

    tp = engine.get("tensor_parallel_size", 1)
    memory = (
        {"gpu_memory_utilization": engine["gpu_memory_utilization"]}
        if torch.cuda.is_available()
        else {"kv_cache_memory_bytes": engine["kv_cache_gib"] << 30}
    )
    return dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_model_len=engine["max_model_len"],
        enforce_eager=engine["enforce_eager"],
        worker_extension_cls="actors.vllm_worker.WeightReceiver",
        tensor_parallel_size=tp,
        # shard workers as child processes of this actor, on the GPUs (or cores) Ray gave it;
        # inside a Ray actor vLLM would otherwise pick its Ray executor and ask for new bundles
        **({"distributed_executor_backend": "mp"} if tp > 1 else {}),
        **memory,
    )


class GenerationActor:
    """Owns a vLLM engine. Placement (CPUs/GPUs) is given by ``cluster/``, not here."""

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
        """``step_delimiter`` is set for process supervision: the reward function then
        returns one reward per step, and each is placed on the token that ends its step."""
        redirect_output(log_path)
        # In-process engine: tensors reach the worker without a serialisation hop.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.name = name
        self.rollout = rollout
        self.seed = seed
        self.llm = LLM(**engine_kwargs(engine, model_path, dtype, seed))
        tokenizer = self.llm.get_tokenizer()
        self.builder = GroupBuilder(
            name,
            load_reward_function(reward_function),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            step_delimiter,
        )
        self.policy = PolicyClock()
        self.tensor_parallel = self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        print(
            f"[{name}] engine ready (pid {os.getpid()}, {model_path}, {dtype}, tensor parallel {self.tensor_parallel})",
            flush=True,
        )

    def ready(self) -> dict[str, Any]:
        import ray

        return {
            "name": self.name,
            "pid": os.getpid(),
            "version": self.policy.version,
            "node": ray.get_runtime_context().get_node_id(),
            "tensor_parallel": self.tensor_parallel,
        }

    # --- weights -------------------------------------------------------------------
    def load_weights(self, named_tensors: list, version: int) -> int:
        """Load ``(name, tensor)`` pairs as policy ``version``; returns the version."""
        self.llm.collective_rpc("load_named_weights", args=(named_tensors,))
        self.llm.reset_prefix_cache()  # KV computed with the old weights must not be reused
        self.policy.loaded(version)
        return version

    def sync_weights(self, channel, min_version: int, timeout: float) -> None:
        """Load the newest published weights; wait (up to ``timeout``) until version >= ``min_version``."""
        start = time.monotonic()
        if self.policy.wants(channel.latest_version(), min_version):
            version, named = channel.fetch(min_version, timeout)
            if version > self.policy.version:
                self.load_weights(named, version)
        self.policy.waited(time.monotonic() - start)

    # --- generation ----------------------------------------------------------------
    def sampling_params(self, prompt_id: int, n: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            max_tokens=self.rollout["max_tokens"],
            min_tokens=self.rollout["min_tokens"],
            temperature=self.rollout["temperature"],
            top_p=self.rollout["top_p"],
            logprobs=0,  # the sampled token's logprob
            seed=self.seed * 1_000_003 + prompt_id,  # reproducible per prompt
        )

    def generate(self, requests: list[PromptRequest]) -> list[TrajectoryGroup]:
        """Sample ``group_size`` completions per request, score them, return one group each."""
        start = time.monotonic()
        G = self.rollout["group_size"]
        prompts = [r.row["prompt"] for r in requests]
        params = [self.sampling_params(r.prompt_id, G) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.monotonic() - start
        return [self.builder.group(req, self._samples(out), elapsed) for req, out in zip(requests, outputs)]

    def _samples(self, output) -> list[Sample]:
        samples = []
        for completion in output.outputs:
            ids = list(completion.token_ids)
            samples.append(
                Sample(
                    prompt_token_ids=list(output.prompt_token_ids),
                    token_ids=ids,
                    logprobs=[step[tok].logprob for tok, step in zip(ids, completion.logprobs)],
                    versions=[self.policy.version] * len(ids),
                    finish_reason="length" if completion.finish_reason == "length" else "stop",
                    text=completion.text,
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
    def run(self, prompt_queue, results_queue, channel, timeouts: dict[str, float]) -> dict[str, Any]:
        """Generate until the channel closes: take prompts, sync weights, generate, push results."""
        per_call = self.rollout["prompts_per_request"]
        groups_done = 0
        while not channel.is_closed():
            requests = prompt_queue.get_batch(per_call, timeout=0.5)
            if not requests:
                continue
            self.sync_weights(channel, max(r.min_version for r in requests), timeouts["weights_s"])
            groups = self.generate(requests)
            groups[0].weight_wait_s = self.policy.take_wait()
            results_queue.put_many(groups, timeout=timeouts["data_s"])
            groups_done += len(groups)
        return {"name": self.name, "groups": groups_done, "weight_loads": self.policy.loads}

    def stats(self) -> dict[str, float]:
        return self.policy.stats()
