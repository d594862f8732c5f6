"""The published-rows table, the GPU model fitted to it, and the plan's use of both."""

from __future__ import annotations

import json
import math

import pytest

from skylift.catalog import load_catalog
from skylift.cli.main import main
from skylift.plan.calibration import fit_gpu_model, node_scaling, predict_row, shipped_gpu_model
from skylift.plan.ddp import BUCKET_BYTES, ddp_communication
from skylift.plan.model import predict_step
from skylift.plan.published import PublishedRow, load_published, load_structures, pairs_for_scaling
from skylift.plan.ranking import PlanRequest, plan_candidates, row_target
from tests.plan.test_model import measurement
from tests.plan.test_ranking import QUICKSTART


def structured(workload: str = "resnet50_v1.5_224", batch: int = 256, half: bool = False, **changes):
    """A CPU bench whose traced structure is the published workload's."""
    structure = load_structures()[(workload, half, batch)]
    fields = {"memory_op_bytes_per_sample": structure.memory_op_bytes_per_sample, "traffic_half": half,
              "conv_flops_per_sample": structure.conv_flops_per_sample,
              "intensity_bins": list(structure.intensity_bins), "flops_per_sample": structure.flops_per_sample,
              "traced_ops_per_micro_step": structure.ops_per_micro_step, "channels_last": True,
              "model_bytes": int(structure.model_bytes), "global_batch_size": batch, "micro_batch_size": batch}  # fmt: skip
    return measurement(**{**fields, **changes})


def test_every_row_loads_validates_and_has_a_pinned_source():
    rows = load_published()
    assert len(rows) >= 40 and len({row.row_id for row in rows}) == len(rows)
    for row in rows:
        assert len(row.source_commit) == 40 and row.source_repo and row.source_path and row.source_date
        assert row.per_gpu == pytest.approx(row.throughput / row.gpu_count)
        if row.figure == "derived":
            assert "/" in row.note or "median" in row.note, f"{row.row_id}: a derived figure says its arithmetic"
        if row.use == "reference":
            assert row.note, f"{row.row_id}: a reference row says why it does not calibrate"


def test_every_row_has_a_traced_structure():
    structures = load_structures()
    missing = [row.row_id for row in load_published()
               if (row.workload, row.half, row.batch_per_gpu) not in structures]  # fmt: skip
    assert not missing


def test_a_bad_row_names_the_field():
    row = load_published()[0].model_dump()
    with pytest.raises(ValueError, match="gpu") as error:
        PublishedRow.model_validate({**row, "gpu": "a100"})
    assert "a100-sxm-80gb" in str(error.value)  # the table's entries, to pick from


def test_the_shipped_structure_is_what_the_trace_gives():
    """The CSV the plan reads is the meta trace of the same model (shape arithmetic: exact)."""
    from skylift.plan.published_trace import trace_structure

    shipped = load_structures()[("resnet50_v1.5_224", True, 256)]
    assert trace_structure("resnet50_v1.5_224", True, 256) == shipped


@pytest.mark.parametrize("held_out", ["a100-sxm-80gb", "v100-sxm-32gb", "a100"])
def test_leave_one_out_never_sees_the_held_out_rows(held_out):
    """The held-out rows are out of every factor: doubling their published throughput
    leaves their leave-one-out prediction where it was, and moves the in-sample one."""
    rows = load_published()
    doubled = tuple(row.model_copy(update={"throughput": 2 * row.throughput}) if held_out in (row.gpu, row.family)
                    else row for row in rows)  # fmt: skip
    held = [row for row in rows if held_out in (row.gpu, row.family) and row.use == "calibrate"]
    out, out_doubled = fit_gpu_model(rows, hold_out=held_out), fit_gpu_model(doubled, hold_out=held_out)
    for factors in out.kinds.values():
        assert not {row.row_id for row in held} & {*factors.rows, *factors.scaling_rows}
    assert [predict_row(row, out) for row in held] == [predict_row(row, out_doubled) for row in held]
    inside, inside_doubled = fit_gpu_model(rows), fit_gpu_model(doubled)
    assert all(predict_row(row, inside_doubled) > 1.05 * predict_row(row, inside) for row in held)


