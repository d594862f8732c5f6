"""S3 and S3-compatible stores: AWS S3 (``s3://``), Alibaba OSS (``oss://``), Tencent COS
(``cos://``), MinIO and friends through an endpoint URL.

boto3 is imported lazily. botocore's own retries are off: every call goes through
skylift's :class:`~skylift.storage.retry.RetryPolicy`, so one policy (with a deadline)
governs all object-store I/O. Credentials come only from the environment or the
standard credential chain and never appear in a message.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from skylift.storage.base import Chunks, Store
from skylift.storage.errors import (
    StorageNotFoundError,
    StoragePermanentError,
    StoragePreconditionFailed,
    StorageTransientError,
)
from skylift.storage.retry import RetryPolicy

__all__ = ["S3Store", "endpoint_for", "is_transient_aws_error"]

T = TypeVar("T")
log = logging.getLogger("skylift")

_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "ConditionalRequestConflict",
    "OperationAborted", "500", "502", "503", "504",
}
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                     "TokenRefreshRequired"}
# Environment variables naming the endpoint of each scheme's S3-compatible API.
_ENDPOINT_VARIABLES = {
    "s3": ("SKYLIFT_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "oss": ("SKYLIFT_OSS_ENDPOINT_URL", "OSS_ENDPOINT"),
    "cos": ("SKYLIFT_COS_ENDPOINT_URL", "COS_ENDPOINT"),
}
# 64 MiB parts, not boto3's 8: S3 allows 10,000 parts, so a streamed object of unknown
# size is capped by its part size (8 MiB: 80 GiB; 64 MiB: 640 GiB), and fewer requests
# cost less CPU per byte.
_PART_BYTES = 64 * 1024**2
_MAX_PARTS = 10_000
_PARALLEL_PARTS = 4


def endpoint_for(scheme: str, configured: str | None) -> str | None:
    """The endpoint URL: the configured one, else the scheme's environment variable."""
    if configured:
        return configured
    for variable in _ENDPOINT_VARIABLES.get(scheme, ()):
        if os.environ.get(variable):
            value = os.environ[variable]
            return value if "://" in value else f"https://{value}"
    return None


