"""Capture the full training state as tensors plus JSON, and restore it.

No pickle anywhere: tensors go to safetensors, everything else to JSON. The capture
runs on the training thread and only copies (device -> host clones); serialising,
hashing and uploading happen later, off the training thread.

Per checkpoint, rank 0 contributes the replicated state (model, optimizer, LR
schedule, GradScaler, counters) and every rank its own RNG streams. A sharded model
(FSDP2) is captured by :mod:`skylift.checkpoint.sharded` instead, into the same
:class:`Snapshot` with every rank's shards; the names of both layouts' files are here.
"""

from __future__ import annotations

import functools
import json
import random
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from torch import nn

__all__ = [
    "SAFETENSORS_DTYPES",
    "HostCopier",
    "Snapshot",
    "capture",
    "param_groups",
    "required_files",
    "restore_extra",
    "restore_replicated",
    "restore_rng",
    "restore_schedule",
    "rng_files",
    "rng_snapshot",
    "shard_files",
    "split_extra",
    "trainer_document",
]

MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
OPTIMIZER_FILE = "optimizer.json"
TRAINER_FILE = "trainer.json"
EXTRA_FILE = "extra.safetensors"
"""The tensors of the user's own state (``Runtime.resume(extra)``); only when there are some."""

REPLICATED = "replicated"
"""The layout of a checkpoint whose model every rank holds whole (one process, DDP)."""
SHARDED = "sharded"
"""The layout of a checkpoint of a sharded model (FSDP2): each rank's shards in its own files."""
DCP_METADATA_FILE = "dcp-metadata.json"
"""Sharded layout, rank 0: every tensor's global shape and chunks, and the file holding each chunk."""


def rng_files(rank: int) -> tuple[str, str]:
    return f"rng-rank{rank}.safetensors", f"rng-rank{rank}.json"


def shard_files(rank: int) -> tuple[str, str]:
    """Sharded layout: rank ``rank``'s (model chunks, optimizer-state chunks) files. Apart,
    so that consolidating the weights never reads the optimizer state (twice their size
    under Adam)."""
    return f"model-rank{rank}.safetensors", f"optimizer-rank{rank}.safetensors"


def required_files(world_size: int, layout: str = REPLICATED) -> set[str]:
    """Files a complete checkpoint of ``world_size`` ranks must list in its manifest."""
    if layout == SHARDED:
        names = {DCP_METADATA_FILE, OPTIMIZER_FILE, TRAINER_FILE}
        for rank in range(world_size):
            names.update(shard_files(rank))
    else:
        names = {MODEL_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_FILE, TRAINER_FILE}
    for rank in range(world_size):
        names.update(rng_files(rank))
    return names


@dataclass
class Snapshot:
    """One rank's share of a checkpoint, already copied off the device."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    documents: dict[str, dict[str, Any]] = field(default_factory=dict)
    local_only: set[str] = field(default_factory=set)
    """Files for this node's local copy only (the replicated state, held by a node
    leader other than rank 0 so that its node's ranks resume from its own disk)."""
    local_entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Size and sha256 of the ``local_only`` files as written."""
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(host buffer, live tensor) copies still to make: parameters and optimizer state,
    which only the next ``optimizer.step()`` changes (see :func:`capture`)."""
    copied: threading.Event = field(default_factory=threading.Event)
    layout: str = REPLICATED
    """How the model is stored: :data:`REPLICATED` or :data:`SHARDED` (the manifest records it)."""

    def complete_copies(self) -> None:
        """Make the deferred copies (off the training thread), then signal ``copied``."""
        try:
            from_cuda = False
            for buffer, live in self.deferred:
                buffer.copy_(live, non_blocking=live.is_cuda)
                from_cuda = from_cuda or live.is_cuda
            if from_cuda:
                torch.cuda.synchronize()
        finally:
            self.deferred = []
            self.copied.set()

    def files(self) -> Iterator[tuple[str, Callable[[], Iterator[bytes | memoryview]]]]:
        """(file name, chunk factory) per file, produced lazily, one file at a time.

        Tensor files stream in safetensors layout straight from the tensors' memory:
        no whole-file buffer, no second copy. Called off the training thread.
        """
        for name, tensors in self.tensors.items():
            yield name, functools.partial(_safetensors_chunks, tensors)
        for name, document in self.documents.items():
            encoded = json.dumps(document, sort_keys=True).encode()
            yield name, functools.partial(iter, (encoded,))

    def serialize(self) -> dict[str, bytes]:
        """File name -> bytes, all in memory (for tests and small states)."""
        return {name: b"".join(bytes(chunk) for chunk in make()) for name, make in self.files()}


