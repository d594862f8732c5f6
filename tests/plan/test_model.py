"""Planner arithmetic on recorded measurements: nothing here depends on this machine's speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from skylift.catalog import load_catalog
from skylift.machine.memory import ModelMemory
from skylift.plan.measurement import Measurement
from skylift.plan.model import Target, predict_step
from skylift.plan.ranking import local_target, row_target

RECORDED = Path(__file__).parent / "data" / "quickstart_cpu_bench.json"


def measurement(**changes) -> Measurement:
    """A 1-process CPU measurement with round numbers (1 s steps)."""
    fields = {
        "config_path": "job.yaml", "config_fingerprint": "f", "created_at": 0.0, "device": "cpu", "device_name": "cpu",
        "precision": "fp32", "configured_precision": "fp32", "world_size": 1, "threads_per_process": 2, "cpu_count": 2,
        "global_batch_size": 64, "accumulation_steps": 1, "micro_batch_size": 64, "steps_per_epoch": 100, "measured_steps": 10,
        "step_time_s": 1.0, "samples_per_s": 64.0,
        "breakdown_s": {"data_wait": 0.1, "host_to_device": 0.0, "forward_backward": 0.6, "communication": 0.0,
                     "optimizer": 0.2, "checkpoint": 0.0, "other": 0.1},
        "peak_flops_per_s": 1e11, "flops_per_sample": 1e9, "mfu": 0.64, "model_bytes": 100 * 2**20,
        "peak_device_memory_bytes": None, "peak_host_memory_bytes": 3 * 2**30, "baseline_host_memory_bytes": 2**30,
        "checkpoint_save_s": 2.0, "host_memory_bandwidth_bytes_per_s": 2e10, "allreduce_bytes_per_s": 1e9, "run_dir": "r",
    }  # fmt: skip
    fields.update(changes)
    return Measurement(**fields)


def test_same_machine_one_process_predicts_the_measurement():
    m = measurement()
    prediction = predict_step(m, local_target(m, 1))
    assert prediction.step_time_s == pytest.approx(1.0)
    assert prediction.samples_per_s == pytest.approx(64.0)


def test_two_processes_split_samples_threads_bandwidth_and_add_a_ring_allreduce():
    m = measurement()
    prediction = predict_step(m, local_target(m, 2))
    parts = prediction.parts_s
    assert parts["compute"] == pytest.approx(0.6 * 0.5 * 2)  # half the samples, half the threads each
    assert parts["memory_bound"] == pytest.approx(0.2 * 2)  # full optimizer step on half the bandwidth
    assert parts["input"] == pytest.approx(0.1 * 0.5)  # in-process loading: samples only
    assert parts["communication"] == pytest.approx(2 * 1 / 2 * 100 * 2**20 / 1e9)
    assert parts["other"] == pytest.approx(0.1)


def test_one_thread_instead_of_two_doubles_compute():
    m = measurement()
    prediction = predict_step(m, local_target(m, 1, threads_per_process=1))
    assert prediction.parts_s["compute"] == pytest.approx(1.2)


def test_micro_batch_times_four_scales_per_sample_parts_only():
    m = measurement()
    prediction = predict_step(m, local_target(m, 1), global_batch_size=256)
    assert prediction.parts_s["compute"] == pytest.approx(0.6 * 4)
    assert prediction.parts_s["input"] == pytest.approx(0.1 * 4)
    assert prediction.parts_s["memory_bound"] == pytest.approx(0.2)
    assert prediction.samples_per_s == pytest.approx(256 / (2.4 + 0.4 + 0.2 + 0.1))


def test_gpu_target_scales_compute_by_peak_and_optimizer_by_bandwidth():
    m = measurement()
    row = next(row for row in load_catalog() if row.instance_type == "g6.xlarge")  # 1x L4
    target = row_target(row, m, nodes=1, efficiency=None)
    prediction = predict_step(m, target)
    assert prediction.parts_s["compute"] == pytest.approx(0.6 * 1e11 / 30.3e12)  # fp32 config: L4 fp32 peak
    assert prediction.parts_s["memory_bound"] == pytest.approx(0.2 * 2e10 / 300e9)
    assert any("efficiency measured on this cpu" in text for text in prediction.assumptions)


def test_given_efficiency_replaces_the_measured_one():
    m = measurement()
    row = next(row for row in load_catalog() if row.instance_type == "g6.xlarge")
    prediction = predict_step(m, row_target(row, m, nodes=1, efficiency=0.5))
    assert prediction.parts_s["compute"] == pytest.approx(1e9 * 64 / (30.3e12 * 0.5))


def test_multi_node_allreduce_uses_nvlink_inside_and_network_between_under_backward():
    # No input time: the bound is then between compute and communication.
    m = measurement(breakdown_s={"data_wait": 0.0, "host_to_device": 0.0, "forward_backward": 0.6,
                                 "communication": 0.0, "optimizer": 0.2, "checkpoint": 0.0, "other": 0.2})  # fmt: skip
    row = next(row for row in load_catalog() if row.instance_type == "p4d.24xlarge")  # 8 GPUs, 600 GB/s, 400 Gb/s
    prediction = predict_step(m, row_target(row, m, nodes=2, efficiency=None))

    def ring(size: float) -> float:
        return 2 * 7 / 8 * size / 300e9 + 2 * 1 / 2 * size / 50e9

    total, last_bucket = ring(m.model_bytes), ring(25 * 2**20)
    backward = prediction.parts_s["compute"] * 2 / 3  # backward: two thirds of forward + backward
    assert prediction.parts_s["communication"] == pytest.approx(last_bucket + max(0.0, total - last_bucket - backward))
    assert prediction.parts_s["communication"] < total
    assert prediction.bound == ("communication-bound" if total > backward else "compute-bound")


def test_a_cpu_allreduce_is_counted_in_full():
    m = measurement()
    prediction = predict_step(m, local_target(m, 2))
    assert prediction.parts_s["communication"] == pytest.approx(2 * 1 / 2 * m.model_bytes / 1e9)
    assert prediction.bound is None


def test_memory_fit_raises_accumulation_then_drops():
    # 1 GiB of fp32 weights under AdamW: 4 GiB of state (weights, gradients, two moments);
    # 0.25 GiB of saved activations per sample.
    m = measurement(device="cuda", device_name="NVIDIA A100")
    memory = ModelMemory(parameters=2**28, trainable_parameters=2**28, optimizer_state_copies=2,
                         saved_float_elements_per_sample=2**26)  # fmt: skip
    base = {"name": "gpu", "device": "cuda", "peak_flops_per_s": 1e14, "memory_bandwidth_bytes_per_s": 1e12, "vcpus_per_rank": 8}
    fits = predict_step(m, Target(**base, device_memory_bytes=40 * 2**30), memory=memory)
    assert fits.accumulation_steps == 1 and fits.dropped is None
    assert fits.memory.total_bytes == 4 * 2**30 + 64 * 2**28
    tight = predict_step(m, Target(**base, device_memory_bytes=16 * 2**30), memory=memory)
    # usable 14.4 GiB - 4 GiB state = 10.4 GiB; 16 GiB of activations -> 2 micro-steps of 32
    assert (tight.accumulation_steps, tight.micro_batch_size) == (2, 32)
    too_small = predict_step(m, Target(**base, device_memory_bytes=4 * 2**30), memory=memory)
    assert too_small.dropped.startswith("does not fit")
    unchecked = predict_step(m, Target(**base, device_memory_bytes=4 * 2**30))
    assert unchecked.dropped is None and any("memory fit not checked" in text for text in unchecked.assumptions)


def test_batch_that_does_not_divide_is_dropped():
    m = measurement(global_batch_size=60)
    assert "does not divide" in predict_step(m, local_target(m, 8)).dropped


def test_recorded_bench_file_predicts_itself():
    m = Measurement.load(RECORDED)
    prediction = predict_step(m, local_target(m, 1))
    assert prediction.step_time_s == pytest.approx(m.step_time_s)


CURVE = {"micro_batch_sizes": [32, 64], "seconds": [0.2, 0.3], "threads": 2, "fixed_s": 0.1, "per_sample_s": 0.003125,
         "thread_seconds": {"2": 0.3, "1": 0.45}}  # fmt: skip
"""A probed forward/backward: 0.1 s fixed + 3.125 ms per sample (0.3 s at 64), 1.5x slower on 1 thread."""


def test_a_probed_curve_keeps_the_fixed_part_when_the_batch_grows():
    m = measurement(forward_backward_curve=CURVE)  # the run's own phase is 0.6 s: the curve is scaled by 2
    prediction = predict_step(m, local_target(m, 1), global_batch_size=256)
    assert prediction.parts_s["compute"] == pytest.approx((0.1 + 0.003125 * 256) * 0.6 / 0.3)


def test_a_probed_thread_count_uses_the_probed_speed_up():
    m = measurement(forward_backward_curve=CURVE)
    one_thread = predict_step(m, local_target(m, 1, threads_per_process=1))
    assert one_thread.parts_s["compute"] == pytest.approx(0.6 * 0.45 / 0.3)
    # Two processes on the two cores: each takes half the samples on one thread.
    two = predict_step(m, local_target(m, 2))
    assert two.parts_s["compute"] == pytest.approx((0.1 + 0.003125 * 32) * 2 * 0.45 / 0.3)


def test_a_gpu_target_from_a_cpu_curve_rescales_all_of_it_and_says_so():
    m = measurement(forward_backward_curve=CURVE)  # no traced traffic: peak FLOP/s alone
    (row,) = [row for row in load_catalog() if row.instance_type == "g6.xlarge"]
    target = row_target(row, m, nodes=1, efficiency=None)
    prediction = predict_step(m, target)
    assert prediction.parts_s["compute"] == pytest.approx(0.6 * 1e11 / target.peak_flops_per_s)
    assert any("keeps the efficiency measured on this cpu" in line for line in prediction.assumptions)


def test_a_gpu_curve_keeps_its_fixed_part_on_another_gpu():
    m = measurement(device="cuda", device_name="NVIDIA L4", forward_backward_curve=CURVE)
    (row,) = [row for row in load_catalog() if row.instance_type == "p4d.24xlarge"]
    target = row_target(row, m, nodes=1, efficiency=None)
    prediction = predict_step(m, target, global_batch_size=64 * 8)  # 64 per GPU, as measured
    fixed = 0.1 * 2  # the curve scaled to the run's 0.6 s phase
    per_sample = 0.003125 * 64 * 2 * 1e11 / target.peak_flops_per_s
    assert prediction.parts_s["compute"] == pytest.approx(fixed + per_sample)
    assert any("launches and dispatch on the host" in line for line in prediction.assumptions)


def test_a_bench_without_flops_says_why_instead_of_nan():
    m = measurement(flops_per_sample=None, mfu=None)
    row = next(row for row in load_catalog() if row.instance_type == "g6.xlarge")
    prediction = predict_step(m, row_target(row, m, nodes=1, efficiency=None))
    texts = [text for text in prediction.assumptions if "efficiency measured on this cpu" in text]
    assert texts and all("nan" not in text for text in prediction.assumptions), prediction.assumptions
    assert "share of peak unknown: the bench has no FLOPs per sample" in texts[0]
