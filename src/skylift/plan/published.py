"""Published training measurements that calibrate and check the plan's GPU model.

``published.csv`` (package data, like the catalog) holds measured training throughput
for workloads skylift can express, each row with its conditions (GPU, count, precision,
memory format, batch per GPU, data and loader, framework and software) and its source
pinned to a commit. ``use`` says what the plan does with a row: ``calibrate`` rows fit
the GPU model's factors (:mod:`skylift.plan.calibration`); ``reference`` rows are kept
for comparison only, with the reason in ``note`` (another framework, or a program
skylift does not run). ``published_structure.csv`` holds each calibrated workload's
traced structure (FLOPs, traffic, kernels per micro-step), written by
``python -m benchmarks.plan_published --refresh-structure`` from skylift's own meta
trace of the same model.
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from functools import lru_cache
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from skylift.errors import SkyliftConfigError
from skylift.machine.gpus import GPU_TABLE, GpuSpec

__all__ = ["PublishedRow", "WorkloadStructure", "load_published", "load_structures", "pairs_for_scaling"]

_ENTRIES = {spec.table_entry: spec for spec in GPU_TABLE}


class PublishedRow(BaseModel):
    """One published throughput figure and the conditions it was measured under."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    row_id: str = Field(min_length=1)
    """Unique name of the row (``dle-rn50-2103-a100-80-1x-amp``)."""
    workload: str = Field(min_length=1)
    """Model and input size (``resnet50_v1.5_224``, ``bert_large_squad_384``)."""
    gpu: str
    """The GPU's entry in skylift's GPU table (``a100-sxm-80gb``)."""
    gpu_count: int = Field(ge=1)
    """GPUs the figure was measured on (all in one node for every calibrated row)."""
    precision: Literal["amp", "tf32", "fp32", "fp8"]
    """``amp``: fp16/bf16 autocast; ``tf32``: fp32 tensors on TF32 tensor cores; ``fp32``: CUDA cores;
    ``fp8``: float8 matmuls in the linear layers, bf16 elsewhere (the GPU table has no fp8
    peak: such a row is kept, not predicted)."""
    memory_format: Literal["channels_last", "nchw", ""]
    """Image models' activation layout; empty for text models."""
    batch_per_gpu: int = Field(ge=1)
    """Samples per GPU per micro-step."""
    sequence_length: int | None = None
    """Tokens per sample of a language model's row read in ``tokens/s`` (``None``: the unit is samples)."""
    parallelism: Literal["all-reduce", "fsdp"]
    """``all-reduce``: data parallel, every GPU holds the model and the gradients are
    all-reduced (DDP, Horovod); ``fsdp``: parameters sharded, gathered per layer, gradients
    reduce-scattered."""
    activation_checkpointing: Literal["", "selective", "full"]
    """Recomputation in backward: none, some ops' outputs (torchtitan's ``selective``), every layer's."""
    throughput: float = Field(gt=0)
    """Samples (or, for ``tokens/s`` rows, tokens) per second over all ``gpu_count`` GPUs."""
    unit: Literal["images/s", "sequences/s", "tokens/s"]
    """What the throughput counts."""
    figure: Literal["quoted", "derived"]
    """``quoted``: as printed in the source; ``derived``: arithmetic on it, given in ``note``."""
    use: Literal["calibrate", "reference"]
    """``calibrate``: fits the GPU model; ``reference``: compared only (``note`` says why)."""
    data: str = Field(min_length=1)
    """The data the figure was measured on (``real ImageNet``)."""
    loader: str = Field(min_length=1)
    """The input pipeline (``pytorch DataLoader``, ``DALI``)."""
    framework: Literal["pytorch", "mxnet"]
    """The training framework."""
    software: str = Field(min_length=1)
    """Container or release (``pytorch-21.03 NGC``)."""
    system: str = Field(min_length=1)
    """The machine (``DGX A100 (NVSwitch)``)."""
    memory_bandwidth_gb_s: float | None = None
    """The GPUs' memory bandwidth where the source states one other than the table entry's
    data sheet (torchtitan's 500 W H100s with HBM2e: 2.4 TB/s); ``None``: the data sheet's."""
    intra_node_gb_s: float | None = None
    """GPU-to-GPU bandwidth of the system, GB/s both directions (multi-GPU rows)."""
    source_repo: str = Field(min_length=1)
    """Where the figure is published (``NVIDIA/DeepLearningExamples``)."""
    source_path: str = Field(min_length=1)
    """The file in that repository."""
    source_commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    """The commit the figure was read at."""
    source_date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    """The date of that commit (or of the publication, where ``note`` says so)."""
    note: str = ""
    """Conditions and caveats; for ``derived`` figures, the arithmetic."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        if value not in _ENTRIES:
            raise ValueError(f"{value!r} is not in the GPU table ({', '.join(sorted(_ENTRIES))})")
        return value

    @model_validator(mode="after")
    def _tokens_need_a_length(self) -> PublishedRow:
        if (self.unit == "tokens/s") != (self.sequence_length is not None):
            raise ValueError("sequence_length is given exactly for the rows in tokens/s")
        return self

    @field_validator("intra_node_gb_s", "sequence_length", "memory_bandwidth_gb_s", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @property
    def spec(self) -> GpuSpec:
        """The GPU's data-sheet figures, with the bandwidth the source states where it states one."""
        sheet = _ENTRIES[self.gpu]
        if self.memory_bandwidth_gb_s is None:
            return sheet
        return replace(sheet, memory_bandwidth_bytes_per_s=self.memory_bandwidth_gb_s * 1e9)

    @property
    def family(self) -> str:
        """The GPU's family (``a100``): a leave-one-GPU-out check holds out every row of it."""
        return self.spec.identity.family if self.spec.identity else self.gpu

    @property
    def per_gpu(self) -> float:
        """The throughput of one GPU, in the row's unit."""
        return self.throughput / self.gpu_count

    @property
    def samples_per_gpu(self) -> float:
        """Samples (sequences, for ``tokens/s`` rows) per second of one GPU: what the model predicts."""
        return self.per_gpu / (self.sequence_length or 1)

    @property
    def half(self) -> bool:
        """Whether the row's activations are 2-byte (``amp``; ``fp8``: float8 matmuls, bf16 elsewhere)."""
        return self.precision in ("amp", "fp8")

    @property
    def source(self) -> str:
        """``repo@commit:path (date)``."""
        return f"{self.source_repo}@{self.source_commit[:8]}:{self.source_path} ({self.source_date})"


