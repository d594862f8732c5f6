"""A bounded local cache of shards, shared by every worker and rank on a node.

Downloads are verified against the index's sha256, written via a temporary file and
rename, and guarded by an ``flock`` per shard so that concurrent workers download each
shard once (the lock dies with its process, so a killed worker never wedges others).
A verified copy gets a stamp of its file identity (inode, size, mtime, ctime); a
cached copy is hashed again when read unless its stamp still matches, that is unless
nothing has changed the file since it was verified (see :func:`_stamped`).
When the cache passes its limit, the least recently used shards go first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from skylift.data.shards import ShardInfo, check_shard_name
from skylift.storage import StorageError, Store

__all__ = ["CorruptShardError", "ShardCache"]

log = logging.getLogger("skylift")
_DOWNLOAD_ATTEMPTS = 3


class CorruptShardError(StorageError):
    """A shard's bytes keep failing their sha256 check."""


class ShardCache:
    """Shards of one dataset under ``cache_dir``, at most ``limit_bytes`` in total."""

    def __init__(self, store: Store, cache_dir: str | os.PathLike[str], *, limit_bytes: int) -> None:
        self.store = store
        self.root = Path(cache_dir) / hashlib.sha256(store.url.encode()).hexdigest()[:16]
        self.root.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = limit_bytes
        self.downloads = 0
        self.bytes_downloaded = 0

    def path(self, shard: ShardInfo) -> Path:
        # read_index checked the name already; this guards a ShardInfo built any other way.
        return self.root / check_shard_name(shard.name, self.store)

    def read(
        self, shard: ShardInfo, keep: frozenset[str] = frozenset(), ready: Callable[[bytes], None] | None = None
    ) -> bytes:
        """The shard's bytes, verified: a cached copy that fails its sha256 is fetched again.

        Shards in ``keep`` (the ones a reader still needs) are never evicted for this one.
        ``ready`` gets the bytes as soon as they are verified, before a download is
        written into the cache: the reader that asked need not wait for the disk.
        """
        target = self.path(shard)  # first: the lock file's name is made of the shard's too
        with _locked(self.root / f".{shard.name}.lock"):
            data = target.read_bytes() if target.is_file() else None
            if data is not None and not _stamped(target, shard) and not _matches(data, shard):
                log.warning("cached shard %s failed its sha256 check; fetching it again", shard.name)
                target.unlink(missing_ok=True)
                data = None
            if data is None:
                data = self._download(shard)
                if ready is not None:
                    ready(data)
                # Write the temporary file outside the cache-wide lock (the workers' other
                # downloads need it too), then make room and publish under it, so that
                # concurrent downloads never take the cache past its limit together.
                temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
                try:
                    temporary.write_bytes(data)
                    with _locked(self.root / ".cache.lock"):
                        self._evict(keep, incoming_bytes=len(data))
                        os.replace(temporary, target)
                        _stamp(target, shard)  # before the lock goes: eviction ranks shards by their stamps
                finally:
                    temporary.unlink(missing_ok=True)
                return data
            if ready is not None:
                ready(data)
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile for another download: nothing to mark
                _stamp(target, shard)  # verified now, and recently used
        return data

    def _download(self, shard: ShardInfo) -> bytes:
        for attempt in range(1, _DOWNLOAD_ATTEMPTS + 1):
            data = self.store.read_bytes(shard.name)
            self.downloads += 1
            self.bytes_downloaded += len(data)
            if _matches(data, shard):
                return data
            log.warning("%s failed its sha256 check (attempt %d)", self.store.describe(shard.name), attempt)
        raise CorruptShardError(
            f"{self.store.describe(shard.name)} does not match index.json (expected sha256 {shard.sha256}); "
            "the dataset changed or is damaged: rebuild it with `skylift shard`"
        )

    def _evict(self, keep: frozenset[str], incoming_bytes: int = 0) -> None:
        """Delete least recently used shards (not in ``keep``) until ``incoming_bytes`` more fit."""
        entries = sorted(self._entries())  # oldest first
        total = sum(size for _, size, _ in entries) + incoming_bytes
        for _, size, path in entries:
            if total <= self.limit_bytes:
                return
            if path.name in keep:
                continue
            with contextlib.suppress(FileNotFoundError):  # another worker evicted it first
                path.unlink()
            _stamp_path(path).unlink(missing_ok=True)
            total -= size

    def cached_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of each cached shard; files vanishing meanwhile are skipped."""
        entries = []
        for path in self.root.glob("shard-*.tar"):
            try:
                status = path.stat()
            except FileNotFoundError:
                continue
            try:
                used = _stamp_path(path).stat().st_mtime
            except FileNotFoundError:  # not stamped (yet): the shard's own time
                used = status.st_mtime
            entries.append((used, status.st_size, path))
        return entries


def _stamp_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.verified")


def _identity(target: Path, shard: ShardInfo) -> str:
    """What a verified copy looks like from outside: any write to the file, a rename
    over it, even a ``touch -m`` that restores the mtime, changes its ctime or inode."""
    status = target.stat()
    return f"{shard.sha256} {status.st_ino} {status.st_size} {status.st_mtime_ns} {status.st_ctime_ns}\n"


def _stamp(target: Path, shard: ShardInfo) -> None:
    """Record that ``target`` matched ``shard``'s sha256 as it is now (its stamp's mtime
    is also the shard's last use, for eviction: the shard itself is never touched, or
    its ctime would change)."""
    stamp = _stamp_path(target)
    identity = _identity(target, shard)
    if stamp.is_file() and stamp.read_text() == identity:
        os.utime(stamp)
        return
    temporary = stamp.with_name(f"{stamp.name}.{uuid.uuid4().hex}.tmp")
    temporary.write_text(identity)
    os.replace(temporary, stamp)


def _stamped(target: Path, shard: ShardInfo) -> bool:
    """Whether ``target`` is unchanged since it was verified against ``shard``'s sha256.

    Every DataLoader worker of a rank reads every shard of a shuffle block, and later
    epochs read them again: hashing each read would cost more CPU than the download.
    """
    try:
        return _stamp_path(target).read_text() == _identity(target, shard)
    except FileNotFoundError:
        return False


def _matches(data: bytes, shard: ShardInfo) -> bool:
    return len(data) == shard.size and hashlib.sha256(data).hexdigest() == shard.sha256


class _locked:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self._handle = open(self.path, "a+")
        fcntl.flock(self._handle, fcntl.LOCK_EX)

    def __exit__(self, *exc_info: object) -> None:
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()
