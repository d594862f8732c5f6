"""Forward + backward on a GPU target, from the bench's traced structure and the GPU model.

The bench's timings say how fast *this* machine runs the job; on a GPU the plan uses
only what the bench traced of the job itself (FLOPs by op group and intensity, memory
traffic, ops per micro-step) and times it with :mod:`skylift.plan.calibration`'s
factors fitted to published rows. A busy laptop, or a faster one, cannot move the GPU's
prediction. A bench taken on a GPU keeps its measured time and is re-timed by the
model's ratio of the two GPUs (the same GPU and batch: exactly as measured).
"""

from __future__ import annotations

from dataclasses import dataclass

from skylift.machine.gpus import gpu_spec, precision_class
from skylift.plan.calibration import (
    GpuModel,
    JobStructure,
    node_scaling,
    recomputation,
    seconds_per_sample,
    shipped_gpu_model,
)
from skylift.plan.measurement import Measurement

__all__ = ["CalibratedCompute", "calibrated_compute", "missing_structure"]


@dataclass(frozen=True, kw_only=True)
class CalibratedCompute:
    """One target's forward + backward per optimizer step, and where it came from."""

    seconds: float
    kind: str
    parts_s: dict[str, float]
    """The step's compute by roofline part (``compute``, ``bandwidth``, ``memory``, ``layout``, ``launch``)."""
    node_scaling: float
    """The in-node factor applied (1 with one GPU per node)."""
    rows: tuple[str, ...]
    """Published rows the factors were fitted on (single-GPU, then multi-GPU)."""
    from_gpu_bench: bool = False
    recomputed: str = ""
    """How activation checkpointing's recomputation was counted, for the assumptions."""


def missing_structure(m: Measurement) -> str | None:
    """What the bench lacks for the GPU model (its trace failed, which its notes say), or ``None``."""
    # The bench records the whole trace or none of it (plan/bench.py): one field stands for all.
    if not m.intensity_bins or m.memory_op_bytes_per_sample is None or m.traffic_half is None:
        reason = next((note for note in m.notes if note.startswith("memory traffic")), "no traced traffic")
        return f"the bench has no traced structure ({reason}); bench again with this skylift"
    return None


def _structure(m: Measurement, half_there: bool) -> JobStructure:
    # Floating tensors are the traffic: 2 bytes under bf16/fp16, 4 in fp32 (the trace's rule).
    scale = 1.0 if half_there == m.traffic_half else (0.5 if half_there else 2.0)
    bins = tuple((flops, moved * scale, conv * scale) for flops, moved, conv in m.intensity_bins or ())
    return JobStructure(flops_per_sample=sum(group[0] for group in bins),
                        conv_flops_per_sample=m.conv_flops_per_sample or 0.0,  # None only without a trace
                        memory_op_bytes_per_sample=(m.memory_op_bytes_per_sample or 0.0) * scale,
                        intensity_bins=bins, ops_per_micro_step=int(m.traced_ops_per_micro_step or 1),
                        channels_last=bool(m.channels_last))  # fmt: skip


def _step_s(job: JobStructure, gpu: str, precision: str, model: GpuModel, micro: int, accumulation: int,
            ranks_per_node: int) -> tuple[float, dict[str, float], float] | None:  # fmt: skip
    spec, factors = gpu_spec(gpu), model.kinds.get(job.kind)
    if spec is None or factors is None:
        return None
    parts = {name: seconds * micro * accumulation
             for name, seconds in seconds_per_sample(job, spec, precision, factors, micro).items()}  # fmt: skip
    scaling = node_scaling(factors, precision, ranks_per_node)
    return sum(parts.values()) * scaling, parts, scaling


def calibrated_compute(m: Measurement, gpu: str, precision: str, ranks_per_node: int, micro_steps: tuple[int, int],
                       model: GpuModel | None = None) -> CalibratedCompute | None:  # fmt: skip
    """Forward + backward of one optimizer step on ``gpu`` (a name ``gpu_spec`` knows) at
    ``precision``, ``micro_steps = (accumulation, micro-batch)``; ``None`` when the GPU or
    the job's kind has no factors, or the bench lacks the structure (:func:`missing_structure`)."""
    if missing_structure(m) is not None:
        return None
    model = model or shipped_gpu_model()
    accumulation, micro = micro_steps
    job = _structure(m, precision_class(precision) == "half")
    there = _step_s(job, gpu, precision, model, micro, accumulation, ranks_per_node)
    if there is None:
        return None
    seconds, parts, scaling = there
    factors = model.kinds[job.kind]
    rows = factors.rows + (factors.scaling_rows if ranks_per_node > 1 else ())
    here = _measured_gpu_step(m, model)
    recomputed = ""
    if here is not None:  # the GPU bench's measured time holds its own recomputation
        measured_s, model_s = here
        seconds *= measured_s / model_s
    elif m.activation_checkpointing:
        extra = recomputation("full", parts)
        seconds, parts = seconds * extra, {name: value * extra for name, value in parts.items()}
        recomputed = (f", plus activation checkpointing's recomputed forward ({extra - 1:.0%} more: every "
                      "checkpointed block's forward runs again in backward)")  # fmt: skip
    elif m.activation_checkpointing is None:
        recomputed = ("; this bench did not record activation_checkpointing, so no recomputation is counted "
                      "(bench again with this skylift)")  # fmt: skip
    return CalibratedCompute(seconds=seconds, kind=job.kind, parts_s=parts, node_scaling=scaling, rows=rows,
                             from_gpu_bench=here is not None, recomputed=recomputed)  # fmt: skip


def _measured_gpu_step(m: Measurement, model: GpuModel) -> tuple[float, float] | None:
    """(measured forward + backward, the model's for the bench's own GPU and batch) of a GPU bench."""
    measured_s = m.breakdown_s.get("forward_backward", 0.0)
    if m.device != "cuda" or not measured_s:
        return None
    job = _structure(m, precision_class(m.precision) == "half")
    here = _step_s(job, m.device_name, m.precision, model, m.micro_batch_size, m.accumulation_steps, 1)
    return (measured_s, here[0]) if here is not None and here[0] > 0 else None
