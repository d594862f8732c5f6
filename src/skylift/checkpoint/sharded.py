"""Sharded checkpoints of FSDP2 models through ``torch.distributed.checkpoint`` (DCP).

DCP plans; skylift stores. On save, DCP's default planner decides which rank writes
which chunk of every tensor (each rank its own shards, one rank each replicated tensor);
the :class:`_SnapshotWriter` below writes nothing itself: it copies each planned chunk
off the device into the rank's :class:`~skylift.checkpoint.state.Snapshot`, which the
:class:`~skylift.checkpoint.manager.CheckpointManager` then writes, hashes, uploads and
commits in the background like any other (rank 0's manifest last). On load, DCP's
planner matches the shards this world size wants against the chunks that were saved
(resharding 2 -> 1 or 1 -> 2), and :class:`VerifiedReader` reads them from files checked
against the manifest.

No pickle anywhere. DCP's own ``.metadata`` file is a pickle and its non-tensor items go
through ``torch.save``; here only tensors go through DCP (the optimizer's parameter
groups and scalars stay in ``optimizer.json``, the counters in ``trainer.json``), the
chunks are safetensors, and DCP's metadata is written as JSON
(:func:`encode_metadata`). A reader that meets anything else refuses it.

Layout of a sharded ``step-N/`` (the manifest's ``layout`` is ``sharded``)::

    model-rank<R>.safetensors      rank R's chunks of the model, keyed fqn@offsets
    optimizer-rank<R>.safetensors  rank R's chunks of the optimizer state
    dcp-metadata.json              rank 0: each tensor's global shape, dtype, chunks and file
    optimizer.json                 rank 0: parameter groups, non-tensor optimizer state
    trainer.json, rng-rank<R>.*, extra.safetensors: as in the replicated layout
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from skylift.checkpoint.manifest import CorruptCheckpointError
from skylift.checkpoint.state import (
    DCP_METADATA_FILE,
    EXTRA_FILE,
    OPTIMIZER_FILE,
    SAFETENSORS_DTYPES,
    SHARDED,
    TRAINER_FILE,
    HostCopier,
    Snapshot,
    param_groups,
    restore_schedule,
    rng_snapshot,
    shard_files,
    split_extra,
    trainer_document,
)
from skylift.errors import SkyliftConfigError
from skylift.loop.collectives import collective
from skylift.storage import StorageError
from skylift.storage.names import check_file_name

__all__ = [
    "VerifiedReader",
    "capture_sharded",
    "decode_metadata",
    "encode_metadata",
    "is_sharded",
    "load_full",
    "restore_sharded",
]

METADATA_FORMAT = "skylift-dcp-metadata/1"
_MODEL, _OPTIMIZER = "model/", "optimizer/"
"""Prefixes of the flat DCP keys: ``model/<fqn>`` and ``optimizer/<fqn>/<state name>``."""
_DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are DTensors (FSDP2 ``fully_shard``): its checkpoint is sharded."""
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def capture_sharded(
    *,
    step: int,
    rank: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    counters: dict[str, Any],
    group: Any,
    buffers: dict[str, torch.Tensor] | None = None,
    defer: bool = False,
    reference_host_tensors: bool = False,
    replicated: bool | None = None,
    extra: dict[str, Any] | None = None,
) -> Snapshot:
    """This rank's shards and RNG streams, and on rank 0 (or a node leader's local copy,
    ``replicated``) the JSON documents; arguments as :func:`~skylift.checkpoint.state.capture`.

    Every rank calls it at the same step: DCP's planning is collective (on ``group``, a
    gloo group; None in one process). It runs on the training thread with the copies;
    with ``defer`` the parameters' and optimizer state's copies are only listed, as in
    the replicated layout.
    """
    snapshot = rng_snapshot(step, rank)
    snapshot.layout = SHARDED
    model_state, optimizer_state = get_state_dict(model, optimizer)
    _refuse_non_tensors(model_state)
    tensors, values = _flatten(model_state, optimizer_state)
    copier = HostCopier(buffers if buffers is not None else {})
    copier.defer, copier.reference_host_tensors = defer, reference_host_tensors
    # FSDP2's parameters are the DTensors; only the optimizer step changes them and the
    # optimizer state, so those copies may be deferred. Buffers change in forward: copied now.
    deferrable = {key for key, value in tensors.items() if isinstance(value, DTensor) or key.startswith(_OPTIMIZER)}
    writer = _SnapshotWriter(snapshot, rank, copier, deferrable=deferrable.__contains__)
    # A tensor that is not a DTensor (a buffer, Adam's step count) counts as replicated and
    # is saved once: rank 0's copy, as the gathered full state has it. FSDP2 does not
    # synchronise buffers, so a BatchNorm's running statistics may differ by rank.
    planner = DefaultSavePlanner(flatten_state_dict=False, dedup_save_to_lowest_rank=True)
    _collectively(dcp.save, tensors, storage_writer=writer, planner=planner, process_group=group, no_dist=group is None)
    copier.finish()
    snapshot.deferred = copier.deferred
    if replicated if replicated is not None else rank == 0:
        _add_documents(snapshot, rank, copier, cast(list[dict[str, Any]], optimizer_state["param_groups"]), values,
                       trainer=(counters, scheduler, scaler), extra=extra or {})
    return snapshot


