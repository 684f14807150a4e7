"""Placement: which Ray resources each process gets, from the ``resources`` config section.

Nothing else in Tandem names CPUs or GPUs; actors are created with
``Actor.options(**placement).remote(**params)``. The plan is one Ray placement group
with a bundle per generation actor and per learner rank (``plan_bundles``);
``check_fits`` compares the totals with what the cluster offers before anything starts,
and ``reserve`` waits (with a deadline) for Ray to place every bundle on a node.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Compiled kernels (vLLM's first logprobs call) are cached across runs here.
INDUCTOR_CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "inductor"


class PlacementError(RuntimeError):
    """The plan asks for more than the cluster has."""


def generation_actor_options(
    actors: dict[str, Any], index: int, engine: dict[str, Any], scheduling: Any = None
) -> dict[str, Any]:
    """Ray options for generation actor ``index`` (``scheduling``: its placement-group bundle)."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in the actor's process: weights pass directly
        "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not actors["num_gpus"]:
        # vLLM on CPU ignores Ray's CPU accounting and would pin every engine to core 0.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
        env["VLLM_CPU_KVCACHE_SPACE"] = str(engine["kv_cache_gib"])
    return _with_scheduling(
        {
            "num_cpus": actors["num_cpus"],
            "num_gpus": actors["num_gpus"],
            "resources": dict(actors.get("custom") or {}),
            "runtime_env": {"env_vars": env},
        },
        scheduling,
    )


def _with_scheduling(options: dict[str, Any], scheduling: Any) -> dict[str, Any]:
    if scheduling is not None:
        options["scheduling_strategy"] = scheduling
    return options


def learner_rank_options(learner: dict[str, Any], scheduling: Any = None) -> dict[str, Any]:
    """Ray options for one learner rank (``scheduling``: its placement-group bundle)."""
    env = {"OMP_NUM_THREADS": str(max(1, int(learner["num_cpus"]))), "TOKENIZERS_PARALLELISM": "false"}
    if not learner["num_gpus"]:
        env["DS_ACCELERATOR"] = "cpu"
    return _with_scheduling(
        {
            "num_cpus": learner["num_cpus"],
            "num_gpus": learner["num_gpus"],
            "resources": dict(learner.get("custom") or {}),
            "runtime_env": {"env_vars": env},
        },
        scheduling,
    )


def required_resources(resources: dict[str, Any]) -> dict[str, float]:
    a, learner = resources["actors"], resources["learner"]
    need = {
        "CPU": a["count"] * a["num_cpus"] + learner["ranks"] * learner["num_cpus"],
        "GPU": a["count"] * a["num_gpus"] + learner["ranks"] * learner["num_gpus"],
    }
    for p, n in ((a, a["count"]), (learner, learner["ranks"])):
        for key, value in (p.get("custom") or {}).items():
            need[key] = need.get(key, 0.0) + n * value
    return need


def check_fits(resources: dict[str, Any], available: dict[str, float]) -> None:
    """Raise ``PlacementError`` explaining what does not fit."""
    need = required_resources(resources)
    for kind, amount in need.items():
        have = available.get(kind, 0.0)
        if amount > have + 1e-9 and kind not in ("CPU", "GPU"):
            raise PlacementError(
                f"{amount:g} of custom resource '{kind}' asked, {have:g} available: start nodes with "
                f"--resources '{{\"{kind}\": N}}' or change resources.*.custom"
            )
        if amount > have + 1e-9:
            a, learner = resources["actors"], resources["learner"]
            raise PlacementError(
                f"{amount:g} {kind}s asked ({a['count']} actors x {a['num_' + kind.lower() + 's']:g} + "
                f"{learner['ranks']} learner ranks x {learner['num_' + kind.lower() + 's']:g}), {have:g} available: "
                f"reduce resources.actors.count or resources.learner.ranks, or the per-process num_{kind.lower()}s"
            )


def local_ray_cpus(resources: dict[str, Any]) -> int:
    """CPUs a local Ray should advertise: the machine's cores, or the plan's need if larger
    (small CPU runs oversubscribe cores on purpose; the processes are mostly idle in turn)."""
    if resources.get("local_num_cpus"):
        return int(resources["local_num_cpus"])
    need = required_resources(resources)["CPU"]
    return max(os.cpu_count() or 1, int(-(-need // 1)))


def plan_bundles(resources: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """``(process name, bundle)`` for every generation actor, then every learner rank."""

    def bundle(p: dict[str, Any]) -> dict[str, float]:
        b = {"CPU": float(p["num_cpus"]), **{k: float(v) for k, v in (p.get("custom") or {}).items()}}
        if p["num_gpus"]:
            b["GPU"] = float(p["num_gpus"])
        return b

    a, learner = resources["actors"], resources["learner"]
    return [(f"actor-{i}", bundle(a)) for i in range(a["count"])] + [
        (f"learner-{r}", bundle(learner)) for r in range(learner["ranks"])
    ]


def describe_plan(resources: dict[str, Any], nodes: list[dict] | None = None) -> str:
    """The placement as text: one line per process, totals, and the cluster's nodes if known."""
    lines = [f"placement group: strategy {resources['strategy']}, {len(plan_bundles(resources))} bundles"]
    lines += [f"  {name:<12} {_fmt(b)}" for name, b in plan_bundles(resources)]
    lines.append(f"  {'total':<12} {_fmt(required_resources(resources))}")
    if nodes is not None:
        lines.append(f"cluster: {len(nodes)} node(s)")
        for n in nodes:
            shown = {k: v for k, v in n["Resources"].items() if not k.startswith(("node:", "memory", "object_store"))}
            lines.append(f"  {n['NodeManagerAddress']:<15} {_fmt(shown)}")
    return "\n".join(lines)


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if v)


def reserve(resources: dict[str, Any]):
    """Create the placement group and wait for it; returns per-process scheduling strategies
    (actors first, then learner ranks). Raises ``PlacementError`` naming what does not fit."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    named = plan_bundles(resources)
    pg = placement_group([b for _, b in named], strategy=resources["strategy"])
    if not pg.wait(timeout_seconds=resources["placement_timeout_s"]):
        remove_placement_group(pg)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        raise PlacementError(
            f"Ray could not place the plan within {resources['placement_timeout_s']:.0f}s "
            f"({len(named)} bundles, strategy {resources['strategy']}): no node has room for some bundle. "
            "Check `tandem plan` against the nodes; reduce resources.actors.count, the per-process "
            "num_cpus/num_gpus/custom, or use resources.strategy=SPREAD. "
            f"Nodes: {'; '.join(_fmt(n['Resources']) for n in nodes)}"
        )
    return [
        PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i) for i in range(len(named))
    ]
