"""The cost ledger: dollars spent by a run folder, per epoch, and projected to the end.

The machines are billed from the moment they run, not from the first step, so an
attempt's cost starts when its Trainer starts. Spending carries over restarts: the
ledger reads what earlier attempts recorded in the same ``metrics.jsonl``.

An elastic job pays for the nodes it holds: the configured price is for
``nodes_priced`` nodes (``distributed.nodes.max``), and an attempt on ``nodes`` of them
pays ``nodes / nodes_priced`` of it; every ``cost`` record says the count it charged.
The seconds between two attempts (a requeue's relaunch, an elastic restart's
``seconds_lost``) belong to no attempt and are not charged.
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
        usd_per_hour: price of ``nodes_priced`` nodes together (all the run's machines).
        on_demand_usd_per_hour: their on-demand price (for the spot savings), if known.
        earlier_usd: what previous attempts of this run spent.
        started_at: when this attempt's machines started being paid for (Unix time).
        nodes: the nodes this attempt holds (``None``: all of ``nodes_priced``).
        nodes_priced: the nodes the prices are for (``None``: ``nodes``).
    """

    def __init__(
        self,
        usd_per_hour: float,
        *,
        on_demand_usd_per_hour: float | None = None,
        earlier_usd: float = 0.0,
        started_at: float | None = None,
        nodes: int | None = None,
        nodes_priced: int | None = None,
    ) -> None:
        self.nodes = nodes if nodes is not None else nodes_priced
        self.nodes_priced = nodes_priced if nodes_priced is not None else self.nodes
        share = self.nodes / self.nodes_priced if self.nodes and self.nodes_priced else 1.0
        # Spot and on-demand scale alike, so the savings below stay (on-demand / spot - 1) x spent.
        self.usd_per_hour = usd_per_hour * share
        self.on_demand_usd_per_hour = on_demand_usd_per_hour * share if on_demand_usd_per_hour is not None else None
        self.earlier_usd = earlier_usd
        self.started_at = started_at if started_at is not None else time.time()
        self._earlier_s = earlier_usd / self.usd_per_hour * 3600 if self.usd_per_hour > 0 else 0.0

    def record(self, *, step: int, total_steps: int, steps_per_epoch: int,
               seconds_per_step: float | None) -> dict[str, Any]:
        """A ``cost`` record at ``step``; projections use the recent ``seconds_per_step``."""
        now = time.time()
        attempt_usd = self._usd(now - self.started_at)
        spent = self.earlier_usd + attempt_usd
        record: dict[str, Any] = {
            "kind": "cost",
            "step": step,
            "usd_per_hour": self.usd_per_hour,
            "nodes": self.nodes,
            "nodes_priced": self.nodes_priced,
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