def _add_documents(snapshot: Snapshot, rank: int, copier: HostCopier, groups: list[dict[str, Any]],
                   values: dict[str, Any], *, trainer: tuple[dict[str, Any], Any, Any], extra: dict[str, Any]) -> None:
    """The JSON documents (and the user's tensors) every rank has alike: rank 0 commits
    them; another node leader keeps them for its node's local copy only."""
    extra_tensors, extra_values = split_extra(extra)
    if extra_tensors:
        # Copied now, not deferred: the user's loop may change them before the next optimizer step.
        snapshot.tensors[EXTRA_FILE] = {
            name: copier.copy(f"extra/{name}", value, deferrable=False) for name, value in extra_tensors.items()
        }
        copier.finish()
    snapshot.documents[OPTIMIZER_FILE] = {"param_groups": groups, "values": values}
    snapshot.documents[TRAINER_FILE] = trainer_document(snapshot.step, *trainer, extra_values)
    if rank != 0:
        snapshot.local_only = {OPTIMIZER_FILE, TRAINER_FILE} | ({EXTRA_FILE} if extra_tensors else set())


def restore_sharded(
    contents: dict[str, bytes],
    read_file: Callable[[str], bytes],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    group: Any,
    where: str,
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` and ``optimizer`` at this world size
    (sharded or not); return the counters.

    Args:
        contents: this rank's verified small files (``dcp-metadata.json``,
            ``optimizer.json``, ``trainer.json``).
        read_file: the verified bytes of a shard file, by name (read only as the plan needs).
        group: the gloo group DCP plans on (None in one process). Every rank calls this.
        where: the checkpoint's location, for messages.

    Raises:
        CorruptCheckpointError: a shard did not read or verify on some rank (raised on every rank).
        SkyliftConfigError: the checkpoint's parameters are not this model's.
    """
    metadata = decode_metadata(contents[DCP_METADATA_FILE], f"{where}/{DCP_METADATA_FILE}")
    document = json.loads(contents[OPTIMIZER_FILE])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors = _loadable(_flatten(model_state, optimizer_state)[0], set(metadata.state_dict_metadata), where)
    _collectively(dcp.load, tensors, storage_reader=VerifiedReader(metadata, read_file),
                  planner=DefaultLoadPlanner(flatten_state_dict=False), process_group=group, no_dist=group is None)
    model_state = {name: tensors[_MODEL + name] for name in model_state}
    set_model_state_dict(model, model_state)
    # Not strict: a parameter that never had a gradient has no optimizer state, and keeps none.
    set_optimizer_state_dict(model, optimizer, _unflatten_optimizer(tensors, document, optimizer_state, where),
                             options=StateDictOptions(strict=False))
    return restore_schedule(json.loads(contents[TRAINER_FILE]), scheduler=scheduler, scaler=scaler)


def _full_tensors(metadata: Metadata, prefix: str = _MODEL) -> dict[str, torch.Tensor]:
    """Empty host tensors of the saved global shapes for the keys under ``prefix``
    (``model/``), by the name after it: what a one-process load fills."""
    return {
        key[len(prefix) :]: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)  # all are: only tensors are written
    }


def load_full(metadata: Metadata, read_file: Callable[[str], bytes]) -> dict[str, torch.Tensor]:
    """The model's full, unsharded tensors, in this process alone (no process group)."""
    model = _full_tensors(metadata)
    flat = {_MODEL + name: tensor for name, tensor in model.items()}
    _collectively(dcp.load, flat, storage_reader=VerifiedReader(metadata, read_file),
                  planner=DefaultLoadPlanner(flatten_state_dict=False), no_dist=True)
    return model


class _SnapshotWriter(StorageWriter):
    """A DCP writer that writes nothing: it copies each chunk DCP planned for this rank
    into the snapshot (model and optimizer chunks to their own files) and answers where
    each will be; skylift's manager writes and commits them afterwards."""

    def __init__(self, snapshot: Snapshot, rank: int, copier: HostCopier, deferrable: Callable[[str], bool]) -> None:
        super().__init__()
        self.snapshot, self.copier, self.deferrable = snapshot, copier, deferrable
        self.files = dict(zip((_MODEL, _OPTIMIZER), shard_files(rank), strict=True))
        for name in self.files.values():
            snapshot.tensors[name] = {}  # written even when empty: the manifest lists every rank's files

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:  # DCP would torch.save (pickle) it
                raise TypeError(f"{item.index.fqn} is not a tensor: a sharded checkpoint holds only tensors")
            fqn = item.index.fqn
            name = self.files[_OPTIMIZER if fqn.startswith(_OPTIMIZER) else _MODEL]
            key = _chunk_key(item.index)
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):  # a BytesIO comes only for BYTE_IO, refused above
                raise TypeError(f"{fqn} is not a tensor: a sharded checkpoint holds only tensors")
            host = self.copier.copy(f"dcp/{key}", data, deferrable=self.deferrable(fqn))
            self.snapshot.tensors[name][key] = host
            results.append(WriteResult(index=item.index, size_in_bytes=host.numel() * host.element_size(),
                                       storage_data={"file": name, "key": key}))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {result.index: result.storage_data for rank_results in results for result in rank_results}
        self.snapshot.documents[DCP_METADATA_FILE] = encode_metadata(metadata, storage)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class VerifiedReader(StorageReader):
    """A DCP reader over a skylift checkpoint: chunks come from safetensors files that
    ``read_file`` returns verified against the manifest, each file read once and only
    if the plan needs it. Nothing is unpickled: a non-tensor item is refused."""

    def __init__(self, metadata: Metadata, read_file: Callable[[str], bytes]) -> None:
        super().__init__()
        self.metadata, self.read_file = metadata, read_file

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[tuple[Any, str]]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise CorruptCheckpointError(
                    f"{item.storage_index.fqn}: not a tensor (a sharded checkpoint is never unpickled)"
                )
            where = self.metadata.storage_data.get(item.storage_index)
            if where is None:
                raise CorruptCheckpointError(f"{DCP_METADATA_FILE} names no file for {_chunk_key(item.storage_index)}")
            by_file.setdefault(where["file"], []).append((item, where["key"]))
        for name, items in sorted(by_file.items()):
            chunks = _safetensors_views(self.read_file(name), name)  # one file in memory at a time
            for item, key in items:
                if key not in chunks:
                    raise CorruptCheckpointError(f"{name} holds no chunk {key}")
                source = _narrow(chunks[key], item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.shape != source.shape:
                    raise CorruptCheckpointError(
                        f"{name}: chunk {key} is {tuple(source.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(source)
                planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def encode_metadata(metadata: Metadata, storage: dict[MetadataIndex, dict[str, str]]) -> dict[str, Any]:
    """DCP's :class:`Metadata` (tensor entries only) and where each chunk is, as a JSON document."""
    tensors = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise TypeError(f"{key} is not a tensor: a sharded checkpoint holds only tensors")
        tensors[key] = {
            "dtype": SAFETENSORS_DTYPES[entry.properties.dtype],
            "size": list(entry.size),
            "chunks": [{"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)} for chunk in entry.chunks],
        }
    chunks = [{"fqn": index.fqn, "offsets": list(index.offset or ()), "file": where["file"], "key": where["key"]}
              for index, where in storage.items()]
    return {"format": METADATA_FORMAT, "tensors": tensors, "storage": sorted(chunks, key=lambda chunk: chunk["key"])}


def decode_metadata(data: bytes, where: str) -> Metadata:
    """The :class:`Metadata` of :func:`encode_metadata`'s document (JSON, never unpickled).

    Raises:
        CorruptCheckpointError: not JSON, or not this format.
    """
    try:
        document = json.loads(data)
    except ValueError:  # a pickle (DCP's own .metadata) lands here, unread
        raise CorruptCheckpointError(
            f"{where} is not JSON: skylift reads DCP metadata only as JSON, never unpickled"
        ) from None
    try:
        if document.get("format") != METADATA_FORMAT:
            raise ValueError(f"format {document.get('format')!r} is not {METADATA_FORMAT!r}")
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
            str(key): TensorStorageMetadata(
                TensorProperties(dtype=_DTYPES_BY_NAME[entry["dtype"]]),
                torch.Size(int(size) for size in entry["size"]),
                [ChunkStorageMetadata(torch.Size(chunk["offsets"]), torch.Size(chunk["sizes"]))
                 for chunk in entry["chunks"]],
            )
            for key, entry in document["tensors"].items()
        }
        storage = {MetadataIndex(str(chunk["fqn"]), [int(offset) for offset in chunk["offsets"]]):
                   {"file": str(chunk["file"]), "key": str(chunk["key"])} for chunk in document["storage"]}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CorruptCheckpointError(f"{where}: unreadable DCP metadata ({type(error).__name__}: {error})") from None
    for chunk_place in storage.values():  # a file name of this checkpoint's folder, never a path out of it
        check_file_name(chunk_place["file"], where=where, what="chunk file name",
                        fix="skylift writes only model-rank<R>.safetensors and optimizer-rank<R>.safetensors "
                        "there: the metadata was altered; delete that checkpoint folder")
    return Metadata(state_dict_metadata=entries, storage_data=storage)


def _collectively(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run a DCP save or load; a failure on any rank (DCP's ``CheckpointException``, a ``BaseException``
    raised on every rank) as an error: ``CorruptCheckpointError`` when each is a bad or unreadable file."""
    try:
        with warnings.catch_warnings():
            # One process without a process group is the intended case, not a fallback.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            with collective(f"the sharded checkpoint's {getattr(call, '__name__', 'call')} (DCP)"):
                call(*args, **kwargs)
    except CheckpointException as failure:
        errors = [error for _, (error, _) in sorted(failure.failures.items())]
        message = "; ".join(f"rank {rank}: {error}" for rank, (error, _) in sorted(failure.failures.items()))
        if all(isinstance(error, (CorruptCheckpointError, StorageError)) for error in errors):
            raise CorruptCheckpointError(message) from None
        raise RuntimeError(f"sharded checkpoint failed: {message}") from errors[0]


def _flatten(model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """The flat tensor dict DCP sees (``model/<fqn>``, ``optimizer/<fqn>/<name>``), and
    the optimizer state's non-tensor values by parameter (for ``optimizer.json``)."""
    tensors = {_MODEL + name: value for name, value in model_state.items() if isinstance(value, torch.Tensor)}
    values: dict[str, dict[str, Any]] = {}
    for fqn, entries in optimizer_state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPTIMIZER}{fqn}/{name}"] = value
            else:
                values.setdefault(fqn, {})[name] = value
    return tensors, values


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], document: dict[str, Any], current: dict[str, Any],
                         where: str) -> dict[str, Any]:
    """The optimizer state dict to set: the loaded tensors, saved values and parameter groups."""
    saved_groups = param_groups(document)
    saved_names = [sorted(group["params"]) for group in saved_groups]
    if saved_names != [sorted(group["params"]) for group in current["param_groups"]]:
        _refuse(f"{where}: the optimizer's parameter groups differ from the checkpoint's",
                "the same model and optimizer")
    state: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        if key.startswith(_OPTIMIZER):
            fqn, _, name = key[len(_OPTIMIZER) :].rpartition("/")
            state.setdefault(fqn, {})[name] = tensor
    for fqn, entries in document["values"].items():
        state.setdefault(fqn, {}).update(entries)
    return {"state": state, "param_groups": saved_groups}


def _loadable(tensors: dict[str, torch.Tensor], saved: set[str], where: str) -> dict[str, torch.Tensor]:
    """The tensors to load: every model entry, and the optimizer state the checkpoint
    holds. DCP's set-up gave every parameter optimizer state (a step with zero gradients);
    one that never had a gradient has none in the checkpoint, and keeps none, as in the
    run that saved it."""
    missing = sorted(key for key in tensors if key.startswith(_MODEL) and key not in saved)
    unexpected = sorted(saved - set(tensors))
    if missing or unexpected:
        problems = [f"this run has {', '.join(missing[:5])} that it lacks"] if missing else []
        problems += [f"it holds {', '.join(unexpected[:5])} that this run lacks"] if unexpected else []
        _refuse(f"{where} is not this model and optimizer's state: {'; '.join(problems)}",
                "the model and optimizer of the run that wrote it")
    return {key: tensor for key, tensor in tensors.items() if key in saved}


def _refuse(message: str, needs: str) -> None:
    raise SkyliftConfigError(
        message, hint=f"Resume it with {needs}, or set checkpoint.resume: never and a new checkpoint.root."
    )


def _refuse_non_tensors(model_state: dict[str, Any]) -> None:
    others = sorted(name for name, value in model_state.items() if not isinstance(value, torch.Tensor))
    if others:
        raise TypeError(f"the model's state holds non-tensor entries ({', '.join(others[:5])}): a sharded "
                        "checkpoint stores tensors only")


def _chunk_key(index: MetadataIndex) -> str:
    return f"{index.fqn}@{','.join(str(offset) for offset in index.offset or ())}"


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _safetensors_views(data: bytes, name: str) -> dict[str, torch.Tensor]:
    """Tensors viewing ``data`` in place (no second copy of a large file), read-only use:
    the safetensors format, as :func:`~skylift.checkpoint.state.Snapshot.files` writes it."""
    try:
        (header_size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_size])
        views = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bytes are not writable; they are only copied from
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                dtype, (start, end) = _DTYPES_BY_NAME[entry["dtype"]], entry["data_offsets"]
                itemsize = torch.empty((), dtype=dtype).element_size()
                count = (end - start) // itemsize
                flat = torch.frombuffer(data, dtype=dtype, count=count, offset=8 + header_size + start) if count else \
                    torch.empty(0, dtype=dtype)
                views[key] = flat.view(entry["shape"])
    except (struct.error, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise CorruptCheckpointError(f"{name} is not a safetensors file ({type(error).__name__}: {error})") from None
    return views
