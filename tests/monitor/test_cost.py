"""The cost ledger: spend, per-epoch cost, projection, savings, and carry-over across restarts."""

from __future__ import annotations

import json
import time

import pytest

from skylift.monitor.cost import CostLedger, previous_spend_usd
from skylift.monitor.schema import read_records


def test_spend_projection_and_savings():
    ledger = CostLedger(3.6, on_demand_usd_per_hour=10.8, started_at=time.time() - 100)
    record = ledger.record(step=50, total_steps=150, steps_per_epoch=25, seconds_per_step=2.0)
    assert record["usd_spent"] == pytest.approx(0.1, abs=1e-3)  # 100 s at 3.6 $/h
    assert record["usd_per_epoch"] == pytest.approx(0.05)  # 25 steps x 2 s
    assert record["projected_s_left"] == pytest.approx(200.0)
    assert record["projected_usd_total"] == pytest.approx(0.3, abs=1e-3)
    assert record["savings_usd"] == pytest.approx(0.2, abs=2e-3)


def test_earlier_attempts_carry_over(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"kind": "run_start", "time": 0}, {"kind": "cost", "usd_spent": 0.5, "attempt_usd": 0.5},
        {"kind": "cost", "usd_spent": 1.0, "attempt_usd": 1.0},
        {"kind": "run_start", "time": 1}, {"kind": "cost", "usd_spent": 1.25, "attempt_usd": 0.25},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert previous_spend_usd(read_records(path)) == pytest.approx(1.25)
    ledger = CostLedger(3.6, earlier_usd=1.25, started_at=time.time())
    assert ledger.record(step=0, total_steps=10, steps_per_epoch=5, seconds_per_step=None)["usd_spent"] >= 1.25
