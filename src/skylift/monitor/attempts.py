"""A run folder's records, split into attempts and summarised for the report and live view.

A run folder accumulates every attempt of the same run (a preempted run that resumes
appends to ``metrics.jsonl``). Attempts start at ``run_start`` records (records before
the first one, a torn line's remains, make an attempt of their own).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Attempt", "AttemptSplitter", "RunFigures", "elapsed_unit", "membership_text", "run_figures",
           "split_attempts", "usd"]


@dataclass
class Attempt:
    """One start of ``skylift run`` in this folder (1-based ``number``)."""

    number: int
    start: dict[str, Any] | None = None
    """The ``run_start`` record; ``None`` for records before the first one."""
    records: list[dict[str, Any]] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [record for record in self.records if record.get("kind") == kind]

    def last(self, kind: str) -> dict[str, Any] | None:
        return next((r for r in reversed(self.records) if r.get("kind") == kind), None)

    @property
    def train(self) -> list[dict[str, Any]]:
        return self.of_kind("train")

    @property
    def resumed_from_step(self) -> int | None:
        return self.start.get("resumed_from_step") if self.start is not None else None

    @property
    def start_time_s(self) -> float | None:
        times = [r["time"] for r in self.records if isinstance(r.get("time"), (int, float))]
        return min(times, default=None)

    @property
    def end_time_s(self) -> float | None:
        times = [r["time"] for r in self.records if isinstance(r.get("time"), (int, float))]
        return max(times, default=None)

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.records if r.get("kind") in ("train", "run_end") and "step" in r]
        return max(steps, default=None)

    @property
    def nodes(self) -> int | None:
        """Nodes this attempt trained on (its ``run_start``), ``None`` when unrecorded."""
        return self.start.get("num_nodes") if self.start is not None else None

    @property
    def outcome(self) -> str:
        """``finished``, ``preempted``, ``stopped: REASON`` or ``running or killed``."""
        if self.last("preemption") is not None:  # its run_end, if any, says "stopped: preemption notice"
            return "preempted"
        end = self.last("run_end")
        if end is not None:
            return "finished" if not end.get("stopped_early") else f"stopped: {end['stopped_early']}"
        return "running or killed"


class AttemptSplitter:
    """Says which record starts a new attempt; fed every record in file order.

    Shared by the report (whole file) and the live view (a growing file).
    """

    def __init__(self) -> None:
        self.attempts = 0

    def starts_attempt(self, record: dict[str, Any]) -> bool:
        begins = record.get("kind") == "run_start" or self.attempts == 0
        if begins:
            self.attempts += 1
        return begins


def split_attempts(records: Iterable[dict[str, Any]]) -> list[Attempt]:
    """Group records into attempts, in file order."""
    attempts: list[Attempt] = []
    splitter = AttemptSplitter()
    for record in records:
        if splitter.starts_attempt(record):
            start = record if record.get("kind") == "run_start" else None
            attempts.append(Attempt(number=splitter.attempts, start=start))
        attempts[-1].records.append(record)
    return attempts


@dataclass
class RunFigures:
    """The headline numbers of a run folder (``None`` where unknown)."""

    attempts: int = 0
    preemptions: int = 0
    step: int | None = None
    total_steps: int | None = None
    samples_seen: int | None = None
    samples_per_s: float | None = None
    samples_per_s_attempt: int | None = None
    """Set when ``samples_per_s`` is an earlier attempt's because every later one ended
    having trained nothing (a finished run started again resumes at its last step and
    writes 0 samples/s)."""
    mfu: float | None = None
    loss: float | None = None
    eval: dict[str, float] = field(default_factory=dict)
    usd_spent: float | None = None
    projected_usd_total: float | None = None
    device: str | None = None
    precision: str | None = None
    outcome: str = "no records"
    wall_time_s: float | None = None
    membership: list[dict[str, Any]] = field(default_factory=list)
    """The elastic job's ``membership`` records (a node left, was lost or joined), in order."""


