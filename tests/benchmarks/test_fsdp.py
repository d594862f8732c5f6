"""The FSDP benchmark's quick path: shape and the figures that do not depend on this machine's speed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quick_benchmark_measures_both_strategies_and_writes_the_json(tmp_path, capsys, monkeypatch):
    # The benchmark's own processes are its two spawned ranks per strategy; the command that
    # starts them and writes the JSON runs in this process, as its start is not under test
    # (a Python start with torch and transformers costs more CPU than it does). ``state_kept``
    # puts back what it sets for the process (the seed it builds the model with, the thread
    # count); the glibc mmap threshold it sets for the ranks' environment is taken back here.
    from benchmarks.fsdp import main
    from tests.checkpoint.runs import state_kept

    monkeypatch.chdir(REPO_ROOT)
    output = tmp_path / "fsdp_quick.json"
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    try:
        with state_kept():
            code = main(["--quick", "--output", str(output)])
    finally:
        if threshold is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    results = json.loads(output.read_text())
    ddp, fsdp = results["runs"]["ddp"], results["runs"]["fsdp"]
    for run in (ddp, fsdp):
        # The memory model's prediction of the state is the state each rank holds: exact
        # for DDP; under FSDP within one row of each parameter (the quick model's rows
        # divide by two ranks, so exact too).
        assert run["state_total_bytes"] == run["predicted_state_bytes"]
        assert run["tracked_peak_bytes"] >= run["state_total_bytes"] and run["peak_rss_bytes"] > 0
        assert len(run["all_step_s"]) == results["workload"]["timed_steps"] and run["step_cpu_s"] > 0
        (save,) = run["checkpoint"]
        assert save["committed"] and save["step"] == results["workload"]["warmup_steps"] + 1 + \
            results["workload"]["timed_steps"] + 1
    assert (ddp["checkpoint_layout"], fsdp["checkpoint_layout"]) == ("replicated", "sharded")
    assert fsdp["state_total_bytes"] * 2 == ddp["state_total_bytes"]
    assert fsdp["tracked_peak_bytes"] < ddp["tracked_peak_bytes"]
    assert set(results["fsdp_over_ddp"]) == {"state_bytes", "tracked_peak_bytes", "peak_rss_bytes", "step_s",
                                             "step_cpu_s"}
