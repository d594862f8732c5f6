"""``skylift plan`` against published GPU measurements, from a bench on this CPU.

For each published row (``skylift/plan/published.csv``) whose workload skylift can
express, the workload is benched here and ``skylift plan``'s step model predicts the
published configuration (GPU, count, precision, memory format, batch per GPU):

- ResNet-50 v1.5 at 224 px: a real ``skylift bench`` on this CPU (micro-batch 4,
  synthetic images; the GPU prediction takes the job's traced structure from it, not
  this CPU's speed). The NCHW rows use the same bench with ``channels_last`` off: the
  meta trace is the same in both layouts, the flag is what the GPU model reads
  (``--both-formats`` benches NCHW too, for another few minutes);
- BERT-large at sequence 384 (SQuAD): traced on ``meta`` only, the structure the bench
  would record (a CPU step of BERT-large at 384 takes tens of seconds here).

BERT-base at 128 has no published PyTorch training throughput in NVIDIA's tables (GLUE
is published as time-to-train only), so it has no row.

The plan column is ``skylift plan``'s whole step model (``predict_step``: compute,
optimizer from the parameter count, the overlapped all-reduce) less its input part: the
published systems fed each GPU from the many cores of a DGX, while this bench loads
synthetic images in the training process on a shared laptop core (the input part is
kept in the JSON).

Errors are predicted / published - 1 per GPU, three ways: in-sample (the factors fitted
on every calibrated row), **leave-one-GPU-out** (each GPU's rows predicted by factors
fitted without any row of that GPU: ``a100-sxm-80gb``), and leave-one-family-out (without
any row of the family: every A100, every V100). Targets: mean |error| <= 10% and every
row within 20%, leave-one-GPU-out. ``reference`` rows (MXNet MLPerf, NVIDIA's fused
pre-training, torchtitan's Llama 3.1 8B) are printed beside, outside the targets.

Then both cross-validations over every row, calibrated and reference, side by side
(:func:`cross_validate`): **leave-one-workload-out** (each workload's rows predicted by a
fit on the calibrated rows of the other workloads) and leave-one-GPU-out, each with the
rows, workloads and GPUs behind it and its worst rows (``cross_validation`` in the JSON).

    python -m benchmarks.plan_published                      # benchmarks/results/plan_published.json
    python -m benchmarks.plan_published --refresh-structure  # re-trace published_structure.csv first
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from skylift.plan.calibration import GpuModel, fit_gpu_model, predict_row
from skylift.plan.measurement import Measurement
from skylift.plan.model import Target, predict_step
from skylift.plan.published import PublishedRow, load_published

TARGET_MEAN, TARGET_WORST = 0.10, 0.20
RESNET = ("examples/resnet18_synthetic.yaml", ["recipe.model=resnet50", "recipe.num_classes=1000", "recipe.image_size=224",
                                               "recipe.num_samples=64", "data.global_batch_size=4"])  # fmt: skip
"""ResNet-50 v1.5 (torchvision's) at 224 px on synthetic images, 4 per step: the bench's structure."""

_PRECISION = {"amp": "fp16", "tf32": "tf32", "fp32": "fp32"}
"""The config precision of each published precision (AMP: fp16 on V100, bf16 on A100: one peak)."""


def bench_resnet(channels_last: bool, folder: Path) -> Measurement:
    """A real ``skylift bench`` of ResNet-50 at 224 px on this CPU (2 measured steps)."""
    from skylift.plan.bench import BenchRequest, run_bench

    config, overrides = RESNET
    request = BenchRequest(config_path=config, overrides=[*overrides, f"channels_last={str(channels_last).lower()}"],
                           steps=2, measure_save=False, output_dir=folder)  # fmt: skip
    return run_bench(request)[0]


def traced_measurement(workload: str, batch: int) -> Measurement:
    """What a bench records of the job's structure, from the meta trace alone (no step run)."""
    from skylift.plan.published import load_structures

    structures = load_structures()
    half = (workload, False, batch) not in structures
    structure = structures[(workload, half, batch)]
    return Measurement(
        config_path=workload, config_fingerprint="traced", created_at=time.time(), device="cpu", device_name="meta trace",
        precision="fp32", configured_precision="auto", world_size=1, threads_per_process=1, cpu_count=1,
        global_batch_size=batch, accumulation_steps=1, micro_batch_size=batch, steps_per_epoch=1, measured_steps=0,
        step_time_s=0.0, samples_per_s=0.0, breakdown_s={}, peak_flops_per_s=None,
        flops_per_sample=structure.flops_per_sample, mfu=None, model_bytes=int(structure.model_bytes),
        peak_device_memory_bytes=None, peak_host_memory_bytes=None, checkpoint_save_s=None, run_dir="",
        memory_op_bytes_per_sample=structure.memory_op_bytes_per_sample, traffic_half=half,
        conv_flops_per_sample=structure.conv_flops_per_sample, intensity_bins=list(structure.intensity_bins),
        traced_ops_per_micro_step=structure.ops_per_micro_step, channels_last=False, activation_checkpointing=False,
        notes=["traced on meta: no step was run"],
    )  # fmt: skip


def row_target(row: PublishedRow) -> Target:
    """The published system as the planner sees it (one node of ``gpu_count`` GPUs)."""
    spec = row.spec
    return Target(name=row.row_id, device="cuda", ranks_per_node=row.gpu_count,
                  peak_flops_per_s=spec.peak_flops_per_s(_PRECISION[row.precision]),
                  memory_bandwidth_bytes_per_s=spec.memory_bandwidth_bytes_per_s, vcpus_per_rank=16.0,
                  intra_node_bus_bytes_per_s=row.intra_node_gb_s * 1e9 / 2 if row.intra_node_gb_s else None,
                  gpu_model=row.gpu)  # fmt: skip


def plan_prediction(measurement: Measurement, row: PublishedRow) -> tuple[float, float] | None:
    """(samples/s of one GPU as ``skylift plan``'s step model predicts the row without
    its input part, that input part in seconds per step)."""
    from skylift.machine.memory import ModelMemory

    job = measurement.model_copy(update={"configured_precision": _PRECISION[row.precision]})
    parameters = int((measurement.model_bytes or 0) // 4)
    # DLE's optimizers: SGD with momentum for ResNet-50 (1 state copy), Adam for BERT (2).
    memory = ModelMemory(parameters=parameters, trainable_parameters=parameters,
                         optimizer_state_copies=1 if row.workload.startswith("resnet") else 2)  # fmt: skip
    prediction = predict_step(job, row_target(row), global_batch_size=row.batch_per_gpu * row.gpu_count,
                              memory=memory)  # fmt: skip
    if prediction.step_time_s is None:
        return None
    step_s = prediction.step_time_s - prediction.parts_s["input"]
    return row.batch_per_gpu / step_s, prediction.parts_s["input"]


def cross_validate(rows: list[PublishedRow], by: str) -> dict[str, dict]:
    """Every row predicted by a fit that never saw its group: ``by="workload"`` holds out
    every row of the row's workload (leave-one-workload-out), ``by="gpu"`` every row of its
    GPU (leave-one-GPU-out). The fit takes the ``calibrate`` rows of ``rows`` outside the
    group; every row, ``reference`` ones too, is predicted. Per row: the error
    (predicted / published - 1, ``None``: no factors for its kind), the group held out, and
    the rows the fit stood on (so a leak shows)."""
    table = tuple(rows)
    models: dict[str, GpuModel] = {}
    out = {}
    for row in rows:
        group = row.workload if by == "workload" else row.gpu
        if group not in models:
            models[group] = (fit_gpu_model(table, hold_out_workload=group) if by == "workload"
                             else fit_gpu_model(table, hold_out=group))  # fmt: skip
        model = models[group]
        predicted = predict_row(row, model)
        out[row.row_id] = {"error": None if predicted is None else predicted / row.samples_per_gpu - 1, "held_out": group,
                           "fitted_on": model.rows}  # fmt: skip
    return out


def _rounded(error: float | None) -> float | None:
    """An error to 4 places; ``None`` (a row the model does not predict: float8) stays ``None``."""
    return None if error is None else round(error, 4)


def _cv_summary(result: dict[str, dict], rows: list[PublishedRow]) -> dict:
    """Mean and worst |error| of a cross-validation, with the rows and workloads behind it."""
    summary = _summary({row_id: item["error"] for row_id, item in result.items()})
    by_id = {row.row_id: row for row in rows}
    return {**summary, "workloads": len({by_id[row_id].workload for row_id in result}),
            "gpus": len({by_id[row_id].gpu for row_id in result}),
            "worst_rows": sorted(((row_id, round(item["error"], 4)) for row_id, item in result.items()
                                  if item["error"] is not None), key=lambda pair: -abs(pair[1]))[:5]}  # fmt: skip


def _errors(rows: list[PublishedRow], model_for) -> dict[str, float | None]:
    out = {}
    for row in rows:
        predicted = predict_row(row, model_for(row))
        out[row.row_id] = None if predicted is None else predicted / row.samples_per_gpu - 1
    return out


def _summary(errors: dict[str, float | None]) -> dict[str, float]:
    values = [abs(error) for error in errors.values() if error is not None]
    return {"mean_abs_error": round(statistics.mean(values), 4), "max_abs_error": round(max(values), 4),
            "rows": len(values), "rows_within_20pct": sum(value <= TARGET_WORST for value in values)}  # fmt: skip


def _measurements(folder: Path, both_formats: bool) -> dict[tuple[str, str], Measurement]:
    started = time.perf_counter()
    channels_last = bench_resnet(True, folder)
    nchw = bench_resnet(False, folder) if both_formats else channels_last.model_copy(update={"channels_last": False})
    print(f"benched ResNet-50 224 px here ({'both formats' if both_formats else 'channels_last'}) in "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    return {("resnet50_v1.5_224", "channels_last"): channels_last, ("resnet50_v1.5_224", "nchw"): nchw}


def _measurement_for(measured: dict, row: PublishedRow) -> Measurement | None:
    if row.workload == "resnet50_v1.5_224":
        return measured[(row.workload, row.memory_format)]
    return traced_measurement(row.workload, row.batch_per_gpu)


def run(folder: Path, both_formats: bool = False) -> dict:
    rows = list(load_published())
    calibrated = [row for row in rows if row.use == "calibrate"]
    full = fit_gpu_model()
    by_gpu: dict[str, GpuModel] = {}
    by_family: dict[str, GpuModel] = {}
    loo_gpu = _errors(calibrated, lambda row: by_gpu.setdefault(row.gpu, fit_gpu_model(hold_out=row.gpu)))
    loo_family = _errors(calibrated, lambda row: by_family.setdefault(row.family, fit_gpu_model(hold_out=row.family)))
    in_sample = _errors(calibrated, lambda row: full)
    by_workload, by_gpu_all = cross_validate(rows, "workload"), cross_validate(rows, "gpu")
    measured = _measurements(folder, both_formats)
    table = []
    for row in calibrated:
        measurement = _measurement_for(measured, row)
        planned = plan_prediction(measurement, row) if measurement is not None else None
        plan, input_s = planned or (None, None)
        table.append({"row_id": row.row_id, "gpu": row.gpu, "gpus": row.gpu_count, "precision": row.precision,
                      "memory_format": row.memory_format or "-", "batch_per_gpu": row.batch_per_gpu,
                      "published_per_gpu": round(row.samples_per_gpu, 2), "plan_per_gpu": plan and round(plan, 2),
                      "plan_error": plan and round(plan / row.samples_per_gpu - 1, 4), "plan_input_s_per_step": input_s,
                      "in_sample_error": round(in_sample[row.row_id], 4),
                      "loo_gpu_error": round(loo_gpu[row.row_id], 4),
                      "loo_family_error": round(loo_family[row.row_id], 4), "source": row.source})  # fmt: skip
    references = []
    for row in rows:
        if row.use == "reference":
            predicted = predict_row(row, full)
            per_unit = row.sequence_length or 1  # tokens/s rows are printed in tokens
            references.append({"row_id": row.row_id, "gpu": row.gpu, "gpus": row.gpu_count, "unit": row.unit,
                               "framework": row.framework, "published_per_gpu": round(row.per_gpu, 2),
                               "predicted_per_gpu": None if predicted is None else round(predicted * per_unit, 2),
                               "error": None if predicted is None else round(predicted / row.samples_per_gpu - 1, 4),
                               "why_reference": row.note[:160]})  # fmt: skip
    resnet = measured[("resnet50_v1.5_224", "channels_last")]
    return {
        "rows": table, "references": references,
        "cross_validation": {
            "leave_one_workload_out": {"summary": _cv_summary(by_workload, rows),
                                       "rows": {key: _rounded(item["error"]) for key, item in by_workload.items()}},
            "leave_one_gpu_out": {"summary": _cv_summary(by_gpu_all, rows),
                                  "rows": {key: _rounded(item["error"]) for key, item in by_gpu_all.items()}},
        },
        "summary": {"leave_one_gpu_out": _summary(loo_gpu), "leave_one_family_out": _summary(loo_family),
                    "in_sample": _summary(in_sample),
                    "plan_path": _summary({item["row_id"]: item["plan_error"] for item in table})},
        "factors": {kind: factors.describe() for kind, factors in full.kinds.items()},
        "busy_laptop": _busy_laptop_check(resnet, calibrated),
        "bench": {fmt: {"samples_per_s_here": measured[("resnet50_v1.5_224", fmt)].samples_per_s,
                        "other_load_share": measured[("resnet50_v1.5_224", fmt)].other_load_share,
                        "device_name": measured[("resnet50_v1.5_224", fmt)].device_name}
                  for fmt in ("channels_last", "nchw")},
    }  # fmt: skip


def _busy_laptop_check(measurement: Measurement, rows: list[PublishedRow]) -> dict:
    """The same bench with every measured phase twice as slow (a laptop busy with something
    else): the GPU prediction must not move."""
    row = next(row for row in rows if row.row_id == "dle-rn50-2103-a100-80-1x-amp")
    slow = measurement.model_copy(update={"breakdown_s": {k: 2 * v for k, v in measurement.breakdown_s.items()},
                                          "step_time_s": 2 * measurement.step_time_s})  # fmt: skip
    as_measured, when_busy = plan_prediction(measurement, row)[0], plan_prediction(slow, row)[0]
    return {"row": row.row_id, "predicted_per_gpu": as_measured, "predicted_with_a_2x_slower_bench": when_busy}


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="skylift plan vs published training throughput (per GPU)")
    for column in ("row", "GPUs", "precision", "format", "batch", "published", "plan", "plan err", "in-sample",
                   "leave-GPU-out", "leave-family-out"):
        table.add_column(column, justify="left" if column in ("row", "precision", "format") else "right")
    for item in result["rows"]:
        table.add_row(item["row_id"], str(item["gpus"]), item["precision"], item["memory_format"],
                      str(item["batch_per_gpu"]), f"{item['published_per_gpu']:,.1f}",
                      "-" if item["plan_per_gpu"] is None else f"{item['plan_per_gpu']:,.1f}",
                      "-" if item["plan_error"] is None else f"{item['plan_error']:+.1%}",
                      f"{item['in_sample_error']:+.1%}", f"{item['loo_gpu_error']:+.1%}",
                      f"{item['loo_family_error']:+.1%}")  # fmt: skip
    console = Console(width=160)
    console.print(table)
    for name, summary in result["summary"].items():
        console.print(f"{name}: mean |error| {summary['mean_abs_error']:.1%}, worst {summary['max_abs_error']:.1%}, "
                      f"{summary['rows_within_20pct']}/{summary['rows']} rows within 20%")  # fmt: skip
    console.print("cross-validation over every row (calibrated and reference), side by side:")
    for name, item in result["cross_validation"].items():
        summary = item["summary"]
        worst = ", ".join(f"{row_id} {error:+.1%}" for row_id, error in summary["worst_rows"])
        console.print(f"  {name}: mean |error| {summary['mean_abs_error']:.1%}, worst {summary['max_abs_error']:.1%} "
                      f"over {summary['rows']} rows, {summary['workloads']} workloads, {summary['gpus']} GPUs; "
                      f"worst rows: {worst}")  # fmt: skip
    for _kind, text in result["factors"].items():
        console.print(f"factors {text}")
    busy = result["busy_laptop"]
    console.print(f"busy laptop: {busy['row']} predicted {busy['predicted_per_gpu']:.2f}/s from the bench, "
                  f"{busy['predicted_with_a_2x_slower_bench']:.2f}/s from the same bench twice as slow")  # fmt: skip
    console.print("reference rows (not calibrated, outside the targets):")
    for item in result["references"]:
        predicted = ("not predicted (float8: no fp8 peak in the GPU table)" if item["predicted_per_gpu"] is None
                     else f"predicted {item['predicted_per_gpu']:,.1f} ({item['error']:+.1%})")  # fmt: skip
        console.print(f"  {item['row_id']}: published {item['published_per_gpu']:,.1f} {item['unit']} a GPU, {predicted}, "
                      f"{item['framework']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="benchmarks/results/plan_published.json")
    parser.add_argument("--both-formats", action="store_true", help="bench NCHW too (the meta trace is the same)")
    parser.add_argument("--refresh-structure", action="store_true",
                        help="re-trace skylift/plan/published_structure.csv from the models first")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.refresh_structure:
        from importlib import resources

        from skylift.plan.published_trace import write_structures

        keys = sorted({(row.workload, row.half, row.batch_per_gpu) for row in load_published()})
        write_structures(Path(str(resources.files("skylift.plan").joinpath("published_structure.csv"))), keys)
    with tempfile.TemporaryDirectory() as folder:
        result = run(Path(folder), args.both_formats)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    print_report(result)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.output} ({result['elapsed_s']} s)")


if __name__ == "__main__":
    main()
