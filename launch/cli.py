"""The ``tandem`` command line.

tandem demo [key=value ...]                   the built-in demo: a real RL run on the CPU
tandem train --config FILE.yaml [key=value]   train with a config file and overrides
tandem train --resume RUN_DIR [key=value]     continue a run from its newest intact checkpoint
tandem train --config F --resume auto [k=v]   continue the newest unfinished run of its name, or start one
tandem export RUN_DIR [--step N] --out DIR    write a run's policy as a Hugging Face model
tandem scale RUN_DIR --actors N               grow or shrink a running run's fleet of generation actors
tandem eval --model DIR --config F [k=v]      evaluate a saved model on the config's held-out set
tandem example math [key=value ...]           warm-start a tiny chat model, GRPO with math-verify, eval
tandem example tools [key=value ...]          warm-start a tiny tool-calling model, multi-turn GRPO, eval
tandem tiny-model DIR [--chat]                build the tiny test model + tokenizer in DIR (--chat: byte-level, ChatML)
tandem check-data --config F [-n N] [k=v]     show N prompts as the sampler gets them, their gold/wrong rewards
tandem config-reference                       print every config key (Markdown)
tandem plan --config F [--address ADDR]       print the placement (checked against a cluster) and GPU memory
tandem submit --config F --address ADDR       run training as a Ray job on a running cluster
tandem slurm --config F --nodes N ...         print an sbatch script (Ray over the allocation, then train)
tandem k8s --config F --image IMG ...         print a KubeRay RayJob manifest
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.config import ConfigError, config_reference, load_config
from launch.deploy.commands import add_launchers, render_launcher
from launch.deploy.submit import LaunchError, SubmitError
from launch.run import UnexpectedError, error_message, run_training, user_errors

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def show_plan(
    config_path: str | list[str],
    overrides: list[str],
    address: str | None,
    gpu_gib: float = 80.0,
    model_shape: str | None = None,
) -> int:
    """``tandem plan``: the placement (checked against a running cluster when ``--address`` is given), then
    each GPU's memory on devices of ``gpu_gib`` GiB; a GPU over it is refused in one line (rc 2)."""
    from cluster.placement import check_fits, describe_plan, local_ray_cpus
    from launch.plan import build_plan, read_shape

    cfg = load_config(config_path, overrides)
    if model_shape and read_shape(model_shape) is None:
        raise ConfigError(f"--model-shape {model_shape}: neither a Qwen2.5 size (0.5B, 1.5B, 3B, 7B) nor a folder "
                          "with a config.json; pass one of those")  # fmt: skip
    for line in cfg.warnings:
        print(f"tandem: warning: {line}", file=sys.stderr)
    kinds, strategy = build_plan(cfg).kinds, cfg.resources.strategy
    if not address:
        print(describe_plan(kinds, strategy))
        cpus = local_ray_cpus(kinds, cfg.resources.local_num_cpus)
        print(f"local Ray would advertise {cpus} CPUs (pass --address to check a cluster)")
        return _show_memory(cfg, gpu_gib, model_shape)
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        print(describe_plan(kinds, strategy, [n for n in ray.nodes() if n["Alive"]]))
        check_fits(kinds, ray.cluster_resources())
        print("fits: the cluster's totals cover the plan (Ray still places each bundle on one node)")
    finally:
        ray.shutdown()
    return _show_memory(cfg, gpu_gib, model_shape)


def _show_memory(cfg, gpu_gib: float, given: str | None) -> int:
    """The memory table under the placement (runs with GPUs only); ``MemoryPlanError`` when a GPU is over."""
    from cluster.memory import GIB, render
    from launch.plan import check_memory, dense_attention, memory_plan, model_shape, shm_note

    if not (cfg.resources.learner.num_gpus or cfg.resources.actors.num_gpus):
        return 0
    shape = model_shape(cfg, given)
    if shape is None:
        print(f"memory: the shape of {cfg.model.path} is unknown here; pass --model-shape 1.5B (0.5B, 3B, 7B) or DIR")
        return 0
    device, dense = int(gpu_gib * GIB), dense_attention(cfg)
    print(render(memory_plan(cfg, shape, device, dense)[0], device))
    if note := shm_note(cfg, shape):
        print(note)
    check_memory(cfg, shape, device, dense)
    return 0


