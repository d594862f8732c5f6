"""The storage interface every backend implements (local folder, S3-compatible stores).

Keys are ``/``-separated paths relative to the store's root URL. Every write is
atomic: a reader sees the old object, the new object, or nothing, never a part.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Callable, Iterable

Chunks = Callable[[], Iterable[bytes | memoryview]]
"""A factory of the chunks of one object; a backend may call it again to retry a write.

A chunk must stay unchanged until the write that consumes it returns (backends may
hold several chunks before copying them into one request)."""

__all__ = ["Chunks", "Store"]


class Store(abc.ABC):
    """A root URL plus atomic object operations under it."""

    url: str

    @abc.abstractmethod
    def write_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write ``data`` atomically.

        Raises:
            StoragePreconditionFailed: ``if_absent`` and the key already exists.
            StorageFullError: no space left.
        """

    def write_chunks(self, key: str, make_chunks: Chunks) -> None:
        """Write an object given as a sequence of chunks, atomically.

        Lets large objects (checkpoint tensors) go to storage without first being
        joined into one buffer. Backends override this to stream.
        """
        self.write_bytes(key, b"".join(bytes(chunk) for chunk in make_chunks()))

    @abc.abstractmethod
    def read_bytes(self, key: str) -> bytes:
        """The whole object. Raises ``StorageNotFoundError`` when absent."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Object size in bytes. Raises ``StorageNotFoundError`` when absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys under ``prefix`` (recursively), sorted; never a partial write."""

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete the keys; missing ones are ignored."""

    def temporary_keys(self, prefix: str = "") -> builtins.list[str]:  # builtins: `list` is the method above
        """The temporary files killed writers left under ``prefix``, sorted: :meth:`list`
        never shows them, so start-up cleanups look here for folders holding only them.
        Stores that write without temporaries (an object store's uploads) have none."""
        return []

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``."""
        self.delete(self.list(prefix))

    def describe(self, key: str = "") -> str:
        """The full URL of ``key``, for messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url
