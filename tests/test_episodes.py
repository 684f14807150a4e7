"""Multi-turn episodes without an engine: chat-template deltas, the rollout's masks, log-probs, versions
and budgets (a scripted engine plays the model), and the episode settings across config sections. The
environments and their workers alone: ``tests/test_environments.py``."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from actors.config import EpisodeConfig, RewardConfig, RolloutConfig
from actors.env_pool import EpisodeEnded
from actors.environments import tool_schema
from actors.episode import MultiTurn, TurnRenderer
from actors.lookup_task import TOOLS_CHAT_TEMPLATE, LookupEnvironment, lookup_rows, tool_call_text
from actors.rollout import Completion
from actors.tiny_model import build_chat_tokenizer
from learner.config import AlgorithmConfig
from queues.messages import PromptRequest
from tests.test_environments import BAD_ENV


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_chat_tokenizer()
    tok.chat_template = TOOLS_CHAT_TEMPLATE
    return tok


def test_deltas_append_turns_without_rerendering_the_history(tokenizer):
    """prompt + sampled turn + delta + ... is the template's own rendering of the conversation when the
    sampled text re-tokenizes to itself; each delta is tokenized alone."""
    row = lookup_rows(1)[0]
    tools = [tool_schema(LookupEnvironment.lookup)]
    renderer = TurnRenderer(tokenizer, tools)
    messages = [{"role": "user", "content": row["prompt"]}]
    call = tool_call_text("lookup", {"key": row["key"]})
    turn1 = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    delta = renderer.delta(turn1, [{"role": "tool", "content": row["answer"]}])
    turn2 = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = renderer.prompt(messages) + turn1 + delta + turn2
    conversation = messages + [
        {"role": "assistant", "content": call},
        {"role": "tool", "content": row["answer"]},
        {"role": "assistant", "content": row["answer"]},
    ]
    whole = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert (
        tokenizer.decode(delta)
        == f"\n<|im_start|>user\n<tool_response>{row['answer']}</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"][: len(ids)]
    # a turn cut before its stop token: the template's whole closing follows it
    cut = tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(renderer.delta(cut, [])).startswith("<|im_end|>\n<|im_start|>assistant")


def test_rerendering_a_sampled_turn_gives_other_ids_than_the_sampler_produced(tokenizer):
    """Why history is never re-rendered: a model can sample ids that do not survive decode -> encode
    (here half of a two-byte character, and a special token inside its text)."""
    renderer = TurnRenderer(tokenizer, [])
    sampled = tokenizer("caf", add_special_tokens=False)["input_ids"] + [
        0xC3,
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    sampled += [tokenizer.eos_token_id]
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    prompt = renderer.prompt([{"role": "user", "content": "hi"}])
    ours = prompt + sampled
    again = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}], tokenize=False
    )
    rerendered = tokenizer(again, add_special_tokens=False)["input_ids"][: len(ours)]
    assert rerendered != ours


class ScriptedEngine:
    """Plays the model: each turn's text, sampled at version ``version`` with log-prob -0.5 per token."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.calls, self.version = tokenizer, turns, [], 0

    async def sample(self, prompt_ids, request, max_tokens, salt):
        text = self.turns[len(self.calls) % len(self.turns)]
        self.calls.append(list(prompt_ids))
        ids = (self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])[:max_tokens]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        version, self.version = self.version, self.version + 1  # a new policy every turn
        return Completion(ids, [-0.5] * len(ids), [version] * len(ids), finish)


class _Spec:
    def __init__(self, rollout, system_prompt=None):
        from actors.config import EngineConfig

        self.rollout, self.engine = rollout, EngineConfig(max_model_len=1024)
        self.chat_template, self.system_prompt = None, system_prompt
        self.name = "actor-0"  # as ActorSpec names it


