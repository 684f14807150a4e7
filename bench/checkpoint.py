"""Checkpoint cost: saving, hashing, exporting, verifying and restoring a run, per model size.

For each size (a Qwen2 with random weights built locally as ``actors/tiny_model.py`` builds the
tiny one, wider and deeper), in this process as ONE DeepSpeed rank (gloo, world size 1, set up as
``learner/worker.py`` does: the shm op build disabled, a torch AdamW passed in, its
``deepspeed_config``):

1. one optimizer step on random tokens, so the AdamW state exists;
2. ``save s``: ``saving.save_engines`` (DeepSpeed ``save_checkpoint``) into
   ``CheckpointStore(run_root, keep=2).begin(step)``, plus ``saving.save_hf_files`` (the config
   and tokenizer, ``hf files s`` in the JSON), then ``store.commit`` (state.json, the SHA-256
   manifest, the rename): ``hash s`` is ``write_manifest`` inside it, ``commit s`` all of it;
   ``ckpt MB`` is the bytes the manifest lists;
3. ``HF save s``: ``saving.save_hf_model`` fed with the engine module's (name, tensor) pairs,
   as ``LearnerWorker.save_model`` does at the end of a run (and every ``run.save_every``);
4. ``export s``: ``tandem export`` from the DeepSpeed state alone (``launch.tools.export._from_deepspeed``),
   checked against step 3's weights (``export ok``);
5. ``verify s``: ``checkpoints.problem`` (re-hashes every file, as ``store.newest`` does on
   resume), and ``load s``: ``saving.load_engines`` into a fresh engine, whose weights and step
   are checked against the saved ones (``load ok``).

Files go to a temporary directory (page cache warm, no fsync: as the product writes them) and
are removed after each size. ``MB/s`` = checkpoint MB / save s; ``peak RSS GB`` = this process's
largest resident memory so far (sizes run smallest first). Nothing here asserts a timing.

    .venv/bin/python bench/checkpoint.py [--sizes 5m 30m 120m --zero-stage 0 --out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import socket
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from learner.environment import rank_env  # noqa: E402

# name -> build_tiny_model arguments (head_dim 64 everywhere; the 64-token vocabulary is tiny,
# so the parameters are in the layers)
SIZES = {
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256),
    "5m": dict(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=768),
    "30m": dict(hidden_size=512, num_layers=10, num_heads=8, num_kv_heads=2, intermediate_size=1536),
    "120m": dict(hidden_size=1024, num_layers=11, num_heads=16, num_kv_heads=4, intermediate_size=2816),
    "400m": dict(hidden_size=1536, num_layers=16, num_heads=24, num_kv_heads=4, intermediate_size=4096),
}
DEFAULT_SIZES = ["5m", "30m", "120m"]  # 400m: ~65 s more, a peak of 8.4 GB at ZeRO-0 (more at ZeRO-2)
COLUMNS = [  # (JSON key, header, format)
    ("params_m", "params M", "{:.1f}"),
    ("checkpoint_mb", "ckpt MB", "{:.0f}"),
    ("save_s", "save s", "{:.2f}"),
    ("hash_s", "hash s", "{:.2f}"),
    ("save_mb_s", "save MB/s", "{:.0f}"),
    ("hf_model_mb", "HF MB", "{:.0f}"),
    ("hf_save_s", "HF save s", "{:.2f}"),
    ("export_s", "export s", "{:.2f}"),
    ("verify_s", "verify s", "{:.2f}"),
    ("load_s", "load s", "{:.2f}"),
    ("peak_rss_gb", "peak RSS GB", "{:.1f}"),
]


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """One rank, as ``LearnerWorker._init_distributed`` sets a CPU rank up."""
    import importlib
    from datetime import timedelta

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_SIZE="1",
    )
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=600))


def make_engine(model_path: str, learner):
    """A policy engine as ``LearnerWorker._engine`` builds it (float32)."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from learner.worker import deepspeed_config

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=learner.lr, betas=tuple(learner.betas), weight_decay=learner.weight_decay
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(learner, "float32"))
    return engine


def named_weights(engine, zero_stage: int) -> list:
    """(HF name, CPU tensor) pairs as ``LearnerWorker.export_weights(copy=False)`` gives rank 0."""
    import deepspeed
    import torch

    module = engine.module
    with torch.no_grad():
        if zero_stage == 3:
            named = []
            for name, param in module.named_parameters():
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    named.append((name, param.detach().to("cpu", copy=True)))
            return named
        return [(name, t.detach().to("cpu", copy=False)) for name, t in module.state_dict().items()]


