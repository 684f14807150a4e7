"""run.trackers: TensorBoard's scalars, histograms and sample text read back from its event file; W&B
offline (its run file read back), resumed under the same id; the config's one-line errors."""

from __future__ import annotations

import builtins
import collections
import glob
import io
import json
import struct
import sys

import numpy as np
import pytest

from cluster.timeline import Span
from launch.config import ConfigError, load_config
from observe.run_dir import RunLog
from observe.trackers import WANDB_MISSING, histogram, markdown_table
from runtime.collector import Batch
from runtime.step_metrics import sample_records, staleness_sample, step_distributions, step_metrics
from tests.fakes import make_group

REQUIRED = ["model.path=m", "data.prompts=p.jsonl", "reward.function=r.py:f"]


def make_batch(step: int = 2) -> Batch:
    """Two groups of 2 completions, 3 tokens each: one generated at version 2, one at version 1.
    Per-token staleness at step 2: 6 tokens of age 0, 6 of age 1."""
    groups = [make_group(0, [1.0, 0.0], version=2), make_group(1, [1.0, 1.0], version=1)]
    batch = Batch(groups=groups, step=step, dropped=0, wait_s=0.5)
    batch.staleness = collections.Counter({0: 6, 1: 6})
    return batch


def log_one_step(run: RunLog, batch: Batch) -> None:
    metrics = {**step_metrics(batch, {"loss": 0.25}, step_seconds=2.0), "actor_restarts": 0}
    run.step(batch.step, metrics, step_distributions(batch))
    run.samples(sample_records(batch, batch.step, 3))


def test_step_distributions_are_per_token_and_per_completion():
    dist = step_distributions(make_batch())
    assert sorted(dist["hist/staleness"].tolist()) == [0] * 6 + [1] * 6
    assert dist["hist/reward"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert dist["hist/completion_len"].tolist() == [3, 3, 3, 3]


def test_staleness_sample_is_capped_and_proportionate():
    # 4,000,010 tokens, cap 1000: shares 750, 250, 0.0025 -> 750, 250, and age 5 kept once (the max shows)
    values = staleness_sample(collections.Counter({0: 3_000_000, 1: 1_000_000, 5: 10}), cap=1000)
    assert np.bincount(values).tolist() == [750, 250, 0, 0, 0, 1]
    # shares 333.3, 333.3, 333.3 of cap 1000: one remainder rounds up -> 334 + 333 + 333 = 1000
    values = staleness_sample(collections.Counter({0: 10_000, 1: 10_000, 2: 10_000}), cap=1000)
    assert len(values) == 1000 and sorted(np.bincount(values).tolist()) == [333, 333, 334]
    # under the cap: every token
    assert np.bincount(staleness_sample(collections.Counter({0: 3, 2: 1}), cap=1000)).tolist() == [3, 0, 1]


def test_histogram_buckets():
    # integers over a narrow range: one bucket per integer, edges at v +- 0.5
    counts, edges = histogram(np.array([0, 0, 1, 3]))
    assert counts.tolist() == [2, 1, 0, 1] and edges.tolist() == [-0.5, 0.5, 1.5, 2.5, 3.5]
    counts, edges = histogram(np.array([0.25, 0.75]))  # not integers: equal-width buckets
    assert counts.sum() == 2 and len(edges) == len(counts) + 1 and edges[0] == 0.25 and edges[-1] == 0.75


def test_markdown_table_escapes_cells():
    text = markdown_table(["prompt", "reward"], [["a|b\nc", 0.5], [None, 1.0]])
    assert text.splitlines() == ["| prompt | reward |", "| --- | --- |", "| a\\|b<br>c | 0.500 |", "|  | 1.000 |"]


def read_tensorboard(root):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(root / "tb"), size_guidance={ea.HISTOGRAMS: 0, ea.TENSORS: 0, ea.SCALARS: 0})
    acc.Reload()
    return acc


