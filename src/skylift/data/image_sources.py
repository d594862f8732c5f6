"""Image folders (``SOURCE/<class>/<image>``) in a local folder or an object store, for ``skylift shard``.

The classes are the first-level folders under SOURCE, sorted; each class's images are
the files directly in its folder whose suffix is in ``IMAGE_SUFFIXES``, sorted by name.
A local folder and the same tree uploaded to ``s3://``, ``oss://`` or ``cos://`` give
the same samples in the same order, so the same shards byte for byte: that
determinism is what lets an interrupted ``skylift shard`` keep the shards it wrote.

Objects are fetched by a bounded thread pool, ahead of the writer but handed to it
in the sorted order; at most ``2 * workers`` images are held in memory.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

from skylift.errors import SkyliftConfigError
from skylift.storage import StoragePermanentError, open_store

__all__ = ["DEFAULT_LOCAL_WORKERS", "DEFAULT_STORE_WORKERS", "IMAGE_SUFFIXES", "ImageFolder", "fetch_ordered",
           "open_image_folder"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")

DEFAULT_STORE_WORKERS = 32
"""Parallel GETs from an object store: its latency, not bandwidth, bounds one stream."""
DEFAULT_LOCAL_WORKERS = 8
T = TypeVar("T")


@dataclass(frozen=True)
class ImageFolder:
    """The listed images of an image folder; ``samples()`` reads them."""

    source: str
    classes: list[str]
    images: list[tuple[int, str]]
    """(label, key relative to the source), in the order they are written."""
    read: Callable[[str], bytes]
    default_workers: int

    def samples(self, workers: int | None = None) -> Iterator[dict[str, bytes]]:
        """``{<suffix>: image bytes, "cls": label}`` per image, in order, read ``workers`` at a time."""
        keys = (key for _, key in self.images)
        fetched = fetch_ordered(self.read, keys, workers or self.default_workers)
        for (label, key), data in zip(self.images, fetched, strict=True):
            yield {_field(key): data, "cls": str(label).encode()}


def open_image_folder(source: str, *, endpoint_url: str | None = None) -> ImageFolder:
    """List ``source`` (a folder, ``file://``, ``s3://``, ``oss://`` or ``cos://`` URL).

    Raises:
        SkyliftConfigError: no class folders, no images, an unusable URL or a missing SDK.
    """
    scheme, separator, rest = source.partition("://")
    if not separator or scheme == "file":
        return _local(Path(rest if separator else source))
    try:
        store = open_store(source, endpoint_url=endpoint_url)
        keys = store.list()
    except StoragePermanentError as error:  # unsupported scheme, no boto3, no bucket, access denied
        message = str(error) if source.rstrip("/") in str(error) else f"{source}: {error}"
        raise SkyliftConfigError(f"shard source {message}") from None
    by_class: dict[str, list[str]] = {}
    for key in keys:
        name, slash, rest = key.partition("/")
        if not slash:
            continue  # an object beside the class folders
        names = by_class.setdefault(name, [])  # a "name/" folder marker alone still makes a class
        if "/" not in rest and _is_image(rest):
            names.append(rest)
    classes = sorted(by_class)
    images = [(label, f"{name}/{file}") for label, name in enumerate(classes) for file in sorted(by_class[name])]
    empty = " (nothing is stored under it)" if not keys else ""
    _check(source, classes, images, empty)
    local = threading.local()

    def read(key: str) -> bytes:
        # One client per thread: a shared one's connection pool (10) would drop connections.
        if not hasattr(local, "store"):
            local.store = open_store(source, endpoint_url=endpoint_url)
        return local.store.read_bytes(key)

    return ImageFolder(store.url, classes, images, read, DEFAULT_STORE_WORKERS)


def fetch_ordered(read: Callable[[str], T], keys: Iterable[str], workers: int) -> Iterator[T]:
    """``read(key)`` for each key, ``workers`` in parallel, yielded in the keys' order.

    At most ``2 * workers`` results are pending or held; the first failure propagates
    (in order) and the reads not yet started are cancelled.
    """
    if workers < 1:
        raise SkyliftConfigError(f"--workers must be at least 1, got {workers}")
    pending: deque[Future[T]] = deque()
    remaining = iter(keys)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="skylift-shard-read")
    try:
        for key in itertools.islice(remaining, 2 * workers):
            pending.append(pool.submit(read, key))
        while pending:
            result = pending.popleft().result()
            following = next(remaining, None)
            if following is not None:
                pending.append(pool.submit(read, following))
            yield result
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _local(root: Path) -> ImageFolder:
    try:
        with os.scandir(root) as entries:
            classes = sorted(entry.name for entry in entries if entry.is_dir())
        images = []
        for label, name in enumerate(classes):
            with os.scandir(root / name) as entries:
                files = sorted(entry.name for entry in entries if entry.is_file() and _is_image(entry.name))
            images += [(label, f"{name}/{file}") for file in files]
    except OSError as error:
        raise SkyliftConfigError(f"cannot list shard source {error.filename or root}: {error.strerror}") from None
    _check(str(root), classes, images, "")

    def read(key: str) -> bytes:
        try:
            return (root / key).read_bytes()
        except OSError as error:
            raise SkyliftConfigError(f"cannot read {root / key}: {error.strerror}") from None

    return ImageFolder(str(root), classes, images, read, DEFAULT_LOCAL_WORKERS)


def _check(source: str, classes: list[str], images: list[tuple[int, str]], note: str) -> None:
    layout = f"the layout is {source.rstrip('/')}/<class name>/<image files> ({', '.join(IMAGE_SUFFIXES)})"
    if not classes:
        raise SkyliftConfigError(f"shard source {source} has no class folders{note}; {layout}")
    if not images:
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        raise SkyliftConfigError(
            f"shard source {source} has {len(classes)} class folder{'s' if len(classes) > 1 else ''} ({shown}) "
            f"but no images directly in them; {layout}"
        )


def _is_image(name: str) -> bool:
    return PurePosixPath(name).suffix.lower() in IMAGE_SUFFIXES


def _field(key: str) -> str:
    return PurePosixPath(key).suffix.lower().lstrip(".").replace("jpeg", "jpg")
