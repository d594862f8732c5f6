"""A local folder as a store: temporary file, fsync, rename; exclusive create by hard link."""

from __future__ import annotations

import builtins
import errno
import os
import uuid
from collections.abc import Iterable
from pathlib import Path

from skylift.storage.base import Chunks, Store
from skylift.storage.errors import (
    StorageFullError,
    StorageNotFoundError,
    StoragePermanentError,
    StoragePreconditionFailed,
)
from skylift.storage.names import UnsafeNameError

__all__ = ["LocalStore"]

_TEMPORARY_PREFIX = ".skylift-tmp-"


class LocalStore(Store):
    """Objects are files under ``root``.

    Writes go to a hidden temporary file in the same folder, are fsync'd, then renamed
    over the target (``if_absent``: hard-linked, which fails if the target exists),
    and the folder is fsync'd, so a crash leaves the old object or the new one.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def path(self, key: str) -> Path:
        """The file of ``key``, which must be a relative path under ``root``.

        Raises:
            UnsafeNameError: ``key`` is absolute or holds a ``..`` (a defence in depth: the
                readers of indexes and manifests check their names before this). Any
                ``..`` is refused, not only one that climbs out on paper: the kernel
                resolves ``link/..`` through the symlink, not lexically.
        """
        if os.path.isabs(key) or ".." in Path(key).parts:
            raise UnsafeNameError(f"{self.describe(key)}: key {key!r} would leave the folder {self.root}; refused")
        return self.root / key

    def write_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._write(key, lambda: (data,), if_absent=if_absent)

    def write_chunks(self, key: str, make_chunks: Chunks) -> None:
        self._write(key, make_chunks, if_absent=False)

    def _write(self, key: str, make_chunks: Chunks, *, if_absent: bool) -> None:
        target = self.path(key)
        temporary = target.with_name(f"{_TEMPORARY_PREFIX}{target.name}.{uuid.uuid4().hex}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                handle.writelines(make_chunks())
                handle.flush()
                os.fsync(handle.fileno())
            self._publish(temporary, target, if_absent=if_absent)
            _fsync_directory(target.parent)
        except OSError as error:
            raise self._translate(error, key) from error
        finally:
            temporary.unlink(missing_ok=True)

    def read_bytes(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except OSError as error:
            raise self._translate(error, key) from error

    def read_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with open(self.path(key), "rb") as handle:
                handle.seek(start)
                return handle.read(max(0, end - start))
        except OSError as error:
            raise self._translate(error, key) from error

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except OSError as error:
            raise self._translate(error, key) from error

    def list(self, prefix: str = "") -> list[str]:
        return self._walk(prefix, temporaries=False)

    def temporary_keys(self, prefix: str = "") -> builtins.list[str]:  # builtins: `list` is the method above
        return self._walk(prefix, temporaries=True)

    def _walk(self, prefix: str, *, temporaries: bool) -> builtins.list[str]:
        """The keys under ``prefix``: published files, or (``temporaries``) only temporaries."""
        base = self.path(prefix) if prefix else self.root
        if base.is_file():
            return [] if base.name.startswith(_TEMPORARY_PREFIX) != temporaries else [prefix]
        keys = []
        for folder, _, names in os.walk(base):
            for name in names:
                if name.startswith(_TEMPORARY_PREFIX) == temporaries:
                    keys.append(str(Path(folder, name).relative_to(self.root)).replace(os.sep, "/"))
        return sorted(keys)

    def delete(self, keys: Iterable[str]) -> None:
        folders = set()
        for key in keys:
            self.path(key).unlink(missing_ok=True)
            folders.add(self.path(key).parent)
        for folder in sorted(folders, key=lambda path: len(path.parts), reverse=True):
            _remove_empty_folders(folder, self.root)

    def delete_prefix(self, prefix: str) -> None:
        """Every key under ``prefix``, and the temporary files a killed writer left there:
        :meth:`list` hides those, so a folder holding only them would never be removed."""
        base = self.path(prefix) if prefix else self.root
        if base.is_dir():
            for folder, _, names in os.walk(base):
                for name in names:
                    if name.startswith(_TEMPORARY_PREFIX):
                        Path(folder, name).unlink(missing_ok=True)
        super().delete_prefix(prefix)
        if base.is_dir() and base != self.root:  # a folder left with only (now removed) temporaries
            for folder, _, _ in sorted(os.walk(base), key=lambda entry: len(Path(entry[0]).parts), reverse=True):
                _remove_empty_folders(Path(folder), self.root)

    def _publish(self, temporary: Path, target: Path, *, if_absent: bool) -> None:
        if not if_absent:
            os.replace(temporary, target)
            return
        try:
            os.link(temporary, target)
        except FileExistsError:
            raise StoragePreconditionFailed(f"{target} already exists") from None

    def _translate(self, error: OSError, key: str) -> Exception:
        if isinstance(error, FileNotFoundError):
            return StorageNotFoundError(f"{self.describe(key)} does not exist")
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageFullError(
                f"no space left writing {self.describe(key)}; free space on that disk or point "
                "checkpoint.root at a larger one"
            )
        return StoragePermanentError(f"{self.describe(key)}: {error.strerror or error}")


def _fsync_directory(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_empty_folders(folder: Path, root: Path) -> None:
    while folder != root and root in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
