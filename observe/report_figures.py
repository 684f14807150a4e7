"""The figures of ``tandem report``, drawn with Matplotlib (``Figure`` objects, no pyplot state).

Each curve figure takes the runs to overlay (one colour per run, the legend names the run
directory) and returns ``None`` when no run recorded its series. ``timeline_figure`` draws one run.
"""

from __future__ import annotations

import zlib

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from observe.run_stats import RunData, series
from observe.timeline_stats import (
    WAIT_KINDS,
    Interval,
    actor_idle_per_step,
    clip,
    extent,
    lanes,
    merge_intervals,
    step_windows,
)

WIDTH = 11.0  # inches; the PNGs are saved at 100 dpi
TIS_KEYS = {
    "learner/tis_rho_mean": "rho mean",
    "learner/tis_rho_max": "rho max",
    "learner/tis_truncated_frac": "truncated fraction",
    "learner/tis_masked_frac": "masked fraction (mask, band)",
    "learner/tis_mismatch_kl": "mismatch KL",
    "learner/tis_ess": "ESS (normalised)",
    "learner/tis_batch_mean": "batch mean weight (raw)",
}
REJECT_PREFIX = "learner/reject_"  # learner/reject_<rule>_frac per rejection rule, and the totals
KIND_COLOURS = {
    "generate": "#2ca02c",
    "reward": "#98df8a",  # inside a generate span: the actor's wait for its groups' rewards
    "environment": "#e377c2",  # multi-turn episodes: resets and steps in the environment workers
    "load_weights": "#9467bd",
    "sleep": "#c5b0d5",  # colocated: an engine giving its memory back, and taking it back with new weights
    "wake": "#aec7e8",
    "wait_weights": "#d62728",
    "wait_prompts": "#7f7f7f",
    "score": "#17becf",
    "advantages": "#bcbd22",
    "train": "#1f77b4",
    "publish": "#ff7f0e",
    "wait_data": "#8c564b",
}


def colour(index: int) -> str:
    return colormaps["tab10"](index % 10)


