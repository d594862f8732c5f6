"""Storage: one small interface over local folders and S3-compatible object stores.

``open_store(url)`` picks the backend from the URL's scheme, importing its SDK only
then, and says what to install when it is missing (fsspec's registry pattern).
"""

from __future__ import annotations

import importlib.util
import re

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
    "SUPPORTED_SCHEMES",
    "RetryPolicy",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermanentError",
    "StoragePreconditionFailed",
    "StorageTransientError",
    "Store",
    "check_store_url",
    "open_store",
]

# scheme -> (module that must be importable, install hint)
SUPPORTED_SCHEMES = {
    "file": (None, None),
    "s3": ("boto3", "pip install 'skylift[s3]'"),
    "oss": ("boto3", "pip install 'skylift[s3]' (OSS is reached through its S3-compatible API)"),
    "cos": ("boto3", "pip install 'skylift[s3]' (COS is reached through its S3-compatible API)"),
}


# What botocore accepts as a bucket name (botocore.handlers.VALID_BUCKET); anything else
# fails inside its first request with a parameter-validation traceback.
_BUCKET_NAME = re.compile(r"^[a-zA-Z0-9.\-_]{1,255}$")


def check_store_url(url: str, *, endpoint_url: str | None = None, endpoint_field: str = "endpoint_url") -> None:
    """Check ``url`` as :func:`open_store` would take it, without opening a connection:
    the scheme, the SDK, the bucket name, and for object stores the endpoint (the given
    one, else the scheme's environment variable; required for ``oss://`` and ``cos://``).
    ``endpoint_field``: what messages call the setting that gives ``endpoint_url``.

    Raises:
        StoragePermanentError: naming what is wrong and the form that works.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return
    if scheme not in SUPPORTED_SCHEMES:
        raise StoragePermanentError(
            f"{url}: unsupported scheme {scheme!r}; use a local path or one of "
            + ", ".join(f"{name}://" for name in SUPPORTED_SCHEMES)
        )
    module, hint = SUPPORTED_SCHEMES[scheme]
    if module and importlib.util.find_spec(module) is None:
        raise StoragePermanentError(f"{url}: {scheme}:// needs {module}; install it with: {hint}")
    if scheme == "file":
        if not rest:
            raise StoragePermanentError(f"{url}: no folder; the form is file:///absolute/folder")
        return
    bucket = rest.split("/", 1)[0]
    if not bucket:
        raise StoragePermanentError(f"{url}: no bucket name; the form is {scheme}://BUCKET/PREFIX")
    if not _BUCKET_NAME.match(bucket):
        raise StoragePermanentError(
            f"{url}: {bucket!r} is not a bucket name; bucket names hold only letters, digits, '.', '-' and '_' "
            f"(on AWS: 3-63 lowercase letters, digits, '.' and '-'); the form is {scheme}://BUCKET/PREFIX"
        )
    if problem := _endpoint_problem(scheme, endpoint_url, endpoint_field):
        raise StoragePermanentError(f"{url}: {problem}")


def _endpoint_problem(scheme: str, configured: str | None, field: str) -> str | None:
    """What is wrong with the endpoint ``scheme://`` would use, or None. botocore would
    refuse a malformed one only when the client is made, with a traceback."""
    from skylift.storage.s3 import _ENDPOINT_VARIABLES, endpoint_for

    endpoint = endpoint_for(scheme, configured)
    source = field if configured else f"the endpoint from ${_ENDPOINT_VARIABLES[scheme][0]} (or a fallback)"
    if endpoint is None:
        if scheme == "s3":
            return None  # AWS's own endpoint, from the region
        return (f"{scheme}:// needs the store's S3-compatible endpoint; set {field} or "
                f"${_ENDPOINT_VARIABLES[scheme][0]} (for example https://oss-cn-hangzhou.aliyuncs.com or "
                "https://cos.ap-shanghai.myqcloud.com)")
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - raises ValueError on a port out of range or not a number
    except ValueError:
        parts = None
    unsafe = any(character.isspace() for character in endpoint)
    if parts is None or unsafe or parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{source}, {endpoint!r}, is not an http:// or https:// URL with a host, such as https://s3.example.com"
    return None


def open_store(url: str, *, endpoint_url: str | None = None, retry: RetryPolicy | None = None) -> Store:
    """The store for ``url``: a local path, ``file://``, ``s3://``, ``oss://`` or ``cos://``.

    Raises:
        StoragePermanentError: unsupported scheme, missing SDK, bad bucket name or
            endpoint, with the fix.

    Example:
        >>> open_store("/tmp/checkpoints").url
        '/tmp/checkpoints'
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        from skylift.storage.local import LocalStore

        return LocalStore(url)
    check_store_url(url, endpoint_url=endpoint_url)
    if scheme == "file":
        from skylift.storage.local import LocalStore

        return LocalStore(rest)
    from skylift.storage.s3 import S3Store

    return S3Store(url, endpoint_url=endpoint_url, retry=retry)