def test_factors_are_readable_and_bounded():
    model = shipped_gpu_model()
    assert set(model.kinds) == {"conv", "gemm"}
    for factors in model.kinds.values():
        assert 0 < factors.compute_share <= 1.0
        assert factors.rows and all(row.startswith("dle-") for row in factors.rows)
        text = factors.describe()
        assert "of peak" in text and all(row in text for row in factors.rows)


def test_in_node_scaling_grows_with_log2_of_the_gpus():
    factors = shipped_gpu_model().kinds["conv"]
    alpha = factors.scaling["half"]
    assert node_scaling(factors, "bf16", 1) == 1.0
    assert node_scaling(factors, "bf16", 8) == pytest.approx(1 + 3 * alpha)
    assert node_scaling(factors, "bf16", 16) == pytest.approx(1 + 4 * alpha)


def test_every_pair_is_one_and_n_gpus_of_the_same_configuration():
    for single, multi in pairs_for_scaling(load_published()):
        assert single.gpu_count == 1 < multi.gpu_count
        assert (single.gpu, single.precision, single.batch_per_gpu, single.source_commit) == \
            (multi.gpu, multi.precision, multi.batch_per_gpu, multi.source_commit)


def test_ddp_hides_all_but_the_last_bucket_until_the_allreduce_outlasts_backward():
    links = ((8, 100e9),)
    gradient = 100 * 2**20
    ring = 2 * 7 / 8 / 100e9  # seconds per byte of a ring all-reduce over 8 ranks
    slow_compute = ddp_communication(gradient_bytes=gradient, links=links, overlaps=True, compute_s=1.0,
                                     accumulation_steps=1)  # fmt: skip
    assert slow_compute.exposed_s == pytest.approx(ring * BUCKET_BYTES) and slow_compute.bound == "compute-bound"
    fast_compute = ddp_communication(gradient_bytes=gradient, links=links, overlaps=True, compute_s=0.0,
                                     accumulation_steps=1)  # fmt: skip
    assert fast_compute.exposed_s == pytest.approx(ring * gradient) and fast_compute.bound == "communication-bound"
    on_cpu = ddp_communication(gradient_bytes=gradient, links=links, overlaps=False, compute_s=1.0,
                               accumulation_steps=1)  # fmt: skip
    assert on_cpu.exposed_s == pytest.approx(ring * gradient)


def test_a_gpu_prediction_does_not_move_when_the_bench_machine_is_busy():
    m = structured()
    busy = m.model_copy(update={"breakdown_s": {phase: 2 * seconds for phase, seconds in m.breakdown_s.items()},
                                "step_time_s": 2 * m.step_time_s, "other_load_share": 0.5})  # fmt: skip
    row = next(row for row in load_catalog() if row.instance_type == "p4d.24xlarge")
    quiet_prediction = predict_step(m, row_target(row, m, nodes=1, efficiency=None))
    busy_prediction = predict_step(busy, row_target(row, busy, nodes=1, efficiency=None))
    assert quiet_prediction.parts_s["compute"] == busy_prediction.parts_s["compute"]  # same arithmetic: exact
    assert quiet_prediction.calibrated_by and all(row_id.startswith("dle-rn50") for row_id in
                                                  quiet_prediction.calibrated_by)  # fmt: skip


def test_the_plan_path_predicts_a_published_row_as_the_calibration_does():
    """One GPU, the row's batch: the step model's compute is the calibrated forward/backward."""
    published = next(row for row in load_published() if row.row_id == "dle-rn50-2103-a100-80-1x-amp")
    m = structured(half=True, configured_precision="fp16")
    catalog_row = next(row for row in load_catalog() if row.instance_type == "Standard_NC24ads_A100_v4")
    prediction = predict_step(m, row_target(catalog_row, m, nodes=1, efficiency=None))
    # That instance's GPU is the A100 80GB PCIe card: the published row put on it. The same
    # arithmetic in another order: equal to rounding (1e-9 is a million times float64's).
    row_s = 256 / predict_row(published.model_copy(update={"gpu": "a100-pcie-80gb"}), shipped_gpu_model())
    assert prediction.parts_s["compute"] == pytest.approx(row_s, rel=1e-9)