def capture(
    *,
    step: int,
    rank: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    counters: dict[str, Any],
    buffers: dict[str, torch.Tensor] | None = None,
    defer: bool = False,
    reference_host_tensors: bool = False,
    replicated: bool | None = None,
    extra: dict[str, Any] | None = None,
) -> Snapshot:
    """Copy this rank's share of the state, and the replicated part if ``replicated``
    (default: on rank 0; on another rank it goes to the node's local copy only).

    ``buffers`` (kept by the caller between saves) are host tensors reused for the
    copies: allocating fresh ones costs about 3x the copy itself. The caller must not
    capture again before the previous snapshot was written.

    With ``defer``, parameters and optimizer state are only *listed*: the caller copies
    them later with :meth:`Snapshot.complete_copies` and must hold the next
    ``optimizer.step()`` until ``snapshot.copied`` is set. Forward and backward of the
    next step overlap the copy; model buffers (BatchNorm statistics change in forward),
    RNG, schedule and counters are copied now.

    With ``reference_host_tensors``, tensors already in host memory are written from
    where they are, not copied: only for a save that is written before training goes
    on (a blocking save), where a copy would cost time and memory (a preemption's
    save: ~1 s per GB) for nothing.
    """
    copier = HostCopier(buffers if buffers is not None else {})
    copier.reference_host_tensors = reference_host_tensors
    snapshot = rng_snapshot(step, rank)
    if not (replicated if replicated is not None else rank == 0):
        return snapshot
    copier.defer = defer
    parameters = {name for name, _ in model.named_parameters()}
    snapshot.tensors[MODEL_FILE] = {
        name: copier.copy(f"model/{name}", value, deferrable=name in parameters)
        for name, value in model.state_dict().items()
    }
    optimizer_tensors, optimizer_document = _split_optimizer(optimizer.state_dict(), copier)
    extra_tensors, extra_values = split_extra(extra or {})
    if extra_tensors:
        # Copied now, not deferred: the user's loop may change them before the next optimizer step.
        snapshot.tensors[EXTRA_FILE] = {
            name: copier.copy(f"extra/{name}", value, deferrable=False) for name, value in extra_tensors.items()
        }
    copier.finish()
    snapshot.deferred = copier.deferred
    snapshot.tensors[OPTIMIZER_TENSORS_FILE] = optimizer_tensors
    snapshot.documents[OPTIMIZER_FILE] = optimizer_document
    snapshot.documents[TRAINER_FILE] = trainer_document(step, counters, scheduler, scaler, extra_values)
    if rank != 0:
        snapshot.local_only = {MODEL_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_FILE, TRAINER_FILE}
        snapshot.local_only.update({EXTRA_FILE} if extra_tensors else set())
    return snapshot


def rng_snapshot(step: int, rank: int) -> Snapshot:
    """A snapshot holding only this rank's RNG streams (what every rank contributes)."""
    snapshot = Snapshot(step)
    rng_tensors_file, rng_json_file = rng_files(rank)
    snapshot.tensors[rng_tensors_file], snapshot.documents[rng_json_file] = _capture_rng()
    return snapshot


def trainer_document(
    step: int,
    counters: dict[str, Any],
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    extra_values: dict[str, Any],
) -> dict[str, Any]:
    """The ``trainer.json`` document: counters, LR schedule, GradScaler, the user's JSON values."""
    return {
        "step": step,
        "counters": counters,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
        "extra": extra_values,
    }


def split_extra(extra: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The user's state as (tensors, JSON values); raises ``TypeError`` naming a value that is neither."""
    tensors, values = {}, {}
    for key, value in extra.items():
        if not isinstance(key, str):
            raise TypeError(f"extra state keys must be strings, got {key!r}")
        if isinstance(value, torch.Tensor):
            tensors[key] = value.detach()
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"extra state {key!r} is a {type(value).__name__}: give a tensor or a JSON value "
                "(numbers, strings, lists, dicts)"
            ) from error
        values[key] = value
    return tensors, values


def restore_extra(files: dict[str, bytes], into: dict[str, Any]) -> None:
    """Put the saved user state back into ``into`` (tensors in place where shapes match)."""
    into.update(json.loads(files[TRAINER_FILE]).get("extra") or {})
    if EXTRA_FILE not in files:
        return
    for name, saved in load_tensors(files[EXTRA_FILE]).items():
        current = into.get(name)
        if isinstance(current, torch.Tensor) and current.shape == saved.shape:
            with torch.no_grad():
                current.copy_(saved)  # keeps the user's tensor (and its device) alive
        else:
            into[name] = saved


