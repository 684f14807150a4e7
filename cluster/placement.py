"""Placement: which Ray resources each process gets, and one placement group for all of them.

Nothing else in Tandem names CPUs or GPUs; processes are created with
``Actor.options(**ray_options(kind, env, bundle)).remote(**params)``. The plan is a list of
``ProcessKind``s (``launch/plan.py`` makes it from the config; this module knows no roles):
each kind is ``count`` processes with the same resources, and the placement group has one
bundle per process (``plan_bundles``). ``check_fits`` compares the totals with what the
cluster offers before anything starts, and ``reserve`` waits (with a deadline) for Ray to
place every bundle on a node. The environment a process needs (vLLM's or DeepSpeed's
variables) comes from its role, passed in as ``env``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


class PlacementError(RuntimeError):
    """The plan asks for more than the cluster has."""


@dataclass(frozen=True)
class ProcessKind:
    """``count`` processes named ``<prefix>-0`` .. ``<prefix>-<count-1>``, each with these resources."""

    prefix: str  # process names, e.g. "actor"
    label: str  # one such process in messages, e.g. "learner rank"
    count: int
    num_cpus: float
    num_gpus: float
    custom: dict[str, float] = field(default_factory=dict)
    section: str = ""  # its config section, e.g. "resources.actors": the keys a fix hint names
    count_key: str | None = None  # the key that sets count, when the user sets it
    colocate_hint: str | None = None  # the setting that would put it on other processes instead
    note: str = ""  # shown beside each of its processes in ``describe_plan``
    # colocated: the prefix of the kind whose bundles these processes share (process i goes into that
    # kind's bundle i % its count) instead of bundles of their own
    shares: str | None = None
    share: float = 1.0  # the fraction of its resources a process asks of Ray (its bundle is shared)

    def names(self) -> list[str]:
        return [f"{self.prefix}-{i}" for i in range(self.count)]

    def bundle(self) -> dict[str, float]:
        b = {"CPU": float(self.num_cpus), **{k: float(v) for k, v in self.custom.items()}}
        if self.num_gpus:
            b["GPU"] = float(self.num_gpus)
        return b


def on_this_node() -> dict[str, Any]:
    """Ray actor options that keep an actor on the node of the process creating it. The queues (made by
    the driver), which hold every prompt in flight, and the weight store (made by learner rank 0, its
    publisher) then go only with their owner, whose loss ends the run anyway, never with another node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


def ray_options(kind: ProcessKind, env: dict[str, str], scheduling: Any = None) -> dict[str, Any]:
    """Ray options for one process of ``kind`` (``scheduling``: its placement-group bundle)."""
    options = {
        "num_cpus": kind.num_cpus * kind.share,
        "num_gpus": kind.num_gpus * kind.share,
        "resources": {k: v * kind.share for k, v in kind.custom.items()},
        "runtime_env": {"env_vars": dict(env)},
    }
    if scheduling is not None:
        options["scheduling_strategy"] = scheduling
    return options


def required_resources(kinds: list[ProcessKind]) -> dict[str, float]:
    need = {"CPU": 0.0, "GPU": 0.0}
    guests = shared_bundles(kinds)
    for k in kinds:
        if k.count and k.names()[0] in guests:  # in another kind's bundles: adds nothing
            continue
        need["CPU"] += k.count * k.num_cpus
        need["GPU"] += k.count * k.num_gpus
        for key, value in k.custom.items():
            need[key] = need.get(key, 0.0) + k.count * value
    return need


def explain_sum(kinds: list[ProcessKind], resource: str) -> str:
    """How the plan's total of ``resource`` (CPU or GPU) adds up, e.g. ``3 actors x 1 + 1 learner ranks x 1``."""
    attr = f"num_{resource.lower()}s"
    return " + ".join(f"{k.count} {k.label}s x {getattr(k, attr):g}" for k in kinds)


def fix_hint(kinds: list[ProcessKind], resource: str) -> str:
    """Which config keys lower the plan's ``resource`` total."""
    keys = [k.count_key for k in kinds if k.count_key]
    hint = f"reduce {' or '.join(keys)}, or the per-process num_{resource.lower()}s"
    colocate = [k.colocate_hint for k in kinds if k.colocate_hint]
    if colocate:
        hint += f", or set {'/'.join(colocate)}=colocated"
    return hint


def check_fits(kinds: list[ProcessKind], available: dict[str, float]) -> None:
    """Raise ``PlacementError`` explaining what does not fit."""
    check_shares(kinds)
    for resource, amount in required_resources(kinds).items():
        have = available.get(resource, 0.0)
        if amount <= have + 1e-9:
            continue
        if resource not in ("CPU", "GPU"):
            raise PlacementError(
                f"{amount:g} of custom resource '{resource}' asked, {have:g} available: start nodes with "
                f"--resources '{{\"{resource}\": N}}' or change resources.*.custom"
            )
        raise PlacementError(
            f"{amount:g} {resource}s asked ({explain_sum(kinds, resource)}), {have:g} available: "
            f"{fix_hint(kinds, resource)}"
        )


