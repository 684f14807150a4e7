"""A node that disappears mid-run (a spot instance reclaimed, a host rebooted), on a real multi-node Ray
cluster on one machine (Ray's cluster utilities: a head and worker nodes, each its own raylet).

- The node holding the generation actor goes: the actor is placed again on a node that has room and
  the run finishes; every prompt trained once, none lost. (The queues stay on the driver's node and
  the weight store on learner rank 0's, so no other part of the run goes with a worker node.)
- The node holding the learner rank goes: one line naming the rank and its node, the checkpoint, and
  ``run.max_restarts`` resumes once a node with the rank's resources has joined again.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.runs import DEMO, read_metrics, read_summary, train

pytestmark = pytest.mark.slow
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"  # the ray beside this Python
COMMON = ["run.steps=10", "rollout.prompts_per_step=8", "run.checkpoint_every=2", "run.max_restarts=1",
          "resources.actors.custom={rollout_node: 1}", "resources.learner.custom={train_node: 1}"]  # fmt: skip


@pytest.fixture
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    joined: list[subprocess.Popen] = []
    made.joined = joined
    try:
        yield made
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for proc in joined:
            proc.terminate()
            proc.wait(timeout=30)
        made.shutdown()


def remove_when(cluster, out: Path, process: str, steps: int, report: dict, join_after_s: float | None = None):
    """Once ``steps`` steps are logged, remove the node ``process`` runs on (no grace: as a lost host);
    then, after ``join_after_s``, a node with ``train_node`` joins (``ray start``, as an operator would)."""

    def go():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = list(out.glob("*/metrics.jsonl"))
            if metrics and len(metrics[0].read_text().splitlines()) >= steps:
                node_id = json.loads((metrics[0].parent / "processes.json").read_text())[process]["node"]
                node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
                report["lost"] = node_id
                cluster.remove_node(node, allow_graceful=False)
                if join_after_s is not None:
                    time.sleep(join_after_s)
                    command = [RAY, "start", f"--address={cluster.address}", "--num-cpus=2"]
                    command += ['--resources={"train_node": 1}', "--block"]
                    cluster.joined.append(
                        subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    )
                return
            time.sleep(0.2)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def assert_every_prompt_once(out: Path) -> None:
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(10))
    ids = [i for m in metrics for i in m["prompt_ids"]]
    assert len(ids) == len(set(ids)) == 80


def test_losing_the_actors_node_places_the_actor_on_another_and_the_run_finishes(
    cluster, tmp_path, tiny_model_dir, capsys
):
    cluster.add_node(num_cpus=2, resources={"train_node": 1})
    cluster.add_node(num_cpus=2, resources={"rollout_node": 1})
    cluster.add_node(num_cpus=2, resources={"rollout_node": 1})
    cluster.wait_for_nodes()
    report: dict = {}
    remover = remove_when(cluster, tmp_path, "actor-0", 3, report)
    assert train(DEMO, tiny_model_dir, tmp_path, f"resources.address={cluster.address}", *COMMON) == 0
    remover.join(timeout=5)
    said = capsys.readouterr().out
    lost = report["lost"][:8]
    assert f"actor-0: its node {lost} is gone; waiting for Ray to place it on another node" in said
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["actor_restarts"] == {"actor-0": 1}
    assert summary["placement"]["actor-0"] != report["lost"]  # it runs elsewhere now
    assert_every_prompt_once(tmp_path)


def test_losing_the_learners_node_is_one_line_and_the_run_resumes_when_a_node_returns(
    cluster, tmp_path, tiny_model_dir, capsys
):
    cluster.add_node(num_cpus=2, resources={"rollout_node": 1})
    cluster.add_node(num_cpus=2, resources={"train_node": 1})
    cluster.wait_for_nodes()
    report: dict = {}
    remover = remove_when(cluster, tmp_path, "learner-0", 3, report, join_after_s=5)
    assert train(DEMO, tiny_model_dir, tmp_path, f"resources.address={cluster.address}", *COMMON) == 0
    remover.join(timeout=10)
    said = capsys.readouterr().out
    line = next(line for line in said.splitlines() if line.startswith("learner-0 (node"))
    assert f"learner-0 (node {report['lost'][:8]}) died: its process cannot be reached: its node left" in line
    assert re.search(r"checkpoints/step-\d+; resume with: tandem train --resume", line), line
    assert "(run.max_restarts: 1 of 1)" in said
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert_every_prompt_once(tmp_path)
