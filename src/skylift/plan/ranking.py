"""Candidates (instance x count x spot/on-demand), their hours and dollars, and the ranking.

Spot costs are the price times the hours plus what interruptions add: each one costs a
restart and the work since the last checkpoint. skylift saves on a spot notice when the
measured save fits the provider's notice window, so then no work is lost. The hourly
interruption rate is an assumption (no provider publishes one), listed in every plan
and overridable with ``--interruptions-per-hour``. An elastic job (``distributed.nodes``)
on more nodes than its minimum loses only the interrupted node: the others train on
while it is relaunched (:func:`elastic_assumptions` says how that is counted).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from skylift.catalog import InstanceRow
from skylift.cloud.vendors import DEFAULT_INTERRUPTIONS_PER_HOUR, cloud_vendors
from skylift.machine.gpus import gpu_spec
from skylift.machine.memory import ModelMemory, Sharding
from skylift.plan.measurement import Measurement
from skylift.plan.model import StepPrediction, Target, predict_step, target_precision

__all__ = ["DEFAULT_INTERRUPTIONS_PER_HOUR", "DEFAULT_RESTART_S", "DEFAULT_WORKER_RESTART_S", "Candidate",
           "PlanRequest", "default_interruptions_per_hour", "elastic_assumptions", "interruption_rates", "local_target",
           "plan_candidates", "row_target", "runnable_step_time_s"]  # fmt: skip


def default_interruptions_per_hour() -> dict[str, float]:
    """Each registered cloud's assumed spot interruptions per instance-hour
    (:attr:`skylift.cloud.vendors.CloudVendor.interruptions_per_hour`: 0.05 until a vendor
    publishes a rate. AWS's Spot Instance Advisor gives monthly interruption-frequency
    buckets per instance type, https://aws.amazon.com/ec2/spot/instance-advisor/; the
    others publish none)."""
    return {vendor.name: vendor.interruptions_per_hour for vendor in cloud_vendors()}


DEFAULT_RESTART_S = 600.0
"""Assumed seconds from an interruption to training again: new capacity, image pull, resume."""

DEFAULT_WORKER_RESTART_S = 60.0
"""Assumed seconds an elastic job's survivors stand still at a membership change: torchrun
stops the workers, the rendezvous re-forms (it waits up to its last-call timeout, 30 s by
default, for late nodes), and the workers start again and load the checkpoint. The bench
does not measure a resume, so this is an assumption, listed in the plan."""


@dataclass(kw_only=True)
class PlanRequest:
    """What the user asked for."""

    epochs: float
    deadline_hours: float | None = None
    budget_usd: float | None = None
    spot: Literal["auto", "only", "never"] = "auto"
    node_counts: tuple[int, ...] = (1, 2, 4)
    efficiency: float | None = None
    interruptions_per_hour: float | dict[str, float] | None = None
    """Spot interruptions per instance-hour: one rate, one per provider (the rest keep the
    defaults), or ``None`` for :func:`default_interruptions_per_hour`."""
    restart_s: float = DEFAULT_RESTART_S
    checkpoint_every_minutes: float | None = 10.0
    checkpoint_async: bool = True
    global_batch_size: int | None = None
    """The job's global batch (default: the measured one)."""
    samples_per_epoch: int | None = None
    """Training samples per epoch of the real job (default: the measured run's dataset)."""
    memory: ModelMemory | None = None
    """The job's model as the meta trace sees it, for the memory fit (``None``: not checked)."""
    sharding: Sharding | None = None
    """The job's FSDP settings (``distributed.strategy: fsdp``); each candidate shards over
    its own ranks. ``None``: DDP."""
    elastic_nodes: tuple[int, int] | None = None
    """The job's ``distributed.nodes`` (min, max): a candidate on more than min and at most
    max nodes loses one node per interruption, not the whole job. ``None``: a fixed job."""
    worker_restart_s: float = DEFAULT_WORKER_RESTART_S
    """Seconds the survivors of an elastic job stand still at each membership change."""


