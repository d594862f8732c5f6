"""The step-time model: a measured step, re-timed on a machine one does not have.

The measured step is split into parts that scale with different resources::

    step = compute            GPU targets: the GPU model (:mod:`skylift.plan.gpu_compute`): the
                              job's traced structure (FLOPs by op group and intensity, traffic,
                              ops per micro-step) timed by factors fitted to published rows,
                              times the in-node scaling; never the bench machine's speed.
                              CPU targets (and GPU ones with --efficiency): forward_backward x
                              samples ratio x [(1 - s) x peak here / peak there + s x bandwidth
                              here / bandwidth there] (s: the bandwidth-bound share, traced)
         + memory-bound       optimizer x (memory bandwidth here / there)
         + input pipeline     loader CPU time per sample here x samples a rank gets: added at 0 workers;
                              on a GPU over the workers, what outlasts the rest of the step (+ copies)
         + communication      DDP: the ring all-reduce of the gradients in buckets under backward,
                              what backward does not hide (:mod:`skylift.plan.ddp`); FSDP: the
                              all-gathers and reduce-scatters, less what the compute hides
                              (:mod:`skylift.plan.fsdp`); on a CPU nothing overlaps
         + other              as measured (Python overhead of the loop)

Every figure the model takes that is not measured is returned as an assumption.

Whether the job fits a GPU is :func:`skylift.machine.memory.training_memory`, the model
``skylift doctor`` judges with, at the precision and rank count of the target (under FSDP
sharded over the target's ranks); where a micro-batch does not fit, accumulation splits it
(the global batch kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from skylift.data.autotune import default_candidates
from skylift.machine.gpus import gpu_spec, precision_class
from skylift.machine.memory import MEMORY_HEADROOM, MemoryBreakdown, ModelMemory, Sharding, training_memory
from skylift.plan.ddp import ddp_communication
from skylift.plan.fsdp import sharded_communication
from skylift.plan.gpu_compute import CalibratedCompute, calibrated_compute, missing_structure
from skylift.plan.host_memory import host_overflow
from skylift.plan.measurement import Measurement

__all__ = ["StepPrediction", "Target", "predict_step"]


@dataclass(kw_only=True)
class Target:
    """A machine to predict: ``nodes`` x ``ranks_per_node`` training processes."""

    name: str
    device: str
    """``cuda`` or ``cpu``."""
    nodes: int = 1
    ranks_per_node: int = 1
    peak_flops_per_s: float
    """One rank's dense peak at the target precision."""
    memory_bandwidth_bytes_per_s: float | None
    """One rank's memory bandwidth (``None``: unknown; memory-bound work is then kept as measured)."""
    vcpus_per_rank: float
    intra_node_bus_bytes_per_s: float | None = None
    """All-reduce bus bandwidth between the ranks of a node (``None`` with one rank per node)."""
    inter_node_bus_bytes_per_s: float | None = None
    """All-reduce bus bandwidth between nodes."""
    device_memory_bytes: float | None = None
    """Memory of one GPU (``None``: not checked, e.g. this machine's CPU)."""
    host_memory_bytes: float | None = None
    """RAM of one node (``None``: not checked); FSDP's ``cpu_offload`` keeps the sharded state there."""
    efficiency: float | None = None
    """Fraction of peak the compute reaches (``--efficiency``); ``None``: the GPU model on a
    GPU target with ``gpu_model``, else the efficiency measured here."""
    threads_per_rank: int | None = None
    """CPU threads each rank computes with (CPU targets; ``None`` on a GPU)."""
    gpu_model: str | None = None
    """The GPU as the catalog or the driver names it (``A100-80GB``): forward/backward is
    then timed by the GPU model fitted to published rows (:mod:`skylift.plan.gpu_compute`);
    ``None``: scaled from the measurement."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(kw_only=True)
class StepPrediction:
    """One target's predicted step, or why it cannot run the job."""

    step_time_s: float | None
    samples_per_s: float | None
    parts_s: dict[str, float] = field(default_factory=dict)
    accumulation_steps: int = 1
    micro_batch_size: int | None = None
    memory_needed_bytes: float | None = None
    memory: MemoryBreakdown | None = None
    """One rank's peak at the chosen micro-batch (``None``: not checked)."""
    sharding: Sharding | None = None
    """FSDP over the target's ranks (``None``: DDP)."""
    communication_bytes: float | None = None
    """Bytes the step's collectives carry, each all-gather and reduce-scatter counted at
    its full tensor's size and an all-reduce twice (``None``: one rank, or the model size
    unknown)."""
    dropped: str | None = None
    """Why the target cannot run the job (does not fit, batch does not divide); else None."""
    assumptions: list[str] = field(default_factory=list)
    calibrated_by: tuple[str, ...] = ()
    """Published rows (``skylift/plan/published.csv``) the GPU model that timed the
    forward/backward was fitted on; empty where the measurement was scaled instead."""
    bound: str | None = None
    """``input-bound`` where the input pipeline sets the step (:func:`_input_s`);
    else ``compute-bound`` or ``communication-bound`` (several ranks on GPUs); else ``None``."""