def _add_tuning(sub) -> None:
    rp = sub.add_parser("report", help="write report.html (curves, staleness, TIS, idle, timeline) of run directories")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one run, or several to overlay")
    rp.add_argument("--out", help="directory for report.html and the figures' PNGs (default: RUN_DIR/report)")
    rp.add_argument("--trace", action="store_true", help="also write trace.json (Chrome / Perfetto) of the timeline")
    tu = sub.add_parser("tune", help="probe staleness, weight-update mode and actor:learner split; recommend one")
    tu.add_argument("--config", required=True, help="YAML config of the job to tune")
    tu.add_argument("--steps", type=int, default=8, help="training steps per probed setting (default 8)")
    tu.add_argument("--out", help="YAML file of the recommended overrides (default: TUNE_DIR/overrides.yaml)")
    tu.add_argument("--staleness", default="0,1,2,4", help="max_staleness values to probe (default 0,1,2,4)")
    tu.add_argument("--modes", default="between_requests,inflight", help="rollout.weight_update modes to probe")
    tu.add_argument(
        "--schedules", default="overlapped,colocated", help="run.schedule values to probe (colocated: CPUs only)"
    )
    tu.add_argument("--max-tis-truncated", type=float, default=0.05, help="threshold: TIS truncated share (0.05)")
    tu.add_argument("--max-mismatch-kl", type=float, default=0.02, help="threshold: sampler/learner KL (0.02)")
    tu.add_argument("--max-dropped", type=float, default=0.10, help="threshold: dropped-stale per group (0.10)")
    tu.add_argument("overrides", nargs="*", help="config overrides for every probe, key=value")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Asynchronous actor-learner RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in demo (tiny model, built-in task, CPU)")
    demo.add_argument("overrides", nargs="*", help="config overrides, key=value")
    exm = sub.add_parser(
        "example", help="run a built-in example end to end (math: SFT warm-start, GRPO, eval; tools: multi-turn)"
    )
    exm.add_argument("name", choices=["math", "tools"])
    exm.add_argument(
        "--sft-steps",
        type=int,
        help="the most supervised warm-start steps it may take to converge (default 3000)",
    )
    exm.add_argument("overrides", nargs="*", help="config overrides for the RL run, key=value")
    tr = sub.add_parser("train", help="train with a YAML config")
    tr.add_argument(
        "--config",
        action="append",
        help="YAML config file (with --resume: default the run's own config.yaml); several are merged in order",
    )
    tr.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue this run from its newest intact checkpoint; 'auto' (with --config): the newest unfinished "
        "run of run.name under run.output_dir, or a new one (a requeued job's command, safe to repeat)",
    )
    tr.add_argument(
        "--allow-changes",
        action="store_true",
        help="with --resume: accept settings that change what the steps mean (model, data, reward, rollout, "
        "learner, algorithm); each segment's config is kept in RUN_DIR/configs/",
    )
    tr.add_argument("--address", help="join this Ray cluster (host:port or 'auto') instead of starting a local Ray")
    tr.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. learner.lr=3e-4)")
    tiny = sub.add_parser("tiny-model", help="build the tiny random-init Qwen2 model and tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument(
        "--chat",
        action="store_true",
        help="a byte-level tokenizer that round-trips any text, ChatML chat template, <|im_end|> as EOS",
    )
    cd = sub.add_parser("check-data", help="show prompts as the sampler gets them and their answers' rewards")
    cd.add_argument("--config", action="append", required=True, help="YAML config (several merge in order)")
    cd.add_argument("-n", type=int, default=3, help="rows to show and score (default 3)")
    cd.add_argument("overrides", nargs="*", help="config overrides, key=value")
    sub.add_parser("config-reference", help="print the config reference (Markdown)")
    ex = sub.add_parser("export", help="write a run's policy as a Hugging Face model directory")
    ex.add_argument("run_dir")
    ex.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest intact one)")
    ex.add_argument("--out", required=True, help="directory to write (new or empty)")
    sc = sub.add_parser("scale", help="grow or shrink a running run's fleet of generation actors")
    sc.add_argument("run_dir")
    sc.add_argument("--actors", type=int, required=True, help="generation actors the run should have")
    ev = sub.add_parser("eval", help="evaluate a saved model on the config's held-out set (pass@1, pass@k)")
    ev.add_argument("--model", required=True, help="model directory (e.g. RUN_DIR/model) or Hugging Face id")
    ev.add_argument("--config", required=True, help="YAML config: its eval, data, reward, rollout and engine")
    ev.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. eval.samples=8)")
    add_launchers(sub)
    _add_tuning(sub)
    args = parser.parse_args(argv)

    try:
        if args.command == "config-reference":
            print(config_reference())
            return 0
        if args.command == "plan":
            return show_plan(args.config, args.overrides, args.address, args.gpu_memory_gib, args.model_shape)
        if args.command in ("slurm", "k8s"):
            return render_launcher(args)
        if args.command == "submit":
            from launch.deploy.submit import submit

            load_config(args.config, args.overrides)  # config mistakes fail here, not on the cluster
            status = submit(
                args.address,
                args.config,
                args.overrides,
                working_dir=args.working_dir,
                follow=not args.no_follow,
                timeout_s=args.timeout,
                includes=args.include,
                dry_run=args.dry_run,
            )
            return 0 if status in ("SUCCEEDED", "PENDING", "RUNNING", "DRY_RUN") else 1
        if args.command == "check-data":  # before any Ray or vLLM: it imports neither
            from launch.check_data import check_data

            return check_data(args.config, args.overrides, args.n)
        if args.command == "tiny-model":
            from actors.tiny_model import build_tiny_model

            print(build_tiny_model(args.dir, chat=args.chat))
            return 0
        if args.command == "scale":
            from launch.tools.scale import scale_fleet

            return scale_fleet(args.run_dir, args.actors)
        if args.command == "export":
            from launch.tools.export import export_model

            print(export_model(args.run_dir, args.out, args.step, say=lambda t: print(t, file=sys.stderr)))
            return 0
        if args.command == "example":
            if args.name == "tools":
                from launch.tools.example_tools import TOOLS_SFT_MAX_STEPS, run_tools_example

                return run_tools_example(args.overrides, args.sft_steps or TOOLS_SFT_MAX_STEPS)
            from launch.tools.example import MATH_SFT_MAX_STEPS, run_math_example

            return run_math_example(args.overrides, args.sft_steps or MATH_SFT_MAX_STEPS)
        if args.command == "eval":
            from launch.tools.evaluate import run_evaluation

            return run_evaluation(args.config, args.model, args.overrides)
        if args.command == "report":
            try:
                from observe.report import run_report
            except ImportError as exc:  # matplotlib is the report extra's, not the core install's
                raise ConfigError(
                    f"tandem report draws with matplotlib ({exc}): pip install 'tandem-rl[report]'"
                ) from None

            return run_report(args.run_dirs, args.out, args.trace)
        if args.command == "tune":
            from launch.tools.tune import Thresholds, run_tune

            limits = Thresholds(args.max_tis_truncated, args.max_mismatch_kl, args.max_dropped)
            return run_tune(
                args.config, args.overrides, args.steps, args.out, args.staleness, args.modes, limits, args.schedules
            )
        config = DEMO_CONFIG if args.command == "demo" else args.config
        resume = getattr(args, "resume", None)
        if config is None and resume is None:
            parser.error("train needs --config FILE.yaml (or --resume RUN_DIR)")
        if getattr(args, "allow_changes", False) and resume is None:
            parser.error("--allow-changes goes with --resume RUN_DIR (a new run has nothing to change)")
        address = [f"resources.address={args.address}"] if getattr(args, "address", None) else []
        if resume == "auto":  # a requeue runs the same command again: continue the run it started
            from launch.resume_auto import choose_for

            if config is None:
                raise ConfigError("--resume auto needs --config FILE.yaml: the run's name and output_dir come from it")
            choice = choose_for(config, args.overrides + address)
            print(f"tandem: {choice.line}", file=sys.stderr, flush=True)
            if choice.action == "complete":
                return 0
            resume = str(choice.run_dir) if choice.run_dir else None
        return run_training(
            config, args.overrides + address, resume, allow_changes=getattr(args, "allow_changes", False)
        )
    except (*user_errors(), LaunchError, SubmitError) as exc:  # the deploy commands' own, besides a run's
        print(f"tandem: error: {error_message(exc)}", file=sys.stderr)
        return 2
    except UnexpectedError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
