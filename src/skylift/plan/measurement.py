"""A measurement of one job on one machine: what ``skylift bench`` writes and ``skylift plan`` reads.

A measurement is built from a run folder (``metrics.jsonl`` + ``config.yaml``), so a
finished ``skylift run`` works as one too. Warm-up steps are left out; the step time is
the median of the measured steps and the phases are their medians scaled to add up to it
(a median per phase resists the odd step a busy machine stalls).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict

from skylift.errors import SkyliftConfigError

__all__ = ["BENCH_DIR", "Measurement", "config_fingerprint", "find_latest", "measurement_from_run_dir"]

BENCH_DIR = Path("runs/bench")
"""Where ``skylift bench`` keeps its runs and JSON files, relative to the working directory."""

_UNSHAPED_SECTIONS = ("run_dir", "schedule", "checkpoint", "monitor", "preemption", "plan", "submit")
"""Config parts a bench changes or that do not change the speed of a step: left out of the fingerprint."""


class Measurement(BaseModel):
    """One job measured on one machine (JSON: ``skylift bench --json``)."""

    model_config = ConfigDict(extra="allow")

    config_path: str
    """The config as given to ``bench``."""
    config_fingerprint: str
    """Hash of the config's speed-relevant sections: a plan picks measurements of the same job."""
    created_at: float
    """Unix time the measurement was taken."""
    device: str
    """``cpu`` or ``cuda``."""
    device_name: str
    precision: str
    configured_precision: str = "auto"
    """``precision`` as the config asks (``auto`` picks per device, so a GPU target may differ)."""
    data_num_workers: int | Literal["auto"] = 0
    """DataLoader workers per rank in the measured run (0: loading in the training process;
    ``auto``: the count ``data.num_workers: auto`` tunes, which a plan bounds by the target's vCPUs)."""
    input_cpu_s_per_sample: float | None = None
    """CPU seconds (user + system, not wall) the input pipeline spends producing one
    training sample here (read, decode, augment, collate), timed in the bench process with
    the loader at 0 workers and one torch thread (as a loader worker runs):
    ``time.thread_time``, so another process on this machine does not change it, as it
    does the wall-clock ``data_wait``. ``None`` where the bench could not time it (its
    notes say why; a plan then uses the measured wall time and says so)."""
    world_size: int
    threads_per_process: int
    """CPU threads each process computed with (``OMP_NUM_THREADS``)."""
    cpu_count: int
    other_load_share: float | None = None
    """Share of this machine's CPUs other processes used while the bench ran: a measurement
    taken beside a busy neighbour is slower than the job is (0 = ran alone)."""
    global_batch_size: int
    accumulation_steps: int
    micro_batch_size: int
    """Samples per rank per micro-step."""
    steps_per_epoch: int
    measured_steps: int
    """Optimizer steps measured (warm-up excluded)."""
    step_time_s: float
    """Median optimizer step, seconds."""
    samples_per_s: float
    """All ranks together, from ``step_time_s``."""
    breakdown_s: dict[str, float]
    """Phases of the median step (data_wait, host_to_device, forward_backward, communication,
    optimizer, checkpoint, other), scaled to add up to ``step_time_s``."""
    peak_flops_per_s: float | None
    """Peak of one device at the run's precision (data sheet, or a measured CPU matmul)."""
    flops_per_sample: float | None
    """Model FLOPs of forward + backward per sample."""
    mfu: float | None
    """Model FLOPs utilisation of the measured steps (0..1)."""
    memory_bytes_per_sample: float | None = None
    """Memory traffic of forward + backward per sample: the tensors every op reads and
    writes, traced on meta (an unfused upper bound, :mod:`skylift.plan.traffic`);
    ``None`` where the model could not be traced."""
    memory_op_bytes_per_sample: float | None = None
    """The part of ``memory_bytes_per_sample`` moved by ops without FLOPs (elementwise,
    norms, pooling): the bandwidth-bound share of the step."""
    traffic_half: bool | None = None
    """The traffic was traced with 2-byte floating tensors (the run's precision was
    bf16/fp16); ``None`` where it was not traced."""
    conv_flops_per_sample: float | None = None
    """The part of ``flops_per_sample`` (as traced) in convolutions: a job with most of its
    FLOPs there is timed on a GPU by the convolutional factors, else by the GEMM ones."""
    intensity_bins: list[tuple[float, float, float]] | None = None
    """The ops with FLOPs by arithmetic intensity, ``(FLOPs, bytes, conv bytes)`` per sample
    per half-octave of FLOP/byte: each group goes on its side of a GPU's roofline."""
    traced_ops_per_micro_step: int | None = None
    """ATen ops of one traced forward + backward: the kernels a GPU launches per micro-step."""
    channels_last: bool | None = None
    """The config's ``channels_last`` (image models' activation layout on a GPU)."""
    activation_checkpointing: bool | None = None
    """The config's ``activation_checkpointing.enabled``: backward runs each checkpointed
    block's forward again, which the meta trace does not count; ``None``: not recorded."""
    forward_backward_curve: dict[str, Any] | None = None
    """Forward + backward of the job's model timed here at two micro-batches and two
    thread counts (:mod:`skylift.plan.probe`): ``fixed_s`` and ``per_sample_s`` per
    micro-step, and ``thread_seconds``; ``None`` where it could not be probed."""
    model_bytes: int | None
    """Bytes of the model's weights (the gradient all-reduce moves this much per step)."""
    peak_device_memory_bytes: int | None
    """Most device memory in use (GPU runs; ``None`` on a CPU)."""
    peak_host_memory_bytes: int | None
    """Largest resident set of a training process."""
    baseline_host_memory_bytes: int | None = None
    """Resident set of a process that imported torch and skylift and did nothing else."""
    checkpoint_save_s: float | None
    """Seconds to write one checkpoint (synchronously), measured at the end of the bench."""
    host_memory_bandwidth_bytes_per_s: float | None = None
    """Copy bandwidth of this machine's memory (scales memory-bound work on a CPU)."""
    allreduce_bytes_per_s: float | None = None
    """Bus bandwidth of an all-reduce of ``model_bytes`` between 2 processes here (gloo or NCCL)."""
    scaling: dict[str, Any] | None = None
    """With ``--nproc N``: ``{"nproc": N, "samples_per_s_1": ..., "samples_per_s_n": ...,
    "efficiency": ...}`` (1 → N scaling efficiency)."""
    run_dir: str
    notes: list[str] = []
    """What the measurement could not give, and why."""

    def save(self, path: Path) -> Path:
        """Write as JSON to ``path`` (folders created)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Measurement:
        """Read a bench JSON file, or build the measurement from a finished run folder."""
        path = Path(path)
        if path.is_dir():
            return measurement_from_run_dir(path, config_path=str(path / "config.yaml"))
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise SkyliftConfigError(f"--bench {path}: not a bench file ({error.__class__.__name__})",
                                     "write one with: skylift bench CONFIG") from None  # fmt: skip


def config_fingerprint(resolved: dict[str, Any]) -> str:
    """Hash of the resolved config without what a bench changes or the planner rescales itself.

    The global batch and accumulation are left out: the planner predicts other batch sizes
    from one measurement, so a plan with ``--set data.global_batch_size=256`` reuses it.
    """
    resolved = _with_recipe_defaults(resolved)
    kept = {key: value for key, value in resolved.items() if key not in _UNSHAPED_SECTIONS and key != "accumulation"}
    kept["data"] = {key: value for key, value in kept.get("data", {}).items()
                    if key not in ("global_batch_size", "micro_batch_size", "micro_batch_memory_gib")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _with_recipe_defaults(resolved: dict[str, Any]) -> dict[str, Any]:
    """``resolved`` with every setting of its recipe spelled out: a run folder's config.yaml
    lists them all (skylift writes the validated settings back), the YAML a bench read
    only those it set; the same job must hash the same."""
    from skylift.config.schema import RunConfig
    from skylift.recipes import check_recipe_settings

    try:
        config = RunConfig.model_validate(resolved)
        check_recipe_settings(config)
    except ValueError:  # a record that no run would accept (a test's, a hand-made one): hashed as given
        return resolved
    return {**resolved, "recipe": config.model_dump(mode="json")["recipe"]}


def find_latest(fingerprint: str, folder: Path = BENCH_DIR) -> Path | None:
    """The newest bench JSON in ``folder`` measured on the same job, or None."""
    best: tuple[float, Path] | None = None
    for candidate in folder.glob("*.json"):
        try:
            data = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if data.get("config_fingerprint") == fingerprint and (best is None or data["created_at"] > best[0]):
            best = (float(data["created_at"]), candidate)
    return None if best is None else best[1]


def measurement_from_run_dir(run_dir: Path, *, config_path: str, warmup_steps: int = 2, **extra: Any) -> Measurement:
    """Summarise the first attempt recorded in ``run_dir``, skipping ``warmup_steps`` steps.

    Raises:
        SkyliftConfigError: the folder has no ``metrics.jsonl`` or too few train records.
    """
    records = _read_records(run_dir)
    start = next((record for record in records if record["kind"] == "run_start"), None)
    trains = [record for record in records if record["kind"] == "train" and record["step"] > warmup_steps]
    if start is None or len(trains) < 2:
        raise SkyliftConfigError(f"{run_dir}: needs a run_start and at least {warmup_steps + 2} train records",
                                 "measure again with more steps: skylift bench CONFIG --steps 20")  # fmt: skip
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    world_size = int(start["world_size"])
    global_batch = int(resolved["data"]["global_batch_size"])
    # run_start has what the run settled (data.micro_batch_size: auto or a number); the
    # config's accumulation.steps for folders that predate it.
    accumulation = int(start.get("accumulation_steps") or resolved.get("accumulation", {}).get("steps", 1))
    step_time_s = statistics.median(record["step_time_s"] for record in trains)
    # Samples and FLOPs of the measured steps from the records: a token-budget step holds
    # as many texts as fit its budget, not data.global_batch_size, and each step has its
    # own FLOPs; with fixed batches both reduce to the global batch and one figure.
    samples_per_step = (trains[-1]["samples_seen"] - trains[0]["samples_seen"]) / (len(trains) - 1)
    counted = [r["flops_per_step"] for r in trains[1:] if r.get("flops_per_step")]
    flops_per_step = statistics.fmean(counted) if len(counted) == len(trains) - 1 else None
    breakdown = _median_breakdown(trains, step_time_s)
    samples_per_rank = samples_per_step / world_size
    peak = start.get("peak_flops_per_s")
    compute_s = breakdown.get("forward_backward", 0.0)
    fields: dict[str, Any] = {
        "config_path": config_path,
        "config_fingerprint": config_fingerprint(resolved),
        "created_at": time.time(),
        "device": start["device"],
        "device_name": start["device_name"],
        "precision": start["precision"],
        "configured_precision": str(resolved.get("precision", "auto")),
        "data_num_workers": _workers(resolved, start),
        "world_size": world_size,
        "threads_per_process": int(extra.pop("threads_per_process",
                                             max(1, int(start.get("cpu_count", 1)) // world_size))),
        "cpu_count": int(start.get("cpu_count", 1)),
        "global_batch_size": global_batch,
        "accumulation_steps": accumulation,
        "micro_batch_size": global_batch // (world_size * accumulation),
        "steps_per_epoch": int(start.get("steps_per_epoch") or 0),
        "measured_steps": len(trains),
        "step_time_s": step_time_s,
        "samples_per_s": samples_per_step / step_time_s,
        "breakdown_s": breakdown,
        "peak_flops_per_s": peak,
        "flops_per_sample": flops_per_step / samples_per_rank if flops_per_step else None,
        "mfu": flops_per_step / (step_time_s * peak) if flops_per_step and peak else None,
        "model_bytes": _model_bytes(run_dir),
        "peak_device_memory_bytes": _peak_device_memory(records),
        "peak_host_memory_bytes": None,
        "checkpoint_save_s": _checkpoint_save_s(records),
        "channels_last": bool(resolved.get("channels_last", False)),
        "activation_checkpointing": bool((resolved.get("activation_checkpointing") or {}).get("enabled", False)),
        "run_dir": str(run_dir),
    }
    notes = [] if compute_s else ["no breakdown_s in the train records: set monitor.breakdown_every_steps"]
    fields.update(extra)
    fields["notes"] = [*notes, *fields.get("notes", [])]
    return Measurement(**fields)


def _workers(resolved: dict[str, Any], start: dict[str, Any]) -> int | Literal["auto"]:
    """The config's ``auto`` (run_start has the first candidate the tuner tried), else the run's count."""
    if resolved.get("data", {}).get("num_workers") == "auto":
        return "auto"
    return int(start.get("data_num_workers") or 0)


def _read_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SkyliftConfigError(f"{run_dir}: no metrics.jsonl (not a run folder)",
                                 "measure with: skylift bench CONFIG")  # fmt: skip
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    starts = [index for index, record in enumerate(records) if record["kind"] == "run_start"]
    # The first attempt only: a resumed attempt repeats warm-up and would mix two runs.
    end = starts[1] if len(starts) > 1 else len(records)
    return records[:end]


def _median_breakdown(trains: list[dict[str, Any]], step_time_s: float) -> dict[str, float]:
    sampled = [record["breakdown_s"] for record in trains if record.get("breakdown_s")]
    if not sampled:
        return {"other": step_time_s}
    medians = {phase: statistics.median(sample.get(phase, 0.0) for sample in sampled) for phase in sampled[0]}
    total = sum(medians.values()) or 1.0
    return {phase: value * step_time_s / total for phase, value in medians.items()}


def _model_bytes(run_dir: Path) -> int | None:
    # safetensors: 8-byte header length, JSON header of tensor offsets, then the raw tensors.
    path = run_dir / "model.safetensors"
    if not path.is_file():
        return None
    with path.open("rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_length))
    return sum(end - begin for name, entry in header.items() if name != "__metadata__"
               for begin, end in [entry["data_offsets"]])  # fmt: skip


def _peak_device_memory(records: list[dict[str, Any]]) -> int | None:
    used = [gpu.get("memory_used_gib") or 0.0 for r in records if r["kind"] == "system" for gpu in r.get("gpus", [])]
    return int(max(used) * 2**30) if used else None


def _checkpoint_save_s(records: list[dict[str, Any]]) -> float | None:
    saves = [record["write_s"] for record in records if record["kind"] == "checkpoint" and record.get("committed")]
    return max(saves) if saves else None
