"""Datasets as shards: plain tar files plus an index, in any store.

Layout at the destination (a local folder or an ``s3://``, ``oss://``, ``cos://`` URL)::

    shard-000000.tar     WebDataset-style: members "<sample key>.<field>", grouped by sample
    shard-000001.tar
    index.json           written last: per shard its sample count, size and sha256

The tar files open with ``tar``, WebDataset or any tar reader; ``index.json`` is the
commit point, so a half-written dataset never looks complete. Writing is
deterministic (same input, same bytes), which makes an interrupted ``skylift shard``
resumable: shards already at the destination with the expected hash are kept.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from skylift.storage import StorageNotFoundError, Store
from skylift.storage.names import check_file_name

__all__ = ["INDEX", "ShardIndex", "ShardInfo", "ShardWriter", "check_shard_name", "read_index", "read_shard_samples"]

INDEX = "index.json"
FORMAT = "skylift-shards/1"


@dataclass(frozen=True)
class ShardInfo:
    name: str
    num_samples: int
    size: int
    sha256: str


@dataclass(frozen=True)
class ShardIndex:
    shards: list[ShardInfo]
    fields: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form facts about the dataset, e.g. ``{"classes": [...]}``."""

    @property
    def num_samples(self) -> int:
        return sum(shard.num_samples for shard in self.shards)

    def encode(self) -> bytes:
        payload = {
            "format": FORMAT,
            "fields": self.fields,
            "num_samples": self.num_samples,
            "metadata": self.metadata,
            "shards": [shard.__dict__ for shard in self.shards],
        }
        return json.dumps(payload, indent=1).encode()


def read_index(store: Store) -> ShardIndex:
    """The committed index of a sharded dataset.

    Raises:
        StorageNotFoundError: no ``index.json`` (not a dataset, or not finished writing).
    """
    try:
        payload = json.loads(store.read_bytes(INDEX))
    except StorageNotFoundError:
        raise StorageNotFoundError(
            f"{store.describe(INDEX)} does not exist: not a sharded dataset, or `skylift shard` did not finish; "
            f"create it with: skylift shard SOURCE {store.url}"
        ) from None
    if payload.get("format") != FORMAT:
        raise ValueError(f"{store.describe(INDEX)}: format {payload.get('format')!r} is not {FORMAT!r}")
    shards = [ShardInfo(**entry) for entry in payload["shards"]]
    for shard in shards:  # every name becomes a path in the shard cache: none may leave it
        check_shard_name(shard.name, store)
    return ShardIndex(shards, list(payload["fields"]), dict(payload.get("metadata") or {}))


def check_shard_name(name: object, store: Store) -> str:
    """``name`` if it is a plain, visible file name, as :class:`ShardWriter` writes them.

    Raises:
        UnsafeNameError: naming the dataset's index, the name and the fix.
    """
    return check_file_name(
        name, where=store.describe(INDEX), what="shard name", hidden_allowed=False,
        fix=f"The index is damaged or was not written by `skylift shard`; rebuild the dataset with: "
        f"skylift shard SOURCE {store.url}",
    )  # fmt: skip


class ShardWriter:
    """Packs samples (``dict`` of field name -> bytes) into tar shards of about ``shard_size_bytes``.

    Example:
        >>> writer = ShardWriter(open_store("/tmp/digits-shards"), shard_size_bytes=1 << 20)  # doctest: +SKIP
        >>> for sample in samples: writer.add(sample)                                        # doctest: +SKIP
        >>> index = writer.close()                                                           # doctest: +SKIP
    """

    def __init__(self, store: Store, *, shard_size_bytes: int = 64 * 1024**2) -> None:
        if shard_size_bytes < 1024:
            raise ValueError(f"shard size must be at least 1 KiB, got {shard_size_bytes} bytes")
        self.store = store
        self.shard_size_bytes = shard_size_bytes
        self.shards: list[ShardInfo] = []
        self.fields: set[str] = set()
        self.reused = 0
        self._buffer = io.BytesIO()
        self._tar = self._new_tar()
        self._pending_samples = 0
        self._next_key = 0
        self._existing = self._existing_sizes()

    def add(self, sample: dict[str, bytes]) -> None:
        if not sample:
            raise ValueError("a sample needs at least one field")
        key = f"{self._next_key:09d}"
        self._next_key += 1
        for field_name in sorted(sample):
            data = sample[field_name]
            if not isinstance(data, bytes):
                raise TypeError(f"sample {key} field {field_name!r} must be bytes, not {type(data).__name__}")
            member = tarfile.TarInfo(f"{key}.{field_name}")
            member.size = len(data)
            member.mtime = 0  # deterministic bytes: an interrupted run can be resumed
            member.mode = 0o644
            self._tar.addfile(member, io.BytesIO(data))
            self.fields.add(field_name)
        self._pending_samples += 1
        if self._buffer.tell() >= self.shard_size_bytes:
            self._flush()

    def close(self, metadata: dict[str, Any] | None = None) -> ShardIndex:
        """Write the last shard and then the index (the commit point)."""
        if self._pending_samples:
            self._flush()
        if not self.shards:
            raise ValueError("no samples were written")
        index = ShardIndex(list(self.shards), sorted(self.fields), dict(metadata or {}))
        self.store.write_bytes(INDEX, index.encode())
        return index

    def _flush(self) -> None:
        self._tar.close()
        data = self._buffer.getvalue()
        name = f"shard-{len(self.shards):06d}.tar"
        digest = hashlib.sha256(data).hexdigest()
        if self._existing.get(name) == len(data) and _sha256(self.store.read_bytes(name)) == digest:
            self.reused += 1
        else:
            self.store.write_bytes(name, data)
        self.shards.append(ShardInfo(name, self._pending_samples, len(data), digest))
        self._buffer = io.BytesIO()
        self._tar = self._new_tar()
        self._pending_samples = 0

    def _new_tar(self) -> tarfile.TarFile:
        return tarfile.open(fileobj=self._buffer, mode="w", format=tarfile.USTAR_FORMAT)

    def _existing_sizes(self) -> dict[str, int]:
        return {key: self.store.size(key) for key in self.store.list() if key.startswith("shard-")}


def read_shard_samples(data: bytes) -> Iterator[dict[str, bytes]]:
    """The samples of one tar shard, in order, as field -> bytes."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        current_key, sample = None, {}
        for member in archive:
            if not member.isfile():
                continue
            key, _, field_name = member.name.partition(".")
            if current_key is not None and key != current_key:
                yield sample
                sample = {}
            current_key = key
            extracted = archive.extractfile(member)
            assert extracted is not None
            sample[field_name] = extracted.read()
        if sample:
            yield sample


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
