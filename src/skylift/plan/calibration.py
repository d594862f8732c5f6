"""The plan's GPU model: a job's traced structure, timed by factors fitted to published rows.

One GPU's forward + backward per sample, for a job of one *kind* (``conv``: most FLOPs
in convolutions; ``gemm``: matmuls and attention), is a roofline taken op group by op
group (the trace groups the ops with FLOPs by arithmetic intensity)::

    t = sum over groups of max(FLOPs / (peak x compute share),     tensor-core or CUDA-core
                               bytes / (bandwidth x op bandwidth share))   peak, dense
      + memory-op bytes / (bandwidth x memory bandwidth share)     elementwise, norms: unfused
      + layout x conv bytes / bandwidth                            NCHW on tensor cores only:
                                                                   cuDNN transposes to NHWC
      + seconds per op x ops / micro-batch                         launches, per micro-step

so the same job is compute-bound in its large GEMMs and bandwidth-bound in its 1x1
convolutions and attention products, each by its own work per kernel (batch, channels,
sequence), on whichever GPU. Every input but the five factors is a fact of the job
(skylift's meta trace) or of the GPU (data sheet: dense peak at the precision,
bandwidth). The factors are fitted per kind on the published single-GPU rows (``use:
calibrate`` in :mod:`skylift.plan.published`), by least squares on the log of the ratio
predicted / published; the compute share is held at or below 1. The bench machine's own
speed enters nowhere, so a busy laptop cannot move a GPU's prediction.

Across the GPUs of one node each rank's step grows by ``1 + scaling x log2(ranks)``
(``scaling`` fitted per kind and precision class from the published 1 -> N pairs, once
the overlapped all-reduce of :mod:`skylift.plan.ddp` is taken out): what NVIDIA's
tables show beyond communication (input pipelines sharing the host, stragglers at each
step's synchronisation). ``log2``: the steps of a tree of ranks; one factor fits DLE's
4-, 8- and 16-GPU BERT rows.

``fit_gpu_model(hold_out=...)`` fits without the rows of one GPU, and
``fit_gpu_model(hold_out_workload=...)`` without the rows of one workload: the
leave-one-GPU-out and leave-one-workload-out checks of ``benchmarks/plan_published.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from skylift.machine.gpus import GpuSpec, precision_class
from skylift.plan.ddp import ddp_communication
from skylift.plan.published import PublishedRow, WorkloadStructure, load_published, load_structures, pairs_for_scaling

if TYPE_CHECKING:
    import numpy as np

__all__ = ["RECOMPUTED_FORWARD", "GpuModel", "JobStructure", "KindFactors", "fit_gpu_model", "node_scaling",
           "predict_row", "recomputation", "seconds_per_sample", "shipped_gpu_model", "standing_row",
           "tensor_cores"]  # fmt: skip

_BOUNDS = {"compute_share": (0.05, 1.0), "bandwidth_share": (0.01, 50.0), "memory_bandwidth_share": (0.01, 50.0),
           "layout": (1e-3, 50.0), "seconds_per_op": (1e-9, 1e-4)}  # fmt: skip
"""Where each factor may land: a compute share at most 1 (the data sheet's dense peak);
bandwidth shares above 1 where fused kernels move less than the unfused trace counts;
a launch cost of at most 100 us per op."""


@dataclass(frozen=True, kw_only=True)
class JobStructure:
    """What carries from a bench to a GPU: per sample, at the GPU's precision."""

    flops_per_sample: float
    conv_flops_per_sample: float
    memory_op_bytes_per_sample: float
    intensity_bins: tuple[tuple[float, float, float], ...]
    """``(FLOPs, bytes, conv bytes)`` per sample of the ops with FLOPs, by intensity."""
    ops_per_micro_step: int
    channels_last: bool

    @property
    def kind(self) -> str:
        """``conv`` when convolutions do most of the FLOPs, else ``gemm``."""
        return "conv" if self.conv_flops_per_sample >= 0.5 * self.flops_per_sample else "gemm"

    @classmethod
    def of(cls, structure: WorkloadStructure, memory_format: str) -> JobStructure:
        return cls(flops_per_sample=structure.flops_per_sample, conv_flops_per_sample=structure.conv_flops_per_sample,
                   memory_op_bytes_per_sample=structure.memory_op_bytes_per_sample,
                   intensity_bins=structure.intensity_bins, ops_per_micro_step=structure.ops_per_micro_step,
                   channels_last=memory_format != "nchw")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class KindFactors:
    """The fitted factors of one kind of job, and the rows they came from."""

    kind: str
    compute_share: float
    """Share of the dense peak the compute-bound op groups reach."""
    bandwidth_share: float
    """Share of memory bandwidth the bandwidth-bound op groups with FLOPs reach (on traced bytes)."""
    memory_bandwidth_share: float
    """The same for the ops without FLOPs (elementwise, norms); above 1 where fused kernels
    move less than the unfused trace counts."""
    layout: float
    """Extra traffic per byte of the convolutions under NCHW on tensor cores (``conv``)."""
    seconds_per_op: float
    """Host and launch cost of one op, per micro-step."""
    scaling: dict[str, float] = field(default_factory=dict)
    """``half``/``32-bit`` -> per-rank step growth per doubling of the GPUs in a node."""
    rows: tuple[str, ...] = ()
    """Single-GPU rows the five factors were fitted on."""
    scaling_rows: tuple[str, ...] = ()
    """Multi-GPU rows the scaling factors were fitted on."""
    borrowed_from: tuple[str, ...] = ()
    """The other kinds whose rows fitted these factors, where no row of this kind was
    left to fit (a held-out workload); empty: fitted on rows of this kind."""

    def describe(self) -> str:
        """The factors in one line, with the rows they came from."""
        scaling = ", ".join(f"{name} {value:.3f}" for name, value in sorted(self.scaling.items())) or "none fitted"
        layout = f", NCHW on tensor cores {self.layout:.2f} x conv bytes more" if self.kind == "conv" else ""
        memory = (f"bandwidth-bound ops with FLOPs at {self.bandwidth_share:.1%} and without at "
                  f"{self.memory_bandwidth_share:.1%} of bandwidth" if self.bandwidth_share < 0.99 *
                  _BOUNDS["bandwidth_share"][1] else "no op group with FLOPs bandwidth-bound (its share at the "
                  f"bound), ops without FLOPs at {self.memory_bandwidth_share:.1%} of bandwidth")  # fmt: skip
        borrowed = f" (no {self.kind} row left: borrowed from {', '.join(self.borrowed_from)})" if self.borrowed_from \
            else ""
        return (f"{self.kind}{borrowed}: compute-bound ops at {self.compute_share:.1%} of peak, {memory}{layout}, "
                f"{self.seconds_per_op * 1e6:.2f} us per op per micro-step; per rank 1 + ({scaling}) x log2(GPUs in "
                f"the node); fitted on {len(self.rows)} single-GPU rows ({', '.join(self.rows)}) and "
                f"{len(self.scaling_rows)} multi-GPU rows ({', '.join(self.scaling_rows)})")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class GpuModel:
    """Fitted factors per kind (a kind without calibrated rows is absent)."""

    kinds: dict[str, KindFactors]
    held_out: str | None = None
    """The GPU left out of the fit (``None``: every calibrated row used)."""
    held_out_workload: str | None = None
    """The workload left out of the fit (``None``: every workload used)."""

    @property
    def rows(self) -> tuple[str, ...]:
        """Every published row any factor of the model was fitted on."""
        return tuple(sorted({row for factors in self.kinds.values() for row in (*factors.rows, *factors.scaling_rows)}))


def tensor_cores(spec: GpuSpec, precision: str) -> bool:
    """Whether ``precision`` runs on tensor cores (fp16/bf16 always; TF32 where the GPU has it)."""
    kind = precision_class(precision)
    return kind == "half" or (kind == "tf32" and spec.peak_tflops["tf32"] > spec.peak_tflops["fp32"])


def seconds_per_sample(structure: JobStructure, spec: GpuSpec, precision: str, factors: KindFactors,
                       micro_batch: int) -> dict[str, float]:  # fmt: skip
    """One GPU's forward + backward per sample, by part: ``compute`` and ``bandwidth``
    (the op groups on each side of the roofline), ``memory`` (ops without FLOPs),
    ``layout`` (NCHW transposes) and ``launch``."""
    peak = spec.peak_flops_per_s(precision) * factors.compute_share
    bandwidth = spec.memory_bandwidth_bytes_per_s
    compute = bound = conv_bytes = 0.0
    for flops, moved, conv in structure.intensity_bins:
        flops_s, bytes_s = flops / peak, moved / (bandwidth * factors.bandwidth_share)
        compute, bound = (compute + flops_s, bound) if flops_s >= bytes_s else (compute, bound + bytes_s)
        conv_bytes += conv
    nchw = not structure.channels_last and tensor_cores(spec, precision) and structure.kind == "conv"
    return {"compute": compute, "bandwidth": bound,
            "memory": structure.memory_op_bytes_per_sample / (bandwidth * factors.memory_bandwidth_share),
            "layout": factors.layout * conv_bytes / bandwidth if nchw else 0.0,
            "launch": factors.seconds_per_op * structure.ops_per_micro_step / micro_batch}  # fmt: skip


RECOMPUTED_FORWARD = {"": 0.0, "selective": 0.5, "full": 1.0}
"""Share of the forward that activation checkpointing runs again in backward: ``full``
every layer's forward; ``selective`` (torchtitan's ``op`` policy) keeps the attention's
output and every other matmul's, so half of the forward's matmuls and the elementwise
ops between them run again (counted as half of the forward)."""


def recomputation(checkpointing: str, parts: dict[str, float]) -> float:
    """How much longer forward + backward is with ``checkpointing``: the forward is a third
    of the FLOPs and of the traffic of forward + backward (backward computes two products
    per forward one), and the recomputed share of it runs again; launches are per op and
    recomputation repeats the same share of them."""
    share = RECOMPUTED_FORWARD[checkpointing]
    return 1.0 + share / 3.0 if sum(parts.values()) > 0 else 1.0


def node_scaling(factors: KindFactors, precision: str, ranks_per_node: int) -> float:
    """How much longer each rank's step is with ``ranks_per_node`` GPUs in the node."""
    alpha = factors.scaling.get(_scaling_class(precision), 0.0)
    return 1.0 + alpha * math.log2(ranks_per_node) if ranks_per_node > 1 else 1.0


def _scaling_class(precision: str) -> str:
    return "half" if precision_class(precision) == "half" else "32-bit"


def _least_squares(residuals: Callable[[np.ndarray], list[float]], start: list[float], lower: list[float],
                   upper: list[float]) -> list[float]:
    """Levenberg-Marquardt on ``residuals(x)``, each step clipped into the box; numeric
    Jacobian (forward differences). Deterministic: the same rows give the same factors."""
    import numpy as np

    low, high = np.array(lower), np.array(upper)
    x = np.clip(np.array(start, dtype=float), low, high)
    r = np.array(residuals(x))
    cost, damping = float(r @ r), 1e-2
    for _ in range(300):
        jacobian = np.empty((len(r), len(x)))
        for index in range(len(x)):
            probe = x.copy()
            probe[index] += 1e-6 if probe[index] + 1e-6 <= high[index] else -1e-6
            jacobian[:, index] = (np.array(residuals(probe)) - r) / (probe[index] - x[index])
        normal = jacobian.T @ jacobian
        step = np.linalg.solve(normal + damping * (np.diag(np.diag(normal)) + 1e-9 * np.eye(len(x))), -jacobian.T @ r)
        candidate = np.clip(x + step, low, high)
        trial = np.array(residuals(candidate))
        if (trial_cost := float(trial @ trial)) < cost:
            improvement = cost - trial_cost
            x, r, cost, damping = candidate, trial, trial_cost, max(damping / 3, 1e-9)
            if improvement < 1e-12:
                break
        else:
            damping *= 4
            if damping > 1e9:
                break
    return [float(value) for value in x]


def _fit_kind(kind: str, rows: list[PublishedRow], structures: dict) -> KindFactors:
    """The five factors from single-GPU rows, in log space within :data:`_BOUNDS`."""
    names = list(_BOUNDS)
    lower = [math.log(_BOUNDS[name][0]) for name in names]
    upper = [math.log(_BOUNDS[name][1]) for name in names]
    cases = [(JobStructure.of(_structure(row, structures), row.memory_format), row) for row in rows]

    def factors_at(x: Iterable[float]) -> KindFactors:
        values = {name: math.exp(value) for name, value in zip(names, x, strict=True)}
        return KindFactors(kind=kind, compute_share=values["compute_share"], bandwidth_share=values["bandwidth_share"],
                           memory_bandwidth_share=values["memory_bandwidth_share"], layout=values["layout"],
                           seconds_per_op=values["seconds_per_op"])

    def residuals(x: Iterable[float]) -> list[float]:
        factors = factors_at(x)
        return [math.log(sum(seconds_per_sample(job, row.spec, _precision(row), factors, row.batch_per_gpu).values())
                         * row.samples_per_gpu) for job, row in cases]  # fmt: skip

    start = [math.log(value) for value in (0.5, 0.5, 0.5, 1.0, 1e-6)]
    return replace(factors_at(_least_squares(residuals, start, lower, upper)), rows=tuple(row.row_id for row in rows))


def _fit_scaling(factors: KindFactors, rows: list[PublishedRow], structures: dict) -> KindFactors:
    """Per precision class, the median over 1 -> N pairs of the per-rank growth left
    after the overlapped all-reduce, per doubling of the GPUs."""
    by_class: dict[str, list[float]] = {}
    used = []
    for single, multi in pairs_for_scaling(rows):
        step_1 = multi.batch_per_gpu / single.samples_per_gpu
        step_n = multi.batch_per_gpu / multi.samples_per_gpu
        exposed = _allreduce_s(_structure(multi, structures), multi, step_1)
        growth = (step_n - exposed - step_1) / (step_1 * math.log2(multi.gpu_count))
        by_class.setdefault(_scaling_class(_precision(multi)), []).append(max(0.0, growth))
        used.append(multi.row_id)
    return replace(factors, scaling={name: _median(values) for name, values in by_class.items()},
                   scaling_rows=tuple(used))  # fmt: skip


def _median(values: list[float]) -> float:
    ordered, middle = sorted(values), len(values) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _allreduce_s(structure: WorkloadStructure, row: PublishedRow, compute_s: float) -> float:
    bus = row.intra_node_gb_s * 1e9 / 2 if row.intra_node_gb_s else None  # both directions stated; a ring sends one
    return ddp_communication(gradient_bytes=structure.model_bytes, links=((row.gpu_count, bus),), overlaps=True,
                             compute_s=compute_s, accumulation_steps=1).exposed_s  # fmt: skip


def _precision(row: PublishedRow) -> str:
    return {"amp": "bf16", "tf32": "tf32", "fp32": "fp32", "fp8": "bf16"}[row.precision]


def _structure(row: PublishedRow, structures: dict) -> WorkloadStructure:
    return structures[(row.workload, row.half, row.batch_per_gpu)]


def _kind(row: PublishedRow, structures: dict) -> str:
    return JobStructure.of(_structure(row, structures), row.memory_format).kind


def fit_gpu_model(rows: tuple[PublishedRow, ...] | None = None, hold_out: str | None = None,
                  hold_out_workload: str | None = None) -> GpuModel:  # fmt: skip
    """The factors from the calibrated rows (default: the shipped table), without any row
    whose GPU (``a100-sxm-80gb``) or GPU family (``a100``) is ``hold_out``, nor any row of
    the workload ``hold_out_workload`` (``resnet50_v1.5_224``).

    A kind left without a calibrated row (every row of it held out) is fitted on the
    rows of the kinds that remain, and says so (``borrowed_from``): a held-out workload
    is then predicted from what the other workloads taught, never left unpredicted."""
    structures = load_structures()
    chosen = [row for row in (rows if rows is not None else load_published())
              if row.use == "calibrate" and hold_out not in (row.gpu, row.family)
              and row.workload != hold_out_workload]  # fmt: skip
    kinds = {}
    for kind in _KINDS:
        of_kind = [row for row in chosen if _kind(row, structures) == kind]
        singles = [row for row in of_kind if row.gpu_count == 1]
        if singles:
            kinds[kind] = _fit_scaling(_fit_kind(kind, singles, structures), of_kind, structures)
    for kind in _KINDS:
        others = [row for row in chosen if row.gpu_count == 1 and _kind(row, structures) != kind]
        if kind not in kinds and others:
            borrowed = _fit_kind(kind, others, structures)
            kinds[kind] = replace(_fit_scaling(borrowed, [row for row in chosen if _kind(row, structures) != kind],
                                               structures), borrowed_from=tuple(sorted(kinds)))  # fmt: skip
    return GpuModel(kinds=kinds, held_out=hold_out, held_out_workload=hold_out_workload)


_KINDS = ("conv", "gemm")


@lru_cache(maxsize=1)
def shipped_gpu_model() -> GpuModel:
    """:func:`fit_gpu_model` on every calibrated row (what ``skylift plan`` uses)."""
    return fit_gpu_model()


def predict_row(row: PublishedRow, model: GpuModel) -> float | None:
    """Samples/s of one GPU of ``row``'s configuration as ``model`` predicts it (``None``:
    no factors for the row's kind, or float8 matmuls, whose peak the GPU table lacks)."""
    if row.precision == "fp8":
        return None
    structure = _structure(row, load_structures())
    job = JobStructure.of(structure, row.memory_format)
    factors = model.kinds.get(job.kind)
    if factors is None:
        return None
    precision = _precision(row)
    parts = seconds_per_sample(job, row.spec, precision, factors, row.batch_per_gpu)
    step_1 = sum(parts.values()) * row.batch_per_gpu * recomputation(row.activation_checkpointing, parts)
    step = step_1 * node_scaling(factors, precision, row.gpu_count)
    if row.gpu_count > 1:
        step += _allreduce_s(structure, row, step_1)
    return row.batch_per_gpu / step


def standing_row(flops_per_sample: float | None, model_bytes: float | None) -> str | None:
    """The published row a job of this structure stands on, in words: the predicted row
    whose workload has the job's parameters (within 1 %) and FLOPs per sample (within 5 %:
    the meta trace counts attention's backward as the math path or the flash kernel does),
    with what it published, what the shipped model predicts and the error, and whether
    the model was fitted on it. ``None``: no published workload is this job."""
    if not flops_per_sample or not model_bytes:
        return None
    structures = load_structures()
    model = shipped_gpu_model()
    for row in sorted(load_published(), key=lambda row: (row.use != "calibrate", row.gpu_count != 1)):
        structure = _structure(row, structures)
        if abs(structure.model_bytes / model_bytes - 1) > 0.01 or abs(structure.flops_per_sample /
                                                                     flops_per_sample - 1) > 0.05:  # fmt: skip
            continue
        predicted = predict_row(row, model)
        if predicted is None:
            continue
        per_unit = row.sequence_length or 1
        conditions = ", ".join(part for part in (
            f"{row.gpu_count}x {row.gpu}", row.precision, f"batch {row.batch_per_gpu} a GPU",
            f"{row.sequence_length:,} tokens a sample" if row.sequence_length else "", row.parallelism,
            f"{row.activation_checkpointing} activation checkpointing" if row.activation_checkpointing else "",
            row.software) if part)  # fmt: skip
        fitted = "the model was fitted on it" if row.row_id in model.rows else "the model was never fitted on it"
        return (f"the published row this job stands on: {row.row_id} ({row.workload}; {conditions}): published "
                f"{row.per_gpu:,.1f} {row.unit} a GPU, the GPU model {predicted * per_unit:,.1f} "
                f"({predicted / row.samples_per_gpu - 1:+.1%}; {fitted}); {row.source}")  # fmt: skip
    return None
