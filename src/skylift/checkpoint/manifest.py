"""Checkpoint layout, the manifest that commits a checkpoint, and verified reads.

Layout under ``checkpoint.root``::

    lease/<generation>.json    who is writing this run (see lease.py)
    LATEST                     name of the newest committed checkpoint (a hint for tools)
    step-120/
      model.safetensors        rank 0: model weights
      optimizer.safetensors    rank 0: optimizer tensors
      optimizer.json           rank 0: parameter groups and scalar optimizer state
      trainer.json             rank 0: counters, LR schedule, GradScaler
      rng-rank<R>.safetensors  every rank: torch CPU/CUDA generator states
      rng-rank<R>.json         every rank: Python and NumPy generator states
      manifest.json            written last: every file with size and sha256, the run's config

A sharded model (FSDP2) is saved in the ``sharded`` layout instead (see sharded.py):
``model-rank<R>.safetensors`` and ``optimizer-rank<R>.safetensors`` from every rank,
``dcp-metadata.json`` from rank 0 in place of the two whole-model files; the manifest's
``layout`` says which.

A ``step-N/`` without a manifest that verifies does not exist for readers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from skylift.errors import SkyliftError
from skylift.storage import StorageError, StorageNotFoundError, Store
from skylift.storage.base import Chunks
from skylift.storage.names import check_relative_name

__all__ = [
    "LATEST",
    "MANIFEST",
    "CorruptCheckpointError",
    "Manifest",
    "committed_steps",
    "file_entry",
    "find_latest_valid",
    "hashing",
    "read_manifest",
    "read_verified",
    "step_folder",
    "step_folders",
    "uncommitted_steps",
    "verified_file",
]

log = logging.getLogger("skylift")

MANIFEST = "manifest.json"
LATEST = "LATEST"
FORMAT = "skylift-checkpoint/1"
LAYOUTS = ("replicated", "sharded")
FIRST_TIMELINE: tuple[tuple[str, int | None], ...] = (("0", None),)
"""The timeline of a root's first run, and of manifests written before timelines (see timeline.py)."""
_STEP_PATTERN = re.compile(r"^step-(\d+)$")


