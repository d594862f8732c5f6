"""The schema of ``RUN_DIR/metrics.jsonl``: one JSON object a line, told apart by ``kind``.

Every record has ``kind`` and ``time`` (Unix seconds). A run folder accumulates the
records of every attempt of the same run (a preempted run that resumes appends), so
readers split attempts at ``run_start`` records.

==============  =============================================================================
kind            written
==============  =============================================================================
run_start       once per attempt, before the first step: device, peak FLOP/s, prices
train           per optimizer step (flushed every ``monitor.log_every_steps``)
eval            after each evaluation
system          every ``monitor.system_interval_s`` per node: host and GPU figures
cost            with each train flush when a price is known: dollars spent and projected
checkpoint      when a save finishes (committed or not)
preemption      when a stop was agreed: reason, notice window, what was saved
diagnosis       at the end of an attempt: what bounds the run and what to change
epoch           at each epoch's start with token-budget batching: padding share
autotune        when ``data.num_workers: auto`` has measured its candidates
flops           once per attempt, at the first step: FLOPs per sample, or why not counted
membership      once per attempt of an elastic job whose nodes changed: old and new size, why
run_end         once per attempt, after the last step
==============  =============================================================================

Field names carry their units (``_s``, ``_gib``, ``_mb_s``, ``_percent``, ``usd``).
:func:`validate_record` checks one record; tests validate every line a real run wrote.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

__all__ = ["BREAKDOWN_PHASES", "MetricsRecord", "read_records", "validate_record"]

BREAKDOWN_PHASES = (
    "data_wait",
    "host_to_device",
    "forward_backward",
    "communication",
    "optimizer",
    "checkpoint",
    "other",
)
"""Where a step's time goes, in loop order; the phases of a breakdown add up to the step."""


class _Record(BaseModel):
    # Readers must accept records written by newer versions, so extra fields are kept.
    model_config = ConfigDict(extra="allow")

    time: float
    """Unix time the record was written."""


class RunStartRecord(_Record):
    kind: Literal["run_start"]
    attempt: int = Field(ge=1)
    """1 for the first start of this run folder, +1 for each restart (resume)."""
    resumed_from_step: int | None
    """Checkpoint step this attempt resumed from; ``null`` for a fresh start."""
    step: int = Field(ge=0)
    """Optimizer step the attempt starts at."""
    total_steps: int = Field(ge=0)
    world_size: int = Field(ge=1)
    num_nodes: int = Field(ge=1)
    device: str
    """``cpu`` or ``cuda``."""
    device_name: str
    """GPU model name, or the CPU model."""
    precision: str
    peak_flops_per_s: float | None
    """Peak dense FLOP/s of one device at the run's precision (MFU's denominator)."""
    peak_flops_source: str
    """Where the peak came from: the GPU table, a measured CPU matmul, or ``unknown``."""
    flops_per_step: float | None = None
    """Unknown at start: FLOPs are counted at the first step and reported with MFU in
    the ``train`` records (``flops_per_step``: one rank's forward + backward)."""
    usd_per_hour: float | None
    """Price of the whole job per hour (all nodes); ``null`` when unknown."""
    on_demand_usd_per_hour: float | None
    """On-demand price of the same machines, for the spot savings figure."""
    nccl_settings: dict[str, Any] | None = None
    """NCCL variables ``skylift run``/``launch`` set for the workers from the machine's facts
    (``set``: name, value, reason), the user's own values it kept (``kept``) and a ``note``;
    ``null`` when the workers were not started by skylift's launcher."""


