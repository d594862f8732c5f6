"""The report's figures, drawn with matplotlib's object API (no pyplot: no global state,
no display, PNG through the Agg canvas).

Each ``*_figure`` function returns a :class:`~matplotlib.figure.Figure`, or ``None``
when the records it needs are absent (the report then says why in one line).
"""

from __future__ import annotations

import warnings
from typing import Any

from matplotlib.figure import Figure

from skylift.monitor.attempts import Attempt, elapsed_unit, usd
from skylift.monitor.schema import BREAKDOWN_PHASES

__all__ = [
    "TimeAxis",
    "breakdown_figure",
    "cost_figure",
    "loss_figure",
    "throughput_figure",
    "timeline_figure",
    "utilization_figure",
]

WIDTH_IN, HEIGHT_IN = 11.0, 3.8
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
PREEMPTED_COLOR = "#d62728"
MEMBERSHIP_COLOR = "#9467bd"
"""An elastic job's node count changing (the timeline's diamonds)."""
MAX_GPU_LINES = 8
"""Above this many GPUs, plot the mean with a min-max band instead of one line each."""


class TimeAxis:
    """Seconds since the folder's first record, shown in s, min or h by the span."""

    def __init__(self, attempts: list[Attempt]) -> None:
        times = [r["time"] for a in attempts for r in a.records if isinstance(r.get("time"), (int, float))]
        self.origin_s = min(times, default=0.0)
        self.unit, self.seconds_per_unit = elapsed_unit(max(times, default=0.0) - self.origin_s)

    def __call__(self, time_s: float) -> float:
        return (time_s - self.origin_s) / self.seconds_per_unit

    @property
    def label(self) -> str:
        return f"time since the run folder's first record ({self.unit})"


# Fixed margins, as fractions of the figure, where constrained layout put the axes on the
# report's figures (measured on a real run's and the synthetic GPU run's): a constrained
# layout measures every tick label twice per PNG, about half of the report's drawing time.
_MARGINS = {"left": 0.065, "right": 0.99, "bottom": 0.125, "top": 0.925}
_PANEL_GAP = 0.075
"""Between two panels: the right one's tick labels and y label (7 digits at 10 pt)."""
_LABELLED_PANEL_GAP = 0.14
"""Before a panel with named horizontal bars (the step phases, up to ``forward_backward``)."""
_LEGEND_RIGHT = 0.83
"""The timeline's right edge: its legend sits outside, beside the axes."""


def _figure(panels: int = 2, gap: float = _PANEL_GAP) -> tuple[Figure, list[Any]]:
    figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=100)
    width = (_MARGINS["right"] - _MARGINS["left"] - gap * (panels - 1)) / panels
    figure.subplots_adjust(**_MARGINS, wspace=gap / width)
    axes = [figure.add_subplot(1, panels, i + 1) for i in range(panels)]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return figure, axes


def _empty(ax: Any, title: str, reason: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, reason, ha="center", va="center", wrap=True, transform=ax.transAxes, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


def _color(attempt: Attempt) -> str:
    return COLORS[(attempt.number - 1) % len(COLORS)]


def _multi(attempts: list[Attempt]) -> bool:
    return len(attempts) > 1


def loss_figure(attempts: list[Attempt]) -> Figure | None:
    evals = [r for a in attempts for r in a.of_kind("eval")]
    if not any(a.train for a in attempts) and not evals:
        return None
    figure, (loss_ax, eval_ax) = _figure()
    for attempt in attempts:
        train = [r for r in attempt.train if "loss" in r]
        label = f"train loss, attempt {attempt.number}" if _multi(attempts) else "train loss"
        loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], color=_color(attempt), lw=1.2, label=label)
    val = [r for r in evals if "loss" in r]
    if val:
        loss_ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", color="black", ms=4, lw=1,
                     label="validation loss")
    loss_ax.set(title="Loss", xlabel="optimizer step", ylabel="loss (mean over the global batch)")
    loss_ax.legend(fontsize=8)
    metrics = sorted({k for r in evals for k, v in r.items() if k not in ("kind", "step", "epoch", "time", "loss")
                      and isinstance(v, (int, float))})
    if not metrics:
        _empty(eval_ax, "Validation", "no validation metrics besides loss")
        return figure
    for index, name in enumerate(metrics):
        points = [(r["step"], r[name]) for r in evals if name in r]
        percent = name == "accuracy" and all(0 <= v <= 1 for _, v in points)
        eval_ax.plot([s for s, _ in points], [100 * v if percent else v for _, v in points], "o-",
                     color=COLORS[index % len(COLORS)], ms=4, label=f"{name} (%)" if percent else name)
    eval_ax.set(title="Validation", xlabel="optimizer step", ylabel="value (accuracy in %)")
    eval_ax.legend(fontsize=8)
    return figure