def run_figures(attempts: list[Attempt], summary: dict[str, Any] | None = None) -> RunFigures:
    """Headline figures from the records, falling back to ``summary.json`` where they are silent."""
    summary = summary or {}
    figures = RunFigures(attempts=len(attempts), outcome=_outcome(attempts, summary))
    records = [record for attempt in attempts for record in attempt.records]
    figures.preemptions = sum(1 for r in records if r.get("kind") == "preemption")
    figures.membership = [r for r in records if r.get("kind") == "membership"]
    _train_figures(figures, records)
    last_eval = _last(records, "eval")
    if last_eval is not None:
        figures.eval = {k: v for k, v in last_eval.items() if k not in ("kind", "step", "epoch", "time")
                        and isinstance(v, (int, float))}
    figures.eval = figures.eval or dict(summary.get("eval_metrics") or {})
    cost = _last(records, "cost")
    if cost is not None:
        figures.usd_spent, figures.projected_usd_total = cost.get("usd_spent"), cost.get("projected_usd_total")
    start = next((a.start for a in reversed(attempts) if a.start is not None), None)
    if start is not None:
        figures.total_steps = start.get("total_steps")
        world = start.get("world_size", 1)
        figures.device = f"{world} × {start.get('device_name', start.get('device', '?'))}"
        figures.precision = start.get("precision")
    else:
        figures.device = f"{summary['world_size']} × {summary['device']}" if "device" in summary else None
        figures.precision = summary.get("precision")
    trained = _last_trained_end(attempts)
    end = _last(records, "run_end")
    if trained is not None:
        figures.samples_per_s = trained[1]["samples_per_s"]
        later = attempts[trained[0] + 1:]
        # Named only when every later attempt ended having trained nothing (not one killed mid-way).
        if later and all(attempt.last("run_end") is not None for attempt in later):
            figures.samples_per_s_attempt = attempts[trained[0]].number
    elif end is not None:
        figures.samples_per_s = end.get("samples_per_s", figures.samples_per_s)
    elif attempts and attempts[-1].outcome != "running or killed" and summary.get("samples_per_s"):
        figures.samples_per_s = summary["samples_per_s"]
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    figures.wall_time_s = max(times) - min(times) if times else None
    return figures


def _outcome(attempts: list[Attempt], summary: dict[str, Any]) -> str:
    if not attempts:
        return "no records"
    last = attempts[-1]
    # A file without run_end records: summary.json, written at the end of each attempt, tells.
    if last.outcome == "running or killed" and summary.get("steps") == last.last_step and "stopped_early" in summary:
        stopped = summary["stopped_early"]
        return "finished (per summary.json)" if stopped is None else f"stopped: {stopped} (per summary.json)"
    return last.outcome


def _train_figures(figures: RunFigures, records: list[dict[str, Any]]) -> None:
    train = _last(records, "train")
    if train is None:
        return
    figures.step = train.get("step")
    figures.samples_seen = train.get("samples_seen")
    figures.samples_per_s = train.get("samples_per_s")
    figures.loss = train.get("loss")
    figures.mfu = next((r["mfu"] for r in reversed(records) if r.get("kind") == "train" and r.get("mfu") is not None),
                       None)


def _last_trained_end(attempts: list[Attempt]) -> tuple[int, dict[str, Any]] | None:
    """(index, run_end record) of the last attempt that ended having trained (its
    samples/s above 0), or None."""
    for index in reversed(range(len(attempts))):
        end = attempts[index].last("run_end")
        if end is not None and isinstance(end.get("samples_per_s"), (int, float)) and end["samples_per_s"] > 0:
            return index, end
    return None


def _last(records: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((r for r in reversed(records) if r.get("kind") == kind), None)


def membership_text(record: dict[str, Any]) -> str:
    """One membership change in words: ``2 -> 1 nodes (16 -> 8 ranks) at step 40: notice, 12.5 s lost``."""
    text = (f"{record.get('old_nodes', '?')} → {record.get('new_nodes', '?')} nodes "
            f"({record.get('old_world_size', '?')} → {record.get('new_world_size', '?')} ranks) at step "
            f"{record.get('step', '?')}: {record.get('reason', '?')}, "
            f"{float(record.get('seconds_lost', 0.0)):.1f} s lost")
    steps_lost = record.get("steps_lost") or 0
    return text + (f", {steps_lost} step{'s' if steps_lost != 1 else ''} trained again" if steps_lost else "")


def elapsed_unit(span_s: float) -> tuple[str, float]:
    """A readable unit for a time axis spanning ``span_s``: (name, seconds per unit)."""
    if span_s < 300:
        return "s", 1.0
    if span_s < 3 * 3600:
        return "min", 60.0
    return "h", 3600.0


def usd(amount: float) -> str:
    """Dollars with cents, or four decimals under a dollar (short test runs cost fractions of a cent)."""
    return f"${amount:,.2f}" if abs(amount) >= 1 else f"${amount:.4f}"
