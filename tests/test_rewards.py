"""Reward functions for reasoning, in-process: builtin:math and builtin:format, the weighted sum of
reward.functions, the batched signature, and the reward config's rules. (The worker processes that
run them in an actor are tested in test_reward_pool.py.)"""

from __future__ import annotations

import textwrap

import pytest

from actors.builtin_rewards import final_answer_text, gold_text, math_score
from actors.config import RewardConfig
from actors.reward_parts import SampleScore, load_parts, score_call
from actors.reward_scorer import RewardScorer
from actors.rewards import RewardSpecError, load_reward_function
from launch.config import ConfigError, load_config

MATH_CASES = [
    ("42", r"so the answer is \boxed{42}", 1.0),
    ("0.5", r"\boxed{\frac{1}{2}}", 1.0),  # compared symbolically, not as strings
    (r"\frac{1}{2}", r"The answer is \boxed{0.5}", 1.0),
    ("Natalia sold 48/2 = 24 clips in May ... #### 18", r"The answer is \boxed{18}", 1.0),  # GSM8K gold
    (18, "The final answer is 18", 1.0),  # an anchored final answer, no box
    ("x+1", r"\boxed{1 + x}", 1.0),
    ("1,000", r"\boxed{1000}", 1.0),
    ("42", r"\boxed{41}", 0.0),  # wrong
    ("3", "I think 3", 0.0),  # a bare number is not a final answer
    ("3", r"first \boxed{2}, no wait: \boxed{3}", 1.0),  # the last box counts
    ("3", r"first \boxed{3}, no wait: \boxed{2}", 0.0),
    ("7", r"<think>the answer is 7</think> the answer is \boxed{8}", 0.0),  # only what follows the thinking
    ("7", "", 0.0),
]


@pytest.mark.parametrize("answer,completion,expected", MATH_CASES)
def test_builtin_math_compares_the_final_answer_symbolically(answer, completion, expected):
    assert math_score(answer, completion) == expected


GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
# (gold, completion, strict, flexible): GSM8K's "#### n" form, as lm-eval's strict-match / flexible-extract read it
GSM8K_CASES = [
    ("6", "She has 2 + 4 = 6.\n#### 6", 1.0, 1.0),
    (GSM8K_GOLD, "24 in May, 48 + 24 = 72 in all.\n#### 72", 1.0, 1.0),  # the gold's own #### too
    ("6", "#### 7", 0.0, 0.0),
    ("6", "#### 6.", 1.0, 1.0),  # a sentence's period is not part of the number
    ("1234", "#### 1,234", 1.0, 1.0),  # thousands commas dropped
    ("1,234", "#### 1234", 1.0, 1.0),
    ("-3", "####-3", 1.0, 1.0),
    ("6", "#### 5 no, recount\n#### 6", 1.0, 1.0),  # the last #### counts
    ("6", "<think>#### 6</think>\n#### 7", 0.0, 0.0),  # only what follows the thinking
    ("5", r"I box \boxed{5} but end with #### 6", 1.0, 1.0),  # a box wins over a later ####
    ("6", r"I box \boxed{5} but end with #### 6", 0.0, 0.0),
    ("6", "so she has 6 apples.", 0.0, 1.0),  # a bare number: flexible only (its last number)
    ("6", "6 apples, then 2 more: 8 apples.", 0.0, 0.0),  # flexible takes the last number, 8
    ("1234", "she pays 1,234.", 0.0, 1.0),
    ("6", "no number here", 0.0, 0.0),
]


@pytest.mark.parametrize("gold,completion,strict,flexible", GSM8K_CASES)
def test_builtin_math_reads_gsm8k_final_answers_strict_and_flexible(gold, completion, strict, flexible):
    assert math_score(gold, completion) == strict
    assert math_score(gold, completion, "flexible") == flexible


