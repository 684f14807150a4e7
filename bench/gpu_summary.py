"""The GPU smoke test's numbers, read back from its run directories (``bench/gpu_smoke.sh``).

Per run: the weight push (learner rank 0's ``publish`` spans: export + send, and on the
distributed channel until every actor has acknowledged; the actor's ``load_weights`` spans),
generation tokens/s and learner tokens/s, from ``timeline.jsonl`` and ``metrics.jsonl`` read with
``observe.run_stats.load_run``; plus ``run_summary``'s end-to-end figures.

- **push s**: median of the publish spans after the first (the first distributed push also waits
  for the group to form); **GB/s** = the model's safetensors bytes / push s.
- **gen tok/s**: completion tokens sampled at policy version ``v`` over the actors' ``generate``
  time at ``v`` (the union of each actor's spans, summed over actors), for versions 1 .. N-1-k:
  version 0 is the engines' warm-up, later versions may have generated groups no step trained.
  A token trained at step ``s`` with staleness ``d`` was sampled at version ``s - d``. The in-flight
  actor's spans mix versions, so there it is over the whole run (``gen basis: run``).
- **learner tok/s**: completion tokens trained in steps 1..N-1 over learner rank 0's score,
  advantages and train time in those steps (a step's spans carry the version it produced, step + 1).
- **e2e tok/s**: ``run_summary``'s trained_tokens_per_s: trained tokens over the steps' wall time.

    python bench/gpu_summary.py RUNS.tsv [--model DIR] [--out SUMMARY.json]

``RUNS.tsv`` has one line per run: label, exit code, wall seconds, output directory (holding one
run directory), log file; a run that failed is a row with its error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GEN_KIND, LOAD_KIND, PUBLISH_KIND = "generate", "load_weights", "publish"
LEARNER_WORK = ("score", "advantages", "train")
SKIPPED = -1  # the exit code a manifest gives a run the time budget left out


def _union_s(spans: Iterable[dict[str, Any]]) -> float:
    from observe.timeline_stats import total

    return total((s["start"], s["end"]) for s in spans)


def _actor_lanes(spans: list[dict[str, Any]], kind: str) -> list[list[dict[str, Any]]]:
    """Each actor's spans of ``kind``, in time order."""
    from observe.timeline_stats import lanes

    by_actor = lanes([s for s in spans if s["process"].startswith("actor") and s["kind"] == kind])
    return [sorted(lane, key=lambda s: s["start"]) for lane in by_actor.values()]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def push_times(spans: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median and max of learner rank 0's publish spans after the first; median of the actors' loads after
    their first (all of them when there is one)."""
    publish = sorted((s for s in spans if s["process"] == "learner-0" and s["kind"] == PUBLISH_KIND),
                     key=lambda s: s["start"])  # fmt: skip
    pushes = [s["end"] - s["start"] for s in publish[1:]] or [s["end"] - s["start"] for s in publish]
    loads = [  # an actor loads only the newest version
        s["end"] - s["start"] for lane in _actor_lanes(spans, LOAD_KIND) for s in (lane[1:] or lane)
    ]
    return {
        "push_s": _median(pushes),
        "push_max_s": max(pushes) if pushes else None,
        "first_push_s": publish[0]["end"] - publish[0]["start"] if publish else None,
        "load_s": _median(loads),
        "pushes": len(publish),
    }


def tokens_by_version(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """Completion tokens trained, by the policy version that sampled them (step - staleness)."""
    out: dict[int, float] = {}
    for m in metrics:
        for staleness, count in (m.get("staleness_hist") or {}).items():
            version = int(m["step"]) - int(staleness)
            out[version] = out.get(version, 0.0) + count
    return out


def generation_rate(metrics: list[dict[str, Any]], spans: list[dict[str, Any]], k: int,
                    inflight: bool) -> tuple[float | None, str]:  # fmt: skip
    """(completion tokens per actor generate-second, basis): ``versions a..b`` or ``run``."""
    gen = _actor_lanes(spans, GEN_KIND)
    by_version = tokens_by_version(metrics)
    versions = list(range(1, len(metrics) - k))  # 1 .. N-1-k
    if not inflight and versions:
        tokens = sum(by_version.get(v, 0.0) for v in versions)
        seconds = sum(_union_s(s for s in lane if s.get("version") in versions) for lane in gen)
        if tokens and seconds > 0:
            return tokens / seconds, f"versions {versions[0]}..{versions[-1]}"
    tokens = sum(by_version.values())
    seconds = sum(_union_s(lane) for lane in gen)
    return (tokens / seconds if tokens and seconds > 0 else None), "run"


def learner_rate(metrics: list[dict[str, Any]], spans: list[dict[str, Any]]) -> float | None:
    """Completion tokens trained per second of learner rank 0's work, steps 1..N-1 (all steps if only one)."""
    steps = metrics[1:] or metrics
    produced = {int(m["step"]) + 1 for m in steps}
    work = [s for s in spans if s["process"] == "learner-0" and s["kind"] in LEARNER_WORK]
    seconds = _union_s(s for s in work if s.get("version") in produced)
    tokens = sum(float(m.get("learner/tokens") or sum((m.get("staleness_hist") or {}).values())) for m in steps)
    return tokens / seconds if tokens and seconds > 0 else None


def model_bytes(model_dir: str | None) -> int | None:
    if not model_dir or not Path(model_dir).is_dir():
        return None
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) or None