def restore_replicated(
    files: dict[str, bytes],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
) -> dict[str, Any]:
    """Load model, optimizer, schedule and scaler; return the counters."""
    model.load_state_dict(load_tensors(files[MODEL_FILE]))
    optimizer.load_state_dict(
        _join_optimizer(load_tensors(files[OPTIMIZER_TENSORS_FILE]), json.loads(files[OPTIMIZER_FILE]))
    )
    return restore_schedule(json.loads(files[TRAINER_FILE]), scheduler=scheduler, scaler=scaler)


def restore_schedule(trainer: dict[str, Any], *, scheduler: Any, scaler: torch.amp.GradScaler | None) -> dict[str, Any]:
    """Load the LR schedule and GradScaler from a ``trainer.json`` document; return the counters."""
    if scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    if scaler is not None:
        if trainer["grad_scaler"] is None:
            raise ValueError("the checkpoint was saved without a GradScaler (not fp16); resume with its precision")
        scaler.load_state_dict(trainer["grad_scaler"])
    return trainer["counters"]


def restore_rng(tensors_bytes: bytes, document_bytes: bytes) -> None:
    tensors = load_tensors(tensors_bytes)
    document = json.loads(document_bytes)
    version, internal, gauss = document["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = document["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[name] for name in sorted(tensors) if name.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])


def _capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index:03d}"] = state
    version, internal, gauss = random.getstate()
    # The legacy form (the default): a tuple; the stubs give the union with the dict form.
    kind, keys, position, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    document = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)],
    }
    return tensors, document


class HostCopier:
    """Copies tensors into reusable host buffers (pinned for GPU sources, asynchronous)."""

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        self.buffers = buffers
        self.defer = False
        self.reference_host_tensors = False
        self.deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._from_cuda = False

    def copy(self, key: str, value: torch.Tensor, *, deferrable: bool = True) -> torch.Tensor:
        # A copy, never a view: training goes on mutating the live tensors while the
        # snapshot is written in the background.
        value = value.detach()
        if self.reference_host_tensors and not value.is_cuda:
            return value
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            pinned = value.is_cuda and torch.cuda.is_available()
            buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=pinned)
            self.buffers[key] = buffer
        if self.defer and deferrable:
            self.deferred.append((buffer, value))
            return buffer
        buffer.copy_(value, non_blocking=value.is_cuda)
        self._from_cuda = self._from_cuda or value.is_cuda
        return buffer

    def finish(self) -> None:
        if self._from_cuda:
            torch.cuda.synchronize()


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


_PIECE_BYTES = 16 * 2**20


def _safetensors_chunks(tensors: dict[str, torch.Tensor]) -> Iterator[bytes | memoryview]:
    """The safetensors format (https://github.com/huggingface/safetensors#format): an
    8-byte little-endian header length, a JSON header padded to 8 bytes, then each
    tensor's raw bytes, back to back in header order."""
    header: dict[str, Any] = {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"cannot store {name} of dtype {tensor.dtype} in a checkpoint")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    yield struct.pack("<Q", len(encoded)) + encoded
    for name in names:
        tensor = tensors[name].contiguous()
        if tensor.numel():
            view = tensor.reshape(-1).view(torch.uint8).numpy().data  # the array's own memoryview
            # Pieces, not whole tensors: a cancelled save stops within one piece even
            # in a multi-gigabyte embedding.
            for start in range(0, len(view), _PIECE_BYTES):
                yield view[start : start + _PIECE_BYTES]


def _split_optimizer(
    state_dict: dict[str, Any], copier: HostCopier
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}/{name}"] = copier.copy(f"optimizer/{index}/{name}", value)
            else:
                values.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "values": values}


def _join_optimizer(tensors: dict[str, torch.Tensor], document: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = tensor
    for index, entries in document["values"].items():
        state.setdefault(int(index), {}).update(entries)
    return {"state": state, "param_groups": param_groups(document)}


def param_groups(document: dict[str, Any]) -> list[dict[str, Any]]:
    """An ``optimizer.json`` document's parameter groups as the optimizer gave them
    (JSON made its tuples lists)."""
    groups = document["param_groups"]
    for group in groups:
        if "betas" in group and isinstance(group["betas"], list):
            group["betas"] = tuple(group["betas"])
    return groups
