"""The GPU smoke test's script, model and summariser (``bench/gpu_smoke.sh``), checked without a GPU:
the script parses, its plan names both weight paths and the 0.5B shape, every override it passes is a
valid config key with the intended value, and the summariser's numbers match hand-computed ones."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from bench import gpu_model, gpu_summary
from launch.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_smoke.sh"


def dry_run(*flags: str) -> str:
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *flags], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def planned_overrides(plan: str) -> dict[str, list[str]]:
    """``{run: [key=value, ...]}`` from the plan's ``OVERRIDES <run>: ...`` lines."""
    runs = {}
    for line in plan.splitlines():
        if line.startswith("OVERRIDES "):
            label, _, rest = line.removeprefix("OVERRIDES ").partition(": ")
            runs[label] = rest.split()
    return runs


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, capture_output=True)


def test_the_plan_names_both_weight_paths_and_the_model_shape():
    plan = dry_run("--inflight")
    runs = planned_overrides(plan)
    assert list(runs) == ["ray", "dist_gloo", "inflight", "dist_nccl"]
    assert "weights.backend=ray" in runs["ray"]
    assert {"weights.backend=distributed", "weights.process_group=gloo"} <= set(runs["dist_gloo"])
    assert {"weights.backend=distributed", "weights.process_group=nccl"} <= set(runs["dist_nccl"])
    assert "rollout.weight_update=inflight" in runs["inflight"]
    model_line = next(line for line in plan.splitlines() if line.startswith("model:"))
    shape = json.loads(model_line[model_line.index("{") :])
    assert shape["hidden_size"] == 896 and shape["num_layers"] == 24 and shape["vocab_size"] == 151936
    assert (shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]) == (14, 2, 64)
    assert shape["tie_word_embeddings"] and shape["parameters"] == 494_032_768
    assert "expected total" in plan and "timeout" in plan


@pytest.mark.parametrize("flags", [("--inflight",), ("--inflight", "--cpu")])
def test_every_planned_override_is_a_valid_config_key(flags):
    runs = planned_overrides(dry_run(*flags))
    assert runs
    for label, overrides in runs.items():
        cfg = load_config(ROOT / "configs" / "demo.yaml", overrides)  # raises on an unknown key or bad value
        assert cfg.run.name == label and not cfg.run.save_final and cfg.run.trackers == ["jsonl"]
        assert cfg.model.build_tiny is False and cfg.model.path.endswith(("model-gpu", "model-cpu"))
        assert cfg.weights.backend == ("distributed" if label.startswith("dist") else "ray")
        assert cfg.rollout.weight_update == ("inflight" if label == "inflight" else "between_requests")
        if "--cpu" in flags:
            assert cfg.model.dtype == "float32" and cfg.resources.learner.num_gpus == 0
        else:  # one GPU: the learner holds it in Ray's accounting, vLLM takes a share of its memory
            assert cfg.model.dtype == "bfloat16" and cfg.rollout.max_tokens == 256
            assert (cfg.resources.actors.num_gpus, cfg.resources.learner.num_gpus) == (0, 1)
            assert cfg.engine.gpu_memory_utilization == 0.3
            assert cfg.run.steps == (2 if label == "dist_nccl" else 6)


def test_the_parameter_count_is_qwen25_05b():
    # embeddings 151936 x 896 = 136,134,656; a layer: q 896^2 + 896, k and v 2 x (896 x 128 + 128), o 896^2,
    # MLP 3 x 896 x 4864, two norms 2 x 896 = 14,912,384; x 24 + the final norm 896 -> 494,032,768 (tied head)
    assert gpu_model.QWEN25_05B.parameters() == 136_134_656 + 24 * 14_912_384 + 896 == 494_032_768
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = gpu_model.TINY_SHAPE
    config = Qwen2Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                         num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                         num_key_value_heads=s.num_kv_heads, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == s.parameters()


def _span(process: str, kind: str, start: float, end: float, version: int | None) -> dict:
    return {"process": process, "kind": kind, "start": start, "end": end, "version": version}