def _figure(rows: int, cols: int, height: float, title: str) -> tuple[Figure, list]:
    fig = Figure(figsize=(WIDTH, height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    fig.suptitle(title, fontweight="bold")
    return fig, axes


def _has(runs: list[RunData], key: str) -> bool:
    return any(series(run.metrics, key)[0] for run in runs)


def _line(ax, index: int, run: RunData, steps: list, values: list) -> None:
    ax.plot(steps, values, color=colour(index), label=run.name, marker="." if len(steps) <= 40 else None)


def _axes_labels(ax, runs: list[RunData], title: str, ylabel: str) -> None:
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize="small")


def _moving_average(values: list[float], window: int) -> list[float]:
    """``out[j]`` = mean of ``values[j - window + 1 .. j]`` (fewer at the start)."""
    return [sum(values[max(0, j - window + 1) : j + 1]) / (j + 1 - max(0, j - window + 1)) for j in range(len(values))]


def _curves(ax, runs: list[RunData], key: str, title: str, ylabel: str, smooth: bool = False) -> None:
    """One line per run of a metrics key over steps; ``smooth`` draws the raw line faint under a
    moving average (a window of 5% of the steps) so the trend of a noisy series reads."""
    for i, run in enumerate(runs):
        steps, values = series(run.metrics, key)
        window = max(1, len(values) // 20)
        if smooth and window > 1:
            ax.plot(steps, values, color=colour(i), alpha=0.3, linewidth=0.8)
            values = _moving_average(values, window)
        if steps:
            _line(ax, i, run, steps, values)
    _axes_labels(ax, runs, title, ylabel)


def reward_figure(runs: list[RunData]) -> Figure:
    """Mean reward per step; beside it pass@k of the evaluation rounds when a run has any."""
    evals = [run for run in runs if run.evals]
    fig, axes = _figure(1, 2 if evals else 1, 4.0, "Reward")
    _curves(axes[0], runs, "reward_mean", "training reward (mean over the step's completions)", "reward", smooth=True)
    if evals:
        styles = ["-", "--", ":", "-."]
        for i, run in enumerate(runs):
            keys = {k for record in run.evals for k in record if k.startswith("eval/pass@")}
            keys = sorted(keys, key=lambda k: int(k.split("@")[1]))
            for j, key in enumerate(keys):
                steps, values = series(run.evals, key)
                label = f"{run.name} {key[5:]}" if len(runs) > 1 else key[5:]
                axes[1].plot(steps, values, styles[j % 4], color=colour(i), marker="o", label=label)
        _axes_labels(axes[1], runs, "evaluation on the held-out set", "pass@k")
        axes[1].legend(fontsize="small")  # the k's, also for one run
    return fig


def length_figure(runs: list[RunData]) -> Figure | None:
    """Mean completion length in tokens, and the share of completions cut at max_tokens."""
    if not _has(runs, "completion_len_mean"):
        return None
    fig, axes = _figure(1, 2, 3.6, "Response length")
    _curves(axes[0], runs, "completion_len_mean", "mean completion length", "tokens")
    _curves(axes[1], runs, "truncated_frac", "truncated at max_tokens", "fraction of completions")
    return fig


def staleness_figure(runs: list[RunData]) -> Figure | None:
    """Per step, the share of trained tokens sampled 0, 1, 2, ... policy versions behind: one panel per run."""
    hists = [[(m["step"], m.get("staleness_hist") or {}) for m in run.metrics] for run in runs]
    top = max((int(k) for hist in hists for _, h in hist for k in h), default=-1)
    if top < 0:
        return None
    fig, axes = _figure(len(runs), 1, 1.0 + 2.4 * len(runs), "Staleness of the trained tokens")
    cmap = colormaps["viridis"]
    for ax, run, hist in zip(axes, runs, hists):
        steps = [step for step, _ in hist]
        bottom = [0.0] * len(hist)
        for staleness in range(top + 1):
            share = [h.get(str(staleness), 0) / max(sum(h.values()), 1) for _, h in hist]
            ax.bar(steps, share, 1.0, bottom=bottom, color=cmap(staleness / max(top, 1)), label=str(staleness))
            bottom = [b + s for b, s in zip(bottom, share)]
        ax.set(title=run.name, xlabel="step", ylabel="share of tokens", ylim=(0, 1))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(title="versions behind", fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def tis_figure(runs: list[RunData]) -> Figure | None:
    """Importance sampling between the sampler's and the learner's log-probs, and what each rejection rule
    dropped (one panel per statistic)."""
    titles = {key: title for key, title in TIS_KEYS.items() if _has(runs, key)}
    rejected = sorted({k for run in runs for m in run.metrics for k in m if k.startswith(REJECT_PREFIX)})
    for key in rejected:  # reject_seq_mean_k3_frac -> "rejected: seq mean k3"
        titles[key] = "rejected: " + key.removeprefix(REJECT_PREFIX).removesuffix("_frac").replace("_", " ")
    if not titles:
        return None
    rows = -(-len(titles) // 3)
    fig, axes = _figure(rows, 3, 3.0 * rows, "Importance sampling and rejection (sampler vs learner)")
    for ax, (key, title) in zip(axes, titles.items()):
        _curves(ax, runs, key, title, title.split(" (")[0])
    for ax in axes[len(titles) :]:
        ax.set_visible(False)
    return fig


def drops_figure(runs: list[RunData]) -> Figure | None:
    """Groups dropped as too stale, and groups filtered (e.g. all rewards equal), per step."""
    if not (_has(runs, "dropped_stale") or _has(runs, "filtered_groups")):
        return None
    fig, axes = _figure(1, 2, 3.6, "Dropped and filtered groups")
    _curves(axes[0], runs, "dropped_stale", "dropped: older than run.max_staleness", "groups")
    _curves(axes[1], runs, "filtered_groups", "filtered by algorithm.filtering.groups", "groups")
    for ax in axes:  # counts: from 0, whole numbers, and a visible axis when every count is 0
        top = max(ax.get_ylim()[1], 1.0)
        ax.set_ylim(-0.04 * top, top)  # a line of zeros stays clear of the axis
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def idle_figure(runs: list[RunData]) -> Figure:
    """Learner idle (learner_wait_s / step_seconds) and actor idle (waits on the timeline) per step."""
    fig, axes = _figure(1, 2, 3.6, "Idle time")
    for i, run in enumerate(runs):
        timed = [m for m in run.metrics if m.get("step_seconds") and "learner_wait_s" in m]
        _line(axes[0], i, run, [m["step"] for m in timed], [m["learner_wait_s"] / m["step_seconds"] for m in timed])
        if run.spans:
            _line(axes[1], i, run, *actor_idle_per_step(run.spans))
    _axes_labels(axes[0], runs, "learner: waiting for a batch", "fraction of the step")
    _axes_labels(axes[1], runs, "actors: waiting for prompts or weights", "fraction of the step")
    untimed = [run.name for run in runs if not run.spans]
    if untimed:
        note = "no timeline.jsonl: " + ", ".join(untimed)
        axes[1].text(0.5, 0.5, note, ha="center", va="center", transform=axes[1].transAxes, color="#8a5a00")
    for ax in axes:
        ax.set_ylim(0, 1.02)
    return fig


def throughput_figure(runs: list[RunData]) -> Figure | None:
    """Tokens (prompt + completion) per second of step."""
    if not _has(runs, "tokens_per_s"):
        return None
    fig, axes = _figure(1, 1, 3.6, "Throughput")
    _curves(axes[0], runs, "tokens_per_s", "tokens per second", "tokens/s")
    return fig


def zoom_window(spans: list[dict], steps: int = 5) -> Interval | None:
    """About ``steps`` step windows in the middle of the run, the first (warm-up) step left out;
    ``None`` (the whole run) when there are no more steps than that."""
    windows = sorted(step_windows(spans).values())
    if len(windows) <= steps:
        return None
    middle = windows[1:]
    first = max(0, (len(middle) - steps) // 2)
    return middle[first][0], middle[first + steps - 1][1]


def timeline_figure(run: RunData, window: Interval | None = None) -> Figure | None:
    """One lane per process, a bar per span coloured by kind (spans of a kind merged first); wait
    kinds are thin bars drawn on top, so a wait during generation shows. ``window`` zooms, marking steps."""
    if not run.spans:
        return None
    process_lanes = lanes(run.spans)
    t0 = extent(run.spans)[0]
    view = window or extent(run.spans)
    title = f"Timeline of {run.name}" + (" (zoom on the middle steps)" if window else " (whole run)")
    fig, axes = _figure(1, 1, 1.4 + 0.45 * len(process_lanes), title)
    ax, kinds = axes[0], []
    for y, lane in enumerate(process_lanes.values()):
        lane_kinds = sorted({s["kind"] for s in lane}, key=_kind_order)
        for kind in lane_kinds:
            bars = clip(merge_intervals(s for s in lane if s["kind"] == kind), view)
            height = 0.3 if kind in WAIT_KINDS else 0.8
            ax.broken_barh([(s - t0, e - s) for s, e in bars], (y - height / 2, height), color=_kind_colour(kind))
            kinds += [kind] if kind not in kinds else []
    if window:
        for step, (start, _) in sorted(step_windows(run.spans).items()):
            if view[0] <= start < view[1] - 0.02 * (view[1] - view[0]):  # no label hanging off the right edge
                ax.axvline(start - t0, color="black", linewidth=0.6, linestyle="--", alpha=0.6)
                ax.text(start - t0, -0.6, f" step {step}", fontsize="small", va="bottom")
    ax.set(
        xlim=(view[0] - t0, view[1] - t0), ylim=(len(process_lanes) - 0.4, -0.8), xlabel="seconds from the first span"
    )
    ax.set_yticks(range(len(process_lanes)), list(process_lanes))
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=_kind_colour(k)) for k in kinds]
    fig.legend(handles, kinds, loc="outside lower center", ncols=min(len(kinds), 9), fontsize="small")
    return fig


def _kind_order(kind: str) -> tuple[bool, int, str]:
    """Waits last (drawn on top), then the order of ``KIND_COLOURS``, a kind added later by name."""
    known = list(KIND_COLOURS)
    return kind in WAIT_KINDS, known.index(kind) if kind in known else len(known), kind


def _kind_colour(kind: str) -> str:
    return KIND_COLOURS.get(kind) or colormaps["Set3"](zlib.crc32(kind.encode()) % 12)  # a kind added later