def throughput_figure(attempts: list[Attempt]) -> Figure | None:
    if not any(a.train for a in attempts):
        return None
    figure, (rate_ax, mfu_ax) = _figure()
    for attempt in attempts:
        train = attempt.train
        label = f"attempt {attempt.number}" if _multi(attempts) else "samples/s"
        rate_ax.plot([r["step"] for r in train], [r.get("samples_per_s", 0) for r in train], color=_color(attempt),
                     lw=1.2, label=label)
    rate_ax.set(title="Throughput", xlabel="optimizer step", ylabel="samples/s (all processes)")
    rate_ax.set_ylim(bottom=0)
    if _multi(attempts):
        rate_ax.legend(fontsize=8)
    if not any(r.get("mfu") is not None for a in attempts for r in a.train):
        _empty(mfu_ax, "Model FLOPs utilisation",
               "no MFU in the train records\n(the peak FLOP/s or model FLOPs is unknown)")
        return figure
    for attempt in attempts:
        points = [(r["step"], 100 * r["mfu"]) for r in attempt.train if r.get("mfu") is not None]
        mfu_ax.plot([s for s, _ in points], [m for _, m in points], color=_color(attempt), lw=1.2)
    mfu_ax.set(title="Model FLOPs utilisation", xlabel="optimizer step", ylabel="MFU (% of peak FLOP/s)")
    mfu_ax.set_ylim(bottom=0)
    return figure


def utilization_figure(attempts: list[Attempt], axis: TimeAxis) -> Figure | None:
    if not any("host" in r for a in attempts for r in a.of_kind("system")):
        return None
    figure, (util_ax, memory_ax) = _figure()
    nodes = sorted({r.get("node_rank", 0) for a in attempts for r in a.of_kind("system")})
    for node in nodes:
        rows = _with_gaps([[r for r in a.of_kind("system") if "host" in r and r.get("node_rank", 0) == node]
                           for a in attempts])
        x = [axis(r["time"]) for r in rows]
        name = f"node {node} " if len(nodes) > 1 else ""
        nan = float("nan")
        util_ax.plot(x, [r["host"].get("cpu_percent", nan) for r in rows], color="black", lw=1.2, label=f"{name}CPU")
        memory_ax.plot(x, [r["host"].get("memory_used_gib", nan) for r in rows], color="black", lw=1.2,
                       label=f"{name}host RAM")
        memory_ax.axhline(rows[-1]["host"]["memory_total_gib"], color="black", ls=":", lw=1)
        _gpu_lines(util_ax, memory_ax, rows, x, name)
    util_ax.set(title="Utilisation", xlabel=axis.label, ylabel="utilisation (%)", ylim=(0, 105))
    memory_ax.set(title="Memory (dotted: capacity)", xlabel=axis.label, ylabel="memory used (GiB)")
    memory_ax.set_ylim(bottom=0)
    util_ax.legend(fontsize=8)
    memory_ax.legend(fontsize=8)
    return figure


