"""The reward model as a reward source, without Ray: its config rules, its place in the plan, the
actor's scores against a plain forward pass (batching changes nothing), and the weighted sum with the
model's part (one model call for all groups of a sync generate call; a failed call is counted)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.config import RewardConfig, RewardModelConfig
from actors.reward_model import RewardModelActor
from actors.reward_parts import SampleScore
from actors.reward_scorer import RewardScorer
from launch.config import ConfigError, load_config
from launch.plan import build_plan
from tests.test_rewards import FakePool

BASE = ["model.path=m", "data.prompts=p.jsonl"]
WITH_MODEL = "reward.functions=[{function: 'builtin:math'}, {function: model, weight: 0.5}]"


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0) -> str:
    """A random-init 2-layer Qwen2ForSequenceClassification (one label) with the tiny model's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from actors.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory) -> str:
    return build_tiny_reward_model(tmp_path_factory.mktemp("models") / "tiny-rm")


def test_reward_model_config_rules():
    with pytest.raises(ConfigError, match="'model' part but reward.model is not set"):
        load_config(None, BASE + [WITH_MODEL])
    with pytest.raises(ConfigError, match="no part uses it; add {function: model"):
        load_config(None, BASE + ["reward.function=builtin:math", "reward.model.path=rm"])
    cfg = load_config(None, BASE + [WITH_MODEL, "reward.model.path=rm"])
    assert [(p.part_name, p.is_model) for p in cfg.reward.parts] == [("math", False), ("model", True)]
    assert [p.part_name for p in cfg.reward.function_parts] == ["math"]


def test_the_reward_model_has_its_own_processes_in_the_plan():
    cfg = load_config(None, BASE + ["reward.function=builtin:math"])
    assert build_plan(cfg).reward_model is None
    placed = ["resources.reward_model.count=2", "resources.reward_model.num_gpus=1"]
    cfg = load_config(None, BASE + [WITH_MODEL, "reward.model.path=rm", *placed])
    kind = build_plan(cfg).reward_model
    assert kind.names() == ["reward-model-0", "reward-model-1"] and kind.bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert kind in build_plan(cfg).kinds and kind.count_key == "resources.reward_model.count"


def test_reward_model_scores_are_the_logit_of_its_label_and_do_not_depend_on_batching(tiny_reward_model):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts, completions = ["next 3:", "next 12:", "copy 7:"], ["4", "13 and more", ""]
    batched = RewardModelActor(RewardModelConfig(path=tiny_reward_model, batch_size=3)).score(prompts, completions)
    single = RewardModelActor(RewardModelConfig(path=tiny_reward_model, batch_size=1)).score(prompts, completions)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model)
    with torch.no_grad():  # one unpadded sequence at a time: prompt + completion (no chat template)
        plain = [
            model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(prompts, completions)
        ]
    assert batched == pytest.approx(plain, abs=1e-5) and single == pytest.approx(plain, abs=1e-5)
    assert len(set(round(v, 4) for v in plain)) == 3  # three different sequences, three different scores


class FakeModel:
    """``RewardModelClient`` as the scorer uses it: each completion's score is its length; or an error."""

    def __init__(self, error: str | None = None):
        self.error, self.calls = error, []

    def submit(self, prompts, completions):
        self.calls.append(len(completions))
        return completions

    def result(self, ref, n):
        return self.error or [float(len(c)) for c in ref]

    async def score_async(self, prompts, completions):
        return self.result(self.submit(prompts, completions), len(completions))


def _cfg() -> RewardConfig:
    return RewardConfig(
        functions=[{"function": "builtin:math"}, {"function": "model", "weight": 0.5}], model={"path": "rm"}
    )


def test_the_model_part_is_weighted_with_the_others_in_one_call_for_all_groups():
    model = FakeModel()
    scores = [SampleScore(parts=[1.0]), SampleScore(parts=[0.0])]
    scorer = RewardScorer(_cfg(), pool=FakePool(scores), model=model)
    calls = [(["p", "p"], ["ab", "abcd"], [{}, {}]), (["q", "q"], ["", "abcdef"], [{}, {}])]
    first, second = scorer.score_groups(calls)
    assert model.calls == [4]  # the two groups' four completions in one reward model call
    # reward = 1 x math + 0.5 x model: 1 + 0.5 x 2 = 2.0;  0 + 0.5 x 4 = 2.0;  1 + 0 = 1.0;  0 + 0.5 x 6 = 3.0
    assert [s.reward for s in first + second] == [2.0, 2.0, 1.0, 3.0]
    assert second[1].parts == {"math": 0.0, "model": 6.0}
    (alone,) = [asyncio.run(scorer.score_group_async(["p"], ["abc"], [{}]))]
    assert [(s.reward, s.parts) for s in alone] == [(2.5, {"math": 1.0, "model": 3.0})]  # 1 + 0.5 x 3


def test_a_failed_reward_model_call_scores_its_part_zero_and_counts_the_error():
    error = "TimeoutError: reward model call took longer than reward.timeout_s = 30 s"
    scorer = RewardScorer(_cfg(), pool=FakePool([SampleScore(parts=[1.0])]), model=FakeModel(error))
    ((scored,),) = scorer.score_groups([(["p"], ["ab"], [{}])])
    assert scored.reward == 1.0 and scored.parts == {"math": 1.0, "model": 0.0} and scored.error == error


def test_a_reward_of_the_model_alone_starts_no_worker():
    cfg = RewardConfig(functions=[{"function": "model"}], model={"path": "rm"})
    scorer = RewardScorer(cfg, model=FakeModel())
    assert scorer.pool is None
    ((scored,),) = scorer.score_groups([(["p"], ["abc"], [{}])])
    assert scored.reward == 3.0 and scored.error is None


def test_a_missing_reward_model_directory_fails_before_the_run(tmp_path, tiny_reward_model):
    from actors.rewards import RewardSpecError, check_rewards

    cfg = RewardConfig(functions=[{"function": "model"}], model={"path": str(tmp_path / "nope")})
    with pytest.raises(RewardSpecError, match="is not a Hugging Face model directory"):
        check_rewards(cfg)
    check_rewards(RewardConfig(functions=[{"function": "model"}], model={"path": tiny_reward_model}))
