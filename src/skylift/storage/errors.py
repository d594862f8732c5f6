"""Storage errors. Messages name the object and the fix, never a credential."""

from __future__ import annotations

from skylift.errors import SkyliftError

__all__ = [
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermanentError",
    "StoragePreconditionFailed",
    "StorageTransientError",
]


class StorageError(SkyliftError):
    """Any failure of a storage operation."""


class StorageTransientError(StorageError):
    """A failure worth retrying (timeouts, 5xx, throttling, dropped connections).

    Raised to callers only once the retry policy gave up.
    """


class StoragePermanentError(StorageError):
    """A failure retrying cannot fix (403, missing bucket, bad credentials)."""


class StorageNotFoundError(StoragePermanentError, FileNotFoundError):
    """The object does not exist."""


class StorageFullError(StoragePermanentError):
    """No space left on the device (ENOSPC) or over a quota."""


class StoragePreconditionFailed(StorageError):
    """A conditional write lost: the object already exists (exclusive create)."""