def _with_gaps(groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The groups' rows, with a NaN row between attempts so lines break over the downtime."""
    rows: list[dict[str, Any]] = []
    for group in (g for g in groups if g):
        if rows:
            rows.append({"time": float("nan"), "host": {}, "gpus": []})
        rows.extend(group)
    return rows


def _gpu_lines(util_ax: Any, memory_ax: Any, rows: list[dict[str, Any]], x: list[float], node: str) -> None:
    import numpy as np

    indices = sorted({g["index"] for r in rows for g in r.get("gpus", [])})
    if not indices:
        return

    def series(index: int, key: str) -> list[float]:
        values = []
        for r in rows:
            gpu = next((g for g in r.get("gpus", []) if g["index"] == index), None)
            values.append(float("nan") if gpu is None or gpu.get(key) is None else gpu[key])
        return values

    if len(indices) <= MAX_GPU_LINES:
        for n, index in enumerate(indices):
            color = COLORS[n % len(COLORS)]
            util_ax.plot(x, series(index, "utilization_percent"), color=color, lw=1, label=f"{node}GPU {index}")
            memory_ax.plot(x, series(index, "memory_used_gib"), color=color, lw=1, label=f"{node}GPU {index}")
    else:
        for ax, key in ((util_ax, "utilization_percent"), (memory_ax, "memory_used_gib")):
            values = np.array([series(index, key) for index in indices], dtype=float)
            with warnings.catch_warnings():  # the gap rows between attempts are all NaN by design
                warnings.simplefilter("ignore", RuntimeWarning)
                mean, low, high = np.nanmean(values, axis=0), np.nanmin(values, axis=0), np.nanmax(values, axis=0)
            ax.plot(x, mean, color=COLORS[0], lw=1.2, label=f"{node}GPU mean of {len(indices)}")
            ax.fill_between(x, low, high, color=COLORS[0], alpha=0.2)
    capacity = np.array([series(index, "memory_total_gib") for index in indices], dtype=float)
    if not np.isnan(capacity).all():
        memory_ax.axhline(np.nanmax(capacity), color=COLORS[0], ls=":", lw=1)


def breakdown_phases(train: list[dict[str, Any]]) -> tuple[list[int], dict[str, list[float]], bool]:
    """Steps and seconds per phase: from ``breakdown_s`` where sampled, else derived.

    Returns (steps, phase -> seconds, measured). Without ``breakdown_s`` the only split
    the train records allow is data wait against the rest of the step.
    """
    by_step = {r["step"]: r for r in train}  # a resumed run rewrites the steps it redoes: keep the last
    sampled = [by_step[s] for s in sorted(by_step) if by_step[s].get("breakdown_s")]
    if sampled:
        names = [p for p in BREAKDOWN_PHASES if any(p in r["breakdown_s"] for r in sampled)]
        names += sorted({p for r in sampled for p in r["breakdown_s"]} - set(names))
        return [r["step"] for r in sampled], {p: [r["breakdown_s"].get(p, 0.0) for r in sampled] for p in names}, True
    rows = [by_step[s] for s in sorted(by_step) if "step_time_s" in by_step[s]]
    waits = [r.get("data_wait_s", 0.0) for r in rows]
    rest = [max(0.0, r["step_time_s"] - w) for r, w in zip(rows, waits, strict=True)]
    return [r["step"] for r in rows], {"data_wait": waits, "rest of step": rest}, False


def breakdown_figure(attempts: list[Attempt]) -> Figure | None:
    steps, phases, measured = breakdown_phases([r for a in attempts for r in a.train])
    if not steps:
        return None
    figure, (stack_ax, share_ax) = _figure(gap=_LABELLED_PANEL_GAP)
    colors = [COLORS[i % len(COLORS)] for i in range(len(phases))]
    milliseconds = [[1000 * v for v in values] for values in phases.values()]
    if len(steps) >= 3:
        stack_ax.stackplot(steps, milliseconds, labels=list(phases), colors=colors, alpha=0.85)
    else:
        bottom = [0.0] * len(steps)
        for name, values, color in zip(phases, milliseconds, colors, strict=True):
            stack_ax.bar(steps, values, bottom=bottom, label=name, color=color)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    source = "sampled breakdown_s" if measured else "step_time_s and data_wait_s (host time)"
    # No legend here: the share panel beside it names the phases in the same colours.
    stack_ax.set(title=f"Step time by phase ({source})", xlabel="optimizer step", ylabel="ms per step")
    totals = {name: sum(values) for name, values in phases.items()}
    whole = sum(totals.values()) or 1.0
    names = list(totals)
    bars = share_ax.barh(names, [100 * totals[n] / whole for n in names], color=colors)
    share_ax.bar_label(bars, fmt="%.1f %%", fontsize=8, padding=3)
    share_ax.invert_yaxis()
    share_ax.set(title="Share of step time (colours as on the left)", xlabel="% of step time (all steps shown)",
                 xlim=(0, 110))
    return figure


def cost_figure(attempts: list[Attempt], axis: TimeAxis) -> Figure | None:
    cost = [r for a in attempts for r in a.of_kind("cost") if "time" in r]
    if not cost:
        return None
    figure, (spent_ax, rate_ax) = _figure()
    x = [axis(r["time"]) for r in cost]
    spent_ax.plot(x, [r["usd_spent"] for r in cost], color=COLORS[0], lw=1.5, label="spent")
    projected = [(xi, r["projected_usd_total"]) for xi, r in zip(x, cost, strict=True)
                 if r.get("projected_usd_total") is not None]
    if projected:
        spent_ax.plot([p for p, _ in projected], [v for _, v in projected], color=COLORS[2], lw=1,
                      label="projected total, as estimated then")
    last = cost[-1]
    if last.get("projected_usd_total") is not None and last.get("projected_s_left") is not None:
        end_x = axis(last["time"] + last["projected_s_left"])
        spent_ax.plot([x[-1], end_x], [last["usd_spent"], last["projected_usd_total"]], ls="--", color=COLORS[0],
                      label=f"projection: {usd(last['projected_usd_total'])} at the end")
    for attempt in attempts[1:]:
        if attempt.start_time_s is not None:
            spent_ax.axvline(axis(attempt.start_time_s), color="#999999", ls=":", lw=1)
    spent_ax.set(title="Cost (dotted lines: restarts)", xlabel=axis.label, ylabel="US$ spent, all attempts")
    spent_ax.set_ylim(bottom=0)
    spent_ax.legend(fontsize=8)
    rate_ax.step(x, [r["usd_per_hour"] for r in cost], where="post", color=COLORS[1], label="price")
    on_demand = [r.get("on_demand_usd_per_hour") for r in cost]
    if any(v is not None for v in on_demand):
        rate_ax.step(x, [float("nan") if v is None else v for v in on_demand], where="post", color="#999999",
                     ls="--", label="on-demand price")
    rate_ax.set(title="Price", xlabel=axis.label, ylabel="US$ per hour (whole job)")
    rate_ax.set_ylim(bottom=0)
    rate_ax.legend(fontsize=8)
    return figure


def timeline_figure(attempts: list[Attempt], axis: TimeAxis) -> Figure | None:
    if not any(a.start_time_s is not None for a in attempts):
        return None
    figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN + 0.6), dpi=100)
    figure.subplots_adjust(left=_MARGINS["left"], right=_LEGEND_RIGHT, bottom=0.11, top=0.935)
    ax = figure.add_subplot(1, 1, 1)
    ax.grid(True, alpha=0.3)
    for attempt in attempts:
        _draw_attempt(ax, attempt, axis)
    ax.set(title="Attempts, checkpoints and preemptions", xlabel=axis.label, ylabel="optimizer step")
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))  # one legend entry per marker kind
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