def test_reward_math_extraction_chooses_the_mode_of_the_loaded_function():
    rows = [{"answer": GSM8K_GOLD}] * 3
    completions = ["#### 72", "so 72 clips.", r"\boxed{72}"]
    strict = load_reward_function("builtin:math", RewardConfig(function="builtin:math"))
    flexible = load_reward_function("builtin:math", RewardConfig(function="builtin:math", math_extraction="flexible"))
    assert strict(["p"] * 3, completions, rows) == [1.0, 0.0, 1.0]
    assert flexible(["p"] * 3, completions, rows) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="math_extraction"):
        RewardConfig(function="builtin:math", math_extraction="loose")


def test_math_reads_the_gold_and_the_final_answer_from_the_right_place():
    assert gold_text("He has 3 + 15 = 18 apples.\n#### 18") == "$18$"
    assert gold_text(r"$\frac{1}{2}$") == r"$\frac{1}{2}$"
    assert gold_text(r"\frac{1}{2}") == r"$\frac{1}{2}$"
    assert final_answer_text(r"<think>\boxed{1}</think> so \boxed{2} or \boxed{3}") == r"\boxed{3}"


def test_builtin_math_is_batched_and_needs_an_answer():
    fn = load_reward_function("builtin:math")
    assert fn.batched is True
    rows = [{"prompt": "p", "answer": "4"}] * 3
    assert fn(["p"] * 3, [r"\boxed{4}", r"\boxed{5}", "four"], rows) == [1.0, 0.0, 0.0]
    (part,) = load_parts(RewardConfig(function="builtin:math"))
    (scored,) = score_call([part], ["p"], [r"\boxed{4}"], [{"prompt": "p"}])  # no answer: an error, scored 0
    assert scored.parts == [0.0] and scored.error.startswith("KeyError") and "answer" in scored.error


def test_builtin_format_matches_the_whole_completion():
    fn = load_reward_function("builtin:format")
    assert fn("p", "<think>2 + 2 is 4</think>\nThe answer is 4.", {}) == 1.0
    assert fn("p", "<think>2 + 2 is 4</think>", {}) == 0.0  # no answer after the thinking
    assert fn("p", "The answer is 4.", {}) == 0.0  # no thinking
    assert fn("p", "<think>a\nb</think> 4 <think>", {}) == 1.0  # DOTALL: lines inside are fine
    custom = load_reward_function("builtin:format", RewardConfig(function="builtin:format", format_pattern=r"\d+"))
    assert custom("p", "42", {}) == 1.0 and custom("p", "42!", {}) == 0.0  # a full match, not a search


def test_a_builtin_task_name_is_still_a_reward_and_an_unknown_name_lists_the_choices():
    assert load_reward_function("builtin:echo")("copy 5:", "5", {"answer": "5"}) == 1.0
    with pytest.raises(RewardSpecError, match="built-in rewards: format, math; tasks: "):
        load_reward_function("builtin:nope")


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_weighted_sum_of_parts_with_each_part_kept(tmp_path):
    path = _write(
        tmp_path,
        """
        def length(prompt, completion, row):
            return float(len(completion))
        """,
    )
    cfg = RewardConfig(
        functions=[
            {"function": "builtin:math", "weight": 1.0},
            {"function": "builtin:format", "weight": 0.5},
            {"function": f"{path}:length", "weight": -0.1, "name": "len"},
        ]
    )
    parts = load_parts(cfg)
    assert [(p.name, p.weight) for p in parts] == [("math", 1.0), ("format", 0.5), ("len", -0.1)]
    completions = [r"<think>x</think> \boxed{4}", r"<think>x</think> \boxed{5}", r"\boxed{4}"]
    scores = score_call(parts, ["p"] * 3, completions, [{"answer": "4"}] * 3)
    assert [s.parts for s in scores] == [[1.0, 1.0, 26.0], [0.0, 1.0, 26.0], [1.0, 0.0, 9.0]]
    scorer = RewardScorer(cfg, pool=FakePool(scores))
    (scored,) = scorer.score_groups([(["p"] * 3, completions, [{"answer": "4"}] * 3)])
    # lengths 26, 26, 9: 1 x 1 + 0.5 x 1 - 0.1 x 26 = -1.1;  0 + 0.5 - 2.6 = -2.1;  1 + 0 - 0.9 = 0.1
    assert [s.reward for s in scored] == pytest.approx([-1.1, -2.1, 0.1])
    assert scored[0].parts == {"math": 1.0, "format": 1.0, "len": 26.0}


