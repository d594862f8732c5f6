"""``skylift bench`` on the quickstart: a real short run, summarised as a valid measurement file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skylift.plan.bench import BenchRequest, run_bench
from skylift.plan.measurement import BENCH_DIR, Measurement, find_latest

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"


@pytest.mark.slow
def test_bench_on_the_quickstart_writes_a_valid_measurement(tmp_path):
    request = BenchRequest(config_path=str(QUICKSTART), steps=3, output_dir=tmp_path)  # 3 warm-up + 3 = 6 steps
    _measurement, path = run_bench(request)
    saved = Measurement.model_validate(json.loads(path.read_text()))
    assert saved.measured_steps == 3 and saved.world_size == 1
    assert saved.samples_per_s > 0 and saved.step_time_s > 0
    assert abs(sum(saved.breakdown_s.values()) - saved.step_time_s) < 1e-9
    assert saved.flops_per_sample and saved.model_bytes and saved.checkpoint_save_s is not None
    assert saved.peak_host_memory_bytes and saved.allreduce_bytes_per_s
    # The loader's own CPU time per sample, the input term a GPU prediction uses (not the wall time).
    assert saved.input_cpu_s_per_sample is not None and saved.input_cpu_s_per_sample > 0
    # Memory traffic from the meta trace; its FLOPs, summed op by op, are the run's own count.
    assert saved.memory_bytes_per_sample > saved.memory_op_bytes_per_sample > 0
    from skylift.config import load_config
    from skylift.plan.traffic import trace_step_traffic

    traced = trace_step_traffic(load_config(str(QUICKSTART)), saved.micro_batch_size, half=False)
    assert traced.flops_per_sample == saved.flops_per_sample
    # The probed forward/backward curve: two micro-batches, two thread counts, real timings.
    curve = saved.forward_backward_curve
    assert curve["micro_batch_sizes"] == [saved.micro_batch_size // 2, saved.micro_batch_size]
    assert all(seconds > 0 for seconds in curve["seconds"])
    assert len(curve["thread_seconds"]) == (2 if saved.cpu_count >= 2 else 1)
    assert curve["fixed_s"] >= 0 and curve["per_sample_s"] >= 0
    assert find_latest(saved.config_fingerprint, tmp_path) == path
    # the run folder itself is a measurement too
    assert Measurement.load(saved.run_dir).config_fingerprint == saved.config_fingerprint
    assert not (BENCH_DIR / path.name).exists()