@dataclass(kw_only=True)
class Candidate:
    """One way to run the job, predicted."""

    instance: str
    provider: str
    count: int
    spot: bool
    prediction: StepPrediction
    predicted_hours: float | None = None
    predicted_usd: float | None = None
    usd_per_epoch: float | None = None
    usd_per_hour: float | None = None
    price_status: str = "verified"
    expected_interruptions: float = 0.0
    spot_savings_usd: float | None = None
    """What spot saves against on-demand for the same instances (spot rows only)."""
    spot_cheapest: tuple[float, str] | None = None
    """The cheapest zone's spot price per instance-hour and the zone, beside the median
    zone's that the plan costs with (spot rows with zone prices only)."""
    dropped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The JSON shape of ``skylift plan --json``."""
        p = self.prediction
        return {
            "instance": self.instance, "provider": self.provider, "count": self.count, "spot": self.spot,
            "predicted_samples_per_s": p.samples_per_s, "predicted_step_time_s": p.step_time_s,
            "predicted_hours": self.predicted_hours, "predicted_usd": self.predicted_usd,
            "usd_per_epoch": self.usd_per_epoch, "usd_per_hour": self.usd_per_hour,
            "price_status": self.price_status, "expected_interruptions": self.expected_interruptions,
            "spot_savings_usd": self.spot_savings_usd, "accumulation_steps": p.accumulation_steps,
            "micro_batch_size": p.micro_batch_size, "step_parts_s": p.parts_s, "dropped": self.dropped,
            "memory_bytes": None if p.memory is None else {**asdict(p.memory), "total_bytes": p.memory.total_bytes,
                                                           "host_bytes": p.memory.host_bytes},
            "sharding": p.sharding.describe() if p.sharding else None, "communication_bytes": p.communication_bytes,
            "bound": p.bound, "calibrated_by": list(p.calibrated_by),
            "spot_cheapest_usd_per_hour": self.spot_cheapest[0] if self.spot_cheapest else None,
            "spot_cheapest_zone": self.spot_cheapest[1] if self.spot_cheapest else None,
        }  # fmt: skip


def row_target(row: InstanceRow, measurement: Measurement, nodes: int, efficiency: float | None) -> Target | None:
    """The planner's view of ``nodes`` instances of ``row``; None when its GPU is not in the table."""
    spec = gpu_spec(row.gpu_model)
    if spec is None:
        return None
    return Target(
        name=f"{row.instance_type} x{nodes}",
        device="cuda",
        nodes=nodes,
        ranks_per_node=row.gpu_count,
        peak_flops_per_s=spec.peak_flops_per_s(target_precision(measurement)),
        memory_bandwidth_bytes_per_s=spec.memory_bandwidth_bytes_per_s,
        vcpus_per_rank=row.vcpus / row.gpu_count,
        # Vendors state links in both directions; a ring sends one way at a time.
        intra_node_bus_bytes_per_s=row.intra_node_gb_s * 1e9 / 2 if row.gpu_count > 1 else None,
        inter_node_bus_bytes_per_s=row.network_gbps * 1e9 / 8,
        device_memory_bytes=row.gpu_memory_gib * 2**30,
        host_memory_bytes=row.ram_gib * 2**30,
        efficiency=efficiency,
        gpu_model=row.gpu_model,
    )


