"""The plan's spot term for an elastic job: an interruption costs one node's relaunch and two
stops of the workers, not the whole job's wait; at its minimum (or past its maximum) the
job waits whole, as a fixed one does. Every expected figure is the formula on its inputs."""

from __future__ import annotations

import json

import pytest

from skylift.cli.main import main
from skylift.plan.ranking import DEFAULT_WORKER_RESTART_S, PlanRequest, plan_candidates, predicted_hours
from tests.plan.test_model import measurement
from tests.plan.test_ranking import QUICKSTART, rows

EPOCHS, RATE_PER_HOUR, RESTART_S, WORKER_RESTART_S = 5000, 0.1, 600.0, 45.0


def _spot(nodes: int, elastic: tuple[int, int] | None):
    # checkpoint_save_s fits AWS's 120 s notice, so no work is lost in either case.
    request = PlanRequest(epochs=EPOCHS, spot="only", node_counts=(nodes,), interruptions_per_hour=RATE_PER_HOUR,
                          restart_s=RESTART_S, elastic_nodes=elastic, worker_restart_s=WORKER_RESTART_S)
    [row] = rows("g6.xlarge")
    [candidate] = plan_candidates(measurement(checkpoint_save_s=2.0), [row], request)
    return candidate, row


def test_an_elastic_interruption_costs_one_nodes_relaunch_and_two_worker_stops():
    nodes = 4
    elastic, row = _spot(nodes, (1, nodes))
    fixed, _ = _spot(nodes, None)
    plain = predicted_hours(measurement(checkpoint_save_s=2.0), elastic.prediction.step_time_s, EPOCHS)
    interruptions = RATE_PER_HOUR * plain * nodes  # per instance-hour, any of the nodes
    assert elastic.expected_interruptions == pytest.approx(interruptions)
    assert elastic.predicted_hours == pytest.approx(
        plain + interruptions * (RESTART_S / nodes + 2 * WORKER_RESTART_S) / 3600)
    assert fixed.predicted_hours == pytest.approx(plain + interruptions * RESTART_S / 3600)
    # In dollars: the fixed job pays every node through the restart; the elastic one pays one
    # node's relaunch, and every node through its two worker stops.
    node_usd_per_s = row.price(True) / 3600
    saved = interruptions * node_usd_per_s * (nodes * RESTART_S - (RESTART_S + nodes * 2 * WORKER_RESTART_S))
    assert fixed.predicted_usd - elastic.predicted_usd == pytest.approx(saved)


@pytest.mark.parametrize(("nodes", "elastic"), [(2, (2, 4)), (4, (1, 2))])
def test_at_its_minimum_or_past_its_maximum_the_job_waits_whole(nodes, elastic):
    assert _spot(nodes, elastic)[0].predicted_hours == pytest.approx(_spot(nodes, None)[0].predicted_hours)


def test_the_plan_takes_the_node_range_from_the_config_and_names_the_assumption(tmp_path, capsys):
    bench = measurement(checkpoint_save_s=2.0).save(tmp_path / "bench.json")
    argv = ["plan", str(QUICKSTART), "--epochs", str(EPOCHS), "--bench", str(bench), "--instances", "g6.xlarge",
            "--spot", "only", "--interruptions-per-hour", str(RATE_PER_HOUR), "--restart-minutes",
            str(RESTART_S / 60), "--set", "distributed.nodes={min: 1, max: 2}", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    [line] = [text for text in plan["assumptions"] if text.startswith("elastic job")]
    assert "distributed.nodes 1..2" in line and f"{DEFAULT_WORKER_RESTART_S:g} s" in line
    by_count = {c["count"]: c for c in plan["candidates"]}
    two, one = by_count[2], by_count[1]
    plain_two = two["predicted_hours"] - two["expected_interruptions"] * (RESTART_S / 2 + 2 * DEFAULT_WORKER_RESTART_S) / 3600
    assert two["expected_interruptions"] == pytest.approx(RATE_PER_HOUR * plain_two * 2)
    # One node is the minimum: losing it stops the job, which waits out the whole restart.
    plain_one = one["predicted_hours"] / (1 + RATE_PER_HOUR * RESTART_S / 3600)
    assert one["expected_interruptions"] == pytest.approx(RATE_PER_HOUR * plain_one)
