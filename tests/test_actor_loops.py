"""The generation actors' loops with stand-ins of vLLM's engines (``tests/standins.py``: built from vLLM's
classes, so a wrong call fails) and in-process queues and weight channel:
prompts in, scored groups out, weights loaded at the right time, the loop ended by closing the
queues, a failing generation surfaced. The wiring, without the real stack, in seconds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from actors.generation import GenerationActor
from actors.spec import ActorTimeouts
from cluster.weights import LocalWeightChannel
from queues.bounded import LocalQueue
from queues.messages import PromptRequest
from tests import standins
from tests.runs import actor_spec

TIMEOUTS = ActorTimeouts(data_s=5.0, weights_s=5.0, idle_s=5.0)
DIGIT = 17  # the fake engines always sample this token, which decodes to "5"


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join("5" if i == DIGIT else "?" for i in ids)

    def batch_decode(self, sequences, skip_special_tokens=True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]


def _completion(tokens: list[int], finish: str | None):
    return SimpleNamespace(
        token_ids=tokens,
        logprobs=[{t: SimpleNamespace(logprob=-0.25)} for t in tokens],
        finish_reason=finish,
        text="",  # the actors ask for no detokenization: they decode the finished completions
    )


class FakeLLM:
    """``vllm.LLM`` as the sync actor uses it (``tests/standins.py``: vLLM's own class, so a wrong call fails):
    every completion is the one token that decodes to "5". ``llm``: the engine, ``worker``: what its
    ``collective_rpc`` reached, ``calls``: prompts per generate call; ``short``: one output too few."""

    def __init__(self, short: bool = False):
        self.calls: list[int] = []
        self.worker = standins.worker()
        self.llm = standins.llm(self.worker, self.generate, FakeTokenizer())
        self.short = short

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None):
        self.calls.append(len(prompts))
        outputs = [
            SimpleNamespace(prompt_token_ids=[3, 4], outputs=[_completion([DIGIT], "stop") for _ in range(p.n)])
            for p in sampling_params
        ]
        return outputs[:-1] if self.short else outputs

    def loaded(self) -> list[float]:
        """The value of the first weight tensor of every load."""
        return [float(pairs[0][1][0]) for pairs in self.worker.loads]


def weights(value: float) -> list:
    return [("w", torch.full((2,), value))]


def test_between_requests_actor_loads_what_each_prompt_needs_and_stops_when_the_queues_close():
    engine = FakeLLM()
    actor = GenerationActor(actor_spec("fake", None, "builtin:echo", group_size=3), engine.llm)
    prompts, results, channel = LocalQueue("prompt", 8), LocalQueue("results", 8), LocalWeightChannel()
    row = {"prompt": "copy 5:", "answer": "5"}

    async def go():
        await actor.ready()
        run = asyncio.create_task(actor.run(prompts, results, channel, TIMEOUTS))
        await prompts.put_many_async([PromptRequest(0, row, min_version=0)], timeout=1)
        (first,) = await results.get_batch_async(1, timeout=30)  # the first generate imports vllm (~5 s)
        channel.publish(1, weights(1.0))
        await prompts.put_many_async([PromptRequest(1, row, min_version=1)], timeout=1)
        (second,) = await results.get_batch_async(1, timeout=30)
        prompts.close_now()
        results.close_now()
        return first, second, await asyncio.wait_for(run, 5)  # closing the queues ended the loop at once

    first, second, report = asyncio.run(go())
    assert (report.name, report.groups, report.weight_loads) == ("actor-0", 2, 1)
    # the timeline rides on the groups: what the actor did before each push, with the version it held
    # (the reward span ends inside the generate span, so it is recorded first)
    assert [(s.kind, s.version) for s in first.spans] == [("wait_prompts", None), ("reward", 0), ("generate", 0)]
    kinds = [(s.kind, s.version) for s in second.spans]
    assert kinds == [("wait_prompts", None), ("wait_weights", 0), ("load_weights", 1), ("reward", 1), ("generate", 1)]
    assert all(s.process == "actor-0" and s.start <= s.end for s in first.spans + second.spans)
    assert [s.kind for s in report.spans] == ["wait_prompts"]  # the wait the closed queue ended
    assert len(first.trajectories) == 3 and all(t.reward == 1.0 for t in first.trajectories)  # echo "5" -> "5"
    assert [t.policy_versions.tolist() for t in first.trajectories] == [[0]] * 3
    assert [t.policy_versions.tolist() for t in second.trajectories] == [[1]] * 3  # loaded before generating
    assert engine.loaded() == [1.0] and engine.llm.reset_prefix_cache.call_count == 1  # once, the published tensor
    assert second.weight_wait_s > 0 and first.weight_wait_s >= 0  # the wait rides on the group it delayed
    assert engine.calls == [1, 1]  # one generate call per queue call


def test_between_requests_actor_samples_the_prompts_of_one_queue_call_in_one_generate_call():
    engine = FakeLLM()
    actor = GenerationActor(actor_spec("fake", None, "builtin:echo", group_size=2, prompts_per_request=4), engine.llm)
    prompts, results, channel = LocalQueue("prompt", 8), LocalQueue("results", 8), LocalWeightChannel()
    rows = [{"prompt": f"copy {i}:", "answer": "5"} for i in range(3)]

    async def go():
        await actor.ready()
        await prompts.put_many_async([PromptRequest(i, row, min_version=0) for i, row in enumerate(rows)], 1)
        run = asyncio.create_task(actor.run(prompts, results, channel, TIMEOUTS))
        groups = await results.get_batch_async(3, timeout=30)
        prompts.close_now()
        results.close_now()
        await asyncio.wait_for(run, 5)
        return groups

    groups = asyncio.run(go())
    assert sorted(g.prompt_id for g in groups) == [0, 1, 2] and engine.calls == [3]  # one call, three prompts


def test_between_requests_turns_that_become_ready_while_a_call_runs_reach_the_engine_together():
    """Episode turns become ready one by one as their tool calls return; while a generate call runs they
    gather, and the next call takes them all (before, each went to the engine in a call of its own)."""
    import threading

    engine, release = FakeLLM(), threading.Event()
    generate = engine.generate

    def slow_first(prompts, sampling_params=None, use_tqdm=True, lora_request=None):
        if not engine.calls:
            release.wait(10)
        return generate(prompts, sampling_params, use_tqdm, lora_request)

    engine.llm.generate.side_effect = slow_first
    actor = GenerationActor(actor_spec("fake", None, "builtin:echo", group_size=2), engine.llm)
    request = PromptRequest(0, {"prompt": "copy 5:", "answer": "5"}, min_version=0)

    async def go():
        await actor.ready()
        first = asyncio.ensure_future(actor.engine.sample([3, 4], request, 4, 0))
        while not engine.llm.generate.called:
            await asyncio.sleep(0.01)
        later = []
        for salt in (1, 2, 3):  # three turns, each ready in a turn of the loop of its own
            later.append(asyncio.ensure_future(actor.engine.sample([3, 4], request, 4, salt)))
            await asyncio.sleep(0.01)
        release.set()
        return await asyncio.gather(first, *later)

    turns = asyncio.run(go())
    assert len(turns) == 4 and engine.calls == [1, 3]


class FakeAsyncLLM:
    """``AsyncLLM`` as the in-flight actor uses it (``tests/standins.py``: vLLM's own class; the weights cross
    into the engine's process as vLLM's msgpack carries them): each request streams 6 tokens; after the third
    it waits until new weights are loaded, so a swap lands exactly mid-generation. Like vLLM's engine
    core it labels each token with the weight version set when it was sampled, and a finished output
    carries the labels as spans. ``late``: the first three tokens are sampled before the swap but only
    reach the actor after it (an output read late), as vLLM's output handler can deliver them."""

    def __init__(self, late: bool = False):
        self.halfway = asyncio.Event()  # a request has sampled its first half
        self.swapped = asyncio.Event()  # weights were loaded
        self.late = late
        self.core = standins.EngineCore()
        self.worker = standins.worker(on_load=lambda pairs: self.swapped.set())
        self.llm = standins.async_llm(self.worker, self.generate, FakeTokenizer(), self.core)

    async def generate(self, prompt, sampling_params, request_id, **_):
        if prompt == "boom":
            raise RuntimeError("engine failed on this prompt")
        labels, unread = [], []
        for t in range(6):
            if t == 3:
                self.halfway.set()
                await self.swapped.wait()
            labels.append(self.core.weight_version)  # the engine's record, at sampling time
            last = t == 5
            unread.append(_completion([DIGIT], "length" if last else None))
            if self.late and t < 3:
                continue  # sampled now, delivered after the swap
            for completion in unread:
                if last and completion is unread[-1]:
                    completion.weight_versions = _spans(labels)
                yield SimpleNamespace(
                    prompt_token_ids=[3, 4], outputs=[completion], finished=last and completion is unread[-1]
                )
            unread = []


def _spans(labels: list[str]) -> list:
    """Contiguous runs of equal labels as vLLM's ``WeightVersionSpan(version, start, end)``."""
    spans = []
    for i, label in enumerate(labels):
        if spans and spans[-1].version == label:
            spans[-1].end = i + 1
        else:
            spans.append(SimpleNamespace(version=label, start=i, end=i + 1))
    return spans


async def _inflight_run(prompts_to_send: list[str], late: bool = False):
    engine = FakeAsyncLLM(late)
    spec = actor_spec("fake", None, "builtin:echo", group_size=2, weight_update="inflight")
    actor = GenerationActor(spec, engine.llm)
    await actor.ready()
    prompts, results, channel = LocalQueue("prompt", 8), LocalQueue("results", 8), LocalWeightChannel()
    run = asyncio.create_task(actor.run(prompts, results, channel, TIMEOUTS))
    for i, text in enumerate(prompts_to_send):
        await prompts.put_many_async([PromptRequest(i, {"prompt": text, "answer": "5"}, 0)], timeout=1)
    return engine, actor, prompts, results, channel, run


@pytest.mark.parametrize("late", [False, True])
def test_inflight_actor_swaps_weights_mid_generation_and_tags_every_token(late):
    # late: three tokens sampled with version 0 reach the actor only after the swap to version 1; their
    # version is the engine's record of the weights that sampled them, not the actor's clock when read
    # (on main, stamped when read: [1, 1, 1, 1, 1, 1])
    async def go():
        engine, actor, prompts, results, channel, run = await _inflight_run(["copy 5:"], late)
        await asyncio.wait_for(engine.halfway.wait(), 5)
        channel.publish(1, weights(1.0))  # the watcher sees it and swaps while the request waits
        pushed = asyncio.create_task(results.get_batch_async(1, timeout=5))
        await asyncio.wait({pushed, run}, return_when=asyncio.FIRST_COMPLETED)
        if run.done():
            run.result()  # the loop failed (a call the engine does not take): its own error fails the test
        (group,) = await pushed
        channel.close()
        await prompts.close()
        await results.close()
        stats = await asyncio.wait_for(run, 5)
        return engine, group, stats

    engine, group, stats = asyncio.run(go())
    assert engine.llm.pause_generation.await_count == 1 and stats.weight_loads == 1 and stats.groups == 1
    assert [float(pairs[0][1][0]) for pairs in engine.worker.loads] == [1.0]  # the tensor, across msgpack as bytes
    for traj in group.trajectories:
        assert traj.policy_versions.tolist() == [0, 0, 0, 1, 1, 1]  # tokens after the swap carry version 1
        assert traj.finish_reason == "length"
    # the swap happened inside the group's generate span: the timeline shows the overlap
    spans = {s.kind: s for s in group.spans}
    assert spans["generate"].version == 0 and spans["load_weights"].version == 1
    assert spans["generate"].start <= spans["load_weights"].start <= spans["generate"].end
    # the intake that began while the group generated went on after it finished: the actor's idle
    # wait for more prompts is on the timeline (the report subtracts the part beside generation)
    (last_wait,) = [s for s in stats.spans if s.kind == "wait_prompts"]
    assert last_wait.start <= spans["generate"].end < last_wait.end


class BrokenChannel:
    """A weight channel whose publisher failed: every fetch fails at once."""

    def latest_version(self) -> int:
        return 0

    def fetch(self, min_version: int, timeout: float):
        from cluster.channel import ChannelFailed

        raise ChannelFailed("weight push v1 failed: receiver actor-0 dropped out")

    def is_closed(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_inflight_actor_stops_on_a_broken_weight_channel_instead_of_spinning():
    from cluster.channel import ChannelFailed

    async def go():
        actor = GenerationActor(actor_spec("fake", None, "builtin:echo", weight_update="inflight"), FakeAsyncLLM().llm)
        await actor.ready()
        prompts, results = LocalQueue("prompt", 8), LocalQueue("results", 8)
        try:
            await asyncio.wait_for(actor.run(prompts, results, BrokenChannel(), TIMEOUTS), 5)
        finally:
            prompts.close_now()

    with pytest.raises(ChannelFailed, match="dropped out"):
        asyncio.run(go())


def test_inflight_actor_raises_a_failed_generation():
    async def go():
        _, _, prompts, _, channel, run = await _inflight_run(["boom"])
        try:
            await asyncio.wait_for(run, 5)
        finally:  # wake the in-process queue's and channel's waiting threads, so the test ends now
            prompts.close_now()
            channel.close()

    with pytest.raises(RuntimeError, match="engine failed on this prompt"):
        asyncio.run(go())


def test_between_requests_an_engine_answer_that_cannot_be_read_fails_every_waiting_rollout():
    # the review found a short answer (fewer outputs than prompts) left the rollouts waiting for ever
    actor = GenerationActor(actor_spec("fake", None, "builtin:echo", group_size=2), FakeLLM(short=True).llm)
    requests = [PromptRequest(i, {"prompt": "copy 5:", "answer": "5"}, min_version=0) for i in range(3)]

    async def go():
        await actor.ready()
        return await asyncio.wait_for(actor.generate(requests), 5)

    with pytest.raises(RuntimeError, match="the engine returned 2 outputs for 3 prompts"):
        asyncio.run(go())


async def asleep_with_a_prompt(weight_update: str):
    """An actor (fake engine) running its loop, put to sleep, that has then taken one prompt: the colocated
    schedule's training phase (CPU level 0, ``actors/sleep.py``). Returns the actor, the queues, the weight
    channel and its running loop."""
    engine = FakeLLM() if weight_update == "between_requests" else FakeAsyncLLM()
    if weight_update == "inflight":
        engine.swapped.set()  # no mid-generation swap here
    spec = actor_spec("fake", None, "builtin:echo", group_size=2, weight_update=weight_update)
    actor = GenerationActor(spec, engine.llm)
    prompts, results, channel = LocalQueue("prompt", 8), LocalQueue("results", 8), LocalWeightChannel()
    await actor.ready()
    run = asyncio.create_task(actor.run(prompts, results, channel, TIMEOUTS))
    await actor.sleep()
    await prompts.put_many_async([PromptRequest(0, {"prompt": "copy 5:", "answer": "5"}, 0)], timeout=1)
    await asyncio.sleep(0.3)
    return actor, prompts, results, channel, run


@pytest.mark.parametrize("weight_update", ["between_requests", "inflight"])
def test_an_asleep_actor_generates_nothing_until_it_wakes_with_the_version_just_published(weight_update):
    """The colocated schedule's training phase (CPU level 0, ``actors/sleep.py``): a prompt taken while asleep
    waits; the wake loads the newest version first, and the prompt is generated with it."""

    async def go():
        actor, prompts, results, channel, run = await asleep_with_a_prompt(weight_update)
        assert results.size() == 0  # taken, not generated
        channel.publish(1, weights(1.0))
        assert await actor.wake(0) == 1  # the newest published, though the phase asked for at least 0
        (group,) = await results.get_batch_async(1, timeout=30)
        prompts.close_now()
        results.close_now()
        await asyncio.wait_for(run, 5)
        return group

    group = asyncio.run(go())
    assert all(set(t.policy_versions.tolist()) == {1} for t in group.trajectories)
    assert any(s.kind == "wake" for s in group.spans)


@pytest.mark.parametrize("weight_update", ["between_requests", "inflight"])
def test_an_asleep_actor_holding_prompts_stops_when_the_run_ends(weight_update):
    """The run ends while an actor sleeps with a prompt it took (a replacement admitted late in the last phase):
    ``end_turns`` lets its loop return at once, and the prompt is not generated."""

    async def go():
        actor, prompts, results, _, run = await asleep_with_a_prompt(weight_update)
        await actor.end_turns()
        report = await asyncio.wait_for(run, 5)
        prompts.close_now()
        results.close_now()
        return report, results.size()

    report, left = asyncio.run(go())
    assert report.groups == 0 and left == 0


# --- what vLLM chose, in the ready line (actors/spec.py) --------------------------------------------
# The CPU engine of the tiny model with 1 GiB of KV cache (measured on the real engine): a token's KV is
# 2 (K, V) x 2 layers x 2 KV heads x 32 dims x 4 bytes = 1024 bytes, so 2^30 bytes hold 2^20 tokens, 8192
# blocks of 128. A 7B GPU engine (Qwen2.5-7B: 28 layers, 4 KV heads of 128 dims, bfloat16): 2 x 28 x 4 x 128
# x 2 = 57344 bytes a token; 23405 blocks of 16 tokens are 23405 x 16 x 57344 = 21474181120 bytes = 20.00 GiB.
GPU_KV_BYTES = 23405 * 16 * 2 * 28 * 4 * 128 * 2


def test_the_ready_line_says_what_vllm_chose_on_the_cpu(capsys):
    engine = FakeLLM()
    actor = GenerationActor(actor_spec("fake", None, "builtin:echo"), engine.llm)
    report = asyncio.run(actor.ready())
    assert {k: report[k] for k in ("async_scheduling", "model_runner", "kv_cache_bytes", "kv_cache_blocks")} == {
        "async_scheduling": False,
        "model_runner": "V1",
        "kv_cache_bytes": 2**30,
        "kv_cache_blocks": 8192,
    }
    assert report["block_size"] == 128 and report["attention"] == "CPU_ATTN"
    line = capsys.readouterr().out
    assert "vLLM chose: async scheduling off; model runner V1; KV cache 1.00 GiB per shard, 8192 blocks of 128" in line
    assert line.rstrip().endswith("attention CPU_ATTN")


@pytest.mark.parametrize("weight_update", ["between_requests", "inflight"])
def test_the_ready_line_of_a_gpu_engine_says_what_vllm_chose_and_why_async_scheduling_is_off(
    weight_update, monkeypatch, capsys
):
    # vLLM 0.32 on a GPU turns async scheduling on and picks Model Runner V2 (config/vllm.py); the in-flight
    # engine is built with async_scheduling=False (engine_kwargs) and VLLM_USE_V2_MODEL_RUNNER=0 (its actor's
    # environment, actors/environment.py), so its config says off and V1, and the line says why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    inflight = weight_update == "inflight"
    config = standins.vllm_config(
        async_scheduling=not inflight,
        v2_runner=not inflight,
        kv_blocks=23405,
        block_size=16,
        attention="FLASH_ATTN",
        layers=28,
    )
    worker = standins.worker(config, kv_bytes=GPU_KV_BYTES)
    engine = (standins.async_llm if inflight else standins.llm)(worker, tokenizer=FakeTokenizer())
    spec = actor_spec("fake", None, "builtin:echo", weight_update=weight_update)
    report = asyncio.run(GenerationActor(spec, engine).ready())
    chosen = (report["async_scheduling"], report["model_runner"], report["attention"])
    assert chosen == (not inflight, "V1" if inflight else "V2", "FLASH_ATTN")
    assert (report["kv_cache_bytes"], report["kv_cache_blocks"], report["block_size"]) == (GPU_KV_BYTES, 23405, 16)
    scheduling = "off: in-flight updates are proven only without it" if inflight else "on"
    runner = "V1: in-flight updates are proven only with it" if inflight else "V2"
    chose = f"vLLM chose: async scheduling {scheduling}; model runner {runner}; KV cache 20.00 GiB per shard, 23405"
    assert chose in capsys.readouterr().out