def test_tensorboard_gets_scalars_histograms_and_samples(tmp_path):
    run = RunLog(tmp_path, total_steps=3, stream=io.StringIO(), config={"run": {"trackers": ["jsonl", "tensorboard"]}})
    log_one_step(run, make_batch())
    run.eval(3, {"eval/pass@1": 0.75, "eval/samples": 4}, "eval after step 3")
    run.close(None)
    acc = read_tensorboard(tmp_path)
    tags = acc.Tags()
    # rewards 1, 0, 1, 1 -> mean 0.75; the evaluation's pass@1 at step 3
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/pass@1")] == [(3, 0.75)]
    assert "prompt_ids" not in tags["scalars"]
    assert {"hist/staleness", "hist/reward", "hist/completion_len"} <= set(tags["histograms"])
    stale = acc.Histograms("hist/staleness")[0]
    assert stale.step == 2
    # 6 tokens of age 0 and 6 of age 1: buckets (-0.5, 0.5], (0.5, 1.5]
    assert stale.histogram_value.num == 12 and list(stale.histogram_value.bucket) == [6, 6]
    assert list(stale.histogram_value.bucket_limit) == [0.5, 1.5]
    reward = acc.Histograms("hist/reward")[0].histogram_value
    assert reward.num == 4 and list(reward.bucket) == [1, 3] and reward.sum == 3.0  # one 0, three 1s
    length = acc.Histograms("hist/completion_len")[0].histogram_value
    assert length.num == 4 and list(length.bucket) == [4] and length.sum == 12.0
    (text_tag,) = [t for t in tags["tensors"] if t.startswith("samples")]
    (event,) = acc.Tensors(text_tag)
    table = event.tensor_proto.string_val[0].decode()
    lines = table.splitlines()
    assert event.step == 2 and lines[0] == "| prompt | completion | reward | staleness |"
    assert len(lines) == 2 + 3  # header, rule, the 3 sample records
    assert "| 12 | xxx | 1.000 | 0 |" in lines  # group 0's first completion: version 2 at step 2


def test_tensorboard_purges_resumed_steps(tmp_path):
    config = {"run": {"trackers": ["jsonl", "tensorboard"]}}
    run = RunLog(tmp_path, 4, stream=io.StringIO(), config=config)
    for step in range(3):
        log_one_step(run, make_batch(step))
    run.close(None)
    run = RunLog.reopen(tmp_path, config, 4, first_step=1)  # the checkpoint was after step 1
    for step in range(1, 4):
        log_one_step(run, make_batch(step))
    run.close(None)
    assert [e.step for e in read_tensorboard(tmp_path).Scalars("reward_mean")] == [0, 1, 2, 3]


