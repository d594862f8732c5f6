"""Ranking, spot arithmetic and the plan command, on recorded measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skylift.catalog import load_catalog
from skylift.cli.main import main
from skylift.plan.model import predict_step
from skylift.plan.ranking import PlanRequest, plan_candidates, predicted_hours, row_target
from tests.plan.test_model import RECORDED, measurement

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"


def rows(*names: str):
    return [row for row in load_catalog() if row.instance_type in names]


def test_hours_and_dollars_follow_from_the_step_time():
    m = measurement()
    (candidate,) = plan_candidates(m, rows("g6.xlarge"), PlanRequest(epochs=2, spot="never", node_counts=(1,)))
    step_s = candidate.prediction.step_time_s
    assert candidate.predicted_hours == pytest.approx(2 * 100 * step_s / 3600)
    assert candidate.predicted_usd == pytest.approx(0.8048 * candidate.predicted_hours)
    assert candidate.usd_per_epoch == pytest.approx(candidate.predicted_usd / 2)


def test_spot_adds_restarts_and_reports_the_saving():
    m = measurement(checkpoint_save_s=2.0)  # fits AWS's 120 s notice: no work lost
    request = PlanRequest(epochs=5000, spot="only", node_counts=(1,), interruptions_per_hour=0.1, restart_s=360.0)
    (spot,) = plan_candidates(m, rows("g6.xlarge"), request)
    plain_hours = predicted_hours(m, spot.prediction.step_time_s, 5000)
    assert spot.expected_interruptions == pytest.approx(0.1 * plain_hours)
    assert spot.predicted_hours == pytest.approx(plain_hours + spot.expected_interruptions * 360 / 3600)
    assert spot.spot_savings_usd == pytest.approx(0.8048 * plain_hours - 0.3653 * spot.predicted_hours)


def test_a_save_longer_than_the_notice_loses_half_a_checkpoint_interval():
    m = measurement(checkpoint_save_s=500.0)
    request = PlanRequest(epochs=5000, spot="only", node_counts=(1,), interruptions_per_hour=0.1, restart_s=0.0,
                          checkpoint_every_minutes=30.0)  # fmt: skip
    (spot,) = plan_candidates(m, rows("g6.xlarge"), request)
    plain_hours = predicted_hours(m, spot.prediction.step_time_s, 5000)
    assert spot.predicted_hours == pytest.approx(plain_hours + spot.expected_interruptions * 0.25)


def test_ranking_respects_deadline_and_budget():
    m = measurement()
    target = row_target(rows("g6.xlarge")[0], m, nodes=1, efficiency=None)
    hours = predicted_hours(m, predict_step(m, target).step_time_s, 1000)
    request = PlanRequest(epochs=1000, spot="never", node_counts=(1, 2), deadline_hours=hours * 1.01,
                          budget_usd=0.8048 * hours * 1.01)  # fmt: skip
    ranked = plan_candidates(m, rows("g6.xlarge", "p5.48xlarge"), request)
    runnable = [c for c in ranked if not c.dropped]
    assert [(c.instance, c.count) for c in runnable] == [("g6.xlarge", 1)]
    reasons = {(c.instance, c.count): " ".join(c.dropped) for c in ranked if c.dropped}
    assert "misses the deadline" in reasons[("g6.xlarge", 2)]
    assert "over budget" in reasons[("p5.48xlarge", 1)]
    assert ranked.index(runnable[0]) == 0


def test_unverified_price_is_dropped_with_the_reason_but_still_timed():
    ranked = plan_candidates(measurement(), rows("GN7.8XLARGE32"), PlanRequest(epochs=1, node_counts=(1,)))
    (candidate,) = ranked
    assert candidate.dropped == ["no price (price_unverified)"]
    assert candidate.predicted_hours is not None and candidate.predicted_usd is None


def test_plan_command_json_and_text_flag_unverified_prices(tmp_path, capsys):
    bench = measurement().save(tmp_path / "bench.json")
    common = ["plan", str(QUICKSTART), "--epochs", "10", "--bench", str(bench),
              "--instances", "ml.p3.16xlarge,ecs.gn6i-c8g1.2xlarge,GN7.8XLARGE32,g6.xlarge"]  # fmt: skip
    assert main([*common, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for candidate in plan["candidates"]:
        assert {"instance", "count", "spot", "predicted_samples_per_s", "predicted_hours", "predicted_usd"} <= set(candidate)
    unverified = [c for c in plan["candidates"] if c["price_status"] == "price_unverified"]
    assert {c["instance"] for c in unverified} == {"ml.p3.16xlarge", "ecs.gn6i-c8g1.2xlarge", "GN7.8XLARGE32"}
    assert main(common) == 0
    text = capsys.readouterr().out
    assert "no price (price_unverified)" in text and "assumptions:" in text and "price_unverified rows" in text


def test_plan_local_reads_a_recorded_bench(capsys):
    assert main(["plan", str(QUICKSTART), "--epochs", "1", "--bench", str(RECORDED), "--machine", "local",
                 "--nproc", "2", "--json"]) == 0  # fmt: skip
    (candidate,) = json.loads(capsys.readouterr().out)["candidates"]
    assert candidate["instance"] == "local" and candidate["count"] == 2 and candidate["predicted_samples_per_s"] > 0


@pytest.mark.parametrize(("flag", "value"), [("--deadline", "soon"), ("--instances", "p99.huge")])
def test_bad_flags_name_themselves(flag, value, capsys):
    assert main(["plan", str(QUICKSTART), "--epochs", "1", "--bench", str(RECORDED), flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_the_config_plan_section_sets_prices_rates_and_restarts_and_flags_win(tmp_path, capsys):
    prices = tmp_path / "prices.csv"
    prices.write_text("provider,instance_type,region,on_demand_usd_per_hour,spot_usd_per_hour\n"
                      "aws,g6.xlarge,us-east-1,0.5,0.25\n")
    config = tmp_path / "job.yaml"
    config.write_text(QUICKSTART.read_text() + f"plan:\n  price_file: {prices}\n"
                      "  interruptions_per_hour: {aws: 1.0}\n  restart_minutes: 30\n")
    bench = measurement().save(tmp_path / "bench.json")
    common = ["plan", str(config), "--epochs", "5000", "--bench", str(bench), "--instances", "g6.xlarge",
              "--spot", "only", "--json"]

    def spot_candidate(*flags):
        assert main([*common, *flags]) == 0
        (candidate,) = [c for c in json.loads(capsys.readouterr().out)["candidates"] if c["count"] == 1]
        return candidate

    from_config = spot_candidate()
    plain_hours = from_config["predicted_hours"] / (1 + 1.0 * 30 / 60)  # each interruption costs 30 min
    assert from_config["expected_interruptions"] == pytest.approx(1.0 * plain_hours)
    assert from_config["predicted_usd"] == pytest.approx(0.25 * from_config["predicted_hours"])
    overridden = spot_candidate("--interruptions-per-hour", "0.5", "--restart-minutes", "6")
    assert overridden["expected_interruptions"] == pytest.approx(0.5 * plain_hours)
    assert overridden["predicted_hours"] == pytest.approx(plain_hours * (1 + 0.5 * 6 / 60))


def test_a_bad_plan_section_names_the_field(tmp_path):
    from skylift.config import load_config
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match="plan.interruptions_per_hour"):
        load_config(str(QUICKSTART), ["plan.interruptions_per_hour=-1"])


def test_build_plan_takes_typed_choices_not_the_commands_namespace():
    """The library call a program makes without argparse: a frozen PlanChoices, left as given."""
    from skylift.plan.planning import PlanChoices, build_plan

    local = PlanChoices(config_path=str(QUICKSTART), epochs=1, bench=str(RECORDED), machine="local", nproc=2)
    (candidate,) = build_plan(local, log=print).candidates
    assert (candidate.instance, candidate.count) == ("local", 2) and candidate.predicted_hours > 0
    cloud = PlanChoices(config_path=str(QUICKSTART), epochs=10, bench=str(RECORDED), instances=("g6.xlarge",),
                        spot="never")
    plan = build_plan(cloud, log=print)
    assert {c.instance for c in plan.candidates} == {"g6.xlarge"} and not any(c.spot for c in plan.candidates)
    assert cloud.price_file is None, "the config's plan.price_file is read, not written into the choices"
