"""Weights reach the actors: a real learner step, exported, published, loaded into vLLM.

After the push the actor's log-probs of a fixed completion equal the learner's within
1e-4 (fp32) and differ from what the actor gave before the push.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.placement import generation_actor_options, learner_rank_options
from cluster.weights import build_weight_channel
from launch.config import AlgorithmConfig, EngineConfig, LearnerConfig, RolloutConfig
from learner.group import LearnerGroup, shard_sequences
from tests.fakes import make_sequence
from tests.runs import DEMO, read_summary, train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["tp1", "tp2"])
def test_pushed_weights_reach_the_actor(ray_session, tiny_model_dir, tmp_path, tensor_parallel):
    """tp2: the engine shards the model over two worker processes (one core each on CPU);
    the pushed weights reach both shards through vLLM's own loader."""
    ray = ray_session
    from actors.generation import GenerationActor
    from learner.worker import LearnerWorker

    engine = {**EngineConfig().model_dump(), "tensor_parallel_size": tensor_parallel}
    placement = {"num_cpus": tensor_parallel, "num_gpus": 0, "tensor_parallel": tensor_parallel}
    actor = (
        ray.remote(GenerationActor)
        .options(**generation_actor_options(placement, 0, engine))
        .remote(
            "actor-0",
            tiny_model_dir,
            engine,
            RolloutConfig().model_dump(),
            "builtin:echo",
            "float32",
            0,
            str(tmp_path / "actor.log"),
        )
    )
    learner_cfg = LearnerConfig(lr=0.05).model_dump()  # a big step, so the weights visibly change
    worker = (
        ray.remote(LearnerWorker)
        .options(**learner_rank_options({"num_cpus": 1, "num_gpus": 0}))
        .remote(0, 1, str(tmp_path / "learner.log"))
    )
    addr, port = ray.get(worker.rendezvous_address.remote())
    ray.get(worker.setup.remote(addr, port, tiny_model_dir, learner_cfg, AlgorithmConfig().model_dump(), "float32", 0))
    assert ray.get(actor.ready.remote())["tensor_parallel"] == tensor_parallel

    rng = random.Random(0)
    probe = make_sequence(rng, prompt_len=5, completion_len=6)
    prompt, completion = probe.prompt_token_ids, probe.completion_token_ids
    before = ray.get(actor.completion_logprobs.remote(prompt, completion))
    learner_before = ray.get(worker.logprobs.remote([probe]))[0]
    # Same initial weights on both sides: vLLM and transformers agree in fp32.
    assert max(abs(a - b) for a, b in zip(before, learner_before)) < 1e-4

    batch = [make_sequence(rng, 5, 6) for _ in range(8)]
    group = LearnerGroup([worker], AlgorithmConfig().model_dump(), token_budget=4096, max_tokens=16)
    ray.get(worker.train_step.remote(shard_sequences(batch, 1, 4096)[0]))
    weights_ref = asyncio.run(group.export_weights())

    channel = build_weight_channel("ray")
    channel.publish(1, weights_ref)
    ray.get(actor.sync_weights.remote(channel, 1, 30.0))
    after = ray.get(actor.completion_logprobs.remote(prompt, completion))
    learner_after = ray.get(worker.logprobs.remote([probe]))[0]

    assert ray.get(actor.stats.remote())["version"] == 1
    assert max(abs(a - b) for a, b in zip(after, learner_after)) < 1e-4
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-3  # the push changed the actor's policy


def test_a_run_over_the_distributed_weight_channel(tmp_path, tiny_model_dir, capsys):
    """weights.backend=distributed: learner rank 0 broadcasts over its own gloo group; every step's
    weights reach the actor (one load per published version) and the run completes."""
    code = train(DEMO, tiny_model_dir, tmp_path, "run.steps=8", "run.max_staleness=0", "weights.backend=distributed")
    assert code == 0, capsys.readouterr()
    summary = read_summary(tmp_path)
    assert summary["steps"] == 8
    # k = 0: each of versions 1..7 must be loaded before the next step's prompts are generated
    assert summary["actors"][0]["weight_loads"] == 7
