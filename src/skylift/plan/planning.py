"""From command-line choices to a rendered plan: find the measurement, predict, rank, list assumptions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from skylift.errors import SkyliftConfigError
from skylift.machine.memory import MEMORY_HEADROOM, ModelMemory, Sharding
from skylift.plan.calibration import KindFactors, shipped_gpu_model, standing_row
from skylift.plan.measurement import Measurement, config_fingerprint, find_latest
from skylift.plan.model import predict_step, target_precision
from skylift.plan.ranking import (
    Candidate,
    PlanRequest,
    elastic_assumptions,
    interruption_rates,
    local_target,
    plan_candidates,
    predicted_hours,
    runnable_step_time_s,
)

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig

__all__ = ["Plan", "PlanChoices", "build_plan", "find_or_measure"]


@dataclass(kw_only=True)
class Plan:
    """A ranked list of candidates and every assumption behind it."""

    measurement_source: str
    measurement: Measurement
    epochs: float
    candidates: list[Candidate]
    assumptions: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """JSON of ``skylift plan --json``."""
        return {
            "measurement": self.measurement_source,
            "measured_samples_per_s": self.measurement.samples_per_s,
            "epochs": self.epochs,
            "candidates": [candidate.as_dict() for candidate in self.candidates],
            "assumptions": self.assumptions,
            "gpu_model": _gpu_model_dict(self.candidates),
        }


@dataclass(frozen=True, kw_only=True)
class PlanChoices:
    """What a plan is asked for (``skylift plan``'s flags). ``None``: the config's ``plan``
    section where it has the field, else the default."""

    config_path: str
    overrides: tuple[str, ...] = ()
    """``SECTION.KEY=VALUE`` overrides of the config (``--set``)."""
    epochs: float
    samples_per_epoch: int | None = None
    """Training samples per epoch of the real job (``None``: the measured run's dataset)."""
    deadline_hours: float | None = None
    budget_usd: float | None = None
    providers: tuple[str, ...] = ()
    """Only these clouds (empty: every one); likewise ``gpus`` and ``instances``."""
    gpus: tuple[str, ...] = ()
    instances: tuple[str, ...] = ()
    spot: Literal["auto", "only", "never"] = "auto"
    bench: str | None = None
    """The measurement (a bench file or run folder; ``None``: the newest bench of this config, else a new one)."""
    price_file: str | None = None
    efficiency: float | None = None
    interruptions_per_hour: float | None = None
    restart_minutes: float | None = None
    machine: Literal["cloud", "local"] = "cloud"
    """``local``: predict this machine at ``nproc`` processes of ``threads`` threads."""
    nproc: int = 1
    threads: int | None = None


def build_plan(choices: PlanChoices, *, log: Callable[[str], None]) -> Plan:
    """Everything ``skylift plan`` does: measure or find the measurement, predict, rank."""
    from skylift.config.load import load_config

    if choices.epochs <= 0:
        raise SkyliftConfigError("--epochs must be positive", f"e.g. skylift plan {choices.config_path} --epochs 10")
    overrides = list(choices.overrides)
    config = load_config(choices.config_path, overrides)
    source, measurement = find_or_measure(choices.config_path, overrides, config.model_dump(mode="json"),
                                          choices.bench, log)  # fmt: skip
    # The command line wins over the config's plan section, which wins over the defaults.
    chosen = config.plan
    rate = (choices.interruptions_per_hour if choices.interruptions_per_hour is not None
            else chosen.interruptions_per_hour)
    restart_minutes = choices.restart_minutes if choices.restart_minutes is not None else chosen.restart_minutes
    request = PlanRequest(
        epochs=choices.epochs, deadline_hours=choices.deadline_hours, budget_usd=choices.budget_usd,
        spot=choices.spot, efficiency=choices.efficiency, interruptions_per_hour=rate,
        restart_s=restart_minutes * 60.0, checkpoint_every_minutes=config.checkpoint.every_minutes,
        checkpoint_async=config.checkpoint.async_save, global_batch_size=config.data.global_batch_size,
        samples_per_epoch=choices.samples_per_epoch, memory=_model_memory(config, measurement),
        sharding=Sharding.of(config.distributed, 1),  # each candidate: over its own ranks
        elastic_nodes=(nodes.min, nodes.max) if (nodes := config.distributed.nodes) else None,
    )  # fmt: skip
    if choices.samples_per_epoch is not None and choices.samples_per_epoch < 1:
        raise SkyliftConfigError("--samples-per-epoch must be at least 1", "e.g. --samples-per-epoch 1281167")
    if choices.machine == "local":
        candidates = [_local_candidate(measurement, choices.nproc, choices.threads, request)]
    else:
        candidates = plan_candidates(measurement, _rows(choices, choices.price_file or chosen.price_file), request)
    assumptions = _assumptions(source, measurement, request, candidates)
    return Plan(measurement_source=source, measurement=measurement, epochs=choices.epochs, candidates=candidates,
                assumptions=assumptions)  # fmt: skip


def find_or_measure(config_path: str, overrides: list[str], resolved: dict, bench: str | None,
                    log: Callable[[str], None]) -> tuple[str, Measurement]:  # fmt: skip
    """The measurement to plan from: ``bench`` if given, else the newest of this config, else a new bench."""
    if bench is not None:
        return bench, Measurement.load(bench)
    latest = find_latest(config_fingerprint(resolved))
    if latest is not None:
        return str(latest), Measurement.load(latest)
    from skylift.plan.bench import BenchRequest, run_bench

    log(f"skylift plan: no measurement of {config_path} yet; running a short bench first (skylift bench)")
    measurement, path = run_bench(BenchRequest(config_path=config_path, overrides=overrides))
    return str(path), measurement


def _rows(choices: PlanChoices, price_file: str | None) -> list:
    from skylift.catalog import filter_rows, load_catalog

    rows = filter_rows(load_catalog(price_file), gpus=list(choices.gpus), providers=list(choices.providers))
    if choices.instances:
        known = {row.instance_type for row in rows}
        missing = [name for name in choices.instances if name not in known]
        if missing:
            raise SkyliftConfigError(f"--instances: not in the catalog (after filters): {', '.join(missing)}",
                                     "list them with: skylift catalog")  # fmt: skip
        rows = [row for row in rows if row.instance_type in choices.instances]
    if not rows:
        raise SkyliftConfigError("no catalog row matches --providers/--gpus/--instances", "list them: skylift catalog")
    return rows


def _local_candidate(measurement: Measurement, nproc: int, threads: int | None, request: PlanRequest) -> Candidate:
    if nproc < 1:
        raise SkyliftConfigError("--nproc must be at least 1", "e.g. skylift plan CONFIG --machine local --nproc 2")
    target = local_target(measurement, nproc, threads)
    prediction = predict_step(measurement, target, request.global_batch_size, request.memory, request.sharding)
    candidate = Candidate(instance="local", provider="local", count=nproc, spot=False, prediction=prediction,
                          price_status="local")  # fmt: skip
    if prediction.dropped:
        candidate.dropped.append(prediction.dropped)
    else:
        candidate.predicted_hours = predicted_hours(measurement, runnable_step_time_s(prediction), request.epochs,
                                                    request.global_batch_size, request.samples_per_epoch)  # fmt: skip
    return candidate


def _assumptions(source: str, m: Measurement, request: PlanRequest, candidates: list[Candidate]) -> list[str]:
    lines = [
        (f"measurement: {source} ({m.device_name}, {m.world_size} process(es) x {m.threads_per_process} thread(s), "
        f"{m.samples_per_s:.1f} samples/s, step {m.step_time_s * 1000:.1f} ms, {m.measured_steps} steps)"),
        f"global batch {request.global_batch_size or m.global_batch_size} on every candidate (measured at "
        f"{m.global_batch_size}; per-sample work rescaled, per-step work kept); "
        + (f"{request.samples_per_epoch:,} samples per epoch (--samples-per-epoch)" if request.samples_per_epoch
           else f"{m.steps_per_epoch * m.global_batch_size:,} samples per epoch, as in the measured run"),
        (f"GPU targets train in {target_precision(m)} (config precision: {m.configured_precision}); peaks and "
        "memory bandwidth from the GPU table shared with the monitor's MFU (dense, data sheets)"),
        _memory_assumption(request.memory, request.sharding),
        "spot: interruptions per instance-hour "
        + ", ".join(f"{provider} {rate:g}" for provider, rate in interruption_rates(request).items())
        + (" (yours: plan.interruptions_per_hour or --interruptions-per-hour)" if request.interruptions_per_hour
           is not None else " (assumed; no provider publishes a rate)")
        + f"; restart {request.restart_s / 60:g} min each",
        (f"work lost per interruption: none when the measured save ({_seconds(m.checkpoint_save_s)}) fits the "
        f"provider's notice window, else half of checkpoint.every_minutes ({request.checkpoint_every_minutes})"),
    ]
    lines += elastic_assumptions(request)
    lines += [f"GPU model, {text}" for text in _gpu_model_lines(candidates)]
    if any(candidate.prediction.calibrated_by for candidate in candidates):
        standing = standing_row(m.flops_per_sample, m.model_bytes)
        lines.append(f"GPU model, {standing}" if standing else "GPU model: no published row is this job's "
                     "workload (its parameters and FLOPs per sample): its error is the cross-validations' "
                     "(docs/plan.md)")  # fmt: skip
    if any(candidate.price_status == "price_unverified" for candidate in candidates):
        lines.append("price_unverified rows have no public price in the catalog: hours are predicted, dollars are "
                     "not; add yours with --price-file")  # fmt: skip
    seen: set[str] = set()
    for candidate in candidates:
        for text in candidate.prediction.assumptions:
            general = text.split(": ", 1)[-1]
            if general not in seen:
                seen.add(general)
                lines.append(general)
    return lines


def _used_kinds(candidates: list[Candidate]) -> list[KindFactors]:
    """The GPU model's factors that timed some candidate (its rows are in the prediction's)."""
    used = {row for candidate in candidates for row in candidate.prediction.calibrated_by}
    return [factors for factors in shipped_gpu_model().kinds.values() if used & set(factors.rows)] if used else []


def _gpu_model_lines(candidates: list[Candidate]) -> list[str]:
    return [factors.describe() for factors in _used_kinds(candidates)]


def _gpu_model_dict(candidates: list[Candidate]) -> dict:
    return {factors.kind: {"compute_share": factors.compute_share, "bandwidth_share": factors.bandwidth_share,
                           "memory_bandwidth_share": factors.memory_bandwidth_share, "layout": factors.layout,
                           "seconds_per_op": factors.seconds_per_op, "scaling": factors.scaling,
                           "rows": list(factors.rows), "scaling_rows": list(factors.scaling_rows)}
            for factors in _used_kinds(candidates)}  # fmt: skip


def _model_memory(config: RunConfig, measurement: Measurement) -> ModelMemory | None:
    """The job's model traced on meta at the measured micro-batch, as ``skylift doctor`` traces it."""
    from skylift.doctor.memory import trace_model_memory

    try:
        return trace_model_memory(config, measurement.micro_batch_size,
                                  sharded=config.distributed.strategy == "fsdp")  # fmt: skip
    except Exception as error:  # noqa: BLE001 - the plan goes on; its assumptions say the fit is unchecked
        return ModelMemory(parameters=0, trainable_parameters=0, optimizer_state_copies=0,
                           note=f"model not traced: {type(error).__name__}: {error}")


def _memory_assumption(memory: ModelMemory | None, sharding: Sharding | None) -> str:
    if memory is None or not memory.parameters:
        return "memory fit: not checked (the model was not traced)"
    adapters = _adapter_text(memory)
    if memory.reference_weight_bytes:
        from skylift.doctor.rules.resources import format_bytes

        adapters += f"; DPO's frozen reference copy of the weights ({format_bytes(memory.reference_weight_bytes)})"
    if memory.checkpoint_in_memory:
        adapters += ("; checkpoint.memory's copies in the node's RAM (3 steps of the node's share of the checkpoint, "
                     "and of its peer's under FSDP)")
    if memory.saved_float_elements_per_sample is None:
        how = ("sharded over each candidate's ranks (FSDP2) with what a rank gathers" if sharding else
               "with DDP buckets and half weight copies")  # fmt: skip
        return (f"memory fit: the model state only ({memory.note or 'activations not traced'}){adapters}, {how}, "
                f"within {MEMORY_HEADROOM:.0%} of GPU memory")
    state = (f"fp32 weights and gradients, {memory.optimizer_state_copies} optimizer state cop"
             f"{'y' if memory.optimizer_state_copies == 1 else 'ies'}" + (", an EMA copy" if memory.ema else ""))
    state += adapters
    if sharding is not None:
        blocks = (f"the root group ({memory.root_parameters:,} parameters) and twice the largest of "
                  f"{memory.block_count} blocks ({memory.largest_block_parameters:,})" if memory.root_parameters
                  is not None else "every parameter (no blocks found: one group)")  # fmt: skip
        offload = "; cpu_offload: the shards in host memory" if sharding.cpu_offload else ""
        return (f"memory fit: {state}, sharded over each candidate's ranks (FSDP2), plus what a rank gathers: "
                f"{blocks} in the compute dtype and one block's gradient for the reduce-scatter{offload}; the "
                f"tensors saved for backward (meta trace), within {MEMORY_HEADROOM:.0%} of GPU memory; the same "
                "model as skylift doctor's")  # fmt: skip
    return (f"memory fit: {state}, DDP buckets with several GPUs, half weight copies under bf16/fp16, and the "
            f"tensors saved for backward (meta trace), within {MEMORY_HEADROOM:.0%} of GPU memory; the same "
            "model as skylift doctor's")


def _adapter_text(memory: ModelMemory) -> str:
    """With adapters: what trains, and that the frozen base holds no gradient or optimizer state."""
    if memory.adapters is None:
        return ""
    from skylift.doctor.rules.resources import format_bytes
    from skylift.machine.memory import nf4_bytes_per_parameter

    frozen = memory.weight_bytes - memory.trainable_parameters * 4
    four_bit = (f", {memory.quantized_parameters:,} of its parameters in 4-bit NF4 at "
                f"{nf4_bytes_per_parameter():.4g} bytes each (bitsandbytes' blocksize-64 fp32 absmax)"
                if memory.quantized_parameters else "")  # fmt: skip
    return (f"; {memory.adapters}: gradients and optimizer state for the {memory.trainable_parameters:,} "
            f"trainable parameters only, the frozen base of {memory.frozen_parameters:,} held as stored "
            f"({format_bytes(frozen)}{four_bit}) with none")


def _seconds(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f} s"

