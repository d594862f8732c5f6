"""Guards that stop money burning: each rule on recorded streams, and the budget guard and the
stall guard in real runs (the idle-GPU guard needs NVML figures: recorded streams only here)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from skylift.config.schema import GuardsConfig
from skylift.errors import EXIT_GUARD
from skylift.monitor.guards import (
    GuardWatch,
    budget_finding,
    idle_gpu_finding,
    resume_refusal,
    stall_finding,
)
from skylift.monitor.schema import validate_record
from tests.checkpoint.runs import records, train


def test_budget_reached_and_projected_past_the_margin():
    guards = GuardsConfig(budget_usd=100.0, budget_margin=0.1)
    assert budget_finding({"usd_spent": 50.0, "projected_usd_total": 109.0}, guards) is None
    projected = budget_finding({"usd_spent": 50.0, "projected_usd_total": 111.0}, guards)
    assert projected.stop and "projected $111.00" in projected.message
    reached = budget_finding({"usd_spent": 100.0, "projected_usd_total": None}, guards)
    assert reached.stop and "spent $100.00 of the $100.00 budget" in reached.message
    assert budget_finding({"usd_spent": 1e9}, GuardsConfig()) is None


def _system(time_s: float, *utilizations: float) -> dict:
    return {"kind": "system", "time": time_s, "node_rank": 0, "host": {},
            "gpus": [{"index": i, "name": "H100", "utilization_percent": u} for i, u in enumerate(utilizations)]}


def test_idle_gpu_needs_every_gpu_idle_over_the_whole_window():
    guards = GuardsConfig(idle_gpu_minutes=1.0, idle_gpu_utilization_pct=5.0, on_idle_gpu="stop")
    idle = [_system(t, 0.0, 3.0) for t in range(0, 61, 5)]
    finding = idle_gpu_finding(idle, guards, now_s=60.0)
    assert finding is not None and finding.stop and "under 5% for 1 min" in finding.message
    one_busy = [*idle[:-1], _system(60, 0.0, 40.0)]
    assert idle_gpu_finding(one_busy, guards, now_s=60.0) is None
    too_short = [_system(t, 0.0) for t in range(40, 61, 5)]  # 20 s of samples cannot show a minute
    assert idle_gpu_finding(too_short, guards, now_s=60.0) is None
    no_gpu = [{"kind": "system", "time": t, "gpus": []} for t in range(0, 61, 5)]
    assert idle_gpu_finding(no_gpu, guards, now_s=60.0) is None
    assert not idle_gpu_finding(idle, GuardsConfig(idle_gpu_minutes=1.0), now_s=60.0).stop  # warn by default


def test_stall_and_the_resume_refusal():
    guards = GuardsConfig(stall_minutes=2.0)
    assert stall_finding(119.0, guards) is None
    assert "no optimizer step for 2.0 min" in stall_finding(121.0, guards).message
    assert resume_refusal(4.99, GuardsConfig(budget_usd=5.0)) is None
    assert "raise monitor.guards.budget_usd" in resume_refusal(5.0, GuardsConfig(budget_usd=5.0))


def test_a_warning_guard_writes_one_valid_record_and_does_not_stop():
    written, stops = [], []
    watch = GuardWatch(GuardsConfig(idle_gpu_minutes=1.0), request_stop=lambda: stops.append(1),
                       write_record=written.append, run_dir=None, rank=0)
    for t in range(0, 70, 5):
        watch.observe(_system(float(t), 0.0))
    assert stops == [] and len(written) == 1
    validate_record({**written[0]})


def test_a_stalled_process_dumps_every_threads_stack(tmp_path):
    written = []
    watch = GuardWatch(GuardsConfig(stall_minutes=0.02), request_stop=lambda: None, write_record=written.append,
                       run_dir=tmp_path, rank=3)
    hung = threading.Event()
    threading.Thread(target=hung.wait, name="stuck-collective", daemon=True).start()
    watch.start()
    deadline = time.monotonic() + 30
    while not written and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.stop()
    hung.set()
    assert written and written[0]["guard"] == "stall" and written[0]["stop"] is False
    stacks = (tmp_path / "stall-rank3.txt").read_text()
    # faulthandler's format: a "Thread 0x..." block per thread, innermost frame first.
    assert stacks.count("Thread 0x") >= 2 and "line" in stacks and " in wait" in stacks


# $100 a second against a $1 budget: the first cost record (at the first flush, a few hundred ms
# after the process started) has spent it whatever the machine's speed, so the stop is the
# "spent" case (a stop on the projection alone leaves a resume that is not yet past the budget).
BUDGET = ("monitor.usd_per_hour=360000", "schedule.max_steps=2000", "schedule.epochs=200")
NO_REPORT = "monitor.report=false"  # the runs' HTML reports are never read here (~1.5 s of matplotlib each)


@pytest.mark.slow
def test_budget_guard_checkpoints_exits_3_and_refuses_to_resume_until_raised(tmp_path):
    run_dir = tmp_path / "run"
    stopped = train(run_dir, *BUDGET, "monitor.guards.budget_usd=1", NO_REPORT)
    assert stopped.returncode == EXIT_GUARD, stopped.stderr[-3000:]
    assert "stopped by a guard" in stopped.stderr
    (guard,) = records(run_dir, "guard")
    assert guard["guard"] == "budget" and guard["stop"] is True and guard["checkpoint_step"] == guard["step"]
    assert guard["message"].startswith("spent $") and "of the $1.00 budget" in guard["message"]
    assert (run_dir / "checkpoints" / f"step-{guard['step']}" / "manifest.json").exists()
    assert guard["step"] < 2000

    refused = train(run_dir, *BUDGET, "monitor.guards.budget_usd=1", NO_REPORT)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "already spent" in refused.stderr and "raise monitor.guards.budget_usd" in refused.stderr

    raised = train(run_dir, "monitor.usd_per_hour=360000", "schedule.max_steps=60", "monitor.guards.budget_usd=10000000",
                   NO_REPORT)
    assert raised.returncode == 0, raised.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from_step"] == guard["step"]


def test_a_budget_without_a_price_is_a_config_error(cli):
    result = cli("check", "examples/quickstart.yaml", "--set", "monitor.guards.budget_usd=5")
    assert result.returncode == 2 and "needs monitor.usd_per_hour" in result.stderr


@pytest.mark.parametrize("key", ["budget_usd=0", "on_stall=kill"])
def test_bad_guard_values_name_the_key(cli, key):
    result = cli("check", "examples/quickstart.yaml", "--set", f"monitor.guards.{key}")
    assert result.returncode == 2 and f"monitor.guards.{key.split('=')[0]}" in result.stderr
