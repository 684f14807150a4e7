"""In-flight weight updates: a generation that spans an update is sampled by both policies.

The async actor streams a long completion; halfway the weights change. Every token
the actor tagged with version 0 must carry the old weights' log-prob, every token
tagged 1 the new weights' (computed independently with transformers on the whole
sequence, so the new tokens also prove the cached KV of the old weights was dropped).
The weights cross into the engine's process as shared-memory handles (``engine.weight_transfer:
shared``, what a GPU actor uses); the other in-flight runs of the suite send them as bytes.
"""

from __future__ import annotations

import time

import pytest
import torch

from actors.config import EngineConfig
from queues.messages import PromptRequest
from tests.runs import actor_options, actor_spec

pytestmark = pytest.mark.slow


def _logprobs(model, prompt_ids, ids, stop_ids):
    """log pi of each sampled token under ``model``, as the engine sampled it: min_tokens covers the whole
    completion, so the stop tokens were impossible at every position (their logits -inf)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0].float()
    logits[:, list(stop_ids)] = float("-inf")
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt_ids) - 1 + t, tok].item() for t, tok in enumerate(ids)]


def test_tokens_before_and_after_an_inflight_update_match_their_weights(ray_session, tiny_model_dir, tmp_path):
    ray = ray_session
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.generation import GenerationActor
    from learner.worker import stop_token_ids

    # 2 x 480 tokens (the model's 512 positions) take 1-2 s once warm: a swap 0.3 s in lands mid-way here.
    rollout = dict(group_size=2, max_tokens=480, min_tokens=480, weight_update="inflight")
    shared = EngineConfig(weight_transfer="shared")
    spec = actor_spec(tiny_model_dir, str(tmp_path / "a.log"), "builtin:successor", engine=shared, **rollout)
    actor = ray.remote(GenerationActor).options(**actor_options()).remote(spec)
    ray.get(actor.ready.remote())
    ray.get(actor.completion_logprobs.remote([5, 6], [7]))  # warm-up: the first logprobs call compiles an op

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # Version k holds weights[k % 2]: each attempt swaps to the other set, so "before" and "after" differ.
    models = [old, new]
    weights = [ray.put(list(m.state_dict().items())) for m in models]  # in the object store before timing
    stops = stop_token_ids(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir))

    # How far a fixed delay gets into a generation depends on the machine's speed, so the delay adapts:
    # a swap that came after the last token halves it, one before the first token doubles it.
    delay, version, group = 0.3, 0, None
    for _attempt in range(6):
        request = PromptRequest(prompt_id=version + 1, row={"prompt": "next 3:", "answer": "4"}, min_version=0)
        group_ref = actor.generate_group.remote(request)
        time.sleep(delay)
        version = ray.get(actor.load_weights.remote(weights[(version + 1) % 2], version + 1, "keep"))
        group = ray.get(group_ref)
        seen = {v for traj in group.trajectories for v in traj.policy_versions.tolist()}
        if all(set(t.policy_versions.tolist()) == {version - 1, version} for t in group.trajectories):
            break
        delay = delay / 2 if seen == {version - 1} else delay * 2
    else:
        raise AssertionError(f"the update never landed mid-generation (last delay {delay:.3f} s)")

    for traj in group.trajectories:
        versions = traj.policy_versions.tolist()
        assert versions == sorted(versions), versions
        split = versions.index(version)
        before_model, after_model = models[(version - 1) % 2], models[version % 2]
        prompt, completion = traj.prompt_token_ids.tolist(), traj.completion_token_ids.tolist()
        lp_before = _logprobs(before_model, prompt, completion, stops)
        lp_after = _logprobs(after_model, prompt, completion, stops)
        sampled = traj.sampler_logprobs.tolist()
        before = max(abs(a - b) for a, b in zip(sampled[:split], lp_before[:split]))
        after = max(abs(a - b) for a, b in zip(sampled[split:], lp_after[split:]))
        assert before < 1e-4 and after < 1e-4, (before, after)
        # and the two policies really differ on these tokens
        assert max(abs(a - b) for a, b in zip(lp_before[split:], lp_after[split:])) > 1e-2
