"""The GPU recipes in configs/recipes/: they parse, their placement fits the nodes they name, the
DAPO recipe sets DAPO's choices, and every math recipe's columns reach builtin:math as it reads them.

No Ray, no vLLM, no download: placement is checked against synthetic nodes of 8 GPUs, and the
rewards against rows written here in the datasets' column layouts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.rewards import load_reward_function
from cluster.placement import PlacementError, check_fits, plan_bundles, required_resources
from launch.config import load_config
from launch.data import fields_of
from launch.deploy.slurm import render_sbatch
from launch.deploy.submit import LaunchError, check_allocation
from launch.plan import build_plan
from queues.sources import to_row

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "configs" / "recipes"
GPUS_PER_NODE = 8
CPUS_PER_NODE = 64  # a modest 8-GPU node; the recipes ask for 24-40 CPUs per node
NODES = {  # recipe -> the 8-GPU nodes it is written for
    "gsm8k-grpo-1node.yaml": 1,
    "gsm8k-grpo-2node.yaml": 2,
    "math-grpo-1node.yaml": 1,
    "math-grpo-2node.yaml": 2,
    "math-dapo-1node.yaml": 1,
}
BOXED_PROMPT = r"\boxed{}"


def recipe(name: str):
    return load_config(RECIPES / name)


def node(gpus: int = GPUS_PER_NODE, cpus: int = CPUS_PER_NODE) -> dict[str, float]:
    return {"GPU": float(gpus), "CPU": float(cpus)}


def first_fit(bundles: list[tuple[str, dict[str, float]]], nodes: list[dict[str, float]]) -> list[list[str]]:
    """Place each bundle on the first node with room left (what Ray must manage, one bundle per node);
    the process names per node. Raises ``AssertionError`` naming a bundle that fits nowhere."""
    left = [dict(n) for n in nodes]
    placed: list[list[str]] = [[] for _ in nodes]
    for name, bundle in bundles:
        for i, free in enumerate(left):
            if all(free.get(k, 0.0) >= v - 1e-9 for k, v in bundle.items()):
                for k, v in bundle.items():
                    free[k] -= v
                placed[i].append(name)
                break
        else:
            raise AssertionError(f"{name} {bundle} fits on none of the nodes (left: {left})")
    return placed


@pytest.mark.parametrize("path", sorted((ROOT / "configs").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_file_loads(path):
    cfg = load_config(path)
    assert cfg.run.steps > 0


def test_the_recipes_are_the_ones_listed_here():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(NODES)


@pytest.mark.parametrize("name", sorted(NODES))
def test_recipe_placement_fills_its_nodes_exactly(name):
    cfg, nodes = recipe(name), NODES[name]
    kinds = build_plan(cfg).kinds
    need = required_resources(kinds)
    # Every GPU of the nodes is used, one per process: 1 node = 8 processes, 2 nodes = 16.
    assert need["GPU"] == GPUS_PER_NODE * nodes
    assert all(k.num_gpus == 1 for k in kinds)
    assert cfg.resources.actors.tensor_parallel == 1
    check_fits(kinds, {"GPU": GPUS_PER_NODE * nodes, "CPU": CPUS_PER_NODE * nodes})
    # The launchers' per-machine check (tandem slurm / k8s run it before printing a script).
    check_allocation(
        cfg, machines=nodes, gpus_each=GPUS_PER_NODE, cpus_each=CPUS_PER_NODE, unit="nodes", fix="raise --nodes"
    )
    # One bundle per process, and they pack onto the nodes: 8 per node.
    bundles = plan_bundles(kinds)
    assert len(bundles) == GPUS_PER_NODE * nodes
    placed = first_fit(bundles, [node() for _ in range(nodes)])
    assert [len(p) for p in placed] == [GPUS_PER_NODE] * nodes
    # ... and not onto fewer GPUs: one missing GPU, or one node fewer, is refused.
    with pytest.raises(PlacementError, match="GPUs asked"):
        check_fits(kinds, {"GPU": GPUS_PER_NODE * nodes - 1, "CPU": CPUS_PER_NODE * nodes})
    if nodes > 1:
        with pytest.raises(LaunchError, match="raise --nodes"):
            check_allocation(
                cfg,
                machines=nodes - 1,
                gpus_each=GPUS_PER_NODE,
                cpus_each=CPUS_PER_NODE,
                unit="nodes",
                fix="raise --nodes",
            )


@pytest.mark.parametrize("name", [n for n, k in NODES.items() if k > 1])
def test_two_node_recipes_say_how_to_launch_and_render_an_sbatch_script(name):
    text = (RECIPES / name).read_text()
    path = f"configs/recipes/{name}"
    assert f"tandem slurm --config {path} --nodes 2 --gpus-per-node 8" in text
    assert f"tandem submit --config {path}" in text
    script = render_sbatch(
        recipe(name),
        path,
        ["run.output_dir=/shared/runs"],
        nodes=2,
        gpus_per_node=GPUS_PER_NODE,
        cpus_per_node=CPUS_PER_NODE,
        partition="gpu",
        time_limit="12:00:00",
        job_name="tandem",
        venv=None,
    )
    assert "#SBATCH --nodes=2" in script and f"--config {path}" in script


@pytest.mark.parametrize("name", sorted(NODES))
def test_recipe_is_a_gpu_math_run(name):
    cfg = recipe(name)
    assert cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.model.dtype == "bfloat16"
    assert [p.function for p in cfg.reward.parts] == ["builtin:math"]
    assert BOXED_PROMPT in cfg.data.system_prompt and cfg.data.chat_template == "auto"
    assert cfg.learner.lr == 1e-6 and cfg.learner.warmup_steps > 0 and cfg.learner.zero_stage in (2, 3)
    assert cfg.eval.enabled and cfg.eval.every > 0 and cfg.eval.split == "test"
    assert cfg.engine.gpu_memory_utilization >= 0.8
    if name.startswith("gsm8k"):
        assert (cfg.data.prompts, cfg.data.subset, cfg.data.prompt_field) == ("openai/gsm8k", "main", "question")
        assert cfg.eval.prompts == "openai/gsm8k"
    else:
        assert (cfg.data.prompt_field, cfg.data.answer_field) == ("problem", "solution")


def test_dapo_recipe_sets_the_dapo_choices():
    cfg = recipe("math-dapo-1node.yaml")
    algo = cfg.algorithm
    assert algo.clip == (0.2, 0.28)  # clip-higher
    assert algo.loss.aggregation == "token_mean"
    assert algo.filtering.groups == "zero_variance" and algo.filtering.max_oversample > 1
    # overlong shaping: no penalty up to 8192 - 2048 = 6144 tokens
    assert algo.shaping.soft_overlong is not None and algo.shaping.soft_overlong.cache_len == 2048
    assert cfg.rollout.max_tokens == 8192 and cfg.rollout.group_size == 16
    assert algo.kl.placement == "none" and not cfg.has_reference
    assert build_plan(cfg).reference is None


# One row of each dataset as it is stored, and a completion that ends as the system prompt asks.
GSM8K_ROW = {
    "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
    "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72",
}
MATH_ROW = {
    "problem": "What is $\\frac{1}{2} + \\frac{1}{3}$?",
    "level": "Level 1",
    "type": "Prealgebra",
    "solution": "The common denominator is 6: $\\frac{3}{6} + \\frac{2}{6} = \\boxed{\\frac{5}{6}}$.",
}
CASES = [
    ("gsm8k-grpo-1node.yaml", GSM8K_ROW, "48 + 24 = 72, so the answer is \\boxed{72}.", "\\boxed{70}"),
    ("math-grpo-1node.yaml", MATH_ROW, "3/6 + 2/6 = 5/6. \\boxed{\\dfrac{5}{6}}", "\\boxed{\\frac{1}{5}}"),
    ("math-dapo-1node.yaml", MATH_ROW, "So the sum is \\boxed{5/6}", "\\boxed{0.8}"),
]


@pytest.mark.parametrize(("name", "raw", "right", "wrong"), CASES, ids=[c[0] for c in CASES])
def test_recipe_columns_reach_the_math_reward(name, raw, right, wrong):
    cfg = recipe(name)
    row, reason = to_row(raw, fields_of(cfg.data))
    assert reason is None and row["prompt"] == raw[cfg.data.prompt_field]
    fn = load_reward_function(cfg.reward.function, cfg.reward)
    # right answer -> 1.0, wrong -> 0.0 (5/6 == \dfrac{5}{6} symbolically; 70 != 72)
    assert fn([row["prompt"]] * 2, [right, wrong], [row, row]) == [1.0, 0.0]


def test_the_recipes_table_lists_every_recipe_and_its_command():
    page = (ROOT / "docs" / "recipes.md").read_text()
    match = re.search(r"^## Recipes\n(.*?)^## ", page, re.S | re.M)
    assert match, "docs/recipes.md has no '## Recipes' section"
    section = match.group(1)
    for name, nodes in NODES.items():
        path = f"configs/recipes/{name}"
        (line,) = [line for line in section.splitlines() if line.startswith(f"| `{path}`")]
        assert f"{nodes} x 8" in line
        command = "tandem slurm" if nodes > 1 else "tandem train"
        assert f"{command} --config {path}" in line