def summarise_run(run_dir: Path, nbytes: int | None = None) -> dict[str, Any]:
    """One run's numbers (see the module docstring)."""
    from observe.run_stats import load_run, run_summary

    run = load_run(run_dir)
    cfg = run.config
    k = int((cfg.get("run") or {}).get("max_staleness") or 0)
    inflight = (cfg.get("rollout") or {}).get("weight_update") == "inflight"
    weights = cfg.get("weights") or {}
    push = push_times(run.spans)
    gen, basis = generation_rate(run.metrics, run.spans, k, inflight)
    e2e = run_summary(run)
    return {
        "backend": weights.get("backend"),
        "process_group": weights.get("process_group") if weights.get("backend") == "distributed" else None,
        "weight_update": e2e["weight_update"],
        "steps": e2e["steps"],
        "status": e2e["status"],
        **push,
        "push_gb_s": nbytes / push["push_s"] / 1e9 if nbytes and push["push_s"] else None,
        "gen_tokens_per_s": gen,
        "gen_basis": basis,
        "learner_tokens_per_s": learner_rate(run.metrics, run.spans),
        "e2e_trained_tokens_per_s": e2e["trained_tokens_per_s"],
        "tokens_per_s": e2e["tokens_per_s"],
        "mean_step_s": e2e["mean_step_s"],
        "startup_s": e2e["startup_s"],
        "learner_idle": e2e["learner_idle"],
        "actor_idle": e2e["actor_idle"],
        "completion_len_mean": statistics.mean(m.get("completion_len_mean", 0.0) for m in run.metrics),
        "run_dir": str(run.path),
    }


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """The runs the smoke test started: label, rc (-1: skipped), wall_s, out_dir, log (tab-separated;
    relative paths are from the manifest's folder, so the results folder can be read anywhere)."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            label, rc, wall, out_dir, log = (line.split("\t") + [""] * 5)[:5]
            out, log_path = (str(path.parent / p) if p else "" for p in (out_dir, log))
            rows.append({"label": label, "rc": int(rc), "wall_s": float(wall), "out_dir": out, "log": log_path})
    return rows


def _last_line(log: str) -> str:
    """The log's last line that says something (an error names its fix there)."""
    p = Path(log)
    lines = [ln.strip() for ln in p.read_text(errors="replace").splitlines() if ln.strip()] if p.is_file() else []
    return lines[-1][:300] if lines else "(no output)"


def summarise(manifest: Path, model_dir: str | None = None) -> list[dict[str, Any]]:
    """Every run of the manifest, summarised; a run without a readable run directory gets its error."""
    nbytes = model_bytes(model_dir)
    results = []
    for row in read_manifest(manifest):
        if row["rc"] == SKIPPED:
            results.append({**row, "status": "skipped", "error": "its timeout would pass BUDGET_S"})
            continue
        dirs = sorted(p.parent for p in Path(row["out_dir"]).glob("*/metrics.jsonl"))
        entry: dict[str, Any] = dict(row)
        try:
            if not dirs:
                raise FileNotFoundError("no run directory with metrics.jsonl")
            entry.update(summarise_run(dirs[-1], nbytes))
        except Exception as exc:
            entry.update(status=entry.get("status") or "failed", error=f"{type(exc).__name__}: {exc}")
        if row["rc"] != 0:
            entry["status"] = f"failed (exit {row['rc']})"
            entry["error"] = _last_line(row["log"])
        results.append(entry)
    return results


def _fmt(value: Any, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = [  # header, key, format
    ("run", "label", "s"),
    ("status", "status", "s"),
    ("steps", "steps", "d"),
    ("push s", "push_s", ".3f"),
    ("push GB/s", "push_gb_s", ".2f"),
    ("load s", "load_s", ".3f"),
    ("gen tok/s", "gen_tokens_per_s", ",.0f"),
    ("learner tok/s", "learner_tokens_per_s", ",.0f"),
    ("e2e tok/s", "e2e_trained_tokens_per_s", ",.0f"),
    ("step s", "mean_step_s", ".2f"),
    ("startup s", "startup_s", ".1f"),
    ("wall s", "wall_s", ".0f"),
]


def table(results: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per run."""
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in results:
        lines.append("| " + " | ".join(_fmt(r.get(key), spec) for _, key, spec in COLUMNS) + " |")
    return "\n".join(lines)


def result_line(r: dict[str, Any]) -> str:
    """One line per run, for grep: ``RESULT <label>: ...``."""
    if "error" in r:
        return f"RESULT {r['label']}: {r.get('status', 'failed')}: {r['error']}"
    return (
        f"RESULT {r['label']}: weight push {_fmt(r['push_s'], '.3f')} s ({_fmt(r['push_gb_s'], '.2f')} GB/s, first "
        f"{_fmt(r['first_push_s'], '.2f')} s, actor load {_fmt(r['load_s'], '.3f')} s) | generation "
        f"{_fmt(r['gen_tokens_per_s'])} tok/s ({r['gen_basis']}) | learner {_fmt(r['learner_tokens_per_s'])} tok/s "
        f"| end to end {_fmt(r['e2e_trained_tokens_per_s'])} trained tok/s | {r['steps']} steps, {r['status']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path, help="runs.tsv written by bench/gpu_smoke.sh")
    parser.add_argument("--model", help="the model directory (for GB/s of the push)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--extra", default="{}", help="JSON object merged into the output (machine, versions)")
    args = parser.parse_args(argv)
    try:
        extra = json.loads(args.extra)
    except json.JSONDecodeError:
        extra = {"extra": args.extra}
    results = summarise(args.manifest, args.model)
    print(table(results))
    for r in results:
        print(result_line(r))
    if args.out:
        args.out.write_text(json.dumps({**extra, "runs": results}, indent=2) + "\n")
        print(f"summary: {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: launch/
    sys.exit(main())