class S3Store(Store):
    """Objects under ``scheme://bucket/prefix``.

    Args:
        url: ``s3://bucket/prefix`` (``oss://`` and ``cos://`` alike).
        endpoint_url: the S3 API endpoint; required for ``oss://`` and ``cos://``
            (e.g. ``https://oss-cn-hangzhou.aliyuncs.com``,
            ``https://cos.ap-shanghai.myqcloud.com``).
        retry: the retry policy for every call.
    """

    def __init__(self, url: str, *, endpoint_url: str | None = None, retry: RetryPolicy | None = None) -> None:
        scheme, _, rest = url.partition("://")
        self.scheme = scheme
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix.strip("/")
        self.url = url.rstrip("/")
        self.endpoint_url = endpoint_for(scheme, endpoint_url)
        if scheme in ("oss", "cos") and not self.endpoint_url:
            variable = _ENDPOINT_VARIABLES[scheme][0]
            raise StoragePermanentError(
                f"{url}: {scheme}:// needs the store's S3-compatible endpoint; set checkpoint.endpoint_url "
                f"or {variable} (for example https://oss-cn-hangzhou.aliyuncs.com or "
                "https://cos.ap-shanghai.myqcloud.com)"
            )
        self.retry = retry or RetryPolicy()
        # Objects larger than one part go up as a multipart upload, parts in parallel.
        self.part_bytes = _PART_BYTES
        self._client = _make_client(scheme, self.endpoint_url)

    def object_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def write_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        # A PUT (or a completed multipart upload) is atomic in S3: no partial object is ever visible.
        if not if_absent and len(data) > self.part_bytes:
            step = self.part_bytes
            self._multipart(key, (data[start : start + step] for start in range(0, len(data), step)))
            return

        def put() -> None:
            extra = {"IfNoneMatch": "*"} if if_absent else {}
            self._client.put_object(Bucket=self.bucket, Key=self.object_key(key), Body=data, **extra)

        self._call(put, key, "write")

    def write_chunks(self, key: str, make_chunks: Chunks) -> None:
        """One PUT when the object fits in a part, else a multipart upload.

        The chunks are read once: a transient error costs one part's retry, not the
        whole object again.
        """
        parts = _parts(make_chunks(), self.part_bytes)
        first = next(parts, b"")
        second = next(parts, None)
        if second is None:
            self.write_bytes(key, first)
            return
        self._multipart(key, itertools.chain((first, second), parts))

    def _multipart(self, key: str, parts: Iterable[bytes]) -> None:
        """Upload ``parts`` in parallel (at most ``_PARALLEL_PARTS`` in memory), each
        retried on its own, then complete; abort on any failure (nothing becomes visible)."""
        target = {"Bucket": self.bucket, "Key": self.object_key(key)}
        upload_id = self._call(lambda: self._client.create_multipart_upload(**target)["UploadId"], key, "write")
        try:
            etags = self._upload_parts(key, {**target, "UploadId": upload_id}, parts)
            done = {"Parts": [{"ETag": etag, "PartNumber": number} for number, etag in enumerate(etags, 1)]}
            self._call(
                lambda: self._client.complete_multipart_upload(**target, UploadId=upload_id, MultipartUpload=done),
                key,
                "write",
            )
        except BaseException:
            self._abort(key, {**target, "UploadId": upload_id})
            raise

    def _upload_parts(self, key: str, upload: dict[str, str], parts: Iterable[bytes]) -> list[str]:
        def send(number: int, body: bytes) -> str:
            return self._call(
                lambda: self._client.upload_part(**upload, PartNumber=number, Body=body)["ETag"],
                key,
                f"write part {number} of",
            )

        futures: list[Future[str]] = []
        with ThreadPoolExecutor(_PARALLEL_PARTS, thread_name_prefix="skylift-s3-part") as pool:
            in_flight: set[Future[str]] = set()
            for number, body in enumerate(parts, 1):
                if number > _MAX_PARTS:
                    raise StoragePermanentError(
                        f"{self.describe(key)} is larger than S3's {_MAX_PARTS:,} parts of "
                        f"{self.part_bytes / 1024**2:.0f} MiB; split the object"
                    )
                if len(in_flight) >= _PARALLEL_PARTS:
                    finished, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                    for future in finished:
                        future.result()  # a part that failed for good stops the upload now
                future = pool.submit(send, number, body)
                futures.append(future)
                in_flight.add(future)
        return [future.result() for future in futures]

    def _abort(self, key: str, upload: dict[str, str]) -> None:
        try:
            self._client.abort_multipart_upload(**upload)
        except Exception as error:  # noqa: BLE001 - the upload failed already; report that, not this
            log.warning(
                "could not abort the multipart upload of %s (%s); its parts stay billed until a lifecycle rule "
                "for incomplete multipart uploads removes them",
                self.describe(key), type(error).__name__,
            )  # fmt: skip

    def read_bytes(self, key: str) -> bytes:
        def get() -> bytes:
            response = self._client.get_object(Bucket=self.bucket, Key=self.object_key(key))
            return _read_body(response)

        return self._call(get, key, "read")

    def read_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""

        def get() -> bytes:
            response = self._client.get_object(
                Bucket=self.bucket, Key=self.object_key(key), Range=f"bytes={start}-{end - 1}"
            )
            return _read_body(response)

        return self._call(get, key, "read")

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except StorageNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        def head() -> int:
            return int(self._client.head_object(Bucket=self.bucket, Key=self.object_key(key))["ContentLength"])

        return self._call(head, key, "stat")

    def list(self, prefix: str = "") -> list[str]:
        full_prefix = self.object_key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")

        def list_all() -> list[str]:
            keys = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                keys += [item["Key"] for item in page.get("Contents", [])]
            return keys

        strip = len(self.prefix) + 1 if self.prefix else 0
        return sorted(key[strip:] for key in self._call(list_all, prefix, "list"))

    def delete(self, keys: Iterable[str]) -> None:
        pending = [{"Key": self.object_key(key)} for key in keys]
        for offset in range(0, len(pending), 1000):  # DeleteObjects takes at most 1,000 keys
            batch = pending[offset : offset + 1000]
            self._call(
                functools.partial(self._client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch}),
                "",
                "delete",
            )

    def _call(self, operation: Callable[[], T], key: str, verb: str) -> T:
        def translated() -> T:
            try:
                return operation()
            except Exception as error:  # botocore raises many unrelated types
                raise self._translate(error, key, verb) from error

        return self.retry.run(translated, what=f"{verb} {self.describe(key)}")

    def _translate(self, error: Exception, key: str, verb: str) -> Exception:
        from botocore.exceptions import ClientError

        if not isinstance(error, ClientError):
            if _is_connection_problem(error):
                return StorageTransientError(f"{type(error).__name__} talking to {self.endpoint_url or 'S3'}")
            return error
        code, status = _code_and_status(error)
        where = self.describe(key)
        if is_transient_aws_error(error):
            return StorageTransientError(f"{code or status} (HTTP {status})")
        if code == "PreconditionFailed" or status == 412:
            return StoragePreconditionFailed(f"{where} already exists")
        if code == "NoSuchBucket":
            return StoragePermanentError(
                f"bucket {self.bucket!r} does not exist{self._at()}; create it "
                f"(aws s3 mb {self.scheme}://{self.bucket}) or fix the URL"
            )
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return StorageNotFoundError(f"{where} does not exist")
        if code in _CREDENTIAL_CODES:
            return StoragePermanentError(
                f"{verb} {where}: the credentials were rejected ({code}); refresh them in the environment "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role)"
            )
        if code == "AccessDenied" or status == 403:
            return StoragePermanentError(
                f"{verb} {where}: access denied; grant the job's credentials s3:GetObject, s3:PutObject, "
                f"s3:DeleteObject and s3:ListBucket on bucket {self.bucket!r}"
            )
        return StoragePermanentError(f"{verb} {where}: {code or status}")

    def _at(self) -> str:
        return f" at {self.endpoint_url}" if self.endpoint_url else ""


