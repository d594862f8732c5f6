"""Resources against the job: /dev/shm for loader workers, disk, device memory, CPUs."""

from __future__ import annotations

import math

from skylift.doctor.verdicts import Finding, rule
from skylift.machine.facts import DiskFacts, Facts, JobFacts, MemoryEstimate
from skylift.machine.memory import MEMORY_HEADROOM, fits_device, memory_tier_bytes

__all__ = [
    "PREFETCH_FACTOR",
    "SMALL_SHM_BYTES",
    "cpus_fit_workers",
    "disk_fits_cache_and_checkpoints",
    "format_bytes",
    "memory_fits_device",
    "shm_fits_workers",
    "workers_per_rank",
]

PREFETCH_FACTOR = 2
"""Batches each DataLoader worker keeps ready: PyTorch's default, which skylift keeps."""
SMALL_SHM_BYTES = 1024**3
"""Below this /dev/shm is reported as small; Docker's default is 64 MB."""
_SHM_HEADROOM = 2  # batches being collated and pinned while the prefetched ones wait


def format_bytes(count: float) -> str:
    """``67108864`` -> ``'64 MiB'``; binary units, as ``df -h`` and ``free -h`` print."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit in ("B", "KiB") or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def workers_per_rank(facts: Facts, job: JobFacts) -> int:
    """``data.num_workers``; ``auto`` may try up to the usable CPUs (at most 16)."""
    if job.num_workers == "auto":
        return min(facts.cpu.usable or 1, 16)
    return int(job.num_workers)


def _shm_fix(need_bytes: int) -> str:
    size_gib = max(1, math.ceil(need_bytes * _SHM_HEADROOM / 1024**3))
    return (
        f"docker run --ipc=host ... (or --shm-size={size_gib}g); on Kubernetes mount an emptyDir with "
        "medium: Memory at /dev/shm; or lower data.num_workers"
    )


@rule("shm", gate=True)
def shm_fits_workers(facts: Facts) -> Finding | None:
    """/dev/shm holds what the DataLoader workers of every rank pass to training."""
    shm, job = facts.shm, facts.job
    if shm.exists is False:
        return Finding("fail", f"{shm.path} does not exist: DataLoader workers cannot pass batches", _shm_fix(0))
    if shm.total_bytes is None:
        return None
    size = format_bytes(shm.total_bytes)
    if job is None or job.source != "config":
        if shm.total_bytes < SMALL_SHM_BYTES:
            return Finding(
                "warn",
                f'{shm.path} is only {size}: DataLoader workers die with "Bus error" once their batches outgrow it',
                _shm_fix(SMALL_SHM_BYTES),
            )
        return Finding("pass", f"{shm.path} is {size}")
    workers = workers_per_rank(facts, job)
    if workers == 0:
        return Finding("pass", f"data.num_workers is 0: batches are loaded in the training process ({shm.path} {size})")
    if job.sample_bytes is None or job.micro_batch_size is None:
        if shm.total_bytes < SMALL_SHM_BYTES:
            return Finding(
                "warn",
                f"{shm.path} is only {size} for {workers} loader workers per rank (streamed "
                "samples: their size is unknown before the first shard)",
                _shm_fix(SMALL_SHM_BYTES),
            )
        return Finding("pass", f"{shm.path} is {size}")
    need = workers * job.nproc * PREFETCH_FACTOR * _SHM_HEADROOM * job.micro_batch_size * job.sample_bytes
    free = shm.free_bytes if shm.free_bytes is not None else shm.total_bytes
    detail = (
        f"{workers} workers x {job.nproc} rank(s) x {PREFETCH_FACTOR * _SHM_HEADROOM} batches of "
        f"{job.micro_batch_size} x {format_bytes(job.sample_bytes)}"
    )
    if free < need:
        return Finding(
            "fail",
            f"{shm.path} has {format_bytes(free)} free; the loader needs about "
            f'{format_bytes(need)} ({detail}): workers will die with "Bus error"',
            _shm_fix(need),
        )
    return Finding("pass", f"{shm.path} has {format_bytes(free)} free for about {format_bytes(need)} ({detail})")


def _disk_needs(
    job: JobFacts, disks: list[DiskFacts], copies: int
) -> dict[int | None, tuple[DiskFacts, int, list[str]]]:
    """Bytes each file system must hold, keyed by device: folders on one disk add up."""
    checkpoint = job.memory.checkpoint_bytes if job.memory else 0
    shards = job.memory.shard_count if job.memory else 1
    wanted = {"cache": job.cache_bytes, "checkpoint_local": copies * checkpoint if job.checkpoint_local else 0,
              # checkpoint.memory keeps a fixed number of steps, its node's share and its peer's
              "checkpoint_memory": memory_tier_bytes(checkpoint // max(shards, 1), sharded=shards > 1,
                                                     ranks_per_node=job.nproc, nodes=job.nnodes)}  # fmt: skip
    needs: dict[int | None, tuple[DiskFacts, int, list[str]]] = {}
    for disk in disks:
        amount = wanted.get(disk.purpose, 0)
        if not amount:
            continue
        first, total, parts = needs.get(disk.device, (disk, 0, []))
        needs[disk.device] = (first, total + amount, [*parts, f"{disk.purpose} {format_bytes(amount)}"])
    return needs


@rule("disk", gate=True)
def disk_fits_cache_and_checkpoints(facts: Facts) -> list[Finding] | None:
    """Free disk for the shard cache plus two checkpoints (fail) or ``keep + 1`` (warn)."""
    job = facts.job
    if job is None or job.source != "config":
        return None
    findings = []
    minimum = _disk_needs(job, facts.disks, 2)
    comfortable = _disk_needs(job, facts.disks, job.checkpoint_keep + 1)
    for device, (disk, need, parts) in minimum.items():
        free = disk.free_bytes
        if free is None:
            continue
        where = f"{disk.path} ({format_bytes(free)} free)"
        fix = "free space there, point checkpoint.root at an object store (s3://...) or lower data.cache_limit_gib"
        if any(part.startswith("checkpoint_memory") for part in parts):
            fix = ("enlarge the tmpfs (mount -o remount,size=NG on its mount point), use nodes with more memory, "
                   "or set checkpoint.memory.enabled: false")
        wanted = comfortable.get(device, (disk, need, parts))[1]
        if free < need:
            findings.append(Finding("fail", f"{where} cannot hold {format_bytes(need)}: {', '.join(parts)}", fix))
        elif free < wanted:
            findings.append(
                Finding(
                    "warn",
                    f"{where} holds two checkpoints but not the {job.checkpoint_keep} "
                    f"kept plus one being written ({format_bytes(wanted)})",
                    fix,
                )
            )
        else:
            findings.append(Finding("pass", f"{where} holds {', '.join(parts)} and more"))
    return findings or None


@rule("memory", gate=True)
def memory_fits_device(facts: Facts) -> Finding | None:
    """The meta-traced estimate of one rank's peak fits the GPU (or the RAM on a CPU)."""
    job = facts.job
    if job is None or job.memory is None or not job.memory.total_bytes:
        return None
    estimate = job.memory
    on_gpu = job.device != "cpu" and facts.torch.cuda_available and facts.gpus
    capacities = [gpu.memory_total_bytes for gpu in facts.gpus if gpu.memory_total_bytes] if on_gpu else []
    capacity = min(capacities) if capacities else facts.memory.available_bytes
    where = "the smallest GPU" if capacities else "available RAM"
    if not capacity:
        return None
    # cpu_offload moves the sharded state to host RAM: on a CPU that is the same memory.
    total = estimate.total_bytes + (0 if capacities else estimate.host_bytes)
    text = f"about {format_bytes(total)} per rank ({_memory_parts(estimate)}) of {format_bytes(capacity)} on {where}"
    host = _offloaded_state_finding(facts, job, estimate) if capacities else None
    if host is not None:
        return host
    fix = (
        "set data.micro_batch_size: auto (the largest that fits, measured at start), lower "
        f"data.global_batch_size or raise accumulation.steps (micro-batch now {job.micro_batch_size}), or set "
        "activation_checkpointing.enabled: true"
    ) + (", or shard the model over the ranks: distributed.strategy: fsdp"
         if estimate.shard_count == 1 and job.nproc * job.nnodes > 1 else "")
    if total > capacity:
        return Finding("fail", f"out of memory: {text}", fix)
    if not fits_device(total, capacity):
        # The plan drops such a machine (the same fits_device); here it may still run.
        return Finding("warn", f"tight: {text}, over {MEMORY_HEADROOM:.0%}; workspaces and the CUDA context "
                       "come on top", fix)
    return Finding("pass", text)


