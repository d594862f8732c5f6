"""The plan's input-pipeline term: the loader's CPU time per sample measured on the bench
machine, spread over the target's loader workers and prefetched under the step, so a busy
bench machine (its wall-clock data wait) does not move a GPU's prediction."""

from __future__ import annotations

from pathlib import Path

import pytest

from skylift.catalog import load_catalog
from skylift.config import load_config
from skylift.data.autotune import default_candidates
from skylift.plan.bench import _add_input_cpu
from skylift.plan.measurement import Measurement
from skylift.plan.model import predict_step
from skylift.plan.ranking import local_target, row_target
from tests.plan.test_published import structured

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
BREAKDOWN = {"data_wait": 0.3, "host_to_device": 0.02, "forward_backward": 0.6, "communication": 0.0,
             "optimizer": 0.05, "checkpoint": 0.0, "other": 0.03}  # fmt: skip


def bench(data_wait_s: float = 0.3, **changes) -> Measurement:
    """A ResNet-50 CPU bench at 256 per step whose loader took ``input_cpu_s_per_sample`` of CPU."""
    return structured(breakdown_s={**BREAKDOWN, "data_wait": data_wait_s}, **changes)


def p3_16xlarge(m: Measurement):
    row = next(row for row in load_catalog() if row.instance_type == "p3.16xlarge")  # 8 V100s, 64 vCPUs
    return row_target(row, m, nodes=1, efficiency=None)


def rest_of_step(parts: dict[str, float]) -> float:
    return sum(seconds for name, seconds in parts.items() if name != "input")


@pytest.mark.parametrize("workers", [0, 4])
def test_a_busy_bench_machine_does_not_move_the_gpu_prediction(workers):
    quiet = bench(input_cpu_s_per_sample=3e-3, data_num_workers=workers)
    busy = bench(data_wait_s=2 * BREAKDOWN["data_wait"], input_cpu_s_per_sample=3e-3, data_num_workers=workers)
    for target_of in (p3_16xlarge, lambda m: local_target(m, 1)):
        calm, loaded = predict_step(quiet, target_of(quiet)), predict_step(busy, target_of(busy))
        # Same arithmetic on the same inputs (the wall-clock wait is not one of them): bitwise.
        assert loaded.step_time_s == calm.step_time_s and loaded.parts_s == calm.parts_s
        assert loaded.bound == calm.bound


def test_a_bench_that_could_not_time_the_input_uses_the_wall_time_and_says_so():
    old, busy = bench(), bench(data_wait_s=2 * BREAKDOWN["data_wait"])
    assert old.input_cpu_s_per_sample is None  # a bench whose epoch was too short to time
    calm, loaded = predict_step(old, p3_16xlarge(old)), predict_step(busy, p3_16xlarge(busy))
    # In-process loading: the wall wait and copy of 256 samples, scaled to the 32 each of 8 ranks gets.
    measured_s = BREAKDOWN["data_wait"] + BREAKDOWN["host_to_device"]
    assert calm.parts_s["input"] == pytest.approx(measured_s * (256 / p3_16xlarge(old).world_size) / 256)
    assert loaded.step_time_s > calm.step_time_s
    assert any("no CPU time of the input pipeline" in text and "bench again" in text for text in calm.assumptions)


@pytest.mark.parametrize("configured", [4, 16, "auto"])
def test_input_bound_exactly_when_the_workers_share_outlasts_the_rest_of_the_step(configured):
    probe = bench(input_cpu_s_per_sample=0.0, data_num_workers=configured)
    target = p3_16xlarge(probe)
    # One vCPU a rank stays with the training process; auto tunes up to default_candidates' top there.
    wanted = default_candidates(int(target.vcpus_per_rank * target.ranks_per_node))[-1] if configured == "auto" \
        else configured
    workers = min(wanted, target.vcpus_per_rank - 1)
    rest_s = rest_of_step(predict_step(probe, target).parts_s)
    samples_per_rank = 256 / target.world_size
    copy_s = 0.0  # a CPU bench makes no host-to-device copy (its phase is a memory-format change)
    for share in (0.5, 1.5):  # the workers' share of the loader's CPU time against the rest of the step
        cpu_per_sample = share * rest_s * workers / samples_per_rank
        prediction = predict_step(bench(input_cpu_s_per_sample=cpu_per_sample, data_num_workers=configured), target)
        assert rest_of_step(prediction.parts_s) == pytest.approx(rest_s, rel=1e-12)  # the input moves nothing else
        exposed = max(0.0, cpu_per_sample * samples_per_rank / workers - rest_s)
        assert prediction.parts_s["input"] == pytest.approx(copy_s + exposed, rel=1e-9)
        assert prediction.step_time_s == pytest.approx(rest_s + copy_s + exposed, rel=1e-9)
        assert (prediction.bound == "input-bound") is (share > 1)


def test_in_process_loading_adds_its_cpu_time_to_the_step():
    cpu_per_sample = 2e-3
    in_process = bench(input_cpu_s_per_sample=cpu_per_sample, data_num_workers=0)
    with_workers = bench(input_cpu_s_per_sample=cpu_per_sample, data_num_workers=4)
    target = p3_16xlarge(in_process)
    samples_per_rank = 256 / target.world_size
    copy_s = 0.0  # a CPU bench makes no host-to-device copy
    added = predict_step(in_process, target)
    rest_s = rest_of_step(added.parts_s)
    assert added.parts_s["input"] == pytest.approx(cpu_per_sample * samples_per_rank + copy_s, rel=1e-9)
    assert added.step_time_s == pytest.approx(rest_s + cpu_per_sample * samples_per_rank + copy_s, rel=1e-9)
    assert any("data.num_workers 0" in text and "as fast as this machine's cores" in text for text in added.assumptions)
    # The same CPU time over 4 workers is prefetched under the step here (64 ms / 4 < the rest).
    hidden = predict_step(with_workers, target)
    assert cpu_per_sample * samples_per_rank / 4 < rest_s
    assert hidden.parts_s["input"] == pytest.approx(copy_s, rel=1e-9) and hidden.bound != "input-bound"
    assert any("host-to-device copy is not predicted" in text for text in hidden.assumptions)
    # On this CPU itself the measured phase is the same work: it adds as measured.
    local = predict_step(in_process, local_target(in_process, 1))
    assert local.parts_s["input"] == pytest.approx(cpu_per_sample * 256 + BREAKDOWN["host_to_device"], rel=1e-9)


def test_the_bench_measures_the_loaders_cpu_time_per_sample():
    config = load_config(str(QUICKSTART)).model_dump(mode="json")
    m = structured(micro_batch_size=8, notes=[])
    _add_input_cpu(m, config)
    assert m.input_cpu_s_per_sample is not None and m.input_cpu_s_per_sample > 0, m.notes


def test_an_epoch_too_short_to_time_leaves_a_note_not_a_figure():
    config = load_config(str(QUICKSTART), ["data.global_batch_size=512"]).model_dump(mode="json")
    m = structured(micro_batch_size=512, notes=[])  # 1,437 training digits: 3 micro-batches, all untimed warm-up
    _add_input_cpu(m, config)
    assert m.input_cpu_s_per_sample is None
    assert any("input pipeline CPU time: not measured" in note and "recipe.num_samples" in note for note in m.notes)
