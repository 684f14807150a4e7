"""Placement: which Ray resources each process gets, from the ``resources`` config section.

Nothing else in Tandem names CPUs or GPUs; actors are created with
``Actor.options(**placement).remote(**params)``. The plan is one Ray placement group with
a bundle per process (``plan_bundles``): every generation actor, every learner rank, and,
when they are placed separately, every critic rank and reference actor. ``check_fits``
compares the totals with what the cluster offers before anything starts, and ``reserve``
waits (with a deadline) for Ray to place every bundle on a node.

``resources`` here is ``TandemConfig.placement()``: its ``critic`` / ``reference`` entries
are None when those models live on the learner ranks (or the run has none).
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
        # vLLM on CPU ignores Ray's CPU accounting and would pin every engine to core 0;
        # a tensor-parallel engine takes one core per shard ("0|1").
        tp, cores = actors.get("tensor_parallel", 1), os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str((index * tp + j) % cores) for j in range(tp))
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
    """Ray options for one learner rank, or a separate critic rank or reference actor (the same
    keys: ``num_cpus``, ``num_gpus``, ``custom``); ``scheduling``: its placement-group bundle."""
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


# What one process of each kind is called in messages.
PROCESS_LABELS = {"actor": "actor", "learner": "learner rank", "critic": "critic rank", "reference": "reference actor"}


def process_groups(resources: dict[str, Any]) -> list[tuple[str, str, int, dict[str, Any]]]:
    """``(name prefix, config key, count, section)`` for each kind of process the plan places."""
    groups = [
        ("actor", "actors", resources["actors"]["count"], resources["actors"]),
        ("learner", "learner", resources["learner"]["ranks"], resources["learner"]),
    ]
    if resources.get("critic"):  # as many critic ranks as learner ranks: they train on the same shards
        groups.append(("critic", "critic", resources["learner"]["ranks"], resources["critic"]))
    if resources.get("reference"):
        groups.append(("reference", "reference", resources["reference"]["count"], resources["reference"]))
    return groups


def required_resources(resources: dict[str, Any]) -> dict[str, float]:
    need = {"CPU": 0.0, "GPU": 0.0}
    for _, _, n, section in process_groups(resources):
        need["CPU"] += n * section["num_cpus"]
        need["GPU"] += n * section["num_gpus"]
        for key, value in (section.get("custom") or {}).items():
            need[key] = need.get(key, 0.0) + n * value
    return need


def explain_sum(resources: dict[str, Any], kind: str) -> str:
    """How the plan's total of ``kind`` (CPU or GPU) adds up, e.g. ``3 actors x 1 + 1 learner ranks x 1``."""
    field = f"num_{kind.lower()}s"
    return " + ".join(
        f"{n} {PROCESS_LABELS[prefix]}s x {section[field]:g}" for prefix, _, n, section in process_groups(resources)
    )


def fix_hint(resources: dict[str, Any], kind: str) -> str:
    """Which config keys lower the plan's ``kind`` total."""
    keys = ["resources.actors.count", "resources.learner.ranks"]
    if resources.get("reference"):
        keys.append("resources.reference.count")
    separate = [k for k in ("critic", "reference") if resources.get(k)]
    hint = f"reduce {' or '.join(keys)}, or the per-process num_{kind.lower()}s"
    if separate:
        hint += f", or set resources.{'/'.join(separate)}.placement=colocated"
    return hint


def check_fits(resources: dict[str, Any], available: dict[str, float]) -> None:
    """Raise ``PlacementError`` explaining what does not fit."""
    for kind, amount in required_resources(resources).items():
        have = available.get(kind, 0.0)
        if amount <= have + 1e-9:
            continue
        if kind not in ("CPU", "GPU"):
            raise PlacementError(
                f"{amount:g} of custom resource '{kind}' asked, {have:g} available: start nodes with "
                f"--resources '{{\"{kind}\": N}}' or change resources.*.custom"
            )
        raise PlacementError(
            f"{amount:g} {kind}s asked ({explain_sum(resources, kind)}), {have:g} available: "
            f"{fix_hint(resources, kind)}"
        )


def local_ray_cpus(resources: dict[str, Any]) -> int:
    """CPUs a local Ray should advertise: the machine's cores, or the plan's need if larger
    (small CPU runs oversubscribe cores on purpose; the processes are mostly idle in turn)."""
    if resources.get("local_num_cpus"):
        return int(resources["local_num_cpus"])
    need = required_resources(resources)["CPU"]
    return max(os.cpu_count() or 1, int(-(-need // 1)))


def plan_bundles(resources: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """``(process name, bundle)`` for every process: actors, learner ranks, then separate
    critic ranks and reference actors."""

    def bundle(p: dict[str, Any]) -> dict[str, float]:
        b = {"CPU": float(p["num_cpus"]), **{k: float(v) for k, v in (p.get("custom") or {}).items()}}
        if p["num_gpus"]:
            b["GPU"] = float(p["num_gpus"])
        return b

    return [(f"{prefix}-{i}", bundle(section)) for prefix, _, n, section in process_groups(resources) for i in range(n)]


def describe_plan(resources: dict[str, Any], nodes: list[dict] | None = None) -> str:
    """The placement as text: one line per process, totals, and the cluster's nodes if known."""
    lines = [f"placement group: strategy {resources['strategy']}, {len(plan_bundles(resources))} bundles"]
    tp = resources["actors"].get("tensor_parallel", 1)
    shards = f"  (vLLM tensor parallel {tp})" if tp > 1 else ""
    lines += [
        f"  {name:<12} {_fmt(b)}{shards if name.startswith('actor-') else ''}" for name, b in plan_bundles(resources)
    ]
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
    """Create the placement group and wait for it; returns each process's scheduling strategy
    by name (``actor-0``, ``learner-0``, ...). Raises ``PlacementError`` naming what does not fit."""
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
    return {
        name: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        for i, (name, _) in enumerate(named)
    }