def _offloaded_state_finding(facts: Facts, job: JobFacts, estimate: MemoryEstimate) -> Finding | None:
    """FSDP ``cpu_offload``: every rank of this node keeps its sharded state in host RAM."""
    needed = estimate.host_bytes * job.nproc
    available = facts.memory.available_bytes
    if not needed or not available or needed <= available:
        return None
    return Finding("fail", f"out of host memory: {job.nproc} rank(s) x {format_bytes(estimate.host_bytes)} "
                   f"of state offloaded by distributed.fsdp.cpu_offload > {format_bytes(available)} available RAM",
                   "set distributed.fsdp.cpu_offload: false, use more ranks to shard over, or a machine with more RAM")


def _memory_parts(estimate: MemoryEstimate) -> str:
    parts = [estimate.sharding] if estimate.sharding else []
    if estimate.adapters:
        # Frozen weights have no gradient and no optimizer state: say which part of the weights they are.
        frozen = estimate.frozen_weight_bytes
        four_bit = (f", {estimate.quantized_parameters:,} of them in 4-bit NF4"
                    if estimate.quantized_parameters else "")  # fmt: skip
        weights = (f"{estimate.adapters}: {estimate.trainable_parameters:,} trainable of {estimate.parameters:,} "
                   f"parameters: weights {format_bytes(estimate.parameter_bytes)} (frozen base {format_bytes(frozen)}"
                   f"{four_bit}; trainable {format_bytes(estimate.parameter_bytes - frozen)})")
        parts += [weights,
                  f"gradients {format_bytes(estimate.gradient_bytes)}"
                  + (f" (DDP buckets {format_bytes(estimate.bucket_bytes)})" if estimate.bucket_bytes else ""),
                  f"optimizer {format_bytes(estimate.optimizer_bytes)}"]
        return ", ".join(parts + _other_parts(estimate))
    parts += [f"{estimate.parameters:,} parameters: weights {format_bytes(estimate.parameter_bytes)}",
             f"gradients {format_bytes(estimate.gradient_bytes)}"
             + (f" (DDP buckets {format_bytes(estimate.bucket_bytes)})" if estimate.bucket_bytes else ""),
             f"optimizer {format_bytes(estimate.optimizer_bytes)}"]
    return ", ".join(parts + _other_parts(estimate))


