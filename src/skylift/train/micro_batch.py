"""``data.micro_batch_size: auto``: the largest per-rank micro-batch this device holds,
found by real forward/backward trials before training starts.

The candidates are the divisors of the per-rank batch (``global_batch_size /
world_size``), so the global batch, and with it convergence, stays what the config says;
accumulation makes up the difference. Each trial runs one micro-batch of real training
samples through the model as it will train (on the device, in its memory format, with
activation checkpointing and autocast; eager, since a compiled graph is traced for the
chosen shape only afterwards) and measures the peak. A candidate fits when that peak,
plus the state the first optimizer step still adds (optimizer moments, the EMA copy,
DDP's gradient buckets), stays within the limit and nothing ran out of memory. Memory
grows with the micro-batch, so a bisection over the divisors finds the largest that fits.

Under ``distributed.strategy: fsdp`` the trials run the same unsharded model, before it
is sharded (so they need no collectives and an out-of-memory trial stops no peer), and
each trial's peak is carried over to a sharded rank by the memory model doctor and plan
share (:mod:`skylift.machine.memory`): the whole fp32 weights the trial held come off,
the rank's shards of the weights and gradients and what it gathers for its blocks
(twice the largest, the root group, a reduce-scatter input, the unsharded gradients an
accumulating step keeps) come on. The trial's own full gradients stay counted, so the
answer errs small. The whole model must fit one device for the trials; a model that
fits only sharded needs a number.

Every rank measures its own device and the ranks take the smallest answer, so all of
them step with the same micro-batch. The trials leave no trace: buffers (BatchNorm's
running statistics), gradients and the random generators are restored, so a run with
``auto`` equals, bit for bit, the run configured with the size it chose.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from skylift.errors import SkyliftConfigError
from skylift.loop.collectives import collective

__all__ = ["MicroBatchChoice", "Trial", "choose_micro_batch", "pending_state_bytes", "slice_batch"]

log = logging.getLogger("skylift")

_GIB = 2**30


@dataclasses.dataclass
class Trial:
    """One candidate's forward/backward."""

    micro_batch_size: int
    peak_bytes: int | None
    """Measured peak of the trial (the device's reserved memory; on CPU the process's
    resident set); ``None`` when it ran out of memory."""
    needed_bytes: int | None
    """``peak_bytes`` plus the state still to come."""
    fits: bool


@dataclasses.dataclass
class MicroBatchChoice:
    """What the trials found and what every rank trains with."""

    micro_batch_size: int
    accumulation_steps: int
    limit_bytes: int
    """The memory this rank may use (``data.micro_batch_memory_gib`` or the device's)."""
    pending_state_bytes: int
    trials: list[Trial]

    def record(self) -> dict[str, Any]:
        """The ``micro_batch`` entry of ``run_start``."""
        return {
            "chosen": self.micro_batch_size,
            "accumulation_steps": self.accumulation_steps,
            "limit_bytes": self.limit_bytes,
            "pending_state_bytes": self.pending_state_bytes,
            "trials": [dataclasses.asdict(trial) for trial in self.trials],
        }