def _draw_attempt(ax: Any, attempt: Attempt, axis: TimeAxis) -> None:
    begin, end = attempt.start_time_s, attempt.end_time_s
    if begin is None or end is None:
        return
    color = _color(attempt)
    ax.axvspan(axis(begin), axis(end), color=color, alpha=0.12)
    ax.text(axis(begin), 1.0, f" attempt {attempt.number}", transform=ax.get_xaxis_transform(), va="top",
            fontsize=8, color=color)
    train = [r for r in attempt.train if "time" in r]
    ax.plot([axis(r["time"]) for r in train], [r["step"] for r in train], color=color, lw=1.5)
    resumed = attempt.resumed_from_step
    if resumed is not None:
        ax.plot([axis(begin)], [resumed], marker=">", ms=9, color="#2ca02c", ls="none", label="resume")
        ax.annotate(f"resumed from step {resumed}", (axis(begin), resumed), xytext=(6, -14),
                    textcoords="offset points", fontsize=8, color="#2ca02c")
    for record in attempt.of_kind("checkpoint"):
        if "time" not in record:
            continue
        committed = record.get("committed", False)
        ax.plot([axis(record["time"])], [record["step"]], marker="|" if committed else "x", ms=12, mew=2, ls="none",
                color="#555555" if committed else PREEMPTED_COLOR,
                label="checkpoint committed" if committed else "checkpoint failed")
    for record in attempt.of_kind("membership"):
        when = axis(record.get("time", begin))
        ax.plot([when], [record["step"]], marker="D", ms=8, color=MEMBERSHIP_COLOR, ls="none",
                label="membership change")
        ax.annotate(f"{record.get('old_world_size')} → {record.get('new_world_size')} ranks ({record.get('reason')})"
                    f"\n{float(record.get('seconds_lost', 0.0)):.1f} s lost", (when, record["step"]), xytext=(8, -26),
                    textcoords="offset points", fontsize=8, color=MEMBERSHIP_COLOR)
    for record in attempt.of_kind("preemption"):
        when = axis(record.get("time", end))
        ax.plot([when], [record["step"]], marker="*", ms=14, color=PREEMPTED_COLOR, ls="none", label="preemption")
        saved = f"saved step {record['checkpoint_step']}" if record.get("saved") else "not saved"
        ax.annotate(f"{record.get('reason', 'preempted')}\n({saved})", (when, record["step"]), xytext=(8, 4),
                    textcoords="offset points", fontsize=8, color=PREEMPTED_COLOR)