def _episode(tokenizer, turns, max_tokens=200, **episode):
    rollout = RolloutConfig(
        kind="multi_turn",
        group_size=2,
        max_tokens=max_tokens,
        episode=EpisodeConfig(environment="builtin:lookup", workers=1, **episode),
    )
    rollout_fn = MultiTurn(_Spec(rollout))
    rollout_fn.start(tokenizer)
    row = lookup_rows(1, seed=5)[0]
    engine = ScriptedEngine(tokenizer, [t.format(**row) for t in turns])
    try:
        sample = asyncio.run(rollout_fn.episode(PromptRequest(1, row, 0), engine, 0))
    finally:
        rollout_fn.close()
    return row, engine, sample


def test_an_episode_masks_the_environment_and_keeps_the_samplers_ids_logprobs_and_versions(tokenizer):
    call = tool_call_text("lookup", {"key": "KEY"}).replace("KEY", "{key}").replace("{", "{{").replace("}", "}}")
    call = call.replace("{{key}}", "{key}")
    row, engine, sample = _episode(tokenizer, [call, "{answer}"])
    ep = sample.episode
    assert ep["end"] == "done" and ep["model_turns"] == 2 and ep["tool_calls"] == 1 and ep["tool_errors"] == 0
    assert ep["environment_reward"] == 1.0 and ep["turn_rewards"] == [0.0, 1.0]
    assert [t["role"] for t in ep["turns"]] == ["model", "environment", "model"]
    turn1 = tokenizer(tool_call_text("lookup", {"key": row["key"]}), add_special_tokens=False)["input_ids"]
    turn1 += [tokenizer.eos_token_id]
    turn2 = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n_env = len(sample.token_ids) - len(turn1) - len(turn2)
    assert sample.token_ids[: len(turn1)] == turn1 and sample.token_ids[-len(turn2) :] == turn2
    assert sample.mask == [1] * len(turn1) + [0] * n_env + [1] * len(turn2)
    assert sample.logprobs == [-0.5] * len(turn1) + [0.0] * n_env + [-0.5] * len(turn2)
    assert sample.versions == [0] * len(turn1) + [0] * n_env + [1] * len(turn2)  # swap between the turns
    assert ep["turn_ends"] == [len(turn1) - 1, len(sample.token_ids) - 1]
    # the second turn was sampled from exactly the ids so far: token in, token out
    assert engine.calls[1] == sample.prompt_token_ids + sample.token_ids[: len(turn1) + n_env]
    assert row["answer"] in sample.text and "<tool_response>" in sample.text


def test_an_episode_ends_at_max_turns_and_at_its_token_budget(tokenizer):
    _, engine, sample = _episode(
        tokenizer, ['<tool_call>{{"name": "lookup", "arguments": {{}}}}</tool_call>'], max_tokens=600, max_turns=3
    )
    assert sample.episode["end"] == "max_turns" and sample.episode["model_turns"] == 3
    # the last turn is still stepped (its reward counts); its observation is not appended
    assert sample.episode["tool_errors"] == 3 and len(engine.calls) == 3
    assert [t["role"] for t in sample.episode["turns"]][-2:] == ["environment", "model"]
    _, _, short = _episode(tokenizer, ["a long turn " * 5], max_tokens=40, max_turns=5)
    assert short.episode["end"] == "length" and short.finish_reason == "length" and len(short.token_ids) <= 40


def test_episode_rewards_reach_the_reward_parts():
    from actors.reward_scorer import RewardScorer, Scored

    cfg = RewardConfig(
        functions=[{"function": "environment", "weight": 2.0}, {"function": "builtin:format", "weight": 1.0}]
    )
    scorer = RewardScorer(cfg, pool=object())  # the pool is not called here
    scored = scorer.with_environment(
        Scored(0.5, {"environment": 0.0, "format": 0.5}, None, None),
        {"environment_reward": 1.0, "turn_rewards": [0.0, 1.0]},
    )
    assert scored.reward == 2.5 and scored.parts == {"environment": 1.0, "format": 0.5} and scored.steps == [0.0, 2.0]
    assert json.dumps(scored.parts)


