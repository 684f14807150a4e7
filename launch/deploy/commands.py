"""The command line of the scheduler launchers: ``tandem slurm`` and ``tandem k8s``, their arguments and their
rendering (``launch/deploy/slurm.py``, ``launch/deploy/k8s.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.config import load_config


def render_launcher(args: argparse.Namespace) -> int:
    """``tandem slurm`` / ``tandem k8s``: validate the config, print (or write) the script or manifest."""
    cfg = load_config(args.config, args.overrides)
    if args.command == "slurm":
        from launch.deploy.slurm import render_sbatch

        text = render_sbatch(
            cfg,
            args.config,
            args.overrides,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            cpus_per_node=args.cpus_per_node,
            partition=args.partition,
            time_limit=args.time,
            job_name=args.job_name,
            venv=args.venv,
            ray_port=args.ray_port,
            wait_s=args.wait,
            signal_s=args.signal_s,
            requeue=args.requeue,
        )
    else:
        from launch.deploy.k8s import render_rayjob

        env = dict(item.partition("=")[::2] for item in args.env)
        text = render_rayjob(
            cfg,
            args.config,
            args.overrides,
            name=args.name,
            image=args.image,
            namespace=args.namespace,
            worker_replicas=args.workers,
            gpus_per_worker=args.gpus_per_worker,
            cpus_per_worker=args.cpus_per_worker,
            memory_per_worker=args.memory_per_worker,
            head_cpus=args.head_cpus,
            head_memory=args.head_memory,
            ttl_s=args.ttl,
            workdir=args.workdir,
            env=env or None,
            retries=args.retries,
            runs_pvc=args.runs_pvc,
            token_secret=args.token_secret,
        )
        if args.retries and not args.runs_pvc:
            print(
                "tandem: warning: without --runs-pvc the run directory is on the head pod's disk and goes with its "
                "cluster: a retry (--retries) starts the run over",
                file=sys.stderr,
            )
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def add_launchers(sub) -> None:
    pl = sub.add_parser("plan", help="print the placement without running it")
    pl.add_argument("--config", action="append", required=True, help="YAML config (several merge in order)")
    pl.add_argument("--address", help="check against this running Ray cluster")
    pl.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU, GiB (default 80)")
    pl.add_argument(
        "--model-shape",
        help="the model's shape: a Qwen2.5 size (0.5B, 1.5B, 3B, 7B) or a folder with "
        "config.json (default: model.path's)",
    )
    pl.add_argument("overrides", nargs="*", help="config overrides, key=value")
    sl = sub.add_parser("slurm", help="print an sbatch script: Ray over the allocation, then tandem train")
    sl.add_argument("--config", required=True, help="YAML config (readable on the first node)")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, default=0)
    sl.add_argument("--cpus-per-node", type=int, required=True)
    sl.add_argument("--partition")
    sl.add_argument("--time", default="24:00:00", help="SLURM time limit")
    sl.add_argument("--job-name", default="tandem")
    sl.add_argument("--venv", help="virtual environment to activate on the nodes")
    sl.add_argument("--ray-port", type=int, default=6379)
    sl.add_argument("--wait", type=int, default=600, help="seconds to wait for all nodes to join")
    sl.add_argument(
        "--signal-s",
        type=int,
        default=300,
        help="SIGTERM to the job this many seconds before --time: tandem train checkpoints and stops",
    )
    sl.add_argument(
        "--requeue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="#SBATCH --requeue: SLURM may requeue the job after a node failure or a preemption (default on); the "
        "script trains with --resume auto, so a requeued or resubmitted job continues its run",
    )
    sl.add_argument("--out", help="write the script here instead of stdout")
    sl.add_argument("overrides", nargs="*", help="config overrides, key=value")
    k8 = sub.add_parser("k8s", help="print a KubeRay RayJob manifest")
    k8.add_argument("--config", required=True, help="config path inside the image (relative to --workdir)")
    k8.add_argument("--image", required=True, help="container image with Tandem and Ray installed")
    k8.add_argument("--name", default="tandem")
    k8.add_argument("--namespace")
    k8.add_argument("--workers", type=int, required=True, help="worker pods")
    k8.add_argument("--gpus-per-worker", type=int, default=0)
    k8.add_argument("--cpus-per-worker", type=int, required=True)
    k8.add_argument("--memory-per-worker", default="32Gi")
    k8.add_argument("--head-cpus", type=int, default=2)
    k8.add_argument("--head-memory", default="8Gi")
    k8.add_argument("--ttl", type=int, default=600, help="seconds the finished cluster is kept")
    k8.add_argument("--workdir", help="directory in the image to run from")
    k8.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="env var for the job (repeat)")
    k8.add_argument(
        "--retries",
        type=int,
        default=2,
        help="the RayJob's backoffLimit: a failed job runs again on a new cluster with --resume auto (default 2)",
    )
    k8.add_argument(
        "--runs-pvc",
        metavar="CLAIM",
        help="PersistentVolumeClaim mounted at run.output_dir on every pod (ReadWriteMany with several pods): the "
        "runs outlive the cluster, so a retry resumes",
    )
    k8.add_argument(
        "--token-secret",
        metavar="SECRET",
        help="a Secret holding the Ray token under the key auth_token (default: the operator makes one)",
    )
    k8.add_argument("--out", help="write the manifest here instead of stdout")
    k8.add_argument("overrides", nargs="*", help="config overrides, key=value")
    sb = sub.add_parser("submit", help="run training as a Ray job on a running cluster")
    sb.add_argument("--config", required=True, help="YAML config inside --working-dir")
    sb.add_argument("--address", required=True, help="Ray dashboard address, e.g. http://head:8265")
    sb.add_argument("--working-dir", default=".", help="directory shipped to the cluster (default: here)")
    sb.add_argument("--no-follow", action="store_true", help="return after submitting")
    sb.add_argument("--timeout", type=float, help="stop the job after this many seconds")
    sb.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATH",
        help="also ship this file or folder of --working-dir (repeat); by default: what git tracks, the config "
        "and the files it names",
    )
    sb.add_argument(
        "--dry-run", action="store_true", help="print the files that would ship, with sizes; submit nothing"
    )
    sb.add_argument("overrides", nargs="*", help="config overrides, key=value")
