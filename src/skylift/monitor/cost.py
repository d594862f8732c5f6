"""The cost ledger: dollars spent by a run folder, per epoch, and projected to the end.

The machines are billed from the moment they run, not from the first step, so an
attempt's cost starts when its Trainer starts. Spending carries over restarts: the
ledger reads what earlier attempts recorded in the same ``metrics.jsonl``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

__all__ = ["CostLedger", "previous_spend_usd"]


def previous_spend_usd(records: Iterable[dict[str, Any]]) -> float:
    """Dollars recorded by earlier attempts in a run folder's records (their last ``cost`` records)."""
    spent, attempt_spent = 0.0, 0.0
    for record in records:
        if record.get("kind") == "run_start":
            spent += attempt_spent
            attempt_spent = 0.0
        elif record.get("kind") == "cost":
            attempt_spent = float(record.get("attempt_usd", record.get("usd_spent", 0.0)))
    return spent + attempt_spent


class CostLedger:
    """Turns elapsed time and progress into ``cost`` records.

    Args:
        usd_per_hour: price of all the run's machines together.
        on_demand_usd_per_hour: their on-demand price (for the spot savings), if known.
        earlier_usd: what previous attempts of this run spent.
        started_at: when this attempt's machines started being paid for (Unix time).
    """

    def __init__(
        self,
        usd_per_hour: float,
        *,
        on_demand_usd_per_hour: float | None = None,
        earlier_usd: float = 0.0,
        started_at: float | None = None,
    ) -> None:
        self.usd_per_hour = usd_per_hour
        self.on_demand_usd_per_hour = on_demand_usd_per_hour
        self.earlier_usd = earlier_usd
        self.started_at = started_at if started_at is not None else time.time()
        self._earlier_s = earlier_usd / usd_per_hour * 3600 if usd_per_hour > 0 else 0.0

    def record(self, *, step: int, total_steps: int, steps_per_epoch: int, seconds_per_step: float | None) -> dict[str, Any]:
        """A ``cost`` record at ``step``; projections use the recent ``seconds_per_step``."""
        now = time.time()
        attempt_usd = self._usd(now - self.started_at)
        spent = self.earlier_usd + attempt_usd
        record: dict[str, Any] = {
            "kind": "cost",
            "step": step,
            "usd_per_hour": self.usd_per_hour,
            "usd_spent": round(spent, 6),
            "attempt_usd": round(attempt_usd, 6),
            "usd_per_epoch": None,
            "projected_usd_total": None,
            "projected_s_left": None,
            "on_demand_usd_per_hour": self.on_demand_usd_per_hour,
            "savings_usd": None,
            "time": now,
        }
        if seconds_per_step is not None and seconds_per_step > 0:
            seconds_left = max(total_steps - step, 0) * seconds_per_step
            record["usd_per_epoch"] = round(self._usd(steps_per_epoch * seconds_per_step), 6)
            record["projected_s_left"] = round(seconds_left, 3)
            record["projected_usd_total"] = round(spent + self._usd(seconds_left), 6)
        if self.on_demand_usd_per_hour is not None:
            paid_s = self._earlier_s + (now - self.started_at)
            record["savings_usd"] = round(self.on_demand_usd_per_hour * paid_s / 3600 - spent, 6)
        return record

    def _usd(self, seconds: float) -> float:
        return self.usd_per_hour * max(seconds, 0.0) / 3600