def test_plan_prints_the_rows_and_the_cheapest_zone(tmp_path, capsys):
    bench = structured(global_batch_size=64, micro_batch_size=64,
                       intensity_bins=list(load_structures()[("resnet50_v1.5_224", False, 256)].intensity_bins))
    path = bench.save(tmp_path / "bench.json")
    common = ["plan", str(QUICKSTART), "--epochs", "1", "--bench", str(path), "--instances", "p3.2xlarge,p4d.24xlarge"]
    assert main([*common, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    spot = [c for c in plan["candidates"] if c["spot"] and not c["dropped"]]
    assert spot and all(c["spot_cheapest_zone"] and c["spot_cheapest_usd_per_hour"] <= c["usd_per_hour"] for c in spot)
    assert all(c["calibrated_by"] for c in plan["candidates"] if not c["dropped"])
    assert set(plan["gpu_model"]) == {"conv"} and plan["gpu_model"]["conv"]["rows"]
    assert main(common) == 0
    text = capsys.readouterr().out
    assert "calibrated by (skylift/plan/published.csv):" in text and "dle-rn50-2103-a100-80-1x-amp" in text
    assert "(cheapest " in text and "GPU model, conv:" in text


def test_a_bench_without_the_structure_says_why_and_scales_instead():
    m = measurement()  # no traced traffic
    row = next(row for row in load_catalog() if row.instance_type == "g6.xlarge")
    prediction = predict_step(m, row_target(row, m, nodes=1, efficiency=None))
    assert not prediction.calibrated_by
    assert any("GPU model not used" in text and "no traced structure" in text for text in prediction.assumptions)
    candidates = plan_candidates(m, [row], PlanRequest(epochs=1))
    assert all(not math.isnan(c.prediction.samples_per_s or 0.0) for c in candidates)


def test_a_gpu_bench_keeps_its_time_on_its_own_gpu_and_is_re_timed_by_the_model_on_another():
    from skylift.machine.gpus import gpu_spec
    from skylift.plan.calibration import JobStructure, seconds_per_sample
    from skylift.plan.model import Target

    m = structured(half=True, device="cuda", device_name="NVIDIA A100-SXM4-80GB", precision="bf16",
                   configured_precision="bf16")  # fmt: skip
    measured_s = m.breakdown_s["forward_backward"]

    def target(gpu: str) -> Target:
        spec = gpu_spec(gpu)
        return Target(name=gpu, device="cuda", peak_flops_per_s=spec.peak_flops_per_s("bf16"),
                      memory_bandwidth_bytes_per_s=spec.memory_bandwidth_bytes_per_s, vcpus_per_rank=8, gpu_model=gpu)

    same = predict_step(m, target("NVIDIA A100-SXM4-80GB"))
    assert same.parts_s["compute"] == pytest.approx(measured_s, rel=1e-12)
    other = predict_step(m, target("Tesla V100-SXM2-16GB"))
    structure = load_structures()[("resnet50_v1.5_224", True, 256)]
    job = JobStructure.of(structure, "channels_last")
    factors = shipped_gpu_model().kinds["conv"]

    def model_s(gpu: str) -> float:
        return sum(seconds_per_sample(job, gpu_spec(gpu), "bf16", factors, 256).values())

    ratio = model_s("Tesla V100-SXM2-16GB") / model_s("NVIDIA A100-SXM4-80GB")
    assert other.parts_s["compute"] == pytest.approx(measured_s * ratio, rel=1e-9)


def test_an_input_pipeline_slower_than_the_gpu_is_called_input_bound():
    m = structured(breakdown_s={"data_wait": 5.0, "host_to_device": 0.0, "forward_backward": 0.4, "communication": 0.0,
                                "optimizer": 0.05, "checkpoint": 0.0, "other": 0.05})  # fmt: skip
    row = next(row for row in load_catalog() if row.instance_type == "p4d.24xlarge")
    prediction = predict_step(m, row_target(row, m, nodes=1, efficiency=None))
    assert prediction.parts_s["input"] > prediction.parts_s["compute"] and prediction.bound == "input-bound"
    quiet = predict_step(structured(), row_target(row, m, nodes=1, efficiency=None))
    assert quiet.bound == "compute-bound"