def local_ray_cpus(kinds: list[ProcessKind], local_num_cpus: int | None = None) -> int:
    """CPUs a local Ray should advertise: ``local_num_cpus``, else the machine's cores, or the plan's
    need if larger (small CPU runs oversubscribe cores on purpose; the processes are mostly idle in turn)."""
    if local_num_cpus:
        return int(local_num_cpus)
    need = required_resources(kinds)["CPU"]
    return max(os.cpu_count() or 1, int(-(-need // 1)))


def plan_bundles(kinds: list[ProcessKind]) -> list[tuple[str, dict[str, float]]]:
    """``(process name, bundle)`` for every process with a bundle of its own, kind by kind."""
    guests = shared_bundles(kinds)
    return [(name, k.bundle()) for k in kinds for name in k.names() if name not in guests]


def shared_bundles(kinds: list[ProcessKind]) -> dict[str, str]:
    """Process name -> the process whose bundle it shares, for the kinds that share (colocated) one of
    ``kinds`` (a kind whose host is not among them, as the actors of ``tandem eval``, has bundles of its own)."""
    hosts = {k.prefix: k for k in kinds}
    out = {}
    for k in kinds:
        if k.shares in hosts:
            host = hosts[k.shares].names()
            out.update({name: host[i % len(host)] for i, name in enumerate(k.names())})
    return out


def check_shares(kinds: list[ProcessKind]) -> None:
    """A kind that shares another's bundles must fit in one of them: ``PlacementError`` otherwise."""
    hosts = {k.prefix: k for k in kinds}
    for k in kinds:
        if k.shares not in hosts:
            continue
        host = hosts[k.shares]
        for resource, need, have in (("CPU", k.num_cpus, host.num_cpus), ("GPU", k.num_gpus, host.num_gpus)):
            if need > have + 1e-9:
                raise PlacementError(
                    f"each {k.label} asks {need:g} {resource}s and shares a {host.label}'s bundle of {have:g} "
                    f"(run.schedule=colocated): lower {k.section}.num_{resource.lower()}s or raise "
                    f"{host.section}.num_{resource.lower()}s"
                )
        for resource, need in k.custom.items():
            if need > host.custom.get(resource, 0.0) + 1e-9:
                raise PlacementError(
                    f"each {k.label} asks {need:g} of custom resource '{resource}' and shares a {host.label}'s bundle, "
                    f"which has {host.custom.get(resource, 0.0):g} (run.schedule=colocated): give "
                    f"{host.section}.custom the same resources"
                )


def describe_plan(kinds: list[ProcessKind], strategy: str, nodes: list[dict] | None = None) -> str:
    """The placement as text: one line per process, totals, and the cluster's nodes if known."""
    lines = [f"placement group: strategy {strategy}, {len(plan_bundles(kinds))} bundles"]
    shared = shared_bundles(kinds)
    for k in kinds:
        note = f"  ({k.note})" if k.note else ""
        for name in k.names():
            where = f"  (in {shared[name]}'s bundle, takes turns with it)" if name in shared else ""
            lines.append(f"  {name:<12} {_fmt(k.bundle())}{note}{where}")
    lines.append(f"  {'total':<12} {_fmt(required_resources(kinds))}")
    if nodes is not None:
        lines.append(f"cluster: {len(nodes)} node(s)")
        for n in nodes:
            shown = {k: v for k, v in n["Resources"].items() if not k.startswith(("node:", "memory", "object_store"))}
            lines.append(f"  {n['NodeManagerAddress']:<15} {_fmt(shown)}")
    return "\n".join(lines)


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if v)


def reserve(kinds: list[ProcessKind], strategy: str, timeout_s: float) -> dict[str, Any]:
    """Create the placement group and wait for it; returns each process's scheduling strategy
    by name (``actor-0``, ``learner-0``, ...). Raises ``PlacementError`` naming what does not fit."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    named = plan_bundles(kinds)
    pg = placement_group([b for _, b in named], strategy=strategy)
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        raise PlacementError(
            f"Ray could not place the plan within {timeout_s:.0f}s "
            f"({len(named)} bundles, strategy {strategy}): no node has room for some bundle. "
            f"Check `tandem plan` against the nodes; reduce {' or '.join(k.count_key for k in kinds if k.count_key)}, "
            "the per-process num_cpus/num_gpus/custom, or use resources.strategy=SPREAD. "
            f"Nodes: {'; '.join(_fmt(n['Resources']) for n in nodes)}"
        )
    strategies = {
        name: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        for i, (name, _) in enumerate(named)
    }
    return strategies | {name: strategies[host] for name, host in shared_bundles(kinds).items()}


def bundle_state(strategy: Any) -> tuple[str, str | None]:
    """``(state of the placement group, node id of this process's bundle)`` for a strategy that
    ``reserve`` returned; ``("none", None)`` for a process outside any placement group."""
    from ray.util.placement_group import placement_group_table

    pg = getattr(strategy, "placement_group", None)
    if pg is None:
        return "none", None
    table = placement_group_table(pg)
    node = (table.get("bundles_to_node_id") or {}).get(strategy.placement_group_bundle_index)
    return str(table.get("state", "?")), node


def node_is_gone(node_id: str | None) -> bool:
    """Ray no longer lists ``node_id`` as an alive node (it was lost, or removed)."""
    import ray

    if not node_id:
        return False
    return not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


async def bundle_placed_again(strategy: Any, deadline: float, lost_node: str | None) -> str:
    """Wait until Ray has placed this process's bundle again after its node was lost (the placement
    group is ``CREATED`` with the bundle on another node); its new node id. ``PlacementError`` past
    ``deadline`` (``time.monotonic()``): no node that is left has room for it."""
    import asyncio
    import time

    while True:
        state, node = bundle_state(strategy)
        if state in ("CREATED", "none") and (node is None or node != lost_node):
            return node or "?"
        if time.monotonic() > deadline:
            raise PlacementError(
                f"its node {str(lost_node)[:8]} was lost and no node left has room for its bundle (placement "
                f"group {state}); add a node with its resources, then resume"
            )
        await asyncio.sleep(0.5)
