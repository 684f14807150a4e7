"""The typed config: shipped files parse, overrides are typed, mistakes get one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch.config import ConfigError, config_reference, load_config

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ["model.path=m", "data.prompts=p.jsonl", "reward.function=r.py:f"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert cfg.run.steps > 0


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        None, REQUIRED + ["learner.lr=3e-4", "run.steps=7", "resources.actors.count=2", "learner.betas=[0.8, 0.95]"]
    )
    assert cfg.learner.lr == 3e-4 and cfg.run.steps == 7 and cfg.resources.actors.count == 2
    assert cfg.learner.betas == (0.8, 0.95)


def test_unknown_key_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, REQUIRED + ["learner.lrr=1"])
    message = str(err.value)
    assert "unknown config key 'learner.lrr'" in message and "lr" in message and "\n" not in message


def test_missing_and_invalid_values():
    with pytest.raises(ConfigError, match="missing config key 'reward'"):
        load_config(None, REQUIRED[:2])
    with pytest.raises(ConfigError, match="'learner.lr'.*greater than 0"):
        load_config(None, REQUIRED + ["learner.lr=-1"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, REQUIRED + ["learner.lr"])


def test_cross_field_rules_name_the_fields():
    with pytest.raises(ConfigError, match="cannot fill algorithm.loss.minibatches = 256"):
        load_config(None, REQUIRED + ["algorithm.loss.minibatches=256"])  # 16 x 8 = 128 sequences
    with pytest.raises(ConfigError, match="cache_len = 16 must be below rollout.max_tokens = 16"):
        load_config(None, REQUIRED + ["algorithm.shaping.soft_overlong={cache_len: 16}"])
    with pytest.raises(ConfigError, match="kl.placement=reward is not defined for grpo_process"):
        load_config(None, REQUIRED + ["algorithm.name=grpo_process", "algorithm.kl.placement=reward"])


@pytest.mark.parametrize(
    "setting",
    [
        "algorithm.shaping.truncation_penalty=-1",
        "algorithm.shaping.soft_overlong={cache_len: 4}",
        "algorithm.shaping.normalise_rewards=true",
        "algorithm.shaping.whiten_rewards=whiten",
    ],
)
def test_process_supervision_refuses_sequence_reward_shaping_it_would_ignore(setting):
    # grpo_process's advantages come from the step rewards alone: these settings changed nothing on main
    key = setting.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key} shapes the sequence reward, which grpo_process does not train on"):
        load_config(None, REQUIRED + ["algorithm.name=grpo_process", setting])
    load_config(None, REQUIRED + [setting])  # the outcome methods use it


def test_k1_kl_in_the_loss_warns_that_its_gradient_is_zero_in_expectation():
    cfg = load_config(None, REQUIRED + ["algorithm.kl.placement=loss", "algorithm.kl.estimator=k1"])
    assert (
        len(cfg.warnings) == 1
        and "estimator=k2" in cfg.warnings[0]
        and "does not involve the reference" in cfg.warnings[0]
    )
    for ok in (["algorithm.kl.placement=loss", "algorithm.kl.estimator=k3"], ["algorithm.kl.placement=reward"]):
        assert (
            load_config(None, REQUIRED + ok + ["algorithm.kl.estimator=k1"] * (ok[-1].endswith("reward"))).warnings
            == []
        )


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_the_config_reference_in_docs_is_in_sync():
    page = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", page, re.S)
    assert block, "docs/configuration.md lacks the config reference markers"
    assert block.group(1).strip() == config_reference().strip(), (
        "docs/configuration.md's config reference is stale: regenerate it with `python -m launch.docs`"
    )


def test_several_config_files_merge_in_order(tmp_path):
    """`tandem train --config job.yaml --config tune.yaml`: the later file's keys win, section by section."""
    job, tune = tmp_path / "job.yaml", tmp_path / "tune.yaml"
    job.write_text(
        "model: {path: m}\ndata: {prompts: p.jsonl}\nreward: {function: builtin:echo}\n"
        "run:\n  steps: 7\n  max_staleness: 1\nrollout:\n  group_size: 4\n"
    )
    tune.write_text("run:\n  max_staleness: 2\nrollout:\n  weight_update: inflight\n")
    cfg = load_config([str(job), str(tune)], ["run.seed=3"])
    assert (cfg.run.steps, cfg.run.max_staleness, cfg.run.seed) == (7, 2, 3)
    assert (cfg.rollout.group_size, cfg.rollout.weight_update) == (4, "inflight")
    with pytest.raises(ConfigError, match="missing.yaml does not exist"):
        load_config([str(job), str(tmp_path / "missing.yaml")])


def test_top_p_below_one_is_refused_because_the_learner_cannot_model_it():
    with pytest.raises(ConfigError, match=r"rollout.top_p = 0.95 is not modelled by the learner.*top_p=1.0"):
        load_config(None, REQUIRED + ["rollout.top_p=0.95"])
    assert load_config(None, REQUIRED + ["rollout.temperature=0.6"]).rollout.temperature == 0.6