class WorkloadStructure(BaseModel):
    """A published workload as skylift's meta trace sees it, at one precision and micro-batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workload: str
    """As in ``published.csv``."""
    half: bool
    """Traced with 2-byte floating tensors (``amp`` rows) or 4-byte (``tf32``/``fp32``)."""
    batch_per_gpu: int = Field(ge=1)
    """The micro-batch it was traced at (weights are read once per micro-step)."""
    flops_per_sample: float = Field(gt=0)
    """Forward + backward FLOPs per sample."""
    conv_flops_per_sample: float = Field(ge=0)
    """The part of them in convolutions."""
    memory_op_bytes_per_sample: float = Field(gt=0)
    """Bytes moved by ops without FLOPs (elementwise, norms, pooling), unfused."""
    compute_op_bytes_per_sample: float = Field(ge=0)
    """Bytes read and written by the ops with FLOPs (matmuls, convolutions)."""
    ops_per_micro_step: int = Field(ge=1)
    """ATen ops of one forward + backward: kernels a GPU launches per micro-step."""
    model_bytes: float = Field(gt=0)
    """fp32 bytes of the weights: what DDP all-reduces each step."""
    intensity_bins: tuple[tuple[float, float, float], ...]
    """The ops with FLOPs by arithmetic intensity: ``(FLOPs, bytes, conv bytes)`` per
    sample per half-octave of FLOP/byte (:class:`skylift.plan.traffic.StepTraffic`)."""

    @field_validator("intensity_bins", mode="before")
    @classmethod
    def _from_json(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, str) else value


def _read(name: str, model: type[BaseModel]) -> list:
    text = resources.files("skylift.plan").joinpath(name).read_text(encoding="utf-8")
    rows = []
    for line, record in enumerate(csv.DictReader(text.splitlines()), start=2):
        try:
            rows.append(model.model_validate(record))
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise SkyliftConfigError(f"skylift/plan/{name} line {line}: {field}: {first['msg']}",
                                     f"fix that row of skylift/plan/{name}") from None  # fmt: skip
    return rows


@lru_cache(maxsize=1)
def load_published() -> tuple[PublishedRow, ...]:
    """Every row of ``published.csv``, validated; row ids are unique.

    Raises:
        SkyliftConfigError: a row does not validate (the line and field named).
    """
    rows = tuple(_read("published.csv", PublishedRow))
    seen: set[str] = set()
    for row in rows:
        if row.row_id in seen:
            raise SkyliftConfigError(f"skylift/plan/published.csv: row_id {row.row_id} appears twice",
                                     "give every row its own row_id")  # fmt: skip
        seen.add(row.row_id)
    return rows


@lru_cache(maxsize=1)
def load_structures() -> dict[tuple[str, bool, int], WorkloadStructure]:
    """``(workload, half, batch_per_gpu) -> structure`` from ``published_structure.csv``."""
    return {(s.workload, s.half, s.batch_per_gpu): s for s in _read("published_structure.csv", WorkloadStructure)}


def pairs_for_scaling(rows: tuple[PublishedRow, ...] | list[PublishedRow]) -> list[tuple[PublishedRow, PublishedRow]]:
    """``(one GPU, N GPUs)`` pairs: the same workload, GPU, precision, format, batch and
    source, measured on 1 and on N > 1 GPUs of one node."""

    def key(row: PublishedRow) -> tuple:
        return (row.workload, row.gpu, row.precision, row.memory_format, row.batch_per_gpu, row.source_commit,
                row.system)  # fmt: skip

    singles = {key(row): row for row in rows if row.gpu_count == 1}
    return [(singles[key(row)], row) for row in rows if row.gpu_count > 1 and key(row) in singles]