def _other_parts(estimate: MemoryEstimate) -> list[str]:
    parts = []
    if estimate.reference_bytes:
        parts.append(f"DPO reference copy {format_bytes(estimate.reference_bytes)}")
    if estimate.ema_bytes:
        parts.append(f"EMA {format_bytes(estimate.ema_bytes)}")
    if estimate.autocast_weight_bytes:
        parts.append(f"autocast weights {format_bytes(estimate.autocast_weight_bytes)}")
    if estimate.unsharded_bytes:
        parts.append(f"gathered blocks {format_bytes(estimate.unsharded_bytes)}")
    if estimate.host_bytes:
        parts.append(f"in host memory {format_bytes(estimate.host_bytes)}")
    activations = estimate.activation_bytes
    parts.append(f"activations {'unknown' if activations is None else format_bytes(activations)}")
    return parts


@rule("cpus")
def cpus_fit_workers(facts: Facts) -> Finding | None:
    """Loader workers plus the training processes fit the CPUs this process may use."""
    job = facts.job
    if job is None or job.source != "config" or job.num_workers == "auto" or not facts.cpu.usable:
        return None
    wanted = job.nproc * (int(job.num_workers) + 1)
    usable = facts.cpu.usable
    text = f"{job.nproc} rank(s) x ({job.num_workers} workers + 1) = {wanted} processes on {usable} usable CPUs"
    if wanted > usable:
        per_rank = max(0, usable // job.nproc - 1)
        return Finding("warn", f"oversubscribed: {text}", f"set data.num_workers: {per_rank} (or auto)")
    return Finding("pass", text)
