"""Weights reach the actors: a real learner step, exported, published, loaded into vLLM.

After the push the actor's log-probs of a fixed completion equal the learner's within
1e-4 (fp32) and differ from what the actor gave before the push.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import WeightsConfig
from learner.config import AlgorithmConfig, LearnerConfig
from learner.group import LearnerGroup
from tests.fakes import make_group, make_sequence
from tests.runs import DEMO, actor_options, actor_spec, rank_options, read_summary, train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["tp1", "tp2"])
def test_pushed_weights_reach_the_actor(ray_session, tiny_model_dir, tmp_path, tensor_parallel):
    """tp2: the engine shards the model over two worker processes (one core each on CPU);
    the pushed weights reach both shards through vLLM's own loader."""
    ray = ray_session
    from actors.generation import GenerationActor
    from learner.worker import LearnerWorker, RankSpec

    spec = actor_spec(tiny_model_dir, str(tmp_path / "actor.log"), tensor_parallel=tensor_parallel)
    actor = ray.remote(GenerationActor).options(**actor_options(tensor_parallel)).remote(spec)
    worker = ray.remote(LearnerWorker).options(**rank_options()).remote(0, 1, str(tmp_path / "learner.log"))
    addr, port = ray.get(worker.rendezvous_address.remote())
    # a big step (lr 0.05), so the weights visibly change
    rank = RankSpec(tiny_model_dir, LearnerConfig(lr=0.05), AlgorithmConfig(), "float32", 0, max_tokens=16)
    ray.get(worker.setup.remote(addr, port, rank))
    assert ray.get(actor.ready.remote())["tensor_parallel"] == tensor_parallel

    probe = make_sequence(random.Random(0), prompt_len=5, completion_len=6)
    prompt, completion = probe.prompt_token_ids, probe.completion_token_ids
    before = ray.get(actor.completion_logprobs.remote(prompt, completion))
    learner_before = ray.get(worker.completion_logprobs.remote(prompt, completion))
    # Same initial weights on both sides: vLLM and transformers agree in fp32.
    assert max(abs(a - b) for a, b in zip(before, learner_before)) < 1e-4

    group = LearnerGroup([worker], AlgorithmConfig(), token_budget=4096, max_tokens=16)
    batch = [make_group(p, [1.0, 0.0, 0.5, 0.0], completion_len=6) for p in range(2)]

    async def step_and_publish():
        await group.train_step(batch)
        (channel,) = await group.open_weight_channel(WeightsConfig(), ["actor-0"], 30.0)
        await group.publish_weights(1)  # rank 0 puts the weights into Ray's object store
        return channel

    channel = asyncio.run(step_and_publish())
    ray.get(actor.sync_weights.remote(channel, 1, 30.0))
    after = ray.get(actor.completion_logprobs.remote(prompt, completion))
    learner_after = ray.get(worker.completion_logprobs.remote(prompt, completion))

    assert ray.get(actor.stats.remote())["version"] == 1
    assert max(abs(a - b) for a, b in zip(after, learner_after)) < 1e-4
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-3  # the push changed the actor's policy


@pytest.mark.parametrize("zero_stage", [0, 3], ids=["zero0", "zero3"])
def test_the_saved_model_loads_in_transformers_and_vllm_and_exports_from_a_checkpoint(
    ray_session, tiny_model_dir, tmp_path, zero_stage
):
    """The trained policy written as a Hugging Face directory (learner/saving.py) is the learner's:
    vLLM's log-probs of a fixed completion from the saved model equal the learner's within 1e-4 in
    fp32; ``tandem export`` from the DeepSpeed checkpoint alone gives the same weights."""
    ray = ray_session
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from actors.generation import GenerationActor
    from launch.tools.export import _from_deepspeed
    from learner.worker import LearnerWorker, RankSpec

    worker = ray.remote(LearnerWorker).options(**rank_options()).remote(0, 1, str(tmp_path / "learner.log"))
    addr, port = ray.get(worker.rendezvous_address.remote())
    learner = LearnerConfig(lr=0.05, zero_stage=zero_stage)
    ray.get(worker.setup.remote(addr, port, RankSpec(tiny_model_dir, learner, AlgorithmConfig(), "float32", 0, 16)))
    group = LearnerGroup([worker], AlgorithmConfig(), token_budget=4096, max_tokens=16)
    asyncio.run(group.train_step([make_group(p, [1.0, 0.0, 0.5, 0.0], completion_len=6) for p in range(2)]))
    saved, checkpoint = tmp_path / "model", tmp_path / "checkpoint"
    asyncio.run(group.save_model(str(saved)))
    asyncio.run(group.save_checkpoint(str(checkpoint)))

    probe = make_sequence(random.Random(1), prompt_len=5, completion_len=6)
    prompt, completion = probe.prompt_token_ids, probe.completion_token_ids
    learner = ray.get(worker.completion_logprobs.remote(prompt, completion))
    ray.kill(worker)
    hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trained = dict(hf.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in initial.named_parameters())  # the trained weights

    actor = (
        ray.remote(GenerationActor)
        .options(**actor_options())
        .remote(actor_spec(str(saved), str(tmp_path / "actor.log")))
    )
    from_saved = ray.get(actor.completion_logprobs.remote(prompt, completion))
    ray.kill(actor)
    assert max(abs(a - b) for a, b in zip(from_saved, learner)) < 1e-4

    exported = _from_deepspeed(checkpoint, tmp_path / "exported")
    a, b = load_file(saved / "model.safetensors"), load_file(exported / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (exported / "tokenizer_config.json").is_file() and (exported / "config.json").is_file()


def test_a_run_over_the_distributed_weight_channel(tmp_path, tiny_model_dir, capsys):
    """weights.backend=distributed: learner rank 0 broadcasts over its own gloo group; every step's
    weights reach the actor (one load per published version) and the run completes."""
    code = train(DEMO, tiny_model_dir, tmp_path, "run.steps=8", "run.max_staleness=0", "weights.backend=distributed")
    assert code == 0, capsys.readouterr()
    summary = read_summary(tmp_path)
    assert summary["steps"] == 8
    # k = 0: each of versions 1..7 must be loaded before the next step's prompts are generated
    assert summary["actors"][0]["weight_loads"] == 7
