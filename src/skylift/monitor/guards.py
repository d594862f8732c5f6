"""Guards that stop money burning: a budget, an idle GPU, a stalled run.

Each rule is one small function over the records a run writes (``cost``, ``system``)
or the time since the last optimizer step, so it is tested on recorded streams; the
:class:`GuardWatch` feeds them from the metrics logger and a watchdog thread and asks
all ranks to stop together at the next step boundary (``StopReason.GUARD``), where the
run saves a checkpoint, writes a ``guard`` record and exits with
:data:`~skylift.errors.EXIT_GUARD`.

- ``budget_usd``: the dollars spent across restarts reach the budget, or the
  projection to the end passes it by more than ``budget_margin`` (a share of it).
  A resume whose earlier attempts already spent the budget is refused until it is raised.
- ``idle_gpu_minutes``: every GPU's utilisation stayed under ``idle_gpu_utilization_pct``
  for that long (a data stall, a hung collective, a deadlocked loader): a warning, and
  with ``on_idle_gpu: stop`` a checkpoint and stop.
- ``stall_minutes``: no optimizer step for that long while the process lives: every
  thread's stack is written to ``RUN_DIR/stall-rank<R>.txt`` (the place a hung NCCL call
  or object-store read is stuck), a warning, and with ``on_stall: stop`` the process
  exits: a stuck step cannot reach a step boundary to save.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GuardFinding", "GuardWatch", "budget_finding", "idle_gpu_finding", "resume_refusal", "stall_finding"]

log = logging.getLogger("skylift")


@dataclass(frozen=True)
class GuardFinding:
    """Why a guard fired, and whether the run stops for it."""

    guard: str
    """``budget``, ``idle_gpu`` or ``stall``."""
    message: str
    stop: bool

    def record(self, step: int) -> dict[str, Any]:
        return {"kind": "guard", "guard": self.guard, "step": step, "message": self.message, "stop": self.stop,
                "time": time.time()}


def budget_finding(cost: dict[str, Any], guards: Any) -> GuardFinding | None:
    """A ``cost`` record against ``monitor.guards.budget_usd``."""
    budget = guards.budget_usd
    if budget is None:
        return None
    spent = float(cost.get("usd_spent") or 0.0)
    if spent >= budget:
        return GuardFinding("budget", f"spent ${spent:,.2f} of the ${budget:,.2f} budget "
                            "(monitor.guards.budget_usd)", stop=True)
    projected = cost.get("projected_usd_total")
    if projected is not None and projected > budget * (1 + guards.budget_margin):
        return GuardFinding(
            "budget",
            f"projected ${projected:,.2f} by the end, over the ${budget:,.2f} budget by more than "
            f"{guards.budget_margin:.0%} (spent ${spent:,.2f} so far)",
            stop=True,
        )
    return None


def idle_gpu_finding(system_records: Iterable[dict[str, Any]], guards: Any, now_s: float) -> GuardFinding | None:
    """Every GPU under the threshold in every ``system`` sample of the last ``idle_gpu_minutes``."""
    minutes = guards.idle_gpu_minutes
    if minutes is None:
        return None
    window_start = now_s - 60 * minutes
    samples = [r for r in system_records if r.get("gpus") and r.get("time", 0) >= window_start]
    if not samples or samples[0]["time"] - window_start > max(5.0, 0.1 * 60 * minutes):
        return None  # the samples do not cover the window yet
    peak = max(float(gpu.get("utilization_percent") or 0.0) for record in samples for gpu in record["gpus"])
    if peak >= guards.idle_gpu_utilization_pct:
        return None
    return GuardFinding(
        "idle_gpu",
        f"GPU utilisation under {guards.idle_gpu_utilization_pct:g}% for {minutes:g} min (peak {peak:.0f}%): a "
        "data stall, a hung collective or a deadlocked loader; see the step-time breakdown and `skylift monitor`",
        stop=guards.on_idle_gpu == "stop",
    )


def stall_finding(seconds_since_step: float, guards: Any) -> GuardFinding | None:
    minutes = guards.stall_minutes
    if minutes is None or seconds_since_step < 60 * minutes:
        return None
    return GuardFinding(
        "stall",
        f"no optimizer step for {seconds_since_step / 60:.1f} min (monitor.guards.stall_minutes: {minutes:g}); "
        "every thread's stack is in the run folder's stall-rank<R>.txt",
        stop=guards.on_stall == "stop",
    )


def resume_refusal(earlier_usd: float, guards: Any) -> str | None:
    """Why a resume must not start: its earlier attempts spent the budget already."""
    budget = guards.budget_usd
    if budget is None or earlier_usd < budget:
        return None
    suggestion = math.ceil(max(2 * budget, earlier_usd + budget))
    return (f"monitor.guards.budget_usd: this run already spent ${earlier_usd:,.2f} of its ${budget:,.2f} budget; "
            f"raise monitor.guards.budget_usd to resume it (e.g. --set monitor.guards.budget_usd={suggestion})")


class GuardWatch:
    """Feeds the rules; a stopping finding asks the agreement to stop at the next boundary.

    Args:
        guards: ``monitor.guards``.
        request_stop: asks every rank to stop at the next step boundary.
        write_record: writes a record (rank 0's metrics logger; None elsewhere).
        run_dir: where stall stack dumps go.
        rank: this process's rank.
    """

    def __init__(self, guards: Any, *, request_stop: Callable[[], None],
                 write_record: Callable[[dict[str, Any]], None] | None, run_dir: Path, rank: int) -> None:
        self.guards = guards
        self.fired: GuardFinding | None = None
        """The finding that stopped (or will stop) the run."""
        self._request_stop = request_stop
        self._write = write_record
        self._run_dir = run_dir
        self._rank = rank
        self._system: list[dict[str, Any]] = []
        self._warned: set[str] = set()
        self._last_step_at = time.monotonic()
        self._step = 0
        self._stop_thread = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self, record: dict[str, Any]) -> None:
        """A record the run just wrote (rank 0 sees them all)."""
        kind = record.get("kind")
        if kind == "cost":
            self._act(budget_finding(record, self.guards))
        elif kind == "system" and self.guards.idle_gpu_minutes is not None:
            self._system.append(record)
            horizon = record.get("time", 0) - 60 * self.guards.idle_gpu_minutes - 60
            self._system = [r for r in self._system if r.get("time", 0) >= horizon]
            self._act(idle_gpu_finding(self._system, self.guards, record.get("time", time.time())))

    def step_done(self, step: int) -> None:
        self._step = step
        self._last_step_at = time.monotonic()
        self._warned.discard("stall")

    def start(self) -> None:
        if self.guards.stall_minutes is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch_stalls, name="skylift-stall-guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop_thread.set()

    def _act(self, finding: GuardFinding | None) -> None:
        if finding is None or finding.guard in self._warned:
            return
        self._warned.add(finding.guard)
        log.warning("guard %s: %s%s", finding.guard, finding.message, "; stopping with a checkpoint" if finding.stop
                    else "")
        if finding.stop:
            self.fired = finding
            self._request_stop()
        elif self._write is not None:
            self._write(finding.record(self._step))

    def _watch_stalls(self) -> None:
        period_s = max(1.0, min(30.0, 60 * self.guards.stall_minutes / 10))
        while not self._stop_thread.wait(period_s):
            finding = stall_finding(time.monotonic() - self._last_step_at, self.guards)
            if finding is None or "stall" in self._warned:
                continue
            self._warned.add("stall")
            path = self._run_dir / f"stall-rank{self._rank}.txt"
            with open(path, "w", encoding="utf-8") as dump:
                faulthandler.dump_traceback(file=dump, all_threads=True)
            log.error("guard stall: %s (this rank's: %s)", finding.message, path)
            if self._write is not None:
                self._write(finding.record(self._step))
            if finding.stop:
                from skylift.errors import EXIT_GUARD

                logging.shutdown()
                os._exit(EXIT_GUARD)  # the training thread is stuck: no boundary will come to save at