def train_one_step(engine, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, engine.module.config.vocab_size, (2, 64), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def bench_size(name: str, model_root: Path, work: Path, zero_stage: int) -> dict:
    from safetensors.torch import load_file

    import runtime.checkpoints as checkpoints
    from actors.tiny_model import build_tiny_model
    from launch.tools.export import _from_deepspeed
    from learner import saving
    from learner.config import LearnerConfig

    spec = SIZES[name]
    t0 = time.perf_counter()
    model_path = str(build_tiny_model(model_root / f"bench-ckpt-{name}", **spec).resolve())
    build_s = time.perf_counter() - t0
    learner = LearnerConfig(zero_stage=zero_stage)
    engine = make_engine(model_path, learner)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())  # ZeRO-3: partitioned
    train_one_step(engine, seed=1)
    step = 1

    # 2. the checkpoint as runtime/saving.py's RunSaver.checkpoint writes it
    run_root = work / "run"
    store = checkpoints.CheckpointStore(run_root, keep=2)
    partial = store.begin(step)
    t0 = time.perf_counter()
    saving.save_engines({"policy": engine}, str(partial), {"rng": saving.rng_state()})
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    saving.save_hf_files(engine.module, model_path, partial / "hf")
    hf_files_s = time.perf_counter() - t0
    manifest_times: list[float] = []
    write_manifest = checkpoints.write_manifest

    def timed_manifest(root):
        start = time.perf_counter()
        try:
            return write_manifest(root)
        finally:
            manifest_times.append(time.perf_counter() - start)

    checkpoints.write_manifest = timed_manifest  # commit() looks it up at call time
    try:
        t0 = time.perf_counter()
        final, ckpt_bytes = store.commit(partial, step, {"step": step, "version": step})
        commit_s = time.perf_counter() - t0
    finally:
        checkpoints.write_manifest = write_manifest
    ds_bytes = dir_bytes(final / "deepspeed")

    # 3. the Hugging Face model, as LearnerWorker.save_model writes it
    hf_dir = work / "model"
    t0 = time.perf_counter()
    saving.save_hf_model(engine.module, named_weights(engine, zero_stage), model_path, hf_dir)
    hf_save_s = time.perf_counter() - t0
    saved = {k: v.clone() for k, v in load_file(hf_dir / "model.safetensors").items()}
    del engine  # the export and the fresh engine below do not need it: free its memory first
    gc.collect()

    # 4. tandem export from the DeepSpeed state alone
    export_dir = work / "export"
    t0 = time.perf_counter()
    try:
        _from_deepspeed(final, export_dir)
    except Exception as exc:  # reported in the table and the JSON; the other steps still run
        export_error = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] export failed: {export_error}", flush=True)
        export_s, export_ok, export_bytes = None, False, 0
    else:
        export_error = None
        export_s = time.perf_counter() - t0
        export_ok = same_weights(saved, load_file(export_dir / "model.safetensors"))
        export_bytes = dir_bytes(export_dir)

    # 5. the resume's checks and load, into a fresh engine (its construction not timed)
    t0 = time.perf_counter()
    bad = checkpoints.problem(final)
    verify_s = time.perf_counter() - t0
    fresh = make_engine(model_path, learner)
    t0 = time.perf_counter()
    client = saving.load_engines({"policy": fresh}, str(final))
    load_s = time.perf_counter() - t0
    loaded = {n: t.clone() for n, t in named_weights(fresh, zero_stage)}
    loaded = {k: v for k, v in loaded.items() if k in saved}
    load_ok = same_weights(saved, loaded) and fresh.global_steps == step and "rng" in client
    del fresh, loaded
    gc.collect()

    mb = ckpt_bytes / 1e6
    return {
        "size": name,
        **spec,
        "params": params,
        "params_m": params / 1e6,
        "checkpoint_mb": mb,
        "deepspeed_mb": ds_bytes / 1e6,
        "files": len(json.loads((final / checkpoints.MANIFEST).read_text())["files"]),
        "save_s": save_s,
        "hf_files_s": hf_files_s,
        "commit_s": commit_s,
        "hash_s": manifest_times[0],
        "save_mb_s": mb / save_s,
        "hash_mb_s": mb / manifest_times[0],
        "hf_model_mb": dir_bytes(hf_dir) / 1e6,
        "hf_save_s": hf_save_s,
        "export_mb": export_bytes / 1e6,
        "export_s": export_s,
        "export_ok": export_ok,
        "export_error": export_error,
        "verify_s": verify_s,
        "verify_problem": bad,
        "load_s": load_s,
        "load_ok": load_ok,
        "model_build_s": build_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,  # the process's, so far
    }


def print_table(rows: list[dict]) -> None:
    headers = ["size", *(h for _, h, _ in COLUMNS), "export ok", "load ok"]
    cells = [
        [
            r["size"],
            *("-" if r[key] is None else fmt.format(r[key]) for key, _, fmt in COLUMNS),
            str(r["export_ok"]),
            str(r["load_ok"]),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("\n" + "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, choices=list(SIZES))
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--out", default=None, help="JSON results (default: bench/results/checkpoint-zero<N>.json)")
    parser.add_argument("--cpus", type=int, default=1, help="torch threads, as a learner rank with this many CPUs")
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache" / "tandem" / "models"))
    parser.add_argument("--work-dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    for key, value in rank_env(args.cpus, 0).items():
        os.environ.setdefault(key, value)
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"checkpoint-zero{args.zero_stage}.json")

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.cpus)
    init_distributed()
    rows = []
    started = time.perf_counter()
    for name in args.sizes:
        work = Path(tempfile.mkdtemp(prefix=f"bench-ckpt-{name}-", dir=args.work_dir))
        try:
            t0 = time.perf_counter()
            rows.append(bench_size(name, Path(args.model_dir), work, args.zero_stage))
            print(f"[{name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    print(f"ZeRO-{args.zero_stage}, float32, {args.cpus} torch thread(s); total {time.perf_counter() - started:.0f}s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "checkpoint",
                "date": date.today().isoformat(),
                "machine": f"{os.cpu_count()}-core CPU, {platform.machine()}",
                "zero_stage": args.zero_stage,
                "dtype": "float32",
                "torch_threads": args.cpus,
                "command": " ".join([".venv/bin/python", "bench/checkpoint.py", *sys.argv[1:]]),
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
