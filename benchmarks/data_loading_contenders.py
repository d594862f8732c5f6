"""The in-process contenders of the data-loading benchmark and the loop that times them.

Every contender runs ``NUM_WORKERS`` DataLoader worker processes and yields batches of
``BATCH_SIZE`` samples, in one of two modes:

* ``bytes``: each sample's raw JPEG bytes (what the storage path delivers);
* ``decoded``: each JPEG decoded to a uint8 CHW tensor with torchvision's
  ``decode_image`` (libjpeg-turbo) in the workers, batches stacked (B, 3, H, W).

(a) ``per_object``: a map-style Dataset doing one ``get_object`` per ``__getitem__``
under a standard shuffling DataLoader: the seed's pattern.
(b) ``skylift``: :class:`skylift.data.streaming.StreamingDataset` with its defaults.
(c) ``webdataset``: ``wds.WebDataset`` over the same tar shards, the pipeline its docs
recommend for throughput (shard shuffle, split by worker, sample shuffle buffer,
batching inside the workers, ``WebLoader(batch_size=None)``); each shard is one
streamed boto3 GET (s3fs would send a HEAD before every GET).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate
from torchvision.io import (  # imported before the workers fork: none pays it
    ImageReadMode,
    decode_image,
)

from benchmarks.data_loading_data import BUCKET, label_of, object_key
from benchmarks.data_loading_servers import CpuMeter

__all__ = ["BATCH_SIZE", "NUM_WORKERS", "drain", "per_object_loader", "skylift_loader", "webdataset_loader"]

NUM_WORKERS = 2
BATCH_SIZE = 32
WDS_SHUFFLE_BUFFER = 1000


def decode_jpeg(data: bytes) -> torch.Tensor:
    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def batch_size_and_bytes(batch: Any) -> tuple[int, int]:
    """Samples in a batch and the payload bytes it delivers (JPEG bytes or pixel bytes)."""
    if isinstance(batch[0], bytes):
        return len(batch), sum(len(data) for data in batch)
    images = batch[0]  # (images, labels)
    return int(images.shape[0]), images.numel() * images.element_size()


def _collate(mode: str) -> Callable[[list[Any]], Any]:
    return list if mode == "bytes" else default_collate


class _Boto3:
    """One boto3 client per process (clients must not cross a fork)."""

    def __init__(self, endpoint_url: str) -> None:
        self.endpoint_url = endpoint_url
        self._client: Any = None
        self._pid = -1

    def client(self) -> Any:
        if self._pid != os.getpid():
            import boto3

            self._client, self._pid = boto3.client("s3", endpoint_url=self.endpoint_url), os.getpid()
        return self._client


class PerObjectDataset(Dataset):
    def __init__(self, count: int, endpoint_url: str, mode: str) -> None:
        self.count, self.mode, self.boto = count, mode, _Boto3(endpoint_url)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        data = self.boto.client().get_object(Bucket=BUCKET, Key=object_key(index))["Body"].read()
        return data if self.mode == "bytes" else (decode_jpeg(data), label_of(index))


def per_object_loader(count: int, endpoint_url: str, mode: str) -> DataLoader:
    dataset = PerObjectDataset(count, endpoint_url, mode)
    generator = torch.Generator().manual_seed(0)
    return DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=NUM_WORKERS,
                      collate_fn=_collate(mode), generator=generator)


def _skylift_decode(mode: str) -> Callable[[dict[str, bytes]], Any]:
    if mode == "bytes":
        return lambda sample: sample["jpg"]
    return lambda sample: (decode_jpeg(sample["jpg"]), int(sample["cls"]))


def skylift_loader(shards_url: str, endpoint_url: str, mode: str, cache_dir: str) -> DataLoader:
    from skylift.data.streaming import StreamingDataset

    dataset = StreamingDataset(
        shards_url, decode=_skylift_decode(mode), global_batch_size=BATCH_SIZE, cache_dir=cache_dir,
        cache_limit_bytes=8 * 2**30, collate=_collate(mode), endpoint_url=endpoint_url,
    )
    return DataLoader(dataset, batch_size=None, num_workers=NUM_WORKERS)


class _WdsS3Opener:
    """``gopen`` handler for ``s3://bucket/key``: a streamed GetObject body (no HEAD first)."""

    def __init__(self, endpoint_url: str) -> None:
        self.boto = _Boto3(endpoint_url)

    def __call__(self, url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        bucket, _, key = url.removeprefix("s3://").partition("/")
        return self.boto.client().get_object(Bucket=bucket, Key=key)["Body"]


def webdataset_loader(shard_urls: list[str], endpoint_url: str, mode: str) -> Any:
    import importlib

    import webdataset as wds

    # ``webdataset.gopen`` the attribute is the function; the dispatch table lives in the module.
    importlib.import_module("webdataset.gopen").gopen_schemes["s3"] = _WdsS3Opener(endpoint_url)  # inherited by forked workers
    if mode == "bytes":
        pipeline = wds.WebDataset(shard_urls, shardshuffle=len(shard_urls), seed=0, empty_check=False)
        pipeline = pipeline.shuffle(WDS_SHUFFLE_BUFFER).map(lambda sample: sample["jpg"])
        pipeline = pipeline.batched(BATCH_SIZE, collation_fn=list, partial=True)
    else:
        pipeline = wds.WebDataset(shard_urls, shardshuffle=len(shard_urls), seed=0, empty_check=False)
        pipeline = pipeline.shuffle(WDS_SHUFFLE_BUFFER)
        pipeline = pipeline.map(lambda sample: (decode_jpeg(sample["jpg"]), int(sample["cls"])))
        pipeline = pipeline.batched(BATCH_SIZE, collation_fn=default_collate, partial=True)
    return wds.WebLoader(pipeline, batch_size=None, num_workers=NUM_WORKERS)


def drain(loader: Iterable[Any], meter: CpuMeter, started: float, limit_samples: int | None = None) -> dict[str, Any]:
    """Iterate ``loader`` (made at ``started``, a ``time.perf_counter()`` stamp).

    ``samples_per_s`` counts the whole pass from the loader's creation, so worker start
    and the fetches before the first batch, which a trainer waits for too, are in it;
    ``steady_samples_per_s`` counts only after the first batch, where a loader that
    fetches much before its first batch looks faster. Stops after ``limit_samples``
    samples past the first batch when given; ``meter`` spans the whole pass.
    """
    delivered, delivered_bytes, steady_samples, steady_bytes = 0, 0, 0, 0
    first_batch_at: float | None = None
    for batch in loader:
        samples, payload_bytes = batch_size_and_bytes(batch)
        delivered += samples
        delivered_bytes += payload_bytes
        if first_batch_at is None:
            first_batch_at = time.perf_counter()
            continue
        steady_samples += samples
        steady_bytes += payload_bytes
        if limit_samples is not None and steady_samples >= limit_samples:
            break
    ended = time.perf_counter()
    shares = meter.shares()
    assert first_batch_at is not None, "the loader delivered nothing"
    return pass_figures(started, first_batch_at, ended, (delivered, delivered_bytes), (steady_samples, steady_bytes)) | {
        f"{name}_cpu_share": share for name, share in shares.items()
    }


def pass_figures(
    started: float, first_batch_at: float, ended: float, delivered: tuple[int, int], steady: tuple[int, int]
) -> dict[str, Any]:
    """Rates of one pass: (samples, payload bytes) delivered in all and after the first batch."""
    wall_s, steady_s = ended - started, ended - first_batch_at
    return {
        "samples_per_s": round(delivered[0] / wall_s, 2),
        "mb_per_s": round(delivered[1] / wall_s / 1e6, 2),
        "steady_samples_per_s": round(steady[0] / steady_s, 2),
        "steady_mb_per_s": round(steady[1] / steady_s / 1e6, 2),
        "delivered_samples": delivered[0],
        "wall_s": round(wall_s, 3),
        "first_batch_s": round(first_batch_at - started, 3),
    }


class FreshDir:
    """An empty temporary folder per measurement, so no contender reads a warm cache."""

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="skylift-bench-")
        return self.path

    def __exit__(self, *exc_info: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
