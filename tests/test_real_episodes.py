"""Multi-turn episodes on the real engine: a generation actor (vLLM, the tiny chat model with a tool
template) runs episodes against an environment in its worker processes.

Checked: the trajectory is the prompt, then exactly the ids the sampler produced and the environment's
deltas (each model token's sampler log-prob is the engine's own log-prob of it given everything before
it, environment tokens included); the mask is 1 on model tokens only; re-rendering the conversation
from its text gives other ids; a tool that hangs ends its episode at the deadline and the actor goes on.
"""

from __future__ import annotations

import time

import pytest

from actors.config import EpisodeConfig
from queues.messages import PromptRequest
from tests.runs import actor_options, actor_spec

pytestmark = pytest.mark.slow

ENV = '''
import time
from actors.environments import Environment, StepResult

class Counter(Environment):
    """Never done: answers every turn with its number; the row "hang" hangs on the first step."""

    def reset(self, row):
        self.row, self.turn = row, 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action_text):
        if self.row["prompt"] == "hang":
            time.sleep(600)
        self.turn += 1
        return StepResult(f"turn {self.turn} seen", reward=0.25)
'''


@pytest.fixture(scope="module")
def episode_actor(ray_session, tmp_path_factory):
    from actors.generation import GenerationActor
    from actors.lookup_task import TOOLS_CHAT_TEMPLATE
    from actors.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("episodes")
    model = str(build_tiny_model(root / "chat", chat=True, chat_template=TOOLS_CHAT_TEMPLATE))
    (root / "env.py").write_text(ENV)
    episode = EpisodeConfig(environment=f"{root / 'env.py'}:Counter", max_turns=3, turn_max_tokens=12, step_timeout_s=3)
    spec = actor_spec(
        model, str(root / "actor.log"), "environment", kind="multi_turn", episode=episode, group_size=3, max_tokens=300
    )
    actor = ray_session.remote(GenerationActor).options(**actor_options()).remote(spec)
    ray_session.get(actor.ready.remote())
    return ray_session, actor, model


def test_episodes_are_the_samplers_ids_with_the_environments_deltas_masked(episode_actor):
    ray, actor, model = episode_actor
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    group = ray.get(actor.generate_group.remote(PromptRequest(1, {"prompt": "count with me"}, 0)))
    rerendered_differs = 0
    for traj in group.trajectories:
        ep, mask, ids = traj.episode, traj.completion_mask.tolist(), traj.completion_token_ids.tolist()
        assert ep["end"] == "max_turns" and ep["model_turns"] == 3, ep
        assert [t["role"] for t in ep["turns"]] == ["model", "environment", "model", "environment", "model"]
        assert ep["environment_reward"] == 0.75 and traj.reward == 0.75 and ep["turn_rewards"] == [0.25] * 3
        assert traj.model_mask.tolist() == mask and set(traj.policy_versions.tolist()) == {0}
        # the environment's tokens are exactly the template's delta, masked out
        gaps = [i for i, m in enumerate(mask) if m == 0]
        env_text = tokenizer.decode([ids[i] for i in gaps])
        assert "turn 1 seen</tool_response>" in env_text and "turn 2 seen" in env_text
        assert all(traj.sampler_logprobs[i] == 0.0 for i in gaps)
        # every model token was sampled from exactly the ids before it: the engine agrees on its log-prob
        prompt = traj.prompt_token_ids.tolist()
        engine = ray.get(actor.completion_logprobs.remote(prompt, ids))
        model_tokens = [i for i, m in enumerate(mask) if m == 1]
        worst = max(abs(engine[i] - float(traj.sampler_logprobs[i])) for i in model_tokens)
        assert worst < 1e-3, worst
        # the same conversation rendered again from its text: other ids (what Tandem does not train on)
        messages = [{"role": "user", "content": "count with me"}]
        for turn in ep["turns"]:
            if turn["role"] == "model":
                messages.append({"role": "assistant", "content": turn["text"]})
            else:
                messages.append({"role": "tool", "content": turn["text"].split("<tool_response>")[1].split("</")[0]})
        again = tokenizer.apply_chat_template(messages, tokenize=False)
        rerendered_differs += tokenizer(again, add_special_tokens=False)["input_ids"] != prompt + ids
    assert rerendered_differs > 0  # a random model samples bytes that do not round-trip through text


def test_a_hanging_environment_ends_its_episodes_at_the_deadline_and_the_actor_goes_on(episode_actor):
    ray, actor, _ = episode_actor
    start = time.monotonic()
    group = ray.get(actor.generate_group.remote(PromptRequest(2, {"prompt": "hang"}, 0)), timeout=120)
    assert time.monotonic() - start < 60
    ends = [t.episode["end"] for t in group.trajectories]
    assert set(ends) <= {"timeout", "lost"} and "timeout" in ends, ends
    # the model's first turn is kept and trains no token (its reward says nothing of the model)
    assert all(t.completion_mask.sum() == 0 and t.model_mask.sum() > 0 for t in group.trajectories)
    after = ray.get(actor.generate_group.remote(PromptRequest(3, {"prompt": "count"}, 0)), timeout=120)
    assert [t.episode["end"] for t in after.trajectories] == ["max_turns"] * 3


def test_a_weight_swap_mid_episode_is_tagged_on_every_token(episode_actor, tmp_path):
    """In flight, new weights land while episodes run: the versions never go back, both appear, and each
    environment delta carries the version of the model token before it."""
    ray, _, model = episode_actor
    from actors.generation import GenerationActor

    (tmp_path / "env.py").write_text(ENV)
    episode = EpisodeConfig(environment=f"{tmp_path / 'env.py'}:Counter", max_turns=3, turn_max_tokens=40)
    spec = actor_spec(
        model,
        str(tmp_path / "actor.log"),
        "environment",
        kind="multi_turn",
        episode=episode,
        group_size=2,
        max_tokens=360,
        min_tokens=40,
        weight_update="inflight",
    )
    actor = ray.remote(GenerationActor).options(**actor_options()).remote(spec)
    ray.get(actor.ready.remote())
    import torch
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    named = ray.put(list(weights.items()))
    delay, version, group = 0.5, 0, None  # the delay adapts to the machine's speed (test_real_inflight.py)
    for _attempt in range(6):
        ref = actor.generate_group.remote(PromptRequest(10 + version, {"prompt": "count"}, 0))
        time.sleep(delay)
        version = ray.get(actor.load_weights.remote(named, version + 1, "keep"))
        group = ray.get(ref, timeout=120)
        seen = [set(t.policy_versions.tolist()) for t in group.trajectories]
        if any(s == {version - 1, version} for s in seen):
            break
        delay = delay / 2 if all(s == {version - 1} for s in seen) else delay * 2
    else:
        raise AssertionError("the swap never landed mid-episode")
    for traj in group.trajectories:
        versions, mask = traj.policy_versions.tolist(), traj.completion_mask.tolist()
        assert versions == sorted(versions)
        for i in range(1, len(mask)):
            if mask[i] == 0:
                assert versions[i] == versions[i - 1]  # an environment token: the version before it
    ray.kill(actor)