def choose_micro_batch(
    model: nn.Module,
    first_batch: Callable[[], Any],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    *,
    runtime: Any,
    config: Any,
    batch_size: Callable[[Any], int],
) -> MicroBatchChoice:
    """Measure the candidates on ``model`` (placed by the runtime, not yet wrapped) with
    slices of ``first_batch()`` (one per-rank batch of training samples; fetched inside
    the restored state, since a loader's first iteration draws from the generator) and
    agree across ranks.

    Raises:
        SkyliftConfigError: not even one sample fits, or the batch cannot be sliced.
    """
    world_size = runtime.dist.world_size
    per_rank = config.data.global_batch_size // world_size
    memory = _memory_meter(runtime.device, runtime.dist.local_world_size)
    limit = int(config.data.micro_batch_memory_gib * _GIB) if config.data.micro_batch_memory_gib else memory.limit()
    pending = pending_state_bytes(model, config, world_size)
    sharded = _ShardedRank(model, config, runtime) if config.distributed.strategy == "fsdp" else None
    trials: list[Trial] = []

    def fits(size: int) -> bool:
        peak = _measure(model, slice_batch(batch, size, batch_size), loss, runtime, memory)
        carried = 0 if sharded is None else sharded.carried_bytes(accumulating=size < per_rank)
        needed = None if peak is None else peak + carried + pending
        trials.append(Trial(size, peak, needed, needed is not None and needed <= limit))
        return trials[-1].fits

    with _restored(model, runtime.device):
        batch = first_batch()
        if batch_size(batch) != per_rank:
            raise SkyliftConfigError(f"the micro-batch trials need one batch of {per_rank} samples, got "
                                     f"{batch_size(batch)}; set data.micro_batch_size to a number")
        local = _largest_fitting(_divisors(per_rank), fits)
    chosen = _agree(local or 0, runtime)
    if not chosen:
        where = (f"needs {_gib(min(trials, key=lambda t: t.micro_batch_size).needed_bytes)} of the {_gib(limit)} "
                 "this rank may use" if local is None else "does not fit on another rank")
        raise SkyliftConfigError(
            f"data.micro_batch_size: auto: even 1 sample per micro-batch {where} (data.micro_batch_memory_gib)"
            + ("; under distributed.strategy: fsdp the trials run the whole, unsharded model on one device"
               if sharded is not None else ""),
            hint="Set activation_checkpointing.enabled: true, precision: bf16, a smaller model, or a larger device"
            + ("; or set data.micro_batch_size to a number (skylift doctor --config estimates the sharded rank)."
               if sharded is not None else "."),
        )
    choice = MicroBatchChoice(chosen, per_rank // chosen, limit, pending, trials)
    if runtime.dist.is_main:
        log.info("micro-batch auto: %d of %d per rank fits (%s, %d trials); accumulation %d", chosen, per_rank,
                 _summary(trials, chosen, limit), len(trials), choice.accumulation_steps)
    return choice


def pending_state_bytes(model: nn.Module, config: Any, world_size: int) -> int:
    """Bytes the first optimizer step adds after a forward/backward: the optimizer's
    moments (AdamW two per parameter, SGD one with momentum), the EMA copy of the weights
    and buffers, and DDP's flattened gradient buckets beside ``.grad``, as the memory
    model doctor and plan share counts them (:mod:`skylift.machine.memory`). Under FSDP
    the moments and the EMA are the rank's shards (on the host with ``cpu_offload``,
    where a GPU's trials do not count them)."""
    from skylift.machine.memory import ModelMemory, Sharding, training_memory

    sharding = Sharding.of(config.distributed, world_size)
    state = training_memory(ModelMemory.of(model, config.optim), 0, half_precision=False, world_size=world_size,
                            sharding=sharding)  # fmt: skip
    if state.offloaded and next(model.parameters()).device.type != "cpu":
        return 0
    return state.optimizer_state_bytes + state.ema_bytes + state.bucket_bytes


class _ShardedRank:
    """What a sharded rank holds instead of what an unsharded trial held (FSDP)."""

    def __init__(self, model: nn.Module, config: Any, runtime: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        from skylift.machine.memory import ModelMemory, Sharding
        from skylift.train.sharding import select_blocks

        for module in model.modules():
            if isinstance(module, FSDPModule):
                raise SkyliftConfigError(
                    "data.micro_batch_size: auto under distributed.strategy: fsdp measures the model before it is "
                    f"sharded, and this one already is ({type(module).__name__})",
                    hint="Set data.micro_batch_size to a number.")  # fmt: skip
        self.model = ModelMemory.of(model, config.optim,
                                    blocks=select_blocks(model, config.distributed.fsdp.block_types))  # fmt: skip
        sharding = Sharding.of(config.distributed, runtime.dist.world_size)
        if sharding is None:  # a _ShardedRank is made only under strategy: fsdp
            raise ValueError("a sharded rank's sizes need distributed.strategy: fsdp")
        if runtime.device.type == "cpu" and sharding.cpu_offload:
            # Offloading on a CPU moves nothing: host memory is the device's.
            sharding = dataclasses.replace(sharding, cpu_offload=False)
        self.sharding = sharding
        self.half = runtime.precision.autocast_dtype in (torch.bfloat16, torch.float16)
        self.trial_weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def carried_bytes(self, *, accumulating: bool) -> int:
        """Added to a trial's peak (negative: the whole weights come off, the rank's
        shards and gathered blocks come on; the pending optimizer state is apart)."""
        from skylift.machine.memory import training_memory

        state = training_memory(self.model, 0, half_precision=self.half, world_size=self.sharding.shard_count,
                                sharding=self.sharding, accumulating=accumulating)  # fmt: skip
        resident = state.unsharded_bytes + (0 if state.offloaded else state.parameter_bytes + state.gradient_bytes)
        return resident - self.trial_weight_bytes


def slice_batch(batch: Any, size: int, batch_size: Callable[[Any], int]) -> Any:
    """The first ``size`` samples of a collated batch (tensors, tuples and lists of
    fields, mappings, dataclasses; a list of per-sample objects is cut as a list)."""
    sliced = _slice(batch, size)
    if batch_size(sliced) != size:
        raise SkyliftConfigError(f"cannot cut a {type(batch).__name__} batch into micro-batches for the trials; "
                                 "set data.micro_batch_size to a number")
    return sliced


def _slice(batch: Any, size: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:size]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {field.name: _slice(getattr(batch, field.name), size) for field in dataclasses.fields(batch)}
        return dataclasses.replace(batch, **fields)
    if isinstance(batch, Mapping):
        items = {key: _slice(value, size) for key, value in batch.items()}
        mapping_type: Any = type(batch)  # dict, OrderedDict, BatchEncoding: each takes one mapping
        try:
            return mapping_type(items)
        except TypeError:
            return items
    if isinstance(batch, (list, tuple)):
        if batch and not all(isinstance(item, (torch.Tensor, Mapping, list, tuple)) for item in batch):
            return batch[:size]  # one object per sample (encoded images)
        parts = [_slice(item, size) for item in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


def _measure(model: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], torch.Tensor], runtime: Any,
             memory: Any) -> int | None:
    memory.start()
    try:
        moved = runtime.to_device(batch)
        with runtime.precision.autocast(runtime.device.type):
            value = loss(model, moved)
        value.backward()
        return memory.peak()
    except memory.out_of_memory:
        return None
    finally:
        model.zero_grad(set_to_none=True)
        memory.release()


def _largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int | None:
    """Bisection over ascending ``candidates``, largest first (the common case: it fits)."""
    if fits(candidates[-1]):
        return candidates[-1]
    best, low, high = None, 0, len(candidates) - 2
    while low <= high:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            best, low = candidates[middle], middle + 1
        else:
            high = middle - 1
    return best


def _divisors(number: int) -> list[int]:
    return [size for size in range(1, number + 1) if number % size == 0]


def _agree(size: int, runtime: Any) -> int:
    if not runtime.dist.is_distributed:
        return size
    device = runtime.device if runtime.dist.backend == "nccl" else torch.device("cpu")
    value = torch.tensor([size], dtype=torch.long, device=device)
    with collective("the micro-batch agreement (all_reduce MIN)"):
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


class _restored:
    """Buffers, gradients and random generators as they were before the trials."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def __enter__(self) -> None:
        self.buffers = [buffer.detach().clone() for buffer in self.model.buffers()]
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), self.buffers, strict=True):
                buffer.copy_(saved)
        self.model.zero_grad(set_to_none=True)
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def _memory_meter(device: torch.device, local_ranks: int) -> Any:
    return _CudaMemory(device) if device.type == "cuda" else _HostMemory(local_ranks)


class _CudaMemory:
    """Reserved memory: what the caching allocator holds is what another allocation
    competes with, so fragmentation counts against the candidate."""

    out_of_memory = (torch.OutOfMemoryError,)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def limit(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free + torch.cuda.memory_reserved(self.device))

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_reserved(self.device))

    def release(self) -> None:
        torch.cuda.empty_cache()


class _HostMemory:
    """The process's peak resident set (``VmHWM``), reset before each trial through
    ``/proc/self/clear_refs``: on CPU the whole process competes for the same RAM."""

    out_of_memory = (MemoryError,)
    _CLEAR_REFS = Path("/proc/self/clear_refs")
    _STATUS = Path("/proc/self/status")

    def __init__(self, local_ranks: int) -> None:
        self.local_ranks = max(local_ranks, 1)

    def limit(self) -> int:
        import psutil

        return int(psutil.virtual_memory().available / self.local_ranks + self._status_bytes("VmRSS"))

    def start(self) -> None:
        try:
            self._CLEAR_REFS.write_text("5")  # 5: reset the peak resident set to the current one
        except OSError as error:
            raise SkyliftConfigError(
                f"data.micro_batch_size: auto on CPU measures the peak resident memory through {self._CLEAR_REFS}, "
                f"which cannot be written here ({error})", hint="Set data.micro_batch_size to a number.") from None

    def peak(self) -> int:
        return self._status_bytes("VmHWM")

    def release(self) -> None:
        pass

    def _status_bytes(self, field: str) -> int:
        match = re.search(rf"^{field}:\s+(\d+) kB", self._STATUS.read_text(), re.MULTILINE)
        if match is None:
            raise SkyliftConfigError(f"{self._STATUS} has no {field}; set data.micro_batch_size to a number")
        return int(match.group(1)) * 1024


def _gib(value: int | None) -> str:
    return "out of memory" if value is None else f"{value / _GIB:.2f} GiB"


def _summary(trials: list[Trial], chosen: int, limit: int) -> str:
    needed = next((trial.needed_bytes for trial in trials if trial.micro_batch_size == chosen), None)
    return f"{_gib(needed)} of {_gib(limit)}" if needed is not None else f"another rank's choice; limit {_gib(limit)}"
