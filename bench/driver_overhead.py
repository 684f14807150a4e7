"""Driver overhead and bytes across process boundaries in one learner step, at a large batch.

The learner group (the driver's side) plans each step, sends every rank its shard and combines
what comes back; the ranks (Ray actors, real DeepSpeed) run the forward and backward passes. This
bench times a step at a batch of real size (default 512 prompts x 16 samples x 1,024 completion
tokens) with a fake model (a 1-layer, hidden-32 Qwen2: the ranks' compute is small, so whatever the
driver adds shows) and reports, per step:

* ``step s``: the driver's wall time of ``LearnerGroup.train_step``;
* ``ranks s``: the critical path of the ranks' own work (for each call the group makes, the slowest
  rank's time inside the call; the calls follow each other);
* ``driver s`` = step - ranks: planning, advantages, (de)serialisation, Ray round trips; and its share;
* ``driver cpu s``: CPU time of the driver process during the step;
* ``to ranks MB`` / ``from ranks MB``: bytes of the arguments and results of the calls, as pickled
  (protocol 5, out-of-band buffers counted), measured inside the ranks;
* ``queue MB``: bytes of the step's trajectory groups as they reach the driver from the results queue.

Every public method of the rank class is wrapped (in this script) to time it and size its
arguments and result; the sizing is outside the timed part.

    .venv/bin/python bench/driver_overhead.py [--prompts 512 --samples 16 --completion 1024 --steps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import synthetic_groups  # noqa: E402

SKIP = {"setup", "rendezvous_address", "bench_stats", "completion_logprobs"}


def pickled_bytes(obj) -> int:
    buffers: list = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(memoryview(b).nbytes for b in buffers)


def timed_class(base: type) -> type:
    """``base`` with every public method timed and its traffic sized (defined here, so Ray ships it by value)."""
    import time as _time

    def wrap(name, method):
        def call(self, *args, **kwargs):
            start = _time.perf_counter()
            out = method(self, *args, **kwargs)
            seconds = _time.perf_counter() - start
            stats = self.__dict__.setdefault("_bench", [])
            stats.append((name, seconds, pickled_bytes((args, kwargs)), pickled_bytes(out)))
            return out

        call.__name__ = name
        return call

    def bench_stats(self):
        stats, self._bench = self.__dict__.get("_bench", []), []
        return stats

    members = {"bench_stats": bench_stats}
    for name in dir(base):
        if name.startswith("_") or name in SKIP or not callable(getattr(base, name)):
            continue
        members[name] = wrap(name, getattr(base, name))
    return type(f"Timed{base.__name__}", (base,), members)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--method", default="grpo", help="grpo (no scoring pass) or grpo-kl (KL loss: reference + old)")
    args = parser.parse_args()

    import ray

    import learner.worker
    from actors.tiny_model import build_tiny_model
    from launch.build import build_learner_group
    from launch.config import load_config
    from launch.plan import build_plan
    from launch.ray_session import start_ray
    from observe.run_dir import RunLog

    tmp = Path(tempfile.mkdtemp(prefix="bench-driver-"))
    model = build_tiny_model(
        tmp / "fake-model",
        hidden_size=32,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        intermediate_size=64,
        max_positions=args.prompt_len + args.completion + 8,
    )
    overrides = [
        "model.path=x",
        "data.prompts=x",
        "reward.function=x",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.samples}",
        f"rollout.max_tokens={args.completion}",
        f"resources.learner.ranks={args.ranks}",
        f"learner.token_budget={args.token_budget}",
        f"resources.local_num_cpus={args.ranks + 1}",
    ]
    if args.method == "grpo-kl":
        overrides += ["algorithm.kl.placement=loss"]
    cfg = load_config(None, overrides)
    learner.worker.LearnerWorker = timed_class(learner.worker.LearnerWorker)
    groups = synthetic_groups(args.prompts, args.samples, args.prompt_len, lambda rng: args.completion, seed=0)
    queue_mb = pickled_bytes(groups) / 1e6
    tokens = sum(t.num_tokens for g in groups for t in g.trajectories)
    print(
        f"batch: {args.prompts} x {args.samples} sequences, {tokens / 1e6:.1f}M tokens; {args.method}, "
        f"{args.ranks} ranks; queue -> driver {queue_mb:.0f} MB per step",
        flush=True,
    )
    start_ray(cfg, build_plan(cfg))
    run = RunLog(tmp / "run", args.steps)

    async def go():
        group = await build_learner_group(cfg, build_plan(cfg), str(model), run)
        rows = []
        for step in range(args.steps + 1):  # step 0 warms up
            cpu0, t0 = time.process_time(), time.perf_counter()
            await group.train_step(groups)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            per_rank = await asyncio.gather(*[w.bench_stats.remote() for w in group.workers])
            calls: dict[str, list[float]] = {}
            sent = received = 0
            for stats in per_rank:
                for name, seconds, nin, nout in stats:
                    calls.setdefault(name, []).append(seconds)
                    sent, received = sent + nin, received + nout
            ranks_s = sum(max(v) for v in calls.values())
            row = dict(step=wall, ranks=ranks_s, driver=wall - ranks_s, cpu=cpu, sent=sent / 1e6, back=received / 1e6)
            print(
                f"  step {step}{' (warm-up)' if step == 0 else ''}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in row.items())
                + f"  calls {sorted(calls)}",
                flush=True,
            )
            if step:
                rows.append(row)
        return rows

    rows = asyncio.run(go())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"\n{'step s':>8}{'ranks s':>9}{'driver s':>10}{'driver %':>10}{'driver cpu s':>14}"
        f"{'to ranks MB':>13}{'from ranks MB':>15}{'queue MB':>10}"
    )
    print(
        f"{med['step']:>8.2f}{med['ranks']:>9.2f}{med['driver']:>10.2f}{100 * med['driver'] / med['step']:>9.1f}%"
        f"{med['cpu']:>14.2f}{med['sent']:>13.0f}{med['back']:>15.0f}{queue_mb:>10.0f}"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
