"""The placement plan: bundles per process, totals checked against a cluster, explained when short."""

from __future__ import annotations

import pytest

from cluster.placement import PlacementError, check_fits, describe_plan, plan_bundles, required_resources
from launch.config import ConfigError, load_config
from launch.plan import actor_environment, build_plan

REQUIRED = ["model.path=m", "data.prompts=builtin:successor", "reward.function=builtin:successor"]
PPO_KL = ["algorithm.name=ppo", "algorithm.kl.placement=loss"]


def plan(*overrides: str) -> list:
    return build_plan(load_config(None, REQUIRED + list(overrides))).kinds


def test_colocated_critic_and_reference_add_no_process():
    names = [name for name, _ in plan_bundles(plan(*PPO_KL, "resources.learner.ranks=2"))]
    assert names == ["actor-0", "learner-0", "learner-1"]


def test_separate_critic_mirrors_the_learner_ranks_and_references_count_their_own():
    p = plan(
        *PPO_KL,
        "resources.actors.count=2",
        "resources.learner.ranks=2",
        "resources.learner.num_gpus=1",
        "resources.critic.placement=separate",
        "resources.critic.num_gpus=0.5",
        "resources.reference.placement=separate",
        "resources.reference.count=3",
        "resources.reference.custom={ref_node: 1}",
    )
    bundles = dict(plan_bundles(p))
    assert list(bundles) == [
        "actor-0", "actor-1", "learner-0", "learner-1", "critic-0", "critic-1",
        "reference-0", "reference-1", "reference-2",
    ]  # fmt: skip
    assert bundles["critic-1"] == {"CPU": 1.0, "GPU": 0.5}
    assert bundles["reference-2"] == {"CPU": 1.0, "ref_node": 1.0}
    assert required_resources(p) == {"CPU": 9.0, "GPU": 3.0, "ref_node": 3.0}
    text = describe_plan(p, "PACK")
    assert "9 bundles" in text and "critic-0" in text and "reference-2" in text


def test_separate_placement_is_ignored_when_the_run_has_no_such_model():
    # GRPO has no critic and, without a KL term, no reference: nothing extra is placed.
    p = plan("resources.critic.placement=separate", "resources.reference.placement=separate")
    assert [k.prefix for k in p] == ["actor", "learner"]
    assert [name for name, _ in plan_bundles(p)] == ["actor-0", "learner-0"]


def test_a_plan_that_does_not_fit_names_every_part_and_the_fix():
    p = plan(*PPO_KL, "resources.critic.placement=separate", "resources.reference.placement=separate")
    with pytest.raises(PlacementError) as err:
        check_fits(p, {"CPU": 3.0})
    message = str(err.value)
    assert "4 CPUs asked (1 actors x 1 + 1 learner ranks x 1 + 1 critic ranks x 1 + 1 reference actors x 1)" in message
    assert "3 available" in message and "resources.critic/reference.placement=colocated" in message
    check_fits(p, {"CPU": 4.0})


def test_tensor_parallel_actors_take_that_many_gpus_or_cores(monkeypatch):
    with pytest.raises(ConfigError, match="num_gpus = 1 but resources.actors.tensor_parallel = 2"):
        plan("resources.actors.num_gpus=1", "resources.actors.tensor_parallel=2")
    p = plan("resources.actors.num_gpus=2", "resources.actors.tensor_parallel=2")
    assert dict(plan_bundles(p))["actor-0"] == {"CPU": 1.0, "GPU": 2.0}
    with pytest.raises(ConfigError, match="one shard per core, but resources.actors.num_cpus = 1 reserves fewer"):
        plan("resources.actors.tensor_parallel=2")
    cfg = load_config(
        None,
        REQUIRED + ["resources.actors.tensor_parallel=2", "resources.actors.num_cpus=2", "resources.actors.count=2"],
    )
    assert "vLLM tensor parallel 2" in describe_plan(build_plan(cfg).kinds, "PACK")

    def binding(index: int) -> str:
        return actor_environment(cfg, index)["VLLM_CPU_OMP_THREADS_BIND"]

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert [binding(0), binding(1)] == ["0|1", "2|3"]  # one core per shard, engines apart
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert [binding(0), binding(1)] == ["0|1", "0|1"]  # oversubscribed, as every small CPU run is


def test_a_critic_is_placed_exactly_for_the_methods_that_need_one():
    from learner.methods import METHODS

    for name, method in METHODS.items():
        kinds = plan(f"algorithm.name={name}", "resources.critic.placement=separate")
        assert ("critic" in [k.prefix for k in kinds]) == method.needs_critic, name


def test_an_eager_cpu_engine_runs_with_dynamo_off():
    """vLLM torch.compiles the sampled token's rank even with enforce_eager (2-3 s of each start on a
    CPU); an eager CPU actor turns dynamo off, a compiled engine keeps it."""
    eager = load_config(None, REQUIRED)
    compiled = load_config(None, REQUIRED + ["engine.enforce_eager=false"])
    assert actor_environment(eager, 0)["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in actor_environment(compiled, 0)
