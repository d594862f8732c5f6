"""``RUN_DIR/report/``: a self-contained HTML dashboard of a run folder, and one PNG per figure.

The HTML embeds its PNGs (base64) and its CSS and has no script and no network
reference, so it opens from a file, a CI artifact or a mail attachment. Every section
is always there; one whose records are absent says why in one line.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skylift.monitor.attempts import (
    Attempt,
    RunFigures,
    membership_text,
    run_figures,
    split_attempts,
    usd,
)
from skylift.monitor.flop_figures import FlopFigures, flop_figures
from skylift.monitor.schema import read_records

__all__ = ["SECTION_IDS", "Report", "diagnosis_lines", "find_diagnosis", "membership_lines", "write_report"]

SECTION_IDS = ("summary", "diagnosis", "loss", "throughput", "utilization", "breakdown", "cost", "timeline")
"""The ``id`` of every section, in page order (tests and links rely on them)."""


@dataclass
class Report:
    html_path: Path
    png_paths: list[Path]
    diagnosis: dict[str, Any] | None
    diagnosis_note: str
    membership: list[dict[str, Any]] = field(default_factory=list)
    """The elastic job's ``membership`` records, in order (empty for a fixed-size job)."""
    flops: FlopFigures | None = None
    """FLOPs per sample and MFU of the last attempt, each with its source or its reason."""


@dataclass
class _Section:
    id: str
    title: str
    figure: Any = None
    notes: list[str] = field(default_factory=list)
    body_html: str = ""
    png_path: Path | None = None
    png_bytes: bytes | None = None


def write_run_report(config: Any) -> Report | None:
    """The report a finished run writes (``monitor.report``); a failure is a warning, not a lost run."""
    if not config.monitor.report:
        return None
    try:
        return write_report(config.run_dir)
    except Exception:  # the run itself succeeded; say why the report did not
        logging.getLogger("skylift").warning("could not write the report", exc_info=True)
        return None


def write_report(run_dir: str | Path, output_dir: str | Path | None = None) -> Report:
    """Read ``RUN_DIR/metrics.jsonl``, write ``index.html`` and the PNGs; raise FileNotFoundError without it."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(metrics_path)
    output = Path(output_dir) if output_dir is not None else run_dir / "report"
    output.mkdir(parents=True, exist_ok=True)
    records = list(read_records(metrics_path))
    attempts = split_attempts(records)
    figures = run_figures(attempts, _summary_json(run_dir))
    diagnosis, note = find_diagnosis(records)
    flops = flop_figures(attempts[-1]) if attempts else None
    sections = _sections(attempts, figures, diagnosis, note, flops)
    pngs = _write_pngs(sections, output)
    html_path = output / "index.html"
    html_path.write_text(_page(run_dir, sections), encoding="utf-8")
    return Report(html_path=html_path, png_paths=pngs, diagnosis=diagnosis, diagnosis_note=note,
                  membership=figures.membership, flops=flops)


def find_diagnosis(records: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """The run's last ``diagnosis`` record, else one computed now; and where it came from."""
    recorded = next((r for r in reversed(records) if r.get("kind") == "diagnosis"), None)
    if recorded is not None:
        return recorded, f"written by the run at step {recorded.get('step', '?')}"
    from skylift.monitor.diagnosis import diagnose

    try:
        computed = diagnose(records)
    except Exception as error:  # noqa: BLE001 - a report must render whatever the diagnosis does
        return None, f"no diagnosis: diagnose() failed with {type(error).__name__}: {error}"
    if computed is None:
        return None, "no diagnosis: the records hold no sampled step-time breakdowns (breakdown_s) to go on"
    return computed, "computed by the report from the records"


def membership_lines(membership: list[dict[str, Any]]) -> list[str]:
    """Each membership change of an elastic job as a line, for the terminal (none for a fixed job)."""
    return [membership_text(record) for record in membership]


