"""Text of ``skylift plan``: the ranked table, dropped candidates with reasons, assumptions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skylift.plan.planning import Plan
    from skylift.plan.ranking import Candidate

__all__ = ["render_plan"]

_HEADER = ("#", "instance", "count", "spot", "samples/s", "hours", "USD", "USD/epoch", "USD/h", "note")


def render_plan(plan: Plan) -> str:
    """The plan as text: runnable candidates ranked, then dropped ones, then every assumption."""
    runnable = [candidate for candidate in plan.candidates if not candidate.dropped]
    dropped = [candidate for candidate in plan.candidates if candidate.dropped]
    lines = [(f"skylift plan: {plan.epochs:g} epoch(s), measured {plan.measurement.samples_per_s:.1f} samples/s "
             f"on {plan.measurement.device_name}")]  # fmt: skip
    rows = [_HEADER] + [_cells(index, candidate) for index, candidate in enumerate(runnable, start=1)]
    lines += _table(rows) if runnable else ["no candidate meets every constraint"]
    lines += _calibration_lines(runnable)
    if dropped:
        lines += ["", "dropped:"]
        rows = [_HEADER] + [_cells("-", candidate, note="; ".join(candidate.dropped)) for candidate in dropped]
        lines += _table(rows)
    lines += ["", "assumptions:"] + [f"  - {text}" for text in plan.assumptions]
    return "\n".join(lines)


def _cells(index: int | str, candidate: Candidate, note: str | None = None) -> tuple[str, ...]:
    p = candidate.prediction
    flags = []
    if candidate.price_status == "price_unverified":
        flags.append("price_unverified")
    if p.sharding is not None:
        flags.append(f"sharded over {p.sharding.shard_count} ranks")
    if p.bound in ("input-bound", "communication-bound"):
        flags.append(p.bound)
    if p.accumulation_steps > 1:
        flags.append(f"accumulation {p.accumulation_steps}")
    if p.memory is not None and p.memory.frozen_weight_bytes:
        from skylift.doctor.rules.resources import format_bytes

        # With adapters the state is far from 16 bytes a parameter: show what a GPU holds.
        flags.append(f"{format_bytes(p.memory.total_bytes)} a GPU (frozen base "
                     f"{format_bytes(p.memory.frozen_weight_bytes)})")
    if candidate.spot and candidate.spot_savings_usd is not None:
        flags.append(f"saves ${_number(candidate.spot_savings_usd)}, "
                     f"{_number(candidate.expected_interruptions)} interruptions expected")  # fmt: skip
    return (
        str(index), candidate.instance, str(candidate.count), "spot" if candidate.spot else "on-demand",
        _number(p.samples_per_s), _number(candidate.predicted_hours), _number(candidate.predicted_usd),
        _number(candidate.usd_per_epoch), _usd_per_hour(candidate),
        note if note is not None else ", ".join(flags),
    )  # fmt: skip


def _usd_per_hour(candidate: Candidate) -> str:
    """The median zone's price the plan costs with, and the cheapest zone's beside it."""
    if candidate.spot_cheapest is None or candidate.usd_per_hour is None:
        return _number(candidate.usd_per_hour)
    price, zone = candidate.spot_cheapest
    return f"{_number(candidate.usd_per_hour)} (cheapest {_number(price)} {zone})"


def _calibration_lines(runnable: list) -> list[str]:
    """Which published rows (``skylift/plan/published.csv``) calibrated each ranked prediction."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for index, candidate in enumerate(runnable, start=1):
        groups.setdefault(candidate.prediction.calibrated_by, []).append(f"#{index}")
    lines = []
    for rows, indices in groups.items():
        label = ", ".join(indices) if len(indices) <= 6 else f"{', '.join(indices[:5])} and {len(indices) - 5} more"
        lines.append(f"  {label}: " + (f"GPU model calibrated on published rows {', '.join(rows)}" if rows else
                                      "scaled from the measurement (no GPU model)"))  # fmt: skip
    return ["", "calibrated by (skylift/plan/published.csv):", *lines] if lines else []


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def _number(value: float | None) -> str:
    """Three significant figures for small values (a short job's hours), thousands separators for large."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