def wandb_records(path):
    """The records of a W&B run file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) hold protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(path) -> list[dict[str, str]]:
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    return {"run": {"trackers": ["jsonl", "wandb"], "wandb_mode": "offline"}}


def test_wandb_offline_run_and_resume(tmp_path, wandb_offline):
    root = tmp_path / "run-1"
    root.mkdir()
    out = io.StringIO()
    run = RunLog(root, 3, stream=out, config=wandb_offline)
    log_one_step(run, make_batch())
    run.eval(3, {"eval/pass@1": 0.75}, "eval after step 3")
    run.close(None)
    run_id = (root / "wandb-run-id").read_text().strip()
    (first,) = glob.glob(str(root / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    history = wandb_history(first)
    (scalars,) = [row for row in history if "reward_mean" in row]
    assert scalars["step"] == "2" and float(scalars["reward_mean"]) == 0.75  # rewards 1, 0, 1, 1
    assert [row["step"] for row in history if "eval/pass@1" in row] == ["3"]
    (hist,) = [row for row in history if "hist/staleness/_type" in row]
    assert hist["hist/staleness/values"] == "[6,6]"
    (samples,) = [row for row in history if "samples/_type" in row]
    assert samples["samples/nrows"] == "3" and samples["samples/ncols"] == "4"
    names = {r.run.display_name for r in wandb_records(first) if r.WhichOneof("record_type") == "run"}
    assert names == {"run-1"}  # the run directory's name
    assert "wandb" not in out.getvalue().lower()  # W&B's chatter stays out of the progress lines

    run = RunLog.reopen(root, wandb_offline, 3, first_step=2)  # resumed: the same W&B run
    log_one_step(run, make_batch())
    run.close(None)
    assert (root / "wandb-run-id").read_text().strip() == run_id
    files = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)


def test_tracker_choices_are_checked_at_config_time():
    assert load_config(None, REQUIRED).run.trackers == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError) as err:
        load_config(None, REQUIRED + ["run.trackers=[tensorboard,wandb]"])
    message = str(err.value)
    assert message.startswith("run.trackers must include jsonl: metrics.jsonl feeds") and "\n" not in message
    assert "run.trackers=[jsonl,tensorboard,wandb]" in message  # the fix, ready to paste
    with pytest.raises(ConfigError, match="unknown tracker 'mlflow'; choose from jsonl, tensorboard, wandb$"):
        load_config(None, REQUIRED + ["run.trackers=[jsonl,mlflow]"])
    with pytest.raises(ConfigError, match="run.wandb_mode"):
        load_config(None, REQUIRED + ["run.wandb_mode=cloud"])


def test_wandb_not_installed_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, find_spec finds nothing
    with pytest.raises(ConfigError) as err:
        load_config(None, REQUIRED + ["run.trackers=[jsonl,wandb]"])
    assert str(err.value) == WANDB_MISSING
    assert WANDB_MISSING == (
        "run.trackers has wandb but the wandb package is not installed; pip install 'tandem-rl[wandb]' or drop it"
    )
    # at start-up too (a config checked elsewhere): the import itself fails
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    from launch.config import RunConfig

    settings = RunConfig.model_construct(**{**RunConfig().model_dump(), "trackers": ["jsonl", "wandb"]})
    with pytest.raises(ConfigError, match="^run.trackers has wandb but the wandb package is not installed"):
        RunLog(tmp_path, 1, stream=io.StringIO(), settings=settings)


def test_a_failing_tracker_is_left_out_and_training_goes_on(tmp_path):
    out = io.StringIO()
    run = RunLog(tmp_path, 2, stream=out, config={"run": {"trackers": ["jsonl", "tensorboard"]}})

    def broken(step, values):
        raise OSError("disk full")

    run.trackers["tensorboard"].scalars = broken
    log_one_step(run, make_batch(0))
    log_one_step(run, make_batch(1))
    run.close(None)
    lines = out.getvalue().splitlines()
    assert lines.count("tracker tensorboard failed (OSError: disk full); it is off for the rest of the run") == 1
    assert [line[:14] for line in lines if line.startswith("step")] == ["step    1/2 | ", "step    2/2 | "]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_resumed_run_keeps_the_timeline_up_to_its_checkpoint(tmp_path):
    """Spans after the learner published the checkpoint's version are of steps trained again, and a
    torn last line (a killed run) would end up mid-file: both go when the run is reopened."""
    config = {"run": {"trackers": ["jsonl"]}}
    run = RunLog(tmp_path, 4, stream=io.StringIO(), config=config)
    span = lambda kind, start, end, version=None: Span(  # noqa: E731
        "learner-0" if kind == "publish" else "actor-0", kind, start, end, version
    )
    run.timeline([span("generate", 0, 1, 0), span("publish", 1, 2, 1), span("generate", 1.5, 3, 1)])
    run.timeline([span("publish", 3, 4, 2), span("generate", 4, 5, 2)])
    run.close(None)
    with (tmp_path / "timeline.jsonl").open("a") as f:
        f.write('{"process": "actor-0", "kind": "gen')  # killed mid-line
    run = RunLog.reopen(tmp_path, config, 4, first_step=1)  # the checkpoint was after step 1
    run.timeline([span("publish", 10, 11, 2)])
    run.close(None)
    kept = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert [(s["kind"], s["start"]) for s in kept] == [
        ("generate", 0),
        ("publish", 1),
        ("generate", 1.5),
        ("publish", 10),
    ]