def write_run(root: Path) -> Path:
    """4 steps at max staleness 1 on the distributed channel (gloo), with spans to check by hand."""
    hists = [{"0": 100}, {"0": 60, "1": 40}, {"0": 80, "1": 20}, {"0": 50, "1": 50}]
    run = root / "dist_gloo-20261202-120000"
    run.mkdir(parents=True)
    metrics = [
        {"step": s, "step_seconds": 5.0, "tokens_per_s": 30.0, "staleness_hist": h, "learner/tokens": 100.0,
         "completion_len_mean": 16.0, "reward_mean": 0.0, "learner_wait_s": 1.0}
        for s, h in enumerate(hists)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    spans = [
        _span("actor-0", "generate", 0, 5, 0),  # warm-up: left out
        _span("actor-0", "generate", 10, 11, 1),
        _span("actor-0", "generate", 10.5, 12, 1),  # overlaps the previous: the union counts
        _span("actor-0", "load_weights", 12, 12.3, 1),
        _span("actor-0", "generate", 13, 14, 2),
        _span("actor-0", "load_weights", 14.5, 14.6, 2),
        _span("actor-0", "generate", 20, 25, 3),  # version 3 = N - k: may have fed no step, left out
        _span("learner-0", "train", 6, 9, 1),  # step 0: left out
        _span("learner-0", "publish", 9, 11, 1),  # the first push: reported on its own
        _span("learner-0", "score", 11.5, 12, 2),
        _span("learner-0", "train", 12, 13, 2),
        _span("learner-0", "publish", 13, 13.4, 2),
        _span("learner-0", "train", 15, 16.5, 3),
        _span("learner-0", "publish", 16.5, 16.7, 3),
        _span("learner-0", "train", 18, 18.5, 4),
        _span("learner-0", "publish", 18.5, 18.6, 4),
    ]
    (run / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    config = {
        "run": {"max_staleness": 1},
        "rollout": {"weight_update": "between_requests"},
        "weights": {"backend": "distributed", "process_group": "gloo"},
        "algorithm": {"name": "grpo"},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "startup_s": 50.0, "wall_s": 80.0}))
    return run


def test_the_summary_numbers_are_the_hand_computed_ones(tmp_path):
    write_run(tmp_path / "runs" / "dist_gloo")
    (tmp_path / "dist_nccl.log").write_text("starting ...\nweight push v1 failed: Duplicate GPU detected\n\n")
    (tmp_path / "runs.tsv").write_text(
        "dist_gloo\t0\t80\truns/dist_gloo\tdist_gloo.log\n"
        "dist_nccl\t1\t40\truns/dist_nccl\tdist_nccl.log\n"
        "inflight\t-1\t0\truns/inflight\t\n"
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    gloo, nccl, skipped = gpu_summary.summarise(tmp_path / "runs.tsv", str(model))
    # pushes after the first: 0.4, 0.2, 0.1 s -> median 0.2, max 0.4; 1000 B / 0.2 s = 5e-6 GB/s
    assert gloo["push_s"] == pytest.approx(0.2) and gloo["push_max_s"] == pytest.approx(0.4)
    assert gloo["first_push_s"] == pytest.approx(2.0) and gloo["push_gb_s"] == pytest.approx(5e-6)
    assert gloo["load_s"] == pytest.approx(0.1)  # the second load; the first is left out
    # versions 1..N-1-k = 1..2: tokens 60 + 20 (v1) + 80 + 50 (v2) = 210 over union 2 s + 1 s -> 70 tok/s
    assert gloo["gen_tokens_per_s"] == pytest.approx(70.0) and gloo["gen_basis"] == "versions 1..2"
    # steps 1..3: 300 tokens over learner work 0.5 + 1 (v2) + 1.5 (v3) + 0.5 (v4) = 3.5 s -> 85.7 tok/s
    assert gloo["learner_tokens_per_s"] == pytest.approx(300 / 3.5)
    assert gloo["e2e_trained_tokens_per_s"] == pytest.approx(300 / 15)  # 3 steady steps x 100 over 3 x 5 s
    assert nccl["status"] == "failed (exit 1)" and "Duplicate GPU" in nccl["error"]
    assert skipped["status"] == "skipped"
    lines = [gpu_summary.result_line(r) for r in (gloo, nccl)]
    assert lines[0].startswith("RESULT dist_gloo: weight push 0.200 s") and "generation 70 tok/s" in lines[0]
    assert lines[1].startswith("RESULT dist_nccl: failed (exit 1): weight push v1 failed")
    assert gpu_summary.table([gloo, nccl, skipped]).count("\n") == 4  # header, rule, three rows


def test_the_inflight_rate_is_over_the_whole_run(tmp_path):
    run = write_run(tmp_path)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    spans = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    # all 400 trained tokens over every generate span's union: 5 + 2 + 1 + 5 = 13 s
    rate, basis = gpu_summary.generation_rate(records, spans, 1, inflight=True)
    assert basis == "run" and rate == pytest.approx(400 / 13)