class TrainRecord(_Record):
    kind: Literal["train"]
    step: int = Field(ge=1)
    epoch: int = Field(ge=0)
    loss: float
    lr: float
    step_time_s: float = Field(ge=0)
    data_wait_s: float = Field(ge=0)
    samples_seen: int = Field(ge=0)
    samples_per_s: float = Field(ge=0)
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation over the logging interval (0..1)."""
    flops_per_step: float | None = None
    """One rank's model FLOPs of this optimizer step (forward + backward; the mean over
    ranks), MFU's numerator: counted step by step under a token budget, else the
    interval's FLOPs per sample times its samples, spread evenly over its steps."""
    breakdown_s: dict[str, float] | None = None
    """Seconds of this step per phase (see ``BREAKDOWN_PHASES``), on sampled steps."""
    breakdown_by_rank_s: list[dict[str, float]] | None = None
    """The same per rank (index = rank), gathered to rank 0, on sampled steps."""


class EvalRecord(_Record):
    kind: Literal["eval"]
    step: int = Field(ge=0)
    epoch: int = Field(ge=0)


class HostFigures(BaseModel):
    model_config = ConfigDict(extra="allow")

    cpu_percent: float
    """All cores, 0..100."""
    memory_used_gib: float
    memory_total_gib: float
    disk_read_mb_s: float | None = None
    disk_write_mb_s: float | None = None
    net_recv_mb_s: float | None = None
    net_sent_mb_s: float | None = None


