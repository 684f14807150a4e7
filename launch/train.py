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

from actors.spec import ActorTimeouts
from cluster.placement import reserve
from launch.build import build_generation_actors, build_learner_group, start_ray
from launch.config import TandemConfig
from launch.plan import build_plan
from launch.run_dir import RunLog
from launch.stepping import BatchCollector, Pace, step_metrics
from queues.bounded import build_queue
from queues.messages import PromptRequest
from queues.prompts import PromptStream


async def train(cfg: TandemConfig, run: RunLog, rows: list[dict], model_path: str) -> dict[str, Any]:
    plan = build_plan(cfg)
    start_ray(cfg)
    extra = "".join(f", {k.count} separate {k.prefix} process(es)" for k in (plan.critic, plan.reference) if k)
    run.say(
        f"run directory: {run.root}\nstarting {plan.actors.count} generation actor(s) and "
        f"{plan.learner.count} learner rank(s){extra} ..."
    )

    P, k, steps = cfg.rollout.prompts_per_step, cfg.run.max_staleness, cfg.run.steps
    prompt_queue = build_queue("ray", "prompt", maxsize=P * (k + 1))
    results_queue = build_queue("ray", "results", maxsize=P * (k + 2))
    scheduling = reserve(plan.kinds, cfg.resources.strategy, cfg.resources.placement_timeout_s)
    actors, learner = await asyncio.gather(
        build_generation_actors(cfg, model_path, run, scheduling),
        build_learner_group(cfg, model_path, run, scheduling),
    )
    run.say("placement: " + ", ".join(f"{name} on node {node[:8]}" for name, node in sorted(run.placement.items())))
    names = plan.actors.names()
    channels = await learner.open_weight_channel(cfg.weights, names, cfg.run.startup_timeout_s)
    timeouts = ActorTimeouts(data_s=cfg.run.data_timeout_s, weights_s=cfg.run.weights_timeout_s)
    actor_loops = {
        a.run.remote(prompt_queue, results_queue, channel, timeouts): name
        for a, channel, name in zip(actors, channels, names, strict=True)
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
        try:
            for step in range(steps):
                t0 = time.monotonic()
                batch = await collector.collect(P, step=step, max_staleness=k)
                learner_metrics = await learner.train_step(batch.groups)
                await learner.publish_weights(step + 1)
                await pace.advance(step + 1)  # policy version step + 1 is now on the channel
                run.step(step, step_metrics(batch, learner_metrics, time.monotonic() - t0))
        finally:
            collector.close()

    rollout = asyncio.create_task(rollout_loop())
    try:
        await training_loop()
    finally:
        rollout.cancel()
        # Weights first (a distributed receiver tears its group down on the close header), then the
        # queues: every actor waiting on them wakes with QueueClosed and its loop returns.
        for close in (learner.close_weight_channel, prompt_queue.close, results_queue.close):
            try:
                await close()
            except Exception as exc:  # a failed run's own error matters more than a failed close
                run.say(f"while stopping: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}")
    try:
        finals = await asyncio.wait_for(
            asyncio.gather(*actor_loops, return_exceptions=True), timeout=cfg.run.weights_timeout_s
        )
    except asyncio.TimeoutError:
        run.say(f"some actors did not stop within {cfg.run.weights_timeout_s:.0f}s; shutting them down")
        finals = [f"did not stop within {cfg.run.weights_timeout_s:.0f}s"] * len(actor_loops)
    return {"actors": [f if isinstance(f, dict) else repr(f) for f in finals], "placement": run.placement}
