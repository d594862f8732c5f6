"""An elastic job's cost ledger (the nodes it holds) and its membership changes in the
report, on the records of a real run.

The run is real: the quickstart trained in this process twice (8 steps, then resumed to
16), as a worker of an elastic job priced for ``distributed.nodes.max`` = 2 nodes while it
holds 1. A two-node job cannot run here, so the ``membership`` record its resumed attempt
would write (2 -> 1 nodes after a notice) is inserted where the worker writes it: after
that attempt's first train record, with the seconds lost from the real records' times.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from skylift.monitor import plots
from skylift.monitor.attempts import run_figures, split_attempts
from skylift.monitor.report import membership_lines, write_report
from skylift.monitor.schema import read_records, validate_record

PRICE_USD_PER_HOUR = 7.2
ON_DEMAND_USD_PER_HOUR = 21.6
NODES = {"min": 1, "max": 2}
# Records round dollars to 6 decimals: half a unit of the last place, per rounded figure.
ROUNDING_USD = 5e-7


def _attempt(run_dir: Path, max_steps: int, *extra: str) -> tuple[float, int]:
    from skylift.cli.worker import main

    overrides = [f"run_dir={run_dir}", "schedule.warmup_steps=2", f"monitor.usd_per_hour={PRICE_USD_PER_HOUR}",
                 f"monitor.on_demand_usd_per_hour={ON_DEMAND_USD_PER_HOUR}",
                 f"distributed.nodes={{min: {NODES['min']}, max: {NODES['max']}}}", "monitor.report=false",
                 "checkpoint.every_steps=4", "checkpoint.every_minutes=null", "monitor.log_every_steps=2",
                 "monitor.tensorboard=false", f"schedule.max_steps={max_steps}"]
    started = time.time()
    argv = ["examples/quickstart.yaml", "--json", *extra]
    for item in overrides:
        argv += ["--set", item]
    return started, main(argv)


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("OMP_NUM_THREADS", "1")
    run_dir = tmp_path_factory.mktemp("elastic") / "run"
    first_started, first_code = _attempt(run_dir, 8)
    second_started, second_code = _attempt(run_dir, 16, "--resume", "auto")
    assert (first_code, second_code) == (0, 0)
    return run_dir, (first_started, second_started)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_each_attempt_pays_for_the_nodes_it_holds(elastic_run):
    run_dir, started = elastic_run
    records = list(read_records(run_dir / "metrics.jsonl"))
    attempts = split_attempts(records)
    assert len(attempts) == 2
    rate = PRICE_USD_PER_HOUR * (1 / NODES["max"])  # one node held of the two the price is for
    spent_before = 0.0
    for attempt, called_at in zip(attempts, started, strict=True):
        costs = attempt.of_kind("cost")
        assert costs, "a priced run writes cost records"
        for record in costs:
            validate_record(record)
            assert (record["nodes"], record["nodes_priced"]) == (attempt.start["num_nodes"], NODES["max"]) == (1, 2)
            assert record["usd_per_hour"] == rate
            assert record["on_demand_usd_per_hour"] == ON_DEMAND_USD_PER_HOUR * (1 / NODES["max"])
        last = costs[-1]
        # The ledger starts when the Trainer does: after this attempt was called, before its run_start.
        least = rate * (last["time"] - attempt.start["time"]) / 3600
        most = rate * (last["time"] - called_at) / 3600
        assert least - ROUNDING_USD <= last["attempt_usd"] <= most + ROUNDING_USD
        assert last["usd_spent"] == pytest.approx(spent_before + last["attempt_usd"], abs=2 * ROUNDING_USD)
        # Spot and on-demand are shared alike, so the savings are (on-demand / spot - 1) x spent.
        ratio = ON_DEMAND_USD_PER_HOUR / PRICE_USD_PER_HOUR
        assert last["savings_usd"] == pytest.approx((ratio - 1) * last["usd_spent"], abs=(ratio + 1) * ROUNDING_USD)
        spent_before = last["usd_spent"]


def _with_membership(run_dir: Path, target: Path) -> dict:
    """The run's records with the membership record a 2 -> 1 notice would add to attempt 2."""
    records = list(read_records(run_dir / "metrics.jsonl"))
    attempts = split_attempts(records)
    first_train = attempts[1].train[0]
    resumed = attempts[1].start["resumed_from_step"]
    last_before = max(r["time"] for r in attempts[0].train)
    membership = {"kind": "membership", "time": first_train["time"], "step": resumed, "old_world_size": 2,
                  "new_world_size": 1, "old_nodes": 2, "new_nodes": 1, "reason": "notice",
                  "seconds_lost": round(first_train["time"] - last_before, 3), "steps_lost": 0}
    validate_record(membership)
    at = records.index(first_train) + 1
    target.mkdir(parents=True)
    lines = [*records[:at], membership, *records[at:]]
    (target / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return membership


def test_the_report_shows_the_membership_change_and_the_nodes_charged(elastic_run, tmp_path):
    run_dir, _ = elastic_run
    folder = tmp_path / "with-membership"
    membership = _with_membership(run_dir, folder)
    report = write_report(folder)
    page = report.html_path.read_text()
    text = (f"2 → 1 nodes (2 → 1 ranks) at step {membership['step']}: notice, "
            f"{membership['seconds_lost']:.1f} s lost")
    assert report.membership == [membership]
    assert membership_lines(report.membership) == [text]
    assert f"<td>membership</td><td>1 change(s), {membership['seconds_lost']:.1f} s lost in all: {text}</td>" in page
    assert f"<td>2</td><td>step {membership['step']}</td><td>{text}</td>" in page  # attempt 2's row
    assert "<td>1</td><td>fresh</td><td>1</td>" in page  # attempt 1: one node, no change
    assert "<td>nodes charged</td><td>1 of 2 (the price is for 2)</td>" in page


def test_the_timeline_marks_the_change_where_it_happened(elastic_run, tmp_path):
    run_dir, _ = elastic_run
    membership = _with_membership(run_dir, tmp_path / "timeline")
    attempts = split_attempts(read_records(tmp_path / "timeline" / "metrics.jsonl"))
    axis = plots.TimeAxis(attempts)
    figure = plots.timeline_figure(attempts, axis)
    [ax] = figure.axes
    markers = [line for line in ax.get_lines() if line.get_label() == "membership change"]
    assert [(tuple(m.get_xdata()), tuple(m.get_ydata())) for m in markers] == [
        ((axis(membership["time"]),), (membership["step"],))]
    notes = [t.get_text() for t in ax.texts]
    assert f"2 → 1 ranks (notice)\n{membership['seconds_lost']:.1f} s lost" in notes
    assert "membership change" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_run_without_membership_records_shows_none(elastic_run):
    run_dir, _ = elastic_run
    figures = run_figures(split_attempts(read_records(run_dir / "metrics.jsonl")))
    assert figures.attempts == 2 and figures.membership == [] and membership_lines(figures.membership) == []
