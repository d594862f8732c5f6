"""The data-loading benchmark's quick path, per-object and skylift only: shape and completeness, not timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODES = ("bytes", "decoded")


@pytest.mark.slow
def test_quick_benchmark_delivers_every_sample_and_writes_the_json(tmp_path):
    output = tmp_path / "data_loading_quick.json"
    command = [sys.executable, "-m", "benchmarks.data_loading", "--quick", "--contenders", "per_object,skylift",
               "--train-steps", "0", "--output", str(output)]
    finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads(output.read_text())

    assert set(results["conditions"]) == {"loopback", "latency_50ms"}
    assert results["setup"]["dataset"]["images"] == 600
    for name, condition in results["conditions"].items():
        assert set(condition["contenders"]) == {"per_object", "skylift"}
        for contender, by_mode in condition["contenders"].items():
            assert set(by_mode) == set(MODES)
            for figures in by_mode.values():
                assert figures["samples_per_s"] > 0 and figures["mb_per_s"] > 0
                assert figures["moto_cpu_share"] >= 0 and "ratio_to_per_object" in figures
                if figures["expected_samples"] is not None:
                    assert figures["delivered_samples"] == figures["expected_samples"], (name, contender)
                else:
                    assert figures["delivered_samples"] >= figures["limit_samples"], (name, contender)
        assert condition["contenders"]["per_object"]["bytes"]["ratio_to_per_object"] == 1.0
    assert results["conditions"]["loopback"]["contenders"]["skylift"]["bytes"]["delivered_samples"] == 576
    assert any("skylift >= 10x per_object" in name for name in results["targets"])
    assert "proxy_cpu_share" in results["conditions"]["latency_50ms"]["contenders"]["skylift"]["bytes"]
