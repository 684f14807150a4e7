"""``tandem report RUN_DIR [RUN_DIR ...]``: one self-contained HTML page of a run's curves,
staleness, importance sampling, idle time and timeline, several runs overlaid.

The page embeds every figure as a base64 PNG and its CSS inline, so it opens offline from a file;
the PNGs are also written beside it, and with ``--trace`` the timeline as a Chrome trace
(``observe/trace.py``). The numbers come from ``observe/run_stats.py``; the figures from
``observe/report_figures.py``.
"""

from __future__ import annotations

import base64
import html
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from observe import report_figures as figures
from observe.run_stats import RunData, load_run, read_jsonl, run_summary
from observe.trace import write_traces

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.55em; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; white-space: nowrap; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
p.what { color: #444; margin: 0.3em 0; } p.note { color: #8a5a00; font-style: italic; }
table.episode td { text-align: left; } table.episode pre { margin: 0; white-space: pre-wrap; }
tr.environment td { background: #f6f0f8; color: #555; } h3 { font-size: 1em; margin-bottom: 0.3em; }
"""


@dataclass
class Section:
    """One figure of the report: the PNG's name, the heading and a line saying what it shows (both
    may be empty: a figure that continues the one above)."""

    name: str
    heading: str
    text: str
    figure: Figure | None = None
    note: str = ""  # why the figure is missing, or what a run lacks
    body: str = ""  # HTML shown under the text (the episodes' turns)


# (png name, heading, what it shows, the figure; None leaves it out with the note)
CURVES: list[tuple[str, str, str, Callable[[list[RunData]], Figure | None], str]] = [
    ("reward", "Reward", "Mean reward of each step's completions (faint: raw, solid: moving average); beside it "
     "pass@k on the held-out set at each evaluation round.", figures.reward_figure, ""),
    ("length", "Response length", "Mean completion length in tokens, and the share of completions cut at "
     "rollout.max_tokens.", figures.length_figure, "no completion lengths in metrics.jsonl"),
    ("staleness", "Staleness", "Per step, the share of trained tokens sampled by a policy 0, 1, 2, ... versions "
     "behind the one being trained (bounded by run.max_staleness).", figures.staleness_figure,
     "no staleness_hist in metrics.jsonl"),
    ("tis", "Truncated importance sampling", "The sampler-vs-learner importance ratio rho (mean, max), the share "
     "of tokens whose rho was truncated, the mismatch KL and the effective sample size.", figures.tis_figure,
     "no TIS statistics (algorithm.tis.mode: none)"),
    ("drops", "Dropped and filtered groups", "Groups dropped for being older than run.max_staleness, and groups "
     "filtered out (algorithm.filtering.groups), per step.", figures.drops_figure, "no dropped/filtered counts"),
    ("idle", "Idle time", "Learner: learner_wait_s / step_seconds, the share of a step spent waiting for a batch. "
     "Actors: the share of each step window spent in wait_prompts or wait_weights while nothing generates "
     "(from the timeline).", figures.idle_figure, ""),
    ("throughput", "Throughput", "Prompt + completion tokens per second of step (the table's trained tokens/s, "
     "what `tandem tune` compares, counts the completion tokens the loss trains on).", figures.throughput_figure,
     "no tokens_per_s in metrics.jsonl"),
]  # fmt: skip
TIMELINE_TEXT = (
    "One lane per process: the driver, each learner rank, each actor; bars coloured by what the process was "
    "doing (spans of a kind merged where they overlap; waits are the thin bars). Generation overlapping training "
    "is the asynchrony at work (run.schedule: overlapped); in the colocated schedule the actors' and the learner's "
    "bars alternate instead, one phase of max_staleness + 1 steps at a time. The zoom shows about five steps from "
    "the middle of the run, dashed lines at step starts."
)


def curve_sections(runs: list[RunData]) -> list[Section]:
    sections = []
    for name, heading, text, draw, missing in CURVES:
        figure = draw(runs)
        sections.append(Section(name, heading, text, figure, "" if figure else missing))
    if not all(run.spans for run in runs):
        idle = next(s for s in sections if s.name == "idle")
        idle.note = "; ".join(_no_timeline(run) for run in runs if not run.spans)
    return sections


def _no_timeline(run: RunData) -> str:
    return f"{run.name}: no timeline.jsonl (run.timeline: false, or an older run), so no actor idle time or timeline"


def timeline_sections(runs: list[RunData]) -> list[Section]:
    """The whole run and the zoom, per run (``timeline.png``, ``timeline-zoom.png``; ``-2``, ... for later runs)."""
    sections = []
    for i, run in enumerate(runs):
        suffix = f"-{i + 1}" if i else ""
        heading = "Timeline" + (f": {run.name}" if len(runs) > 1 else "")
        text = "" if i else TIMELINE_TEXT
        if not run.spans:
            sections.append(Section(f"timeline{suffix}", heading, text, None, _no_timeline(run)))
            continue
        sections.append(Section(f"timeline{suffix}", heading, text, figures.timeline_figure(run)))
        window = figures.zoom_window(run.spans)
        if window is not None:
            sections.append(Section(f"timeline-zoom{suffix}", "", "", figures.timeline_figure(run, window)))
    return sections


EPISODES_SHOWN = 3  # episodes of the last step that wrote samples, per run
EPISODES_TEXT = (
    "Multi-turn episodes of the last step that wrote samples (samples.jsonl), turn by turn: the model's turns "
    "(trained) and the environment's (masked out of the loss), each model turn with the environment's reward for it."
)


def episode_sections(runs: list[RunData]) -> list[Section]:
    """The last step's sample episodes of each run that has any (``samples.jsonl`` records with ``turns``)."""
    sections = []
    for run in runs:
        records = [r for r in read_jsonl(run.path / "samples.jsonl") if r.get("turns")]
        if not records:
            continue
        last = [r for r in records if r["step"] == records[-1]["step"]][:EPISODES_SHOWN]
        rows = []
        for record in last:
            head = f"step {record['step']}, prompt {record['prompt_id']}: reward {record['reward']:.3f}"
            head += f", ended: {record['end']}"
            rows.append(f"<h3>{html.escape(head)}</h3><table class='episode'>")
            for turn in record["turns"]:
                reward = f" (reward {turn['reward']:g})" if turn["role"] == "model" else ""
                rows.append(
                    f"<tr class='{turn['role']}'><th>{html.escape(turn['role'] + reward)}</th>"
                    f"<td><pre>{html.escape(turn['text'][:2000])}</pre></td></tr>"
                )
            rows.append("</table>")
        heading = "Episodes" + (f": {run.name}" if len(runs) > 1 else "")
        sections.append(Section(f"episodes-{run.name}", heading, EPISODES_TEXT, body="\n".join(rows)))
    return sections


def png_bytes(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, metadata={"Software": None})  # no URL in the file
    return buffer.getvalue()


def _cell(value, kind: str = "") -> str:
    if value is None:
        return "&ndash;"
    if kind == "%":
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return html.escape(str(value))


def summary_table(runs: list[RunData]) -> str:
    """One row per run: its setting and its numbers (``run_summary``)."""
    columns = [
        ("run", "name", ""), ("status", "status", ""), ("steps", "steps", ""), ("method", "method", ""),
        ("schedule", "schedule", ""), ("max staleness", "max_staleness", ""), ("weight update", "weight_update", ""),
        ("actors / learner ranks", "split", ""), ("start-up s", "startup_s", ""), ("mean step s", "mean_step_s", ""),
        ("tokens/s (all)", "tokens_per_s", ""), ("trained tokens/s", "trained_tokens_per_s", ""),
        ("learner idle", "learner_idle", "%"), ("actor idle", "actor_idle", "%"),
        ("final reward", "reward_final", ""), ("final pass@1", "eval_pass1_final", ""),
    ]  # fmt: skip
    rows = []
    for run in runs:
        summary = run_summary(run)
        summary["split"] = f"{_cell(summary['actors'])} / {_cell(summary['learner_ranks'])}"
        rows.append("<tr>" + "".join(f"<td>{_cell(summary[key], kind)}</td>" for _, key, kind in columns) + "</tr>")
    head = "<tr>" + "".join(f"<th>{html.escape(title)}</th>" for title, _, _ in columns) + "</tr>"
    legend = (
        "<p class='what'>Steady-state numbers: the steps after the first (which includes the engines' warm-up). "
        "Final reward: mean over the last 10% of steps. Actor idle: from the timeline.</p>"
    )
    return f"<table>{head}{''.join(rows)}</table>{legend}"


def render_html(runs: list[RunData], sections: list[Section], images: dict[str, bytes]) -> str:
    """The page: the run table, then each section's heading, text, embedded PNG and note."""
    title = "Tandem run report: " + ", ".join(run.name for run in runs)
    parts = [
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1><h2>Runs</h2>{summary_table(runs)}",
    ]
    for section in sections:
        if section.heading:
            parts.append(f"<h2>{html.escape(section.heading)}</h2>")
        if section.text:
            parts.append(f"<p class='what'>{html.escape(section.text)}</p>")
        if section.name in images:
            data = base64.b64encode(images[section.name]).decode()
            alt = html.escape(f"{section.heading or 'zoom'} ({section.name}.png)")
            parts.append(f"<img src='data:image/png;base64,{data}' alt='{alt}' id='{section.name}'>")
        if section.body:
            parts.append(section.body)
        if section.note:
            parts.append(f"<p class='note'>{html.escape(section.note)}</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def run_report(run_dirs: list[str], out: str | None, trace: bool) -> int:
    """Write ``report.html`` and one PNG per figure into ``out`` (default ``<first RUN_DIR>/report``),
    and ``trace.json`` with ``trace``; print the paths. Returns the exit code."""
    runs = [load_run(path) for path in run_dirs]  # ConfigError names a directory that is not a run
    out_dir = Path(out) if out else runs[0].path / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = curve_sections(runs) + timeline_sections(runs) + episode_sections(runs)
    images = {s.name: png_bytes(s.figure) for s in sections if s.figure is not None}
    written = []
    for name, data in images.items():
        (out_dir / f"{name}.png").write_bytes(data)
        written.append(out_dir / f"{name}.png")
    page = out_dir / "report.html"
    page.write_text(render_html(runs, sections, images))
    written.insert(0, page)
    if trace:
        timed = [(run.name, run.spans) for run in runs if run.spans]
        if not timed:
            print(
                "tandem: no timeline.jsonl in any run, so no trace.json (run.timeline: true records one)",
                file=sys.stderr,
            )
        else:
            written.append(write_traces(timed, out_dir / "trace.json"))
    for path in written:
        print(path)
    return 0
