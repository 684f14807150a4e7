"""LoRA on the real stack (``learner.lora``): PEFT adapters in the DeepSpeed learner, vLLM serving them,
in the small-cluster setting the colocated schedule is for.

The base: the tiny model warm-started (full fine-tuning, 150 supervised steps, 3 s) on the built-in
``echo`` task ("copy 4:" -> "4"), so that it knows its digits; the RL task is ``successor`` ("next 4:" ->
"5"), which the adapters must learn. (From the random tiny model LoRA cannot learn it at all: with the
embeddings and the output head frozen, supervised training plateaus at a loss of 1.74 at every rank up to
128, against 0.01 for full fine-tuning; from the echo model it reaches 0.02 in 50 steps.)

One run, LoRA in the colocated schedule with in-flight updates and max staleness 2 (two engines and a
two-core learner rank taking turns on two cores; the between-requests colocated case is
``tests/test_real_run.py``'s). It learns: reward from about 0.01 to about 0.7 in 60 steps (overlapped,
measured 2026-12-04: 0.009 -> 0.718; between requests 0.003 -> 0.552). Every published version is the
adapter alone; ``model/`` is the merged model and ``model/adapter/`` the adapter, and the base with that
adapter gives the merged model's logits. The run's timeline shows no generation beside the learner's
work, each step's staleness is its place in its phase of 3 steps, and only each phase's last version
is pushed. (Exact resume and export of LoRA checkpoints: ``tests/test_lora.py``, in-process.)
"""

from __future__ import annotations

import pytest
import torch

from tests.runs import COLOCATED, DEMO, overlapping, read_metrics, read_spans, run_dir, train

pytestmark = pytest.mark.slow

LORA = ("learner.lora.rank=8", "learner.lora.alpha=16", "learner.lr=0.003")


@pytest.fixture(scope="module")
def echo_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model after 150 supervised steps on the echo task."""
    from transformers import AutoTokenizer

    from actors.tasks import echo_rows
    from learner.sft import warm_start

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = [(tokenizer(r["prompt"])["input_ids"], tokenizer(r["answer"])["input_ids"]) for r in echo_rows(512, 1)]
    out = tmp_path_factory.mktemp("models") / "echo"
    warm_start(tiny_model_dir, out, pairs, steps=150, lr=1e-3)
    return str(out)


def test_a_colocated_lora_run_learns_publishes_only_the_adapter_and_saves_it_merged(tmp_path, echo_model, capsys):
    steps, k = 60, 2
    runs = tmp_path / "runs"
    code = train(
        DEMO, echo_model, runs, f"run.steps={steps}", f"run.max_staleness={k}", "rollout.weight_update=inflight",
        "rollout.prompts_per_request=8", *COLOCATED, *LORA,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    metrics = read_metrics(runs)
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.3, f"reward did not rise: {first:.3f} -> {last:.3f}"
    assert [m["staleness_max"] for m in metrics] == [i % (k + 1) for i in range(steps)]  # phases of k + 1 steps
    spans = read_spans(runs)
    assert {s["process"] for s in spans if s["kind"] == "generate"} == {"actor-0", "actor-1"}  # both engines
    assert overlapping(spans, ("generate",), ("score", "train")) == []  # never beside the learner's work
    assert len([s for s in spans if s["kind"] == "publish"]) == steps // (k + 1)  # each phase's last version

    root = run_dir(runs)
    learner_log = (root / "logs" / "learner-0.log").read_text()
    assert "each version published: the LoRA adapter, 28 tensors" in learner_log  # 2 layers x 7 modules x A, B

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(echo_model, dtype=torch.float32)
    before = base(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]])).logits.detach()
    adapted = PeftModel.from_pretrained(base, root / "model" / "adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(merged(input_ids=ids).logits, before)  # it trained
