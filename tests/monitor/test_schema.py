"""Every record a real run writes validates against the documented schema."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from skylift.config import load_config
from skylift.monitor.schema import BREAKDOWN_PHASES, read_records, validate_record
from skylift.train.trainer import Trainer


def monitored_config(run_dir, *overrides):
    base = [f"run_dir={run_dir}", "monitor.tensorboard=false", "monitor.progress_bar=off",
            "checkpoint.enabled=false", "preemption.enabled=false", "schedule.warmup_steps=2",
            "monitor.system_interval_s=0.05", "monitor.breakdown_every_steps=2", "monitor.log_every_steps=4",
            "monitor.usd_per_hour=2.5", "monitor.on_demand_usd_per_hour=8.0"]
    return load_config("examples/quickstart.yaml", [*base, *overrides])


@pytest.fixture(scope="module")
def run_records(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("monitored")
    Trainer(monitored_config(run_dir, "schedule.max_steps=24", "precision=fp32")).fit()
    return list(read_records(run_dir / "metrics.jsonl"))


def test_every_record_validates(run_records):
    kinds = [validate_record(record).kind for record in run_records]
    assert kinds[0] == "run_start"
    assert {"run_start", "train", "eval", "system", "cost", "diagnosis", "run_end"} <= set(kinds)


def test_breakdowns_cover_the_step(run_records):
    sampled = [r for r in run_records if r["kind"] == "train" and "breakdown_s" in r]
    assert [r["step"] for r in sampled] == list(range(2, 25, 2))
    for record in sampled:
        assert list(record["breakdown_s"]) == list(BREAKDOWN_PHASES)
        assert all(value >= 0 for value in record["breakdown_s"].values())
        # The window opens at the previous step's end, before this step's clock starts, and closes
        # at step_end, after it stops: it holds the step. Both are one wall clock on a CPU, so the
        # only slack is the record's rounding (seven phases and the step time, 0.5e-6 s each).
        assert sum(record["breakdown_s"].values()) >= record["step_time_s"] - 8 * 0.5e-6, record


def test_mfu_and_system_figures(run_records):
    start = run_records[0]
    peak = start["peak_flops_per_s"]
    assert peak > 1e9 and start["peak_flops_source"].startswith("measured:cpu-matmul")
    counted = [r for r in run_records if r["kind"] == "flops"]
    assert len(counted) == 1 and counted[0]["flops_per_sample"] > 0, counted
    assert counted[0]["reason"] == "counted on meta"
    train = [r for r in run_records if r["kind"] == "train"]
    assert train[0]["flops_per_step"] > 0
    for record in train:
        # MFU is the interval's achieved FLOP/s over one device's peak, below 1: a CPU's peak is
        # the best matmul rate per CPU-second this machine measured (skylift.monitor.cpu_peak),
        # so a core another process held while it was measured does not lower it.
        expected = counted[0]["flops_per_sample"] * record["samples_per_s"] / peak
        # The record rounds samples_per_s to 0.01 and mfu to four significant digits (at most
        # half a unit of the fourth: 5e-4 of the value); the tolerance is those two roundings.
        rounding = expected * 0.005 / record["samples_per_s"] + 5e-4 * expected
        assert 0 < record["mfu"] < 1 and record["mfu"] == pytest.approx(expected, rel=0, abs=rounding + 1e-12), record
    system = [r for r in run_records if r["kind"] == "system"]
    assert system and all(r["gpus"] == [] and 0 <= r["host"]["cpu_percent"] <= 100 for r in system)


def test_cost_accumulates(run_records):
    costs = [r for r in run_records if r["kind"] == "cost"]
    spent = [r["usd_spent"] for r in costs]
    assert spent == sorted(spent) and spent[-1] > 0
    assert costs[-1]["savings_usd"] > 0  # on demand costs more than 2.5 $/h


def test_bad_record_names_the_field():
    with pytest.raises(ValidationError, match="breakdown_s"):
        validate_record({"kind": "train", "time": 1.0, "step": 1, "epoch": 0, "loss": 1.0, "lr": 0.1,
                         "step_time_s": 0.1, "data_wait_s": 0.0, "samples_seen": 8, "samples_per_s": 80.0,
                         "breakdown_s": "slow"})


def test_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "eval", "time": 1, "step": 1, "epoch": 0}\n{"kind": "tra')
    assert [r["kind"] for r in read_records(path)] == ["eval"]


def test_a_torn_line_from_a_killed_attempt_does_not_swallow_the_next(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "time": 1, "step": 1, "epoch": 0}\n{"kind": "tra')
    Trainer(monitored_config(tmp_path, "schedule.max_steps=2", "precision=fp32")).fit()
    kinds = [r["kind"] for r in read_records(tmp_path / "metrics.jsonl")]
    assert kinds[:2] == ["eval", "run_start"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_ranks_breakdowns_are_gathered_to_rank_0(cli, tmp_path):
    # --no-doctor: its checks are tested on their own; its memory trace costs the launcher the
    # import of torch._dynamo, which it needs for nothing else.
    result = cli("run", "examples/quickstart.yaml", "--nproc", "2", "--json", "--no-doctor",
                 "--set", f"run_dir={tmp_path}", "--set", "schedule.max_steps=6", "--set", "schedule.warmup_steps=2",
                 "--set", "monitor.breakdown_every_steps=2",
                 "--set", "monitor.log_every_steps=3", "--set", "checkpoint.enabled=false",
                 "--set", "monitor.tensorboard=false", "--set", "precision=fp32", "--set", "monitor.report=false")
    assert result.returncode == 0, result.stderr[-2000:]
    records = list(read_records(tmp_path / "metrics.jsonl"))
    for record in records:
        validate_record(record)
    sampled = [r for r in records if r["kind"] == "train" and "breakdown_s" in r]
    assert [r["step"] for r in sampled] == [2, 4, 6]
    for record in sampled:
        by_rank = record["breakdown_by_rank_s"]
        assert len(by_rank) == 2 and by_rank[0] == record["breakdown_s"]
        assert all(set(rank) == set(BREAKDOWN_PHASES) for rank in by_rank)
    assert sum(1 for r in records if r["kind"] == "run_start") == 1  # rank 0 alone writes
    assert {r["node_rank"] for r in records if r["kind"] == "system"} == {0}