def diagnosis_lines(diagnosis: dict[str, Any] | None, note: str) -> list[str]:
    """The diagnosis as plain lines, for the terminal."""
    if diagnosis is None:
        return [note]
    shares = sorted(diagnosis.get("shares", {}).items(), key=lambda item: -item[1])
    shown = ", ".join(f"{name} {100 * share:.0f}%" for name, share in shares[:3])
    lines = [f"bound: {diagnosis.get('bound', 'unknown')}" + (f" (step time: {shown})" if shown else "")]
    for finding in diagnosis.get("findings", []):
        advice = f" -> {finding['advice']}" if finding.get("advice") else ""
        lines.append(f"[{finding.get('severity', 'info')}] {finding.get('message', '')}{advice}")
    return lines


# -- sections ------------------------------------------------------------------------


def _sections(attempts: list[Attempt], figures: RunFigures, diagnosis: dict | None, note: str,
              flops: FlopFigures | None = None) -> list[_Section]:
    from skylift.monitor import plots

    axis = plots.TimeAxis(attempts)
    has_train = any(a.train for a in attempts)
    sections = [
        _Section("summary", "Summary", body_html=_summary_html(figures, flops)),
        _Section("diagnosis", "Diagnosis", body_html=_diagnosis_html(diagnosis, note)),
        _Section("loss", "Loss and validation", plots.loss_figure(attempts)),
        _Section("throughput", "Throughput and MFU", plots.throughput_figure(attempts)),
        _Section("utilization", "Utilisation and memory", plots.utilization_figure(attempts, axis)),
        _Section("breakdown", "Step-time breakdown", plots.breakdown_figure(attempts)),
        _Section("cost", "Cost", plots.cost_figure(attempts, axis), body_html=_cost_html(attempts)),
        _Section("timeline", "Attempts, preemptions and resumes", plots.timeline_figure(attempts, axis),
                 body_html=_attempts_html(attempts)),
    ]
    missing = {
        "loss": "no train or eval records yet",
        "throughput": "no train records yet",
        "utilization": "no system records: the system sampler writes one every monitor.system_interval_s",
        "breakdown": "no train records yet",
        "cost": "no cost records: set monitor.usd_per_hour",
        "timeline": "no timed records yet",
    }
    for section in sections:
        if section.figure is None and section.id in missing:
            section.notes.append(missing[section.id])
    _add_notes(sections, attempts, has_train)
    return sections


def _add_notes(sections: list[_Section], attempts: list[Attempt], has_train: bool) -> None:
    by_id = {section.id: section for section in sections}
    system = [r for a in attempts for r in a.of_kind("system")]
    if system and not any(r.get("gpus") for r in system):
        by_id["utilization"].notes.append("no GPU on this run: CPU and host memory only")
    train = [r for a in attempts for r in a.train]
    if has_train and not any(r.get("mfu") is not None for r in train):
        by_id["throughput"].notes.append(
            "no MFU in the train records: the peak FLOP/s of the device or the model's FLOPs is unknown")
    if has_train and not any(r.get("breakdown_s") for r in train):
        by_id["breakdown"].notes.append(
            "no breakdown_s in the train records: the split shown is data wait against the rest of the step")
    if has_train:
        by_id["breakdown"].body_html = _breakdown_html(train)


def _write_pngs(sections: list[_Section], output: Path) -> list[Path]:
    paths = []
    for section in sections:
        if section.figure is None:
            continue
        buffer = io.BytesIO()
        section.figure.savefig(buffer, format="png")
        section.png_bytes = buffer.getvalue()
        section.png_path = output / f"{section.id}.png"
        section.png_path.write_bytes(section.png_bytes)
        paths.append(section.png_path)
    return paths