def predict_step(measurement: Measurement, target: Target, global_batch_size: int | None = None,
                 memory: ModelMemory | None = None, sharding: Sharding | None = None) -> StepPrediction:
    """Predict one optimizer step of the measured job on ``target``.

    Args:
        global_batch_size: the job's global batch (default: the measured one). Work per
            sample scales with the samples each rank gets; per-step work (optimizer,
            all-reduce, loop overhead) does not.
        memory: the job's model as the meta trace sees it (``None``: the fit is not checked,
            which the assumptions say).
        sharding: the job's FSDP settings (``None``: DDP); the state is sharded over the
            target's ranks, whatever ``shard_count`` says.
    """
    m = measurement
    batch = global_batch_size or m.global_batch_size
    if batch % target.world_size:
        return StepPrediction(step_time_s=None, samples_per_s=None,
                              dropped=f"global batch {batch} does not divide by {target.world_size} ranks")  # fmt: skip
    assumptions: list[str] = []
    sharding = replace(sharding, shard_count=target.world_size) if sharding else None
    samples_ratio = (batch / target.world_size) / (m.global_batch_size / m.world_size)
    fit = _fit(m, target, batch, memory, sharding, assumptions)
    accumulation, micro = (fit[0], fit[1]) if not isinstance(fit, str) else (1, batch // target.world_size)
    calibrated = _calibrated(m, target, (accumulation, micro), assumptions)
    compute = calibrated.seconds if calibrated else _compute_s(m, target, samples_ratio, batch, assumptions,
                                                                 micro_steps=(accumulation, micro))  # fmt: skip
    bound = None
    if sharding:
        communication, moved = _sharded_communication_s(m, target, memory, sharding, compute, accumulation,
                                                        assumptions)  # fmt: skip
    else:
        communication, moved, bound = _communication_s(m, target, compute, accumulation, assumptions)
    parts = {
        "compute": compute,
        "memory_bound": _memory_bound_s(m, target, memory, calibrated is not None, assumptions)
        * _optimizer_share(m, sharding, assumptions),
        "input": 0.0,
        "communication": communication,
        "other": _other_s(m, target, calibrated is not None, assumptions),
    }
    parts["input"], input_bound = _input_s(m, target, batch, samples_ratio, parts, assumptions)
    rows = calibrated.rows if calibrated else ()
    if isinstance(fit, str):
        return StepPrediction(step_time_s=None, samples_per_s=None, parts_s=parts, dropped=fit, assumptions=assumptions,
                              sharding=sharding, calibrated_by=rows)  # fmt: skip
    breakdown = fit[2]
    step_s = sum(parts.values())
    if input_bound:
        bound = "input-bound"
        assumptions.append(f"{target.name}: the input pipeline sets the step (input-bound): more loader workers "
                           "(data.num_workers), a host with more vCPUs per GPU or a cheaper pipeline change it")
    return StepPrediction(step_time_s=step_s, samples_per_s=batch / step_s, parts_s=parts,
                          accumulation_steps=accumulation, micro_batch_size=micro,
                          memory_needed_bytes=breakdown.total_bytes if breakdown else None, memory=breakdown,
                          sharding=sharding, communication_bytes=moved, assumptions=assumptions,
                          calibrated_by=rows, bound=bound)  # fmt: skip


def _other_s(m: Measurement, target: Target, on_gpu_model: bool, assumptions: list[str]) -> float:
    """The loop's own overhead as measured; under the GPU model the host's work per
    micro-step is its fitted per-op cost, so this machine's is not added to it."""
    if on_gpu_model:
        assumptions.append(f"{target.name}: the loop's host overhead is the GPU model's per-op cost (fitted), not "
                           "this machine's measured 'other' phase")  # fmt: skip
        return m.breakdown_s.get("checkpoint", 0.0)
    return m.breakdown_s.get("other", 0.0) + m.breakdown_s.get("checkpoint", 0.0)


def _calibrated(m: Measurement, target: Target, micro_steps: tuple[int, int],
                assumptions: list[str]) -> CalibratedCompute | None:  # fmt: skip
    """The GPU model's forward/backward for a GPU target (``None``: scaled from the measurement instead)."""
    if target.device != "cuda" or target.gpu_model is None or target.efficiency is not None:
        return None
    precision = target_precision(m)
    calibrated = calibrated_compute(m, target.gpu_model, precision, target.ranks_per_node, micro_steps)
    if calibrated is None:
        reason = missing_structure(m) or f"no fitted factors for {target.gpu_model}"
        assumptions.append(f"{target.name}: GPU model not used ({reason})")
        return None
    origin = ("the GPU bench's measured time, re-timed by the model's ratio of the two GPUs" if
              calibrated.from_gpu_bench else "not the bench machine's speed")  # fmt: skip
    assumptions.append(f"{target.name}: forward/backward from the job's traced structure ({calibrated.kind}: FLOPs "
                       f"by op group, traffic, ops per micro-step) and the GPU model fitted to published rows, "
                       f"{origin}{calibrated.recomputed}")  # fmt: skip
    return calibrated


def _compute_s(m: Measurement, target: Target, samples_ratio: float, batch: int, assumptions: list[str], *,
               micro_steps: tuple[int, int]) -> float:
    measured_s = m.breakdown_s.get("forward_backward", 0.0)
    curve = m.forward_backward_curve
    if curve and target.efficiency is None:
        return _compute_from_curve(m, target, measured_s, curve, micro_steps, assumptions)
    if target.efficiency is None or not (m.flops_per_sample and m.peak_flops_per_s):
        if m.device != target.device:
            assumptions.append(f"{target.name}: compute keeps the efficiency measured on this {m.device} "
                               f"({_share_of_peak_text(m)}); a {target.device} reaches a different "
                               "share: bench on one, or pass --efficiency")  # fmt: skip
        peak_here = m.peak_flops_per_s or target.peak_flops_per_s
        compute_scale = peak_here / target.peak_flops_per_s
        share = _memory_op_share(m)
        if share is None or not target.memory_bandwidth_bytes_per_s:
            assumptions.append(f"{target.name}: forward/backward scaled by peak FLOP/s alone (no traced memory "
                               "traffic or bandwidth to split off the bandwidth-bound ops)")  # fmt: skip
            return measured_s * samples_ratio * compute_scale
        bandwidth_scale = (_bandwidth_here(m) or 0.0) / target.memory_bandwidth_bytes_per_s
        return measured_s * samples_ratio * ((1.0 - share) * compute_scale + share * bandwidth_scale)
    compute_s = m.flops_per_sample * batch / target.world_size / (target.peak_flops_per_s * target.efficiency)
    if m.memory_op_bytes_per_sample and target.memory_bandwidth_bytes_per_s:
        compute_s += m.memory_op_bytes_per_sample * batch / target.world_size / target.memory_bandwidth_bytes_per_s
    return compute_s


def _compute_from_curve(m: Measurement, target: Target, measured_s: float, curve: dict,
                        micro_steps: tuple[int, int], assumptions: list[str]) -> float:
    """Forward/backward from the probed curves: a fixed time per micro-step plus a time
    per sample (both scaled so they add up to the run's own measured phase). This CPU at
    other threads: the probed thread speed-up. Another GPU: the per-sample part re-timed
    by the two-class roofline, the fixed part (launches) kept. CPU to GPU: both re-timed."""
    fixed_s, per_sample_s = curve["fixed_s"], curve["per_sample_s"]
    here = m.accumulation_steps * (fixed_s + per_sample_s * m.micro_batch_size)
    scale = measured_s / here if here > 0 else 0.0
    accumulation, micro = micro_steps
    fixed_there = accumulation * fixed_s * scale
    per_sample_there = accumulation * micro * per_sample_s * scale
    if target.device == "cpu" and m.device == "cpu":
        return (fixed_there + per_sample_there) * _thread_factor(m, target, curve, assumptions)
    share = _memory_op_share(m)
    compute_scale = (m.peak_flops_per_s or target.peak_flops_per_s) / target.peak_flops_per_s
    if share is None or not target.memory_bandwidth_bytes_per_s:
        rescale = compute_scale
    else:
        rescale = (1 - share) * compute_scale + share * (_bandwidth_here(m) or 0) / target.memory_bandwidth_bytes_per_s
    if m.device != target.device:
        # On a CPU the curve's fixed part is mostly small-batch inefficiency of the
        # kernels, not host dispatch: it is compute on a GPU too, scaled like the rest.
        assumptions.append(f"{target.name}: forward/backward keeps the efficiency measured on this {m.device} "
                           f"({_share_of_peak_text(m)}); a {target.device} reaches a different share: bench "
                           "on one, or pass --efficiency")  # fmt: skip
        return (fixed_there + per_sample_there) * rescale
    assumptions.append(f"{target.name}: the fixed part of forward/backward per micro-step "
                       f"({fixed_s * scale * 1000:.2f} ms: launches and dispatch on the host) is kept as measured")
    return fixed_there + per_sample_there * rescale


def _thread_factor(m: Measurement, target: Target, curve: dict, assumptions: list[str]) -> float:
    """Time at the target's threads over time at the measured ones, as probed; by peak
    FLOP/s (linear in threads that have a core) for a thread count not probed."""
    timings = {int(threads): seconds for threads, seconds in curve.get("thread_seconds", {}).items()}
    here, there = int(curve["threads"]), target.threads_per_rank or int(curve["threads"])
    if there in timings and here in timings:
        return timings[there] / timings[here]
    assumptions.append(f"{target.name}: {there} threads per process were not probed; forward/backward scaled by "
                       "the CPU's peak FLOP/s")  # fmt: skip
    return (m.peak_flops_per_s or target.peak_flops_per_s) / target.peak_flops_per_s


def _memory_op_share(m: Measurement) -> float | None:
    """Share of the measured forward/backward the bandwidth-bound ops take, by the
    two-class roofline of the traced step: their bytes over this machine's bandwidth
    against the compute ops' FLOPs over its peak."""
    bandwidth = _bandwidth_here(m)
    if not (m.memory_op_bytes_per_sample and m.flops_per_sample and m.peak_flops_per_s and bandwidth):
        return None
    memory_s = m.memory_op_bytes_per_sample / bandwidth
    return memory_s / (memory_s + m.flops_per_sample / m.peak_flops_per_s)


def _share_of_peak_text(m: Measurement) -> str:
    """``48.5% of peak``, or why the share is unknown (never ``nan%``)."""
    share = _efficiency_here(m)
    if math.isnan(share):  # NaN: no FLOP count, peak or measured compute time
        missing = "FLOPs per sample" if not m.flops_per_sample else "peak FLOP/s" if not m.peak_flops_per_s \
            else "forward/backward time"
        return f"share of peak unknown: the bench has no {missing}"
    return f"{share:.1%} of peak"


def _efficiency_here(m: Measurement) -> float:
    compute_s = m.breakdown_s.get("forward_backward", 0.0)
    if not (m.flops_per_sample and m.peak_flops_per_s and compute_s):
        return float("nan")
    samples = m.global_batch_size / m.world_size
    return m.flops_per_sample * samples / (compute_s * m.peak_flops_per_s)


def _bandwidth_here(m: Measurement) -> float | None:
    if m.device == "cpu":
        return m.host_memory_bandwidth_bytes_per_s and m.host_memory_bandwidth_bytes_per_s / m.world_size
    spec = gpu_spec(m.device_name)
    return spec.memory_bandwidth_bytes_per_s if spec else None


def _memory_bound_s(m: Measurement, target: Target, memory: ModelMemory | None, on_gpu_model: bool,
                    assumptions: list[str]) -> float:  # fmt: skip
    """The optimizer step. Where the GPU model times the compute and the parameters are
    traced: its traffic at the GPU's bandwidth (read weights, gradients and each state,
    write weights and states, fp32: ``4 x (3 + 2 x states)`` bytes per parameter, the
    multi-tensor kernels streaming at bandwidth), so the bench machine's speed stays out;
    else the measured step scaled by the two bandwidths."""
    if on_gpu_model and memory is not None and memory.parameters and target.memory_bandwidth_bytes_per_s:
        moved = 4.0 * (3 + 2 * memory.optimizer_state_copies) * memory.trainable_parameters
        return moved / target.memory_bandwidth_bytes_per_s
    measured_s = m.breakdown_s.get("optimizer", 0.0)
    here = _bandwidth_here(m)
    if not (here and target.memory_bandwidth_bytes_per_s):
        assumptions.append(f"{target.name}: optimizer time kept as measured (a memory bandwidth is unknown)")
        return measured_s
    return measured_s * here / target.memory_bandwidth_bytes_per_s


def _input_s(m: Measurement, target: Target, batch: int, samples_ratio: float, parts: dict[str, float],
             assumptions: list[str]) -> tuple[float, bool]:  # fmt: skip
    """The input pipeline's part of the step, and whether it sets the step (input-bound).

    The loader's work is its CPU time per sample here times the samples a rank gets, on
    cores as fast as this one's. At 0 workers it runs in the training process and adds. On
    a GPU host its workers share it and prefetch while the training process does the rest
    of the step: only what outlasts that shows. On a CPU the workers take the compute
    threads' cores: nothing hides. The host-to-device phase adds as measured, on the same
    device only: a CPU bench's is no copy (a memory-format change at most)."""
    if m.input_cpu_s_per_sample is None:
        return _input_from_wall_s(m, target, samples_ratio, parts, assumptions)
    copy_s = m.breakdown_s.get("host_to_device", 0.0) * samples_ratio if m.device == target.device else 0.0
    if m.device != target.device:
        assumptions.append(f"{target.name}: the host-to-device copy is not predicted (a {m.device} bench makes none)")
    loader_s, workers = m.input_cpu_s_per_sample * batch / target.world_size, _workers_there(m, target)
    per_worker_s, cores = loader_s / max(workers, 1.0), "on vCPUs as fast as this machine's cores"
    if workers == 0 or target.device == "cpu":
        how = ("in the training process (data.num_workers 0: one core, not overlapped)" if workers == 0 else
               f"over {workers:g} workers, added (they share the cores the compute threads use)")  # fmt: skip
        assumptions.append(f"{target.name}: the input pipeline's {loader_s * 1e3:.3g} ms of CPU a step runs {how}, "
                           f"{cores}")  # fmt: skip
        return per_worker_s + copy_s, per_worker_s + copy_s > max(parts["compute"], parts["communication"])
    rest_s = sum(seconds for name, seconds in parts.items() if name != "input")
    assumptions.append(f"{target.name}: the input pipeline's {loader_s * 1e3:.3g} ms of CPU a step over {workers:g} "
                       f"loader workers ({per_worker_s * 1e3:.3g} ms each) is prefetched under the "
                       f"{rest_s * 1e3:.3g} ms rest of the step, {cores}")  # fmt: skip
    return copy_s + max(0.0, per_worker_s - rest_s), per_worker_s > rest_s


def _workers_there(m: Measurement, target: Target) -> float:
    """Loader workers of a rank that get a vCPU there; on a GPU host one stays with the training process
    (it launches the kernels). ``auto``: the largest count :func:`default_candidates` tries there."""
    if m.data_num_workers == 0:
        return 0
    node_vcpus = int(target.vcpus_per_rank * target.ranks_per_node)
    configured = default_candidates(node_vcpus)[-1] if m.data_num_workers == "auto" else m.data_num_workers
    return max(1.0, min(float(configured), target.vcpus_per_rank - (1 if target.device == "cuda" else 0)))


def _input_from_wall_s(m: Measurement, target: Target, samples_ratio: float, parts: dict[str, float],
                       assumptions: list[str]) -> tuple[float, bool]:  # fmt: skip
    """A bench that could not time the input's CPU (an epoch too short to time past its warm-up, a
    loader error: its notes say which): its wall-clock wait, which follows this machine's load."""
    assumptions.append(f"{target.name}: the bench has no CPU time of the input pipeline (its notes say why): the "
                       "wall-clock data wait measured here is used, which a busy bench machine inflates; bench again")
    measured_s = (m.breakdown_s.get("data_wait", 0.0) + m.breakdown_s.get("host_to_device", 0.0)) * samples_ratio
    if m.data_num_workers != 0:
        workers = default_candidates(m.cpu_count)[-1] if m.data_num_workers == "auto" else m.data_num_workers
        workers_here, workers_there = min(workers, m.cpu_count / m.world_size), min(workers, target.vcpus_per_rank)
        measured_s *= workers_here / max(workers_there, 1.0)
    return measured_s, measured_s > max(parts["compute"], parts["communication"])


def _communication_s(m: Measurement, target: Target, compute_s: float, accumulation: int,
                     assumptions: list[str]) -> tuple[float, float | None, str | None]:  # fmt: skip
    """DDP's all-reduce of the gradients, less what backward hides (:mod:`skylift.plan.ddp`):
    seconds, bytes (the gradients twice: an all-reduce is a reduce-scatter and an
    all-gather, the unit FSDP's are counted in) and the bound."""
    if target.world_size == 1:
        return 0.0, None, None
    if not m.model_bytes:
        assumptions.append(f"{target.name}: gradient communication not predicted (model size unknown)")
        return 0.0, None, None
    links = ((target.ranks_per_node, target.intra_node_bus_bytes_per_s),
             (target.nodes, target.inter_node_bus_bytes_per_s))
    overlaps = target.device == "cuda"
    result = ddp_communication(gradient_bytes=m.model_bytes, links=links, overlaps=overlaps, compute_s=compute_s,
                               accumulation_steps=accumulation)  # fmt: skip
    size = f"{m.model_bytes / 2**20:.1f} MiB"
    if overlaps:
        assumptions.append(f"{target.name}: the all-reduce of {size} of gradients runs in 25 MiB buckets under "
                           "backward (DDP): the last bucket and what outlasts backward are exposed (each "
                           "candidate's bound: --json)")  # fmt: skip
    else:
        assumptions.append(f"{target.name}: the all-reduce of {size} of gradients is not overlapped with backward "
                           "(a CPU's collectives share its cores)")  # fmt: skip
    return result.exposed_s, 2.0 * m.model_bytes, result.bound if overlaps else None


def _sharded_communication_s(m: Measurement, target: Target, memory: ModelMemory | None, sharding: Sharding,
                             compute_s: float, accumulation: int, assumptions: list[str]) -> tuple[float, float | None]:
    """FSDP's all-gathers and reduce-scatters, less what the compute hides (:mod:`skylift.plan.fsdp`)."""
    if sharding.cpu_offload:
        assumptions.append(f"{target.name}: cpu_offload's host-device copies and the optimizer step on the CPU are "
                           "not predicted (the step is a lower bound)")  # fmt: skip
    if target.world_size == 1:
        return 0.0, None
    parameters = memory.parameters if memory is not None and memory.parameters else (m.model_bytes or 0) // 4
    if not parameters:
        assumptions.append(f"{target.name}: FSDP communication not predicted (model size unknown)")
        return 0.0, None
    half = precision_class(target_precision(m) if target.device == "cuda" else m.precision) == "half"
    links = ((target.ranks_per_node, target.intra_node_bus_bytes_per_s),
             (target.nodes, target.inter_node_bus_bytes_per_s))
    result = sharded_communication(parameters=parameters, memory=memory, sharding=sharding, links=links,
                                   overlaps=target.device == "cuda", compute_s=compute_s,
                                   accumulation_steps=accumulation, half_precision=half)  # fmt: skip
    blocks = memory.block_count if memory is not None and memory.root_parameters is not None else 0
    overlap = ("overlapped as FSDP2 overlaps it (each block's all-gather under the previous block's compute, "
               f"{blocks} blocks)" if target.device == "cuda" and blocks > 1 else
               "not overlapped (" + ("no blocks counted" if blocks <= 1 else "a CPU's collectives share its cores")
               + ")")  # fmt: skip
    moved = (f"{result.bytes_per_step / 2**30:.1f} GiB" if result.bytes_per_step >= 2**30 else
             f"{result.bytes_per_step / 2**20:.1f} MiB")  # fmt: skip
    assumptions.append(f"{target.name}: FSDP moves {moved} a step (all-gathers "
                       f"{'in forward and backward' if sharding.reshard_after_forward else 'in forward'}, a "
                       f"reduce-scatter of the gradients), {overlap}")  # fmt: skip
    return result.exposed_s, result.bytes_per_step


def _optimizer_share(m: Measurement, sharding: Sharding | None, assumptions: list[str]) -> float:
    """Under FSDP each rank steps its shard: the measured optimizer time (taken under the
    same strategy, at the measured world size) scales with the parameters a rank holds."""
    if sharding is None:
        return 1.0
    assumptions.append("FSDP: each rank's optimizer steps 1/world size of the parameters (the bench ran the same "
                       "strategy, sharded over its own ranks)")  # fmt: skip
    return m.world_size / sharding.shard_count


def _fit(m: Measurement, target: Target, batch: int, memory: ModelMemory | None, sharding: Sharding | None,
         assumptions: list[str]) -> tuple[int, int, MemoryBreakdown | None] | str:
    """(accumulation, micro-batch, one rank's memory), or why the job does not fit one GPU."""
    micro = batch // target.world_size
    if target.device_memory_bytes is None:
        return 1, micro, None
    if memory is None or not memory.parameters:
        reason = memory.note if memory is not None and memory.note else "the model was not traced"
        assumptions.append(f"{target.name}: memory fit not checked ({reason})")
        return 1, micro, None
    half = precision_class(target_precision(m) if target.device == "cuda" else m.precision) == "half"

    def at(size: int, accumulation: int = 1) -> MemoryBreakdown:
        return training_memory(memory, size, half_precision=half, world_size=target.world_size, sharding=sharding,
                               accumulating=accumulation > 1)  # fmt: skip

    capacity = target.device_memory_bytes
    usable_gib = MEMORY_HEADROOM * capacity / 2**30
    sharded = f", {sharding.describe()}" if sharding else ""
    if not at(0).fits(capacity):
        return f"does not fit: model state {at(0).total_bytes / 2**30:.1f} GiB > {usable_gib:.1f} GiB usable{sharded}"
    host = host_overflow(at(0), memory, ranks_per_node=target.ranks_per_node, nodes=target.nodes,
                         host_memory_bytes=target.host_memory_bytes)
    if host:
        return host
    if memory.saved_float_elements_per_sample is None:
        # The state is known, the activations are not: a lower bound of the need still drops.
        reason = memory.note or "the activations were not traced"
        assumptions.append(f"{target.name}: memory fit checked for the model state only ({reason})")
        return 1, micro, at(0)
    if sharding and not at(micro).fits(capacity) and not at(1, 2).fits(capacity):
        held = (at(0, 2).unsharded_bytes - at(0).unsharded_bytes) / 2**30
        return (f"does not fit: the whole micro-batch does not, and accumulating holds every unsharded gradient "
                f"({held:.1f} GiB) between micro-steps{sharded}")  # fmt: skip
    accumulation = 1
    while micro % accumulation or not at(micro // accumulation, accumulation).fits(capacity):
        accumulation += 1
        if accumulation > micro:
            return f"does not fit: one sample's activations exceed the {usable_gib:.1f} GiB usable{sharded}"
    if accumulation > 1:
        assumptions.append(f"{target.name}: accumulation {accumulation} so a micro-batch of "
                           f"{micro // accumulation} fits (global batch kept)")  # fmt: skip
    return accumulation, micro // accumulation, at(micro // accumulation, accumulation)


def target_precision(m: Measurement) -> str:
    """The precision the job would train in on a recent GPU: ``auto`` becomes bf16/fp16 there."""
    if m.configured_precision == "auto":
        return "bf16"
    return m.configured_precision if precision_class(m.configured_precision) != "fp32" else m.precision
