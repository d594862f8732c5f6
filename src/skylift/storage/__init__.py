"""Storage: one small interface over local folders and S3-compatible object stores.

``open_store(url)`` picks the backend from the URL's scheme, importing its SDK only
then, and says what to install when it is missing (fsspec's registry pattern).
"""

from __future__ import annotations

import importlib.util

from skylift.storage.base import Store
from skylift.storage.errors import (
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermanentError,
    StoragePreconditionFailed,
    StorageTransientError,
)
from skylift.storage.retry import RetryPolicy

__all__ = [
    "RetryPolicy",
    "Store",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermanentError",
    "StoragePreconditionFailed",
    "StorageTransientError",
    "SUPPORTED_SCHEMES",
    "open_store",
]

# scheme -> (module that must be importable, install hint)
SUPPORTED_SCHEMES = {
    "file": (None, None),
    "s3": ("boto3", "pip install 'skylift[s3]'"),
    "oss": ("boto3", "pip install 'skylift[s3]' (OSS is reached through its S3-compatible API)"),
    "cos": ("boto3", "pip install 'skylift[s3]' (COS is reached through its S3-compatible API)"),
}


def open_store(url: str, *, endpoint_url: str | None = None, retry: RetryPolicy | None = None) -> Store:
    """The store for ``url``: a local path, ``file://``, ``s3://``, ``oss://`` or ``cos://``.

    Raises:
        StoragePermanentError: unsupported scheme or missing SDK, with the fix.

    Example:
        >>> open_store("/tmp/checkpoints").url
        '/tmp/checkpoints'
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        from skylift.storage.local import LocalStore

        return LocalStore(url)
    if scheme not in SUPPORTED_SCHEMES:
        raise StoragePermanentError(
            f"{url}: unsupported scheme {scheme!r}; use a local path or one of "
            + ", ".join(f"{name}://" for name in SUPPORTED_SCHEMES)
        )
    module, hint = SUPPORTED_SCHEMES[scheme]
    if module and importlib.util.find_spec(module) is None:
        raise StoragePermanentError(f"{url}: {scheme}:// needs {module}; install it with: {hint}")
    if scheme == "file":
        from skylift.storage.local import LocalStore

        return LocalStore(rest)
    from skylift.storage.s3 import S3Store

    if not rest.split("/", 1)[0]:
        raise StoragePermanentError(f"{url}: no bucket name; the form is {scheme}://BUCKET/PREFIX")
    return S3Store(url, endpoint_url=endpoint_url, retry=retry)