def test_episode_settings_are_checked_across_sections(tmp_path):
    from launch.config import load_config

    base = [
        "model.path=m",
        "data.prompts=builtin:lookup",
        "rollout.max_tokens=100",
    ]
    with pytest.raises(Exception, match="rollout.kind is single_turn"):
        load_config(None, [*base, "reward.function=environment"])
    with pytest.raises(Exception, match="set reward.function=environment"):
        load_config(
            None,
            [
                *base,
                "reward.function=builtin:lookup",
                "rollout.kind=multi_turn",
                "rollout.episode.environment=builtin:lookup",
                "algorithm.name=grpo_process",
            ],
        )
    cfg = load_config(
        None,
        [*base, "reward.function=environment", "rollout.kind=multi_turn", "rollout.episode.environment=builtin:lookup"],
    )
    assert cfg.reward.uses_environment and cfg.reward.function_parts == []


def test_the_tools_examples_demonstrations_are_what_the_rollout_builds(tokenizer):
    from launch.tools.example_tools import demonstration_pairs

    row = lookup_rows(1, seed=9)[0]
    (p1, call), (p2, answer) = demonstration_pairs(tokenizer, [row])
    renderer = TurnRenderer(tokenizer, [tool_schema(LookupEnvironment.lookup)])
    eos = tokenizer.eos_token_id
    assert p1 == renderer.prompt([{"role": "user", "content": row["prompt"]}])
    assert tokenizer.decode(call) == tool_call_text("lookup", {"key": row["key"]})
    assert p2 == p1 + call + [eos] + renderer.delta(call + [eos], [{"role": "tool", "content": row["answer"]}])
    assert tokenizer.decode(answer) == row["answer"]


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' and loop.last and '<think>' not in m.content %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_adds_empty_reasoning_to_the_last_turn_still_appends_turns():
    tok = build_chat_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    renderer = TurnRenderer(tok, [])
    delta = renderer.delta([tok.eos_token_id], [{"role": "tool", "content": "42"}])
    assert tok.decode(delta) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ messages | length }}"  # rewrites
    with pytest.raises(Exception, match="renders earlier turns differently"):
        TurnRenderer(tok, []).delta([tok.eos_token_id], [{"role": "tool", "content": "42"}])


def _bad_episode(tmp_path, tokenizer, environment: str, system_prompt: str | None = None):
    """One episode of prompt 1 against ``environment``, a class of ``BAD_ENV``, the model saying "hello"."""
    (tmp_path / "bad.py").write_text(BAD_ENV)
    rollout = RolloutConfig(
        kind="multi_turn",
        group_size=2,
        max_tokens=200,
        episode={"environment": f"{tmp_path / 'bad.py'}:{environment}", "workers": 1},
    )
    fn = MultiTurn(_Spec(rollout, system_prompt=system_prompt))
    fn.start(tokenizer)
    try:
        return asyncio.run(fn.episode(PromptRequest(1, {"prompt": "p"}, 3), ScriptedEngine(tokenizer, ["hello"]), 0))
    finally:
        fn.close()


def test_an_episode_the_environment_failed_trains_no_token_but_stays_in_its_group(tmp_path, tokenizer, capfd):
    sample = _bad_episode(tmp_path, tokenizer, "Raising", system_prompt="be brief")
    assert sample.episode["end"] == "error" and "the sandbox is gone" in sample.episode["detail"]
    assert sample.mask == [0] * len(sample.token_ids) and sample.model_mask == [1] * len(sample.token_ids)
    assert tokenizer.decode(sample.prompt_token_ids).startswith("<|im_start|>system\nbe brief")  # data.system_prompt
    # the actor log (its stdout) says which prompt's episode failed, and why
    assert (
        "[actor-0] episode of prompt 1 ended by its environment (1 so far ended error): error:"
        in capfd.readouterr().out
    )


def test_an_episode_never_outgrows_the_engines_context(tokenizer):
    rollout = RolloutConfig(
        kind="multi_turn", group_size=2, max_tokens=500, episode={"environment": "builtin:lookup", "workers": 1}
    )
    spec = _Spec(rollout)
    spec.engine = spec.engine.model_copy(update={"max_model_len": 120})
    fn = MultiTurn(spec)
    fn.start(tokenizer)
    engine = ScriptedEngine(tokenizer, ['<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'])
    try:
        sample = asyncio.run(fn.episode(PromptRequest(1, lookup_rows(1)[0], 0), engine, 0))
    finally:
        fn.close()
    assert sample.episode["end"] == "length" and len(sample.prompt_token_ids) + len(sample.token_ids) <= 120