def test_the_actors_engine_reports_the_sampled_distributions_logprobs_and_prefills_whole_prompts_on_cpu():
    from actors.spec import ActorSpec, engine_kwargs

    cfg = load_config(None, REQUIRED + ["engine.max_model_len=12000"])
    spec = ActorSpec("actor-0", "m", cfg.engine, cfg.rollout, cfg.reward, "float32", 0)
    kwargs = engine_kwargs(spec)
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # after temperature, as the learner scores
    # no chunked prefill on the CPU: a seeded request split over two steps crashes vLLM's CPU runner
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 12000


def test_a_config_written_before_the_algorithm_groups_loads_the_same_and_says_where_its_keys_went():
    base = ["model.path=m", "data.prompts=p", "reward.function=f"]
    flat = ["algorithm.minibatches=2", "algorithm.filter_groups=zero_variance", "algorithm.loss_aggregation=seq_mean"]
    grouped = [
        "algorithm.loss.minibatches=2",
        "algorithm.filtering.groups=zero_variance",
        "algorithm.loss.aggregation=seq_mean",
    ]
    old, new = load_config(None, [*base, *flat]), load_config(None, [*base, *grouped])
    assert old.model_dump() == new.model_dump()
    assert old.algorithm.updates_per_batch == 2 and old.algorithm.aggregation == "seq_mean"
    (said,) = old.warnings  # one line, however many keys moved
    assert "written flat" in said and "minibatches -> loss.minibatches, filter_groups -> filtering.groups" in said
    assert not new.warnings
    both = "algorithm.minibatches and algorithm.loss.minibatches are the same setting, given twice; keep algorithm.loss"
    with pytest.raises(ConfigError, match=both):  # named, not "unknown key"
        load_config(None, [*base, "algorithm.minibatches=2", "algorithm.loss.minibatches=3"])


def test_flat_and_grouped_algorithm_keys_mix_across_sources_and_the_later_one_wins(tmp_path):
    # each source (a file, the overrides) is grouped before they merge: a shipped grouped config takes a
    # flat override, and a run saved flat takes a grouped one (the reviewer found both refused)
    assert load_config(ROOT / "configs" / "ppo.yaml", ["algorithm.minibatches=4"]).algorithm.loss.minibatches == 4
    flat = tmp_path / "flat.yaml"
    flat.write_text(
        "model: {path: m}\ndata: {prompts: p}\nreward: {function: f}\n"
        "algorithm: {name: grpo, epochs: 1, minibatches: 2, gamma: 1.0}\n"
    )
    cfg = load_config(flat, ["algorithm.loss.epochs=3"])
    assert (cfg.algorithm.loss.epochs, cfg.algorithm.loss.minibatches) == (3, 2)
    later = tmp_path / "later.yaml"
    later.write_text("algorithm: {loss: {minibatches: 5}}\n")
    assert load_config([flat, later]).algorithm.loss.minibatches == 5
    cfg.algorithm.name = "rloo"  # a later assignment keeps the warning
    assert len(cfg.warnings) == 1 and "epochs -> loss.epochs" in cfg.warnings[0]


def test_a_run_saved_with_the_flat_algorithm_section_resumes_without_a_config_change():
    from learner.config import regroup
    from runtime.saving import config_changes

    now = load_config(None, ["model.path=m", "data.prompts=p", "reward.function=f", "algorithm.loss.epochs=2"])
    then = now.model_dump(mode="json")
    algorithm = then.pop("algorithm")
    flat = {"name": algorithm["name"], "epochs": 2, "gamma": 1.0, "kl": algorithm["kl"]}  # as an older run wrote it
    then["algorithm"], moved = regroup(flat)
    assert moved == ["epochs", "gamma"]
    assert config_changes(then, now.model_dump(mode="json")) == []


def test_the_descriptions_of_choices_name_every_choice():
    """A user reads the choices in the description (docs/configuration.md): a mode added to a registry and
    not to its description is a mode nobody finds."""
    from learner.algorithms import AGGREGATIONS
    from learner.algorithms.kl import KL_ESTIMATORS
    from learner.config import KLConfig, LossConfig

    aggregation = LossConfig.model_fields["aggregation"].description
    assert [m for m in AGGREGATIONS if m not in aggregation] == []
    estimator = KLConfig.model_fields["estimator"].description
    assert [k for k in (*KL_ESTIMATORS, "exact") if k not in estimator] == []


def test_a_rejection_rule_with_a_positive_floor_on_k2_or_k3_is_warned_about():
    """k2 and k3 are 0 on-policy: `low: 1.0` keeps only the tokens that diverge (the review's run rejected all)."""
    base = ["model.path=m", "data.prompts=p", "reward.function=f"]
    cfg = load_config(None, [*base, "algorithm.tis.reject=[{level: token, divergence: k2, low: 1.0}]"])
    assert any(w.startswith("algorithm.tis.reject: a rule keeps only k2 >= 1, but k2 is 0") for w in cfg.warnings)
    fine = load_config(None, [*base, "algorithm.tis.reject=[{divergence: k1, low: -0.1, high: 0.1}, {high: 2.0}]"])
    assert not any("tis.reject" in w for w in fine.warnings)
