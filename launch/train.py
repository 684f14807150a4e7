"""The Tandem training program: actors and a learner, a rollout loop and a training loop.

    rows ──▶ prompt queue ──▶ generation actors (vLLM) ──▶ results queue ──▶ learner (DeepSpeed)
                 ▲                   ▲                                           │
        admission control            └──────────── weight channel ◀──────────────┘

The rollout loop admits a prompt only while it can still be trained on within
``max_staleness`` policy versions; the training loop drops (and counts) anything older
all the same. With ``max_staleness: 0`` the two loops alternate (synchronous RL).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cluster.placement import process_groups, reserve
from launch.build import build_generation_actors, build_learner_group, build_weight_path, start_ray
from launch.config import TandemConfig
from launch.run_dir import RunLog
from launch.stepping import BatchCollector, Pace, step_metrics
from queues.bounded import build_queue
from queues.messages import PromptRequest
from queues.prompts import PromptStream


async def train(cfg: TandemConfig, run: RunLog, rows: list[dict], model_path: str) -> dict[str, Any]:
    plan = cfg.placement()
    start_ray(plan)
    # separate critic ranks / reference actors: every kind of process after the actors and learner ranks
    extra = "".join(f", {n} separate {prefix} process(es)" for prefix, _, n, _ in process_groups(plan)[2:])
    run.say(
        f"run directory: {run.root}\nstarting {cfg.resources.actors.count} generation actor(s) and "
        f"{cfg.resources.learner.ranks} learner rank(s){extra} ..."
    )

    P, k, steps = cfg.rollout.prompts_per_step, cfg.run.max_staleness, cfg.run.steps
    prompt_queue = build_queue("ray", "prompt", maxsize=P * (k + 1))
    results_queue = build_queue("ray", "results", maxsize=P * (k + 2))
    scheduling = reserve(plan)  # one placement group: a bundle per process
    actors, learner = await asyncio.gather(
        build_generation_actors(cfg, model_path, run, scheduling),
        build_learner_group(cfg, model_path, run, scheduling),
    )
    run.say("placement: " + ", ".join(f"{name} on node {node[:8]}" for name, node in sorted(run.placement.items())))
    weights = await build_weight_path(cfg, learner, len(actors))  # Ray object store or a distributed broadcast
    timeouts = {"data_s": cfg.run.data_timeout_s, "weights_s": cfg.run.weights_timeout_s}
    actor_loops = {
        a.run.remote(prompt_queue, results_queue, weights.channels[i], timeouts): f"actor-{i}"
        for i, a in enumerate(actors)
    }
    pace = Pace(prompts_per_step=P, max_staleness=k)
    run.say(f"training {steps} steps: {P} prompts x {cfg.rollout.group_size} samples per step, max staleness {k}")

    async def rollout_loop() -> None:
        for prompt_id, row in enumerate(PromptStream(rows, cfg.run.seed, cfg.data.shuffle)):
            await pace.admit(prompt_id)  # waits until this prompt can be trained on within k versions
            request = PromptRequest(prompt_id=prompt_id, row=row, min_version=pace.version)
            await prompt_queue.put_many_async([request], timeout=cfg.run.data_timeout_s)

    async def training_loop() -> None:
        collector = BatchCollector(results_queue, actor_loops, run, cfg.run.data_timeout_s, on_drop=pace.drop)
        for step in range(steps):
            t0 = time.monotonic()
            batch = await collector.collect(P, step=step, max_staleness=k)
            learner_metrics = await learner.train_step(batch.groups)
            await weights.publish(step + 1)
            pace.advance(step + 1)  # policy version step + 1 is now on the channel
            run.step(step, step_metrics(batch, learner_metrics, time.monotonic() - t0))

    rollout = asyncio.create_task(rollout_loop())
    try:
        await training_loop()
    finally:
        rollout.cancel()
        await weights.close()
    try:  # actor loops end once the channel closes; a stuck one is left to Ray's shutdown
        finals = await asyncio.wait_for(
            asyncio.gather(*actor_loops, return_exceptions=True), timeout=cfg.run.weights_timeout_s
        )
    except asyncio.TimeoutError:
        run.say(f"some actors did not stop within {cfg.run.weights_timeout_s:.0f}s; shutting them down")
        finals = [f"did not stop within {cfg.run.weights_timeout_s:.0f}s"] * len(actor_loops)
    return {"actors": [f if isinstance(f, dict) else repr(f) for f in finals], "placement": run.placement}
