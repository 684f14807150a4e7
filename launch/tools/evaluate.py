"""``tandem eval --model DIR --config F``: evaluate any saved model on the held-out set, the way a
training run evaluates its policy (``runtime/evaluation.py``): the config's generation actors
(vLLM) sample ``eval.samples`` completions of each held-out prompt at ``eval.temperature``, its
reward scores them, and the metrics (pass@1, pass@k, mean reward, mean length) are printed and
written to ``<run.output_dir>/eval-<timestamp>/eval.jsonl``. No learner starts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.placement import on_this_node, reserve
from cluster.weights import RayWeightChannel
from launch.assemble import ActorStarter
from launch.build import build_generation_actors
from launch.config import TandemConfig
from launch.plan import Plan, build_plan
from launch.ray_session import start_ray, stop_ray
from observe.run_dir import RunLog
from queues.bounded import build_queue
from queues.templates import PromptRenderer
from runtime.collector import BatchCollector
from runtime.evaluation import Evaluator, eval_line
from runtime.supervise import ActorWatch

CLOSE_TIMEOUT_S = 15.0


async def evaluate_model(
    cfg: TandemConfig, plan: Plan, model_path: str, rows: list[dict], run: RunLog
) -> dict[str, Any]:
    """One evaluation round of ``rows`` with the weights in ``model_path``; returns its metrics. The actors
    are built and their loops started as a training run's are (``launch/assemble.py``); no learner starts."""
    start_ray(cfg, plan)
    scheduling = reserve([plan.actors], cfg.resources.strategy, cfg.resources.placement_timeout_s)
    run.say(f"evaluating {model_path} on {len(rows)} prompts x {cfg.eval.samples} with {plan.actors.count} actor(s)")
    actors = await build_generation_actors(cfg, plan, model_path, run, scheduling)
    channel = RayWeightChannel()  # never published to: the actors keep the weights they loaded (version 0)
    P = cfg.rollout.prompts_per_step
    prompt_queue = build_queue("ray", "prompt", maxsize=P, actor_options=on_this_node())
    results_queue = build_queue("ray", "results", maxsize=2 * P, actor_options=on_this_node())
    receivers = channel.receivers(plan.actors.names())
    starter = ActorStarter(cfg, plan, model_path, run, scheduling, (prompt_queue, results_queue), receivers)
    loops = {starter.run_loop(actor, i): name for i, (actor, name) in enumerate(zip(actors, starter.names))}
    renderer = PromptRenderer.load(model_path, cfg.data.chat_template, cfg.data.system_prompt)
    evaluator = Evaluator(
        rows,
        cfg.eval,
        put=lambda requests: prompt_queue.put_many_async(requests, timeout=cfg.run.data_timeout_s),
        render=renderer.token_ids,
        record=lambda step, metrics: run.eval(step, metrics, eval_line(None, metrics)),
        chunk=P,
    )
    collector = BatchCollector(results_queue, ActorWatch(loops, run), run, cfg.run.data_timeout_s, evaluator=evaluator)
    try:
        evaluator.start(0, version=0)
        await collector.drain_eval(lambda: evaluator.pending, cfg.run.data_timeout_s)
        evaluator.check_sending()
    finally:
        evaluator.give_up()
        collector.close()
        channel.close()
        for close in (prompt_queue.close, results_queue.close):
            try:
                await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)
            except Exception as exc:
                run.say(f"while stopping: {type(exc).__name__}: {exc}")
        ends = asyncio.gather(*[asyncio.ensure_future(ref) for ref in loops], return_exceptions=True)
        try:
            await asyncio.wait_for(ends, cfg.run.weights_timeout_s)
        except asyncio.TimeoutError:
            run.say(f"some actors did not stop within {cfg.run.weights_timeout_s:.0f}s; shutting them down")
    return evaluator.results[0]


def run_evaluation(config_path: str | None, model: str, overrides: list[str]) -> int:
    """The ``tandem eval`` command: check everything, evaluate, print and record the metrics."""
    import json
    import sys

    from launch.config import ConfigError, load_config
    from launch.data import load_run_rows
    from launch.preflight import check_context_length, check_output_dir, check_prompt_lengths

    cfg = load_config(config_path, [*overrides, f"model.path={model}", "model.build_tiny=false"])
    if not cfg.eval.enabled:
        raise ConfigError("tandem eval needs a held-out set: set eval.prompts (or eval.fraction) in the config")
    from actors.rewards import check_rewards
    from launch.build import prepare_model

    check_rewards(cfg.reward)
    _, rows = load_run_rows(cfg, lambda line: print(f"tandem: {line}", file=sys.stderr, flush=True))
    model_path = prepare_model(cfg.model)
    check_output_dir(cfg.run.output_dir)
    check_context_length(cfg.engine.max_model_len, model_path)
    rows = check_prompt_lengths(cfg, model_path, rows, "the held-out set")
    run = RunLog.create(cfg.run.output_dir, f"eval-{cfg.run.name}", cfg.model_dump(mode="json"), 0, cfg.run.private)
    try:
        plan = build_plan(cfg.model_copy(update={"run": cfg.run.model_copy(update={"schedule": "overlapped"})}))
        metrics = asyncio.run(evaluate_model(cfg, plan, model_path, rows, run))  # no learner to take turns with
    finally:
        stop_ray()
    run.close({"model": model_path, **metrics})
    print(json.dumps({"model": model_path, "run_dir": str(run.root), **metrics}))
    return 0