def _summary_json(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


# -- HTML ----------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d1d1f;background:#f6f7f9}
header{background:#1d2733;color:#fff;padding:16px 28px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c9d1d9;font-size:13px}
nav{padding:8px 28px;background:#fff;border-bottom:1px solid #e1e4e8;font-size:14px}
nav a{margin-right:16px;color:#0366d6;text-decoration:none}
main{padding:8px 28px 40px;max-width:1180px}
section{background:#fff;border:1px solid #e1e4e8;border-radius:6px;margin:16px 0;padding:12px 20px}
h2{font-size:18px;margin:4px 0 10px}img{max-width:100%;height:auto;display:block}
table{border-collapse:collapse;font-size:14px;margin:6px 0}
td,th{padding:4px 14px 4px 0;text-align:left;border-bottom:1px solid #eef0f2;vertical-align:top}
th{color:#57606a;font-weight:600}.num{text-align:right;font-variant-numeric:tabular-nums}
.note{color:#57606a;font-style:italic;margin:6px 0}.warn{color:#b35900;font-weight:600}
.info{color:#0366d6;font-weight:600}.bound{font-size:16px;margin:4px 0}
"""


def _page(run_dir: Path, sections: list[_Section]) -> str:
    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    nav = "".join(f'<a href="#{s.id}">{html.escape(s.title)}</a>' for s in sections)
    body = "\n".join(_section_html(section) for section in sections)
    title = f"skylift report: {run_dir.name or run_dir}"
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        # An empty inline icon: otherwise the browser asks for /favicon.ico and logs an error.
        '<link rel="icon" href="data:,">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>"
        f"<header><h1>{html.escape(title)}</h1><p>{html.escape(str(run_dir.resolve()))} · "
        f"generated {html.escape(generated)} by skylift report</p></header>"
        f"<nav>{nav}</nav>\n<main>\n{body}\n</main></body></html>\n"
    )


def _section_html(section: _Section) -> str:
    parts = [f'<section id="{section.id}"><h2>{html.escape(section.title)}</h2>']
    parts += [f'<p class="note">{html.escape(note)}</p>' for note in section.notes]
    if section.png_bytes is not None:
        encoded = base64.b64encode(section.png_bytes).decode("ascii")
        parts.append(f'<img alt="{html.escape(section.title)}" src="data:image/png;base64,{encoded}">')
    parts.append(section.body_html)
    parts.append("</section>")
    return "".join(parts)


def _table(rows: Sequence[tuple[object, ...]], header: tuple[str, ...] | None = None) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows
    )
    return f"<table>{head}{body}</table>"


def _summary_html(figures: RunFigures, flops: FlopFigures | None = None) -> str:
    rows = [("status", figures.outcome)]
    if figures.step is not None:
        total = f" of {figures.total_steps:,}" if figures.total_steps else ""
        rows.append(("steps", f"{figures.step:,}{total}"))
    if figures.samples_seen is not None:
        rows.append(("samples seen", f"{figures.samples_seen:,}"))
    if figures.samples_per_s is not None:
        which = ("" if figures.samples_per_s_attempt is None
                 else f" (attempt {figures.samples_per_s_attempt}, the last that trained)")
        rows.append(("throughput", f"{figures.samples_per_s:,.0f} samples/s{which}"))
    if flops is not None:
        rows += flops.rows()
    elif figures.mfu is not None:
        rows.append(("MFU", f"{100 * figures.mfu:.1f} % of peak FLOP/s"))
    if figures.loss is not None:
        rows.append(("last train loss", f"{figures.loss:.4f}"))
    for name, value in figures.eval.items():
        shown = f"{100 * value:.2f} %" if name == "accuracy" and 0 <= value <= 1 else f"{value:.4f}"
        rows.append((f"validation {name}", shown))
    rows.append(("cost", _usd(figures.usd_spent, figures.projected_usd_total)))
    rows.append(("attempts", f"{figures.attempts} ({figures.preemptions} preempted)"))
    if figures.membership:
        lost = sum(float(record.get("seconds_lost", 0.0)) for record in figures.membership)
        changes = "; ".join(membership_text(record) for record in figures.membership)
        rows.append(("membership", f"{len(figures.membership)} change(s), {lost:.1f} s lost in all: {changes}"))
    if figures.wall_time_s is not None:
        rows.append(("wall time", _duration(figures.wall_time_s)))
    if figures.device:
        rows.append(("devices", figures.device + (f", {figures.precision}" if figures.precision else "")))
    return _table(rows)


def _usd(spent: float | None, projected: float | None) -> str:
    if spent is None:
        return "unknown (no cost records: set monitor.usd_per_hour)"
    return f"{usd(spent)} spent" + (f", {usd(projected)} projected in total" if projected is not None else "")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _diagnosis_html(diagnosis: dict[str, Any] | None, note: str) -> str:
    if diagnosis is None:
        return f'<p class="note">{html.escape(note)}</p>'
    shares = sorted(diagnosis.get("shares", {}).items(), key=lambda item: -item[1])
    bound = html.escape(str(diagnosis.get("bound", "unknown")))
    parts = [f'<p class="bound">Bound by <b>{bound}</b> <span class="note">({html.escape(note)})</span></p>']
    if shares:
        parts.append(_table([(name, f"{100 * share:.1f} %") for name, share in shares], ("phase", "share of step")))
    items = []
    for finding in diagnosis.get("findings", []):
        severity = html.escape(str(finding.get("severity", "info")))
        advice = f"<br>→ {html.escape(finding['advice'])}" if finding.get("advice") else ""
        items.append(f'<li><span class="{severity}">[{severity}] {html.escape(str(finding.get("kind", "")))}</span> '
                     f"{html.escape(str(finding.get('message', '')))}{advice}</li>")
    parts.append(f"<ul>{''.join(items)}</ul>" if items else '<p class="note">no findings</p>')
    return "".join(parts)


def _breakdown_html(train: list[dict[str, Any]]) -> str:
    from skylift.monitor.plots import breakdown_phases

    steps, phases, _ = breakdown_phases(train)
    if not steps:
        return ""
    totals = {name: sum(values) for name, values in phases.items()}
    whole = sum(totals.values()) or 1.0
    rows = [(name, f"{1000 * total / len(steps):.2f} ms", f"{100 * total / whole:.1f} %")
            for name, total in totals.items()]
    return _table(rows, ("phase", "mean per step", "share")) + f'<p class="note">over {len(steps):,} steps</p>'


def _cost_html(attempts: list[Attempt]) -> str:
    cost = [r for a in attempts for r in a.of_kind("cost")]
    if not cost:
        return ""
    last = cost[-1]
    rows = [("spent", usd(last["usd_spent"])), ("price", f"{usd(last['usd_per_hour'])} per hour")]
    if last.get("nodes") is not None and last.get("nodes_priced") not in (None, last["nodes"]):
        # An elastic job on fewer nodes than its price is for pays its share.
        rows.append(("nodes charged", (f"{last['nodes']} of {last['nodes_priced']} (the price is for "
                                       f"{last['nodes_priced']})")))
    if last.get("projected_usd_total") is not None:
        rows.append(("projected total", usd(last["projected_usd_total"])))
    if last.get("projected_s_left") is not None:
        rows.append(("time left", _duration(last["projected_s_left"])))
    if last.get("usd_per_epoch") is not None:
        rows.append(("per epoch", usd(last["usd_per_epoch"])))
    if last.get("savings_usd") is not None:
        rows.append(("saved against on-demand", usd(last["savings_usd"])))
    return _table(rows)


def _attempts_html(attempts: list[Attempt]) -> str:
    rows = []
    for attempt in attempts:
        preemption = attempt.last("preemption")
        begin, end = attempt.start_time_s, attempt.end_time_s
        rows.append((
            str(attempt.number),
            "fresh" if attempt.resumed_from_step is None else f"step {attempt.resumed_from_step}",
            _attempt_nodes(attempt),
            "-" if attempt.last_step is None else f"{attempt.last_step:,}",
            "-" if begin is None or end is None else _duration(end - begin),
            sum(1 for r in attempt.of_kind("checkpoint") if r.get("committed")),
            attempt.outcome + (f" ({preemption.get('reason')})" if preemption else ""),
        ))
    header = ("attempt", "resumed from", "nodes", "last step", "duration", "checkpoints committed", "outcome")
    return _table(rows, header) if rows else ""


def _attempt_nodes(attempt: Attempt) -> str:
    """The attempt's node count, and how it changed when it began at another size."""
    change = attempt.last("membership")
    if change is not None:
        return membership_text(change)
    return "-" if attempt.nodes is None else str(attempt.nodes)
