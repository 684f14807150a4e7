"""A real two-node Ray cluster on one machine: actors on one node, the learner on the other.

Ray's cluster utilities start a head node and a second node (each with its own raylet
and object store) advertising different custom resources; the config pins generation
actors to one and learner ranks to the other. A short run joins the cluster with
``--address``, trains, and reports where each process ran.
"""

from __future__ import annotations

import pytest

from tests.runs import DEMO, read_summary, train

pytestmark = pytest.mark.slow


def test_actors_and_learner_on_different_nodes(tmp_path, tiny_model_dir, capsys):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"rollout_node": 2}})
    try:
        cluster.add_node(num_cpus=2, resources={"train_node": 2})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        node_of = {key: n["NodeID"] for n in ray.nodes() for key in n["Resources"] if key.endswith("_node")}
        ray.shutdown()

        code = train(
            DEMO,
            tiny_model_dir,
            tmp_path,
            f"resources.address={cluster.address}",  # what --address sets
            "run.steps=6",
            "resources.actors.custom={rollout_node: 1}",
            "resources.learner.custom={train_node: 1}",
        )
        out = capsys.readouterr().out
        assert code == 0, out
        summary = read_summary(tmp_path)
        assert summary["steps"] == 6
        assert summary["placement"]["actor-0"] == node_of["rollout_node"]
        assert summary["placement"]["learner-0"] == node_of["train_node"]
        assert node_of["rollout_node"] != node_of["train_node"]
        assert "placement: actor-0 on node" in out
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def test_a_plan_that_does_not_fit_is_explained(tmp_path, tiny_model_dir, capsys):
    code = train(DEMO, tiny_model_dir, tmp_path, "resources.local_num_cpus=2", "resources.actors.count=3")
    err = capsys.readouterr().err
    assert code == 2 and "4 CPUs asked (3 actors x 1 + 1 learner ranks x 1), 2 available" in err
    assert "reduce resources.actors.count" in err