def _make_client(scheme: str, endpoint_url: str | None) -> Any:
    from botocore.config import Config

    from skylift.storage.s3_clients import new_client

    s3_options: dict[str, Any] = {"addressing_style": _addressing_style(scheme)}
    if endpoint_url is None or endpoint_url.startswith("https://"):
        # TLS protects the body in transit and the checkpoint manifest's sha256 checks
        # it when read; a signed payload would hash every uploaded byte once more.
        s3_options["payload_signing_enabled"] = False
    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        s3=s3_options,
        # Newer botocore adds CRC checksums that some S3-compatible stores reject.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return new_client(endpoint_url, config)


def _parts(chunks: Iterable[bytes | memoryview], part_bytes: int) -> Iterator[bytes]:
    """The chunks regrouped into parts of ``part_bytes`` (the last one shorter).

    Each part is joined from views of the chunks, one copy: a chunk stays unchanged
    until the write returns (the :data:`~skylift.storage.base.Chunks` contract).
    """
    pieces: list[memoryview] = []
    wanted = part_bytes
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while len(view):
            piece = view[:wanted]
            pieces.append(piece)
            view = view[len(piece) :]
            wanted -= len(piece)
            if not wanted:
                yield b"".join(pieces)
                pieces, wanted = [], part_bytes
    if pieces:
        yield b"".join(pieces)


def _addressing_style(scheme: str) -> str:
    """OSS and COS accept only virtual-hosted-style requests; MinIO and local test
    servers often only path style, hence SKYLIFT_S3_ADDRESSING_STYLE=path|virtual|auto."""
    configured = os.environ.get("SKYLIFT_S3_ADDRESSING_STYLE")
    if configured:
        if configured not in ("path", "virtual", "auto"):
            raise StoragePermanentError(
                f"SKYLIFT_S3_ADDRESSING_STYLE={configured!r} is not one of: path, virtual, auto"
            )
        return configured
    return "virtual" if scheme in ("oss", "cos") else "auto"


def _read_body(response: dict[str, Any]) -> bytes:
    body = response["Body"].read()
    expected = response.get("ContentLength")
    if expected is not None and len(body) != int(expected):
        raise StorageTransientError(f"truncated body: {len(body)} of {expected} bytes")
    return body


def is_transient_aws_error(error: Exception) -> bool:
    """Throttling, a 5xx or 429, or a dropped connection: an AWS call worth retrying."""
    from botocore.exceptions import ClientError

    if not isinstance(error, ClientError):
        return _is_connection_problem(error)
    code, status = _code_and_status(error)
    return code in _TRANSIENT_CODES or status >= 500 or status == 429


def _code_and_status(error: Any) -> tuple[str, int]:
    code = str(error.response.get("Error", {}).get("Code", ""))
    return code, int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _is_connection_problem(error: Exception) -> bool:
    from botocore import exceptions as botocore_errors

    transient = (
        botocore_errors.EndpointConnectionError,
        botocore_errors.ConnectionClosedError,
        botocore_errors.ReadTimeoutError,
        botocore_errors.ConnectTimeoutError,
        botocore_errors.ResponseStreamingError,
        botocore_errors.IncompleteReadError,
        ConnectionError,
        TimeoutError,
    )
    if isinstance(error, transient):
        return True
    import urllib3.exceptions

    return isinstance(error, (urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError))