def test_a_failed_part_counts_zero_in_the_sum_and_the_completion_counts_as_an_error():
    cfg = RewardConfig(functions=[{"function": "builtin:math", "weight": 2.0}, {"function": "builtin:format"}])
    scores = [SampleScore(parts=[0.0, 1.0], error="KeyError: 'answer'"), SampleScore(parts=[1.0, 1.0])]
    scored = RewardScorer(cfg, pool=FakePool(scores)).score_groups([(["p"] * 2, ["a", "b"], [{}] * 2)])[0]
    assert [s.reward for s in scored] == [1.0, 3.0]  # 2 x 0 + 1 x 1;  2 x 1 + 1 x 1
    assert [s.error for s in scored] == ["KeyError: 'answer'", None]


def test_step_rewards_are_scaled_by_the_weight_of_the_one_part():
    cfg = RewardConfig(functions=[{"function": "builtin:successor_steps", "weight": 2.0}])
    pool = FakePool([SampleScore([0.75], steps=[1.0, -0.25])])
    (scored,) = RewardScorer(cfg, pool=pool).score_groups([(["next 4:"], ["5x"], [{}])])
    assert scored[0].reward == 1.5 and scored[0].steps == [2.0, -0.5]


def test_batched_signature_is_chosen_once_by_the_batched_attribute(tmp_path):
    path = _write(
        tmp_path,
        """
        from pathlib import Path

        def by_length(prompts, completions, rows):
            with open(Path(__file__).with_name("calls.txt"), "a") as f:
                f.write(f"{len(completions)}\\n")
            return [len(c) / 10 for c in completions]

        by_length.batched = True

        def wrong_count(prompts, completions, rows):
            return [1.0]

        wrong_count.batched = True

        def per_sample(prompt, completion, row):
            return 0.5
        """,
    )
    cfg = RewardConfig(
        functions=[
            {"function": f"{path}:by_length"},
            {"function": f"{path}:wrong_count"},
            {"function": f"{path}:per_sample"},
        ]
    )
    parts = load_parts(cfg)
    scores = score_call(parts, ["p"] * 3, ["a", "bb", "cccc"], [{}] * 3)
    assert [s.parts[0] for s in scores] == [0.1, 0.2, 0.4]  # len / 10, in one call for the group
    assert [s.parts[2] for s in scores] == [0.5, 0.5, 0.5]  # called once per completion
    assert all(s.parts[1] == 0.0 for s in scores)
    assert scores[0].error == "ValueError: batched reward function returned 1 values for 3 completions"
    assert (tmp_path / "calls.txt").read_text() == "3\n"  # one call for three completions


def test_reward_config_rules():
    base = ["model.path=m", "data.prompts=p.jsonl"]
    with pytest.raises(ConfigError, match="set exactly one of reward.function"):
        load_config(None, base + ["reward.function=builtin:math", "reward.functions=[{function: builtin:format}]"])
    with pytest.raises(ConfigError, match="set exactly one of reward.function"):
        load_config(None, base + ["reward={}"])
    with pytest.raises(ConfigError, match="two parts named 'math'"):
        load_config(None, base + ["reward.functions=[{function: builtin:math}, {function: r.py:math}]"])
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        load_config(None, base + ["reward.function=builtin:format", "reward.format_pattern=("])
    with pytest.raises(ConfigError, match="scores every reasoning step with one reward function"):
        load_config(
            None,
            base + ["algorithm.name=grpo_process", "reward.functions=[{function: a.py:f}, {function: b.py:g}]"],
        )
    cfg = load_config(None, base + ["reward.function=builtin:math"])
    assert [(p.part_name, p.weight) for p in cfg.reward.parts] == [("math", 1.0)]  # one part, weight 1


class FakePool:
    """``RewardPool`` as the scorer uses it, answering every call with the same scores."""

    def __init__(self, scores: list[SampleScore]):
        self.scores = scores

    def score_many(self, calls):
        return [self.scores for _ in calls]

    async def score_async(self, prompts, completions, rows):
        return self.scores