def test_a_per_turn_discount_on_single_turn_completions_is_a_warning():
    from launch.config import load_config

    base = [
        "model.path=m",
        "data.prompts=builtin:echo",
        "reward.function=builtin:echo",
        "algorithm.name=reinforce",
        "algorithm.estimator.gamma=0.9",
    ]
    assert any(
        "discounts nothing" in w for w in load_config(None, [*base, "algorithm.estimator.discount=turn"]).warnings
    )
    assert not any("discounts nothing" in w for w in load_config(None, base).warnings)


def test_an_episode_whose_reset_failed_keeps_its_reward_in_its_groups_baseline(tmp_path, tokenizer):
    """A failed reset leaves one end-of-text token that trains nothing; the reward its episode got (here a
    reward function's -0.5 for an empty answer) still counts in the group's baseline: GRPO sees the group's
    rewards as [-0.5, 1, 0], not [0, 1, 0] (the bug: the token was not the sequence's, so its reward was lost)."""
    from learner.estimators import TokenRewards
    from learner.rank_batch import RankBatch
    from learner.returns import token_rewards
    from learner.shard import Normaliser, RankShard, TokenShard
    from queues.messages import Trajectory

    failed = _bad_episode(tmp_path, tokenizer, "TextReset")
    assert failed.episode["end"] == "error" and failed.mask == [0] and failed.model_mask == [1]

    def trajectory(mask, model_mask, reward):
        return Trajectory(
            np.array([1, 2], np.int32),
            np.array([5] * len(mask), np.int32),
            np.array(mask, np.uint8),
            np.zeros(len(mask), np.float32),
            np.zeros(len(mask), np.int32),
            reward,
            "stop",
            "",
            model_mask=np.array(model_mask, np.uint8),
        )

    trajs = [
        trajectory(failed.mask, failed.model_mask, -0.5),
        trajectory([1, 1], [1, 1], 1.0),
        trajectory([1], [1], 0.0),
    ]
    shard = TokenShard.from_trajectories(trajs, np.array([t.reward for t in trajs], np.float32))
    batch = RankBatch(RankShard(shard, [[3]], [Normaliser(4.0, 3.0)]), pad_id=0)
    completion = batch.column("completion_tokens")
    rewards = token_rewards(batch.rewards, None, batch.column("completion_mask"), 0.0, completion)
    algo = AlgorithmConfig(name="grpo")
    summary = algo.method.estimator(algo).summarise(
        TokenRewards(rewards, batch.column("completion_mask"), completion=completion)
    )
    assert summary["reward"].tolist() == [-0.5, 1.0, 0.0]  # the group's baseline: mean 1/6, not 1/3


def test_a_killed_environment_worker_ends_its_episode_saying_how_it_died(tmp_path):
    """kill -9 of the worker in the middle of a step (an OOM killer, a user's kill): the episode ends with
    reason error and a detail that says the worker was killed, and the next episode gets a new worker."""
    import os
    import signal
    import threading

    from tests.test_environments import _pool

    pool = _pool(tmp_path, "Slow", step_timeout_s=30.0)
    try:

        async def go():
            episode, _, _ = await pool.reset({"prompt": "p"})
            pid = pool.workers[0].proc.pid
            threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
            with pytest.raises(EpisodeEnded) as ended:
                await pool.step(episode, tool_call_text("wait", {"seconds": 20}))
            after, _, _ = await pool.reset({"prompt": "p"})
            return ended.value, after

        ended, _ = asyncio.run(go())
        assert ended.reason == "error"
        assert ended.detail == "the environment worker died during step (killed by SIGKILL)"
        assert pool.replaced == 1
    finally:
        pool.close()