class CorruptCheckpointError(SkyliftError):
    """A checkpoint's manifest or one of its files does not verify."""


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    files: dict[str, dict[str, Any]]
    created_at: float
    layout: str = "replicated"
    """``replicated`` (the whole model from rank 0) or ``sharded`` (every rank's shards)."""
    timeline: tuple[tuple[str, int | None], ...] = FIRST_TIMELINE
    """The forks that led to this checkpoint, oldest first: (timeline id, the step of the
    previous timeline it started from; None for the first). See timeline.py."""
    config: dict[str, Any] | None = None
    """The configuration of the run that wrote it, secrets redacted (compatibility.py
    compares it with a resuming run's); None in manifests written before it was recorded."""

    def encode(self) -> bytes:
        payload = {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "layout": self.layout,
            "files": self.files,
            "timeline": [list(fork) for fork in self.timeline],
        }
        if self.config is not None:
            payload["config"] = self.config
        return json.dumps(payload, indent=1, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Manifest:
        try:
            payload = json.loads(data)
            if payload.get("format") != FORMAT:
                raise ValueError(f"format {payload.get('format')!r} is not {FORMAT!r}")
            files = {str(name): {"size": int(entry["size"]), "sha256": str(entry["sha256"])}
                     for name, entry in payload["files"].items()}
            layout = payload.get("layout", "replicated")  # manifests written before sharding have none
            if layout not in LAYOUTS:
                raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
            step, world_size = int(payload["step"]), int(payload["world_size"])
            timeline = decode_timeline(payload.get("timeline"))
            config = payload.get("config")  # manifests written before configs were recorded have none
            if config is not None and not isinstance(config, dict):
                raise ValueError(f"config is a {type(config).__name__}, not a mapping")
            manifest = cls(step, world_size, files, float(payload["created_at"]), layout, timeline, config)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptCheckpointError(f"{where}: unreadable manifest ({error})") from None
        # Each name becomes a path or key under the checkpoint's folder, read from and,
        # restoring a mirror, written to: one that leaves the folder is refused (an
        # UnsafeNameError is a StorageError: readers skip this checkpoint as a corrupt one).
        for name in files:
            check_relative_name(name, where=where, what="file name", fix=(
                "skylift never writes such a name: the manifest was altered; delete that checkpoint folder"))
        return manifest

    @classmethod
    def create(
        cls, step: int, world_size: int, files: dict[str, dict[str, Any]], layout: str = "replicated",
        timeline: tuple[tuple[str, int | None], ...] = FIRST_TIMELINE, config: dict[str, Any] | None = None,
    ) -> Manifest:
        return cls(step, world_size, dict(sorted(files.items())), time.time(), layout, timeline, config)


def decode_timeline(value: Any) -> tuple[tuple[str, int | None], ...]:
    if value is None:  # written before timelines
        return FIRST_TIMELINE
    if not isinstance(value, list) or not all(isinstance(fork, list) and len(fork) == 2 for fork in value):
        raise ValueError(f"timeline {value!r} is not a list of [id, step] pairs")
    forks = tuple((str(identity), None if start is None else int(start)) for identity, start in value)
    if not forks or forks[0][1] is not None or any(start is None for _, start in forks[1:]):
        raise ValueError(f"timeline {value!r} does not start with a first timeline")
    return forks


def step_folder(step: int) -> str:
    return f"step-{step}"


def file_entry(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def hashing(make_chunks: Chunks) -> tuple[Chunks, dict[str, Any]]:
    """Wrap a chunk factory so the bytes are hashed as they are written, in one pass.

    The returned entry holds the size and sha256 of the last complete pass (a retried
    write passes again; the bytes are the same).
    """
    entry: dict[str, Any] = {}

    def chunks() -> Iterator[bytes | memoryview]:
        digest, size = hashlib.sha256(), 0
        for chunk in make_chunks():
            digest.update(chunk)
            size += len(memoryview(chunk).cast("B"))
            yield chunk
        entry.update(size=size, sha256=digest.hexdigest())

    return chunks, entry


def step_folders(store: Store) -> dict[int, set[str]]:
    """Every ``step-N`` folder under the root (committed or not) with its file names."""
    folders: dict[int, set[str]] = {}
    for key in store.list():
        head, _, name = key.partition("/")
        match = _STEP_PATTERN.match(head)
        if match and name:
            folders.setdefault(int(match.group(1)), set()).add(name)
    return folders


def uncommitted_steps(store: Store) -> list[int]:
    """Steps whose folder holds no manifest, sorted: written by a save that never committed
    (at start, with no writer running, they are what killed writers left). Includes a
    folder holding only temporary files (a writer killed during its first file), which
    :func:`step_folders` cannot see."""
    folders = step_folders(store)
    for key in store.temporary_keys():
        match = _STEP_PATTERN.match(key.partition("/")[0])
        if match and "/" in key:
            folders.setdefault(int(match.group(1)), set())
    return sorted(step for step, names in folders.items() if MANIFEST not in names)


def committed_steps(store: Store) -> list[int]:
    """Steps whose folder holds a manifest, oldest first (not yet verified)."""
    return sorted(step for step, names in step_folders(store).items() if MANIFEST in names)


def read_manifest(store: Store, step: int) -> Manifest:
    """The manifest of ``step-N``, checked to list every file a checkpoint needs."""
    from skylift.checkpoint.state import required_files

    key = f"{step_folder(step)}/{MANIFEST}"
    try:
        data = store.read_bytes(key)
    except StorageNotFoundError:
        raise CorruptCheckpointError(f"{store.describe(step_folder(step))} has no manifest: not committed") from None
    manifest = Manifest.decode(data, store.describe(key))
    missing = sorted(required_files(manifest.world_size, manifest.layout) - set(manifest.files))
    if missing or manifest.step != step:
        problem = f"lists no {', '.join(missing)}" if missing else f"is for step {manifest.step}"
        raise CorruptCheckpointError(f"{store.describe(key)} {problem}")
    return manifest


def read_verified(store: Store, step: int, manifest: Manifest, names: list[str] | None = None) -> dict[str, bytes]:
    """Read files of a checkpoint, checking each against the manifest.

    Raises:
        CorruptCheckpointError: naming the file, the expected and the actual sha256.
    """
    folder = step_folder(step)
    wanted = names if names is not None else sorted(manifest.files)
    contents = {}
    for name in wanted:
        key = f"{folder}/{name}"
        expected = manifest.files.get(name)
        if expected is None:
            raise CorruptCheckpointError(f"{store.describe(key)} is not listed in the manifest")
        contents[name] = verified_file(store, key, expected)
    return contents


def verified_file(store: Store, key: str, expected: dict[str, Any]) -> bytes:
    """The bytes of ``key`` if they match ``expected`` (a manifest entry).

    Raises:
        CorruptCheckpointError: missing, or naming the expected and the actual sha256.
    """
    try:
        data = store.read_bytes(key)
    except StorageNotFoundError:
        raise CorruptCheckpointError(f"{store.describe(key)} is listed in the manifest but missing") from None
    actual = file_entry(data)
    if actual != expected:
        raise CorruptCheckpointError(
            f"{store.describe(key)} does not match the manifest: expected {expected['size']} bytes, sha256 "
            f"{expected['sha256']}; found {actual['size']} bytes, sha256 {actual['sha256']}"
        )
    return data


def find_latest_valid(store: Store) -> tuple[Manifest, dict[str, bytes]] | None:
    """The newest checkpoint whose manifest and every file verify, with its contents.

    Torn or corrupt checkpoints are skipped with a warning that names them.
    """
    for step in reversed(committed_steps(store)):
        try:
            manifest = read_manifest(store, step)
            return manifest, read_verified(store, step, manifest)
        except (CorruptCheckpointError, StorageError) as error:
            log.warning("skipping checkpoint %s: %s", store.describe(step_folder(step)), error)
    return None
