"""LoRA on the real stack (``learner.lora``): PEFT adapters in the DeepSpeed learner, vLLM serving them.

1. A LoRA run of the demo learns (its reward rises) with in-flight updates; every version the learner
   publishes is the adapter alone; ``model/`` is the merged model and ``model/adapter/`` the adapter,
   and the base model with that adapter gives the merged model's logits.
2. Exact resume: a synchronous LoRA run stopped after 4 steps and resumed to 8 is the run trained in one
   go (losses, rewards, final weights), and ``tandem export`` of its DeepSpeed checkpoint merges the
   adapter into the same weights as the run's own ``model/``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from launch.cli import main
from tests.runs import DEMO, read_metrics, run_dir, train

pytestmark = pytest.mark.slow

LORA = ("learner.lora.rank=8", "learner.lora.alpha=16")


def test_a_lora_run_learns_publishes_only_the_adapter_and_saves_it_merged(tmp_path, tiny_model_dir, capsys):
    steps = 60
    runs = tmp_path / "runs"
    code = train(
        DEMO, tiny_model_dir, runs, f"run.steps={steps}", "run.max_staleness=2", "rollout.weight_update=inflight",
        "learner.lr=0.01", *LORA,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    metrics = read_metrics(runs)
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.2, f"reward did not rise: {first:.3f} -> {last:.3f}"
    assert max(m["staleness_max"] for m in metrics) <= 2

    root = run_dir(runs)
    learner_log = (root / "logs" / "learner-0.log").read_text()
    assert "each version published: the LoRA adapter, 28 tensors" in learner_log  # 2 layers x 7 modules x A, B

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, root / "model" / "adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(merged(input_ids=ids).logits, base(input_ids=ids).logits)  # it trained


def test_a_resumed_lora_run_is_the_same_run_and_exports_merged(tmp_path, tiny_model_dir, capsys):
    common = [*LORA, "run.max_staleness=0", "rollout.prompts_per_step=8", "learner.lr=0.01", "run.checkpoint_every=4"]
    one_go, halves = tmp_path / "one-go", tmp_path / "halves"
    assert train(DEMO, tiny_model_dir, one_go, "run.steps=8", *common) == 0
    assert train(DEMO, tiny_model_dir, halves, "run.steps=4", *common) == 0
    root = run_dir(halves)
    capsys.readouterr()
    assert main(["train", "--resume", str(root), "run.steps=8"]) == 0
    assert f"resumed from {root / 'checkpoints' / 'step-4'} at step 4" in capsys.readouterr().out

    expected, got = read_metrics(one_go), read_metrics(halves)
    assert [m["step"] for m in got] == list(range(8))
    for key in ("learner/loss", "reward_mean", "prompt_ids"):
        assert [m[key] for m in got] == [m[key] for m in expected], key
    a, b = load_file(run_dir(one_go) / "model" / "model.safetensors"), load_file(root / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    exported = tmp_path / "exported"  # from the DeepSpeed state of step 8, not from model/
    assert main(["export", str(root), "--step", "8", "--out", str(exported)]) == 0
    c = load_file(exported / "model.safetensors")
    assert c.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(c[k], b[k], atol=1e-6, rtol=0, msg=k)
