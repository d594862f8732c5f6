"""A measurement from a run folder counts the samples and FLOPs each step really held.

Under ``data.batching: token_budget`` a step holds as many texts as fit its budget (here
16 to 70 against ``data.global_batch_size: 64``) and each step has its own FLOPs; dividing
by the configured batch or pricing every step like the first misstates both."""

from __future__ import annotations

import json

import pytest

from skylift.plan.measurement import measurement_from_run_dir


def _run_folder(tmp_path, samples_per_step: list[int], flops_per_step: list[float], step_time_s: list[float]):
    (tmp_path / "config.yaml").write_text("data:\n  global_batch_size: 64\n  batching: token_budget\n")
    records = [{"kind": "run_start", "time": 0.0, "world_size": 2, "device": "cpu", "device_name": "test CPU",
                "precision": "fp32", "cpu_count": 2, "peak_flops_per_s": 1e10}]  # fmt: skip
    seen = 0
    for step, (samples, flops, seconds) in enumerate(zip(samples_per_step, flops_per_step, step_time_s, strict=False), start=1):
        seen += samples
        records.append({"kind": "train", "time": float(step), "step": step, "samples_seen": seen,
                        "flops_per_step": flops, "step_time_s": seconds})  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return tmp_path


def test_token_budget_steps_count_their_own_samples_and_flops(tmp_path):
    samples = [64, 64, 16, 70, 40, 30]  # steps 1-2 are warm-up
    flops = [9e9, 9e9, 2e9, 8e9, 5e9, 4e9]
    seconds = [3.0, 3.0, 1.0, 2.0, 1.5, 1.2]
    measured = measurement_from_run_dir(_run_folder(tmp_path, samples, flops, seconds), config_path="c.yaml")
    # Measured steps 3..6; the first of them starts the count, so steps 4..6 are summed.
    per_step = (70 + 40 + 30) / 3
    assert measured.measured_steps == 4
    assert measured.samples_per_s == pytest.approx(per_step / 1.35, rel=1e-12)  # median of 1.0, 2.0, 1.5, 1.2
    assert measured.flops_per_sample == pytest.approx(((8e9 + 5e9 + 4e9) / 3) / (per_step / 2), rel=1e-12)


def test_fixed_batches_give_the_configured_batch(tmp_path):
    measured = measurement_from_run_dir(_run_folder(tmp_path, [64] * 6, [6.4e9] * 6, [2.0] * 6), config_path="c.yaml")
    assert measured.samples_per_s == 64 / 2.0
    assert measured.flops_per_sample == pytest.approx(6.4e9 / 32, rel=1e-15)
