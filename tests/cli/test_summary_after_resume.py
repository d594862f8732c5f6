"""``summary.json`` across attempts (issue 41, item 12): a resumed attempt's throughput is its
own samples over its own time, and rerunning a finished run keeps the summary that finished it."""

from __future__ import annotations

import json

import pytest

QUICKSTART = "examples/quickstart.yaml"


def _run(cli_here, run_dir, epochs: int) -> dict:
    # 256 samples a step: 5 steps an epoch of the digits' 1,437 training samples.
    result = cli_here("run", QUICKSTART, "--json", "--no-doctor", "--set", f"run_dir={run_dir}",
                      "--set", f"schedule.epochs={epochs}", "--set", "data.global_batch_size=256",
                      "--set", "schedule.warmup_steps=0", "--set", "monitor.report=false",
                      "--set", "monitor.tensorboard=false")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_resumed_throughput_is_this_attempts_and_a_finished_run_keeps_its_summary(cli_here, tmp_path):
    run_dir = tmp_path / "run"
    first = _run(cli_here, run_dir, epochs=1)
    assert first["resumed_from_step"] is None and first["steps"] == 5

    resumed = _run(cli_here, run_dir, epochs=2)
    assert resumed["resumed_from_step"] == 5 and resumed["samples_seen"] == 2 * first["samples_seen"]
    this_attempt = resumed["samples_seen"] - first["samples_seen"]
    # Before: every sample of the run over this attempt's time (twice the true figure here).
    assert resumed["samples_per_s"] == pytest.approx(this_attempt / resumed["train_time_s"], rel=0.01)

    again = _run(cli_here, run_dir, epochs=2)  # finished: nothing to train
    assert again == resumed  # before: eval_metrics {} and the samples over a near-zero time
    assert again["eval_metrics"]["accuracy"] > 0