def local_target(measurement: Measurement, nproc: int, threads_per_process: int | None = None) -> Target:
    """This machine at ``nproc`` processes (each with ``threads_per_process`` threads)."""
    m = measurement
    threads = threads_per_process or max(1, m.cpu_count // nproc)
    # A CPU's matmul peak grows with the threads that have a core; oversubscribed threads add nothing.
    usable_threads = min(threads, m.cpu_count / nproc) if nproc > 1 else min(threads, m.cpu_count)
    threads_here = min(m.threads_per_process, m.cpu_count / m.world_size)
    peak_here = m.peak_flops_per_s or 1.0
    bandwidth = m.host_memory_bandwidth_bytes_per_s
    return Target(
        name=f"local x{nproc}",
        device=m.device,
        ranks_per_node=nproc,
        peak_flops_per_s=peak_here * usable_threads / threads_here,
        memory_bandwidth_bytes_per_s=bandwidth / nproc if bandwidth else None,
        vcpus_per_rank=m.cpu_count / nproc,
        threads_per_rank=int(min(threads, m.cpu_count)),
        intra_node_bus_bytes_per_s=m.allreduce_bytes_per_s,
    )


def plan_candidates(measurement: Measurement, rows: list[InstanceRow], request: PlanRequest) -> list[Candidate]:
    """Every candidate, ranked: runnable ones by dollars (then hours), dropped ones after, with reasons."""
    candidates = []
    for row in rows:
        for nodes in request.node_counts:
            target = row_target(row, measurement, nodes, request.efficiency)
            prediction = (predict_step(measurement, target, request.global_batch_size, request.memory,
                                       request.sharding) if target else
                          StepPrediction(step_time_s=None, samples_per_s=None,
                                         dropped=f"GPU {row.gpu_model} has no peak in the GPU table"))  # fmt: skip
            # A row without any price gets one line: spot and on-demand would say the same.
            choices = (False,) if row.price_status == "price_unverified" else _spot_choices(request.spot)
            for spot in choices:
                candidates.append(_costed(row, nodes, spot, prediction, measurement, request))
    return rank(candidates)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Runnable candidates cheapest first (then fastest), then the dropped ones by predicted hours."""
    def key(candidate: Candidate) -> tuple:
        hours = candidate.predicted_hours if candidate.predicted_hours is not None else float("inf")
        usd = candidate.predicted_usd if candidate.predicted_usd is not None else float("inf")
        return (bool(candidate.dropped), usd, hours)

    return sorted(candidates, key=key)


def predicted_hours(measurement: Measurement, step_time_s: float, epochs: float,
                    global_batch_size: int | None = None, samples_per_epoch: int | None = None) -> float:  # fmt: skip
    """Hours of training: epochs x optimizer steps per epoch (at ``global_batch_size``) x step time."""
    samples_per_epoch = samples_per_epoch or measurement.steps_per_epoch * measurement.global_batch_size
    steps_per_epoch = math.ceil(samples_per_epoch / (global_batch_size or measurement.global_batch_size))
    return epochs * steps_per_epoch * step_time_s / 3600.0


def runnable_step_time_s(prediction: StepPrediction) -> float:
    """The step time of a prediction that was not dropped (a dropped one has none)."""
    if prediction.step_time_s is None:
        raise ValueError(f"a dropped prediction has no step time ({prediction.dropped})")
    return prediction.step_time_s


def _request_hours(measurement: Measurement, step_time_s: float, request: PlanRequest) -> float:
    return predicted_hours(measurement, step_time_s, request.epochs, request.global_batch_size,
                           request.samples_per_epoch)  # fmt: skip


def _spot_choices(mode: str) -> tuple[bool, ...]:
    return {"auto": (False, True), "only": (True,), "never": (False,)}[mode]


def _costed(row: InstanceRow, nodes: int, spot: bool, prediction: StepPrediction, measurement: Measurement,
            request: PlanRequest) -> Candidate:  # fmt: skip
    candidate = Candidate(instance=row.instance_type, provider=row.provider, count=nodes, spot=spot,
                          prediction=prediction, price_status=row.price_status)  # fmt: skip
    if prediction.dropped:
        candidate.dropped.append(prediction.dropped)
        return candidate
    hours = _request_hours(measurement, runnable_step_time_s(prediction), request)
    hours += _checkpoint_overhead_hours(hours, measurement, request)
    if spot:
        candidate.expected_interruptions, hours = _with_interruptions(hours, row, nodes, measurement, request)
    candidate.predicted_hours = hours
    price = row.price(spot)
    if price is None:
        candidate.dropped.append("no price (price_unverified)" if row.price_status == "price_unverified"
                                 else "no spot price listed" if spot else "no on-demand price listed")  # fmt: skip
    else:
        candidate.usd_per_hour = price * nodes
        if spot and row.spot_cheapest_usd_per_hour is not None and row.spot_cheapest_zone:
            candidate.spot_cheapest = (row.spot_cheapest_usd_per_hour * nodes, row.spot_cheapest_zone)
        candidate.predicted_usd = candidate.usd_per_hour * hours
        candidate.usd_per_epoch = candidate.predicted_usd / request.epochs
        on_demand = row.price(False)
        if spot and on_demand is not None:
            plain_hours = _request_hours(measurement, runnable_step_time_s(prediction), request)
            candidate.spot_savings_usd = on_demand * nodes * plain_hours - candidate.predicted_usd
    if request.deadline_hours is not None and hours > request.deadline_hours:
        candidate.dropped.append(f"misses the deadline ({hours:.1f} h > {request.deadline_hours:g} h)")
    if (request.budget_usd is not None and candidate.predicted_usd is not None
            and candidate.predicted_usd > request.budget_usd):
        candidate.dropped.append(f"over budget (${candidate.predicted_usd:,.0f} > ${request.budget_usd:,.0f})")
    return candidate


def _checkpoint_overhead_hours(hours: float, measurement: Measurement, request: PlanRequest) -> float:
    # Async saves stall a step only for the copy off the device: not counted.
    if request.checkpoint_async or not request.checkpoint_every_minutes or not measurement.checkpoint_save_s:
        return 0.0
    saves = hours * 60.0 / request.checkpoint_every_minutes
    return saves * measurement.checkpoint_save_s / 3600.0


def _with_interruptions(hours: float, row: InstanceRow, nodes: int, measurement: Measurement,
                        request: PlanRequest) -> tuple[float, float]:  # fmt: skip
    """(expected interruptions, hours including their cost), in hours of the whole job.

    A fixed job stops whole when any instance goes: all nodes wait out the restart. An
    elastic one keeps training on the others while the lost node is relaunched, so the
    job is short of 1/nodes of its speed for the restart: ``restart_s / nodes`` of
    whole-job time, one node's relaunch paid. Its workers stand still twice (shrink now,
    grow back when the node returns). The work since the last checkpoint is lost alike.
    """
    rate = interruption_rates(request).get(row.provider, DEFAULT_INTERRUPTIONS_PER_HOUR)
    interruptions = rate * hours * nodes
    if _keeps_training(nodes, request):
        lost_s = request.restart_s / nodes + 2 * request.worker_restart_s
    else:
        lost_s = request.restart_s
    lost_s += _work_lost_s(row, measurement, request)
    return interruptions, hours + interruptions * lost_s / 3600.0


def _keeps_training(nodes: int, request: PlanRequest) -> bool:
    """Whether an elastic job on ``nodes`` survives losing one (it stays at or above min)."""
    return request.elastic_nodes is not None and request.elastic_nodes[0] < nodes <= request.elastic_nodes[1]


def elastic_assumptions(request: PlanRequest) -> list[str]:
    """The plan's line on an elastic job's interruptions (none for a fixed job)."""
    if request.elastic_nodes is None:
        return []
    low, high = request.elastic_nodes
    if low == high:
        return [(f"elastic job with distributed.nodes min = max = {low}: losing a node leaves too few, so the whole "
                 "job waits out the restart, as a fixed one does")]
    survivable = f"{high}" if low + 1 == high else f"{low + 1}..{high}"
    return [(f"elastic job (distributed.nodes {low}..{high}): on {survivable} nodes an interruption costs one "
             f"node's relaunch (the restart / N of whole-job time; the others train on) plus two stops of all "
             f"workers of {request.worker_restart_s:g} s (shrink, grow back; assumed, the bench measures no resume); "
             f"on other counts the whole job waits out the restart")]


def interruption_rates(request: PlanRequest) -> dict[str, float]:
    """Interruptions per instance-hour for each provider, the request's over the defaults."""
    given, defaults = request.interruptions_per_hour, default_interruptions_per_hour()
    if given is None:
        return defaults
    if isinstance(given, dict):
        return {**defaults, **given}
    return dict.fromkeys(defaults, given)


def _work_lost_s(row: InstanceRow, measurement: Measurement, request: PlanRequest) -> float:
    window_s = row.spot_notice_window_s
    save_s = measurement.checkpoint_save_s
    if save_s is not None and window_s is not None and save_s < window_s:
        return 0.0  # skylift saves on the notice: nothing since the last checkpoint is lost
    every_s = (request.checkpoint_every_minutes or 0.0) * 60.0
    return every_s / 2.0  # an interruption lands on average halfway between saves