class GpuFigures(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    name: str
    utilization_percent: float | None = None
    memory_used_gib: float | None = None
    memory_total_gib: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    pcie_rx_mb_s: float | None = None
    pcie_tx_mb_s: float | None = None


class SystemRecord(_Record):
    kind: Literal["system"]
    node_rank: int = Field(ge=0)
    step: int | None = None
    """Optimizer steps completed when sampled."""
    host: HostFigures
    gpus: list[GpuFigures]
    """Empty on a machine without GPUs (or without NVML)."""


class CostRecord(_Record):
    kind: Literal["cost"]
    step: int = Field(ge=0)
    usd_per_hour: float = Field(ge=0)
    """What this attempt pays per hour: ``monitor.usd_per_hour`` x ``nodes`` / ``nodes_priced``."""
    nodes: int | None = Field(default=None, ge=1)
    """Nodes this attempt holds and pays for (fewer than ``nodes_priced`` in a shrunk elastic job)."""
    nodes_priced: int | None = Field(default=None, ge=1)
    """Nodes ``monitor.usd_per_hour`` is the price of (``distributed.nodes.max`` in an elastic job)."""
    usd_spent: float = Field(ge=0)
    """Spent by this run folder so far, every attempt included."""
    usd_per_epoch: float | None
    projected_usd_total: float | None
    projected_s_left: float | None
    on_demand_usd_per_hour: float | None
    savings_usd: float | None
    """What the same time would have cost on demand, minus ``usd_spent``."""


class CheckpointRecord(_Record):
    kind: Literal["checkpoint"]
    step: int = Field(ge=0)
    committed: bool
    stall_s: float
    write_s: float
    error: str | None = None
    local_commit_s: float | None = None
    """With ``checkpoint.local_root``: seconds to the local commit (``write_s`` includes the upload)."""
    uploaded: bool | None = None
    """With ``checkpoint.local_root``: whether the copy in ``checkpoint.root`` committed too."""
    upload_error: str | None = None


class PreemptionRecord(_Record):
    kind: Literal["preemption"]
    step: int = Field(ge=0)
    reason: str
    seconds_left_at_notice: float | None
    saved: bool
    checkpoint_step: int | None
    notice_to_commit_s: float
    notice_to_upload_s: float | None = None
    """With ``checkpoint.local_root``: notice to the root's commit (``notice_to_commit_s``
    is to the local commit); ``null`` if the upload did not commit."""


class Finding(BaseModel):
    model_config = ConfigDict(extra="allow")

    kind: Literal["input", "compute", "communication", "checkpoint", "memory", "other"]
    severity: Literal["info", "warn"]
    message: str
    """The observation, with numbers."""
    advice: str | None
    """The concrete change that would help (``null`` when none is needed)."""


class DiagnosisRecord(_Record):
    kind: Literal["diagnosis"]
    step: int = Field(ge=0)
    bound: Literal["input", "compute", "communication", "checkpoint", "unknown"]
    """What limits throughput."""
    shares: dict[str, float]
    """Share of step time per phase (sums to ~1)."""
    findings: list[Finding]


class EpochRecord(_Record):
    kind: Literal["epoch"]
    epoch: int = Field(ge=0)
    step: int = Field(ge=0)
    batching: str
    """``token_budget`` (the only batching that writes it so far)."""
    padding_share: float = Field(ge=0, le=1)
    """Share of the epoch's padded tokens that are padding."""


class AutotuneRecord(_Record):
    kind: Literal["autotune"]
    step: int = Field(ge=0)
    """Step at which the last trial ended and the choice took effect."""
    setting: str
    """What was tuned (``data.num_workers``)."""
    chosen: int
    results: dict[str, float]
    """Training samples/s measured with each candidate."""


class FlopsRecord(_Record):
    kind: Literal["flops"]
    step: int = Field(ge=0)
    """The step whose first micro-batch was counted."""
    flops_per_sample: float | None = Field(default=None, gt=0)
    """Forward + backward FLOPs per training sample of the first micro-batch; ``None`` when
    not counted (no MFU). Under a token budget samples differ in length: the train
    records' ``flops_per_step`` count each step at its own lengths."""
    reason: str
    """How it was counted, or why it could not be (the MFU columns then stay empty)."""
    sequence_flops: dict[str, Any] | None = None
    """Under a token budget: one sequence padded to ``S`` tokens costs ``per_token * S +
    per_token_pair * S**2 + fixed`` FLOPs, fitted from exact counts at ``counted_lengths``."""


class MembershipRecord(_Record):
    kind: Literal["membership"]
    step: int = Field(ge=0)
    """The step the job continues from at its new size (the checkpoint it resumed)."""
    old_world_size: int = Field(ge=1)
    new_world_size: int = Field(ge=1)
    old_nodes: int = Field(ge=1)
    new_nodes: int = Field(ge=1)
    reason: Literal["notice", "node_lost", "node_joined"]
    """``notice``: a node left after a spot notice, with a checkpoint at the step boundary;
    ``node_lost``: a node vanished without notice, resumed from the newest complete
    checkpoint; ``node_joined``: a node came (back) and the job grew at a boundary."""
    seconds_lost: float = Field(ge=0)
    """Wall seconds from the old size's last finished step to this size's first step."""
    steps_lost: int = Field(default=0, ge=0)
    """Steps trained at the old size after ``step`` that are trained again (``node_lost`` only)."""


class RunEndRecord(_Record):
    kind: Literal["run_end"]
    step: int = Field(ge=0)
    samples_per_s: float = Field(ge=0)
    train_time_s: float = Field(ge=0)
    stopped_early: str | None


class GuardRecord(_Record):
    kind: Literal["guard"]
    guard: Literal["budget", "idle_gpu", "stall"]
    """Which guard of ``monitor.guards`` fired."""
    step: int = Field(ge=0)
    message: str
    """Why, with the figures (dollars spent or projected, minutes idle or stalled)."""
    stop: bool
    """Whether the run stopped for it (exit 3) or only warned."""
    checkpoint_step: int | None = None
    """With a stop at a step boundary: the checkpoint it committed."""


MetricsRecord = (
    RunStartRecord
    | TrainRecord
    | EvalRecord
    | SystemRecord
    | CostRecord
    | CheckpointRecord
    | PreemptionRecord
    | DiagnosisRecord
    | EpochRecord
    | AutotuneRecord
    | FlopsRecord
    | MembershipRecord
    | GuardRecord
    | RunEndRecord
)
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Annotated[MetricsRecord, Field(discriminator="kind")])


def validate_record(record: dict[str, Any]) -> MetricsRecord:
    """Return the typed record; raise ``pydantic.ValidationError`` naming the bad field."""
    return _ADAPTER.validate_python(record)


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the records of a metrics file, skipping a torn last line (a killed writer)."""
    with Path(path).open(encoding="utf-8") as lines:
        for raw_line in lines:
            line = raw_line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
