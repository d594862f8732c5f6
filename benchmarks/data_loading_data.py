"""The data-loading benchmark's dataset: deterministic ~100 KB JPEGs, uploaded three ways.

* ``objects/000123.jpg``: one object per sample, for the per-object baseline;
* ``shards/``: skylift's tar shards (``ShardWriter``), which WebDataset reads as they are;
* ``mds/``: MosaicML Streaming's MDS shards, written by its ``MDSWriter`` in its own venv.

The JPEGs are generated once (PIL, seeded) and cached under ``benchmarks/.cache``.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from skylift.data.shards import ShardIndex, ShardWriter
from skylift.storage.s3 import S3Store

__all__ = ["BUCKET", "IMAGE_SIDE", "NUM_CLASSES", "SHARD_SIZE_BYTES", "generate_images", "label_of",
           "object_key", "upload_dataset"]

BUCKET = "skylift-bench"
IMAGE_SIDE = 256
NUM_CLASSES = 10
# Quality 98 over sine textures plus strong noise lands near 100 KB at 256 x 256
# (a typical ImageNet JPEG is ~110 KB): small objects are what makes per-object GETs slow.
JPEG_QUALITY = 98
NOISE_SIGMA = 72.0
# 16 MiB shards: ~32 shards for 5,000 images, so each of 2 workers has many to pipeline.
SHARD_SIZE_BYTES = 16 * 2**20
CACHE_DIR = Path(__file__).parent / ".cache"


def label_of(index: int) -> int:
    return index % NUM_CLASSES


def object_key(index: int) -> str:
    return f"objects/{index:06d}.jpg"


def _image(index: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:IMAGE_SIDE, 0:IMAGE_SIDE] / IMAGE_SIDE
    frequency, phase = rng.uniform(2, 12, size=3), rng.uniform(0, 2 * np.pi, size=3)
    channels = [
        127 + 100 * np.sin(2 * np.pi * frequency[c] * (x * np.cos(phase[c]) + y * np.sin(phase[c])) + phase[c])
        for c in range(3)
    ]
    pixels = np.stack(channels, -1) + rng.normal(0, NOISE_SIGMA, size=(IMAGE_SIDE, IMAGE_SIDE, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def generate_images(count: int) -> Path:
    """A folder holding ``000000.jpg`` ... for ``count`` images (made once, then reused)."""
    folder = CACHE_DIR / f"jpegs-{IMAGE_SIDE}-q{JPEG_QUALITY}"
    folder.mkdir(parents=True, exist_ok=True)
    missing = [index for index in range(count) if not (folder / f"{index:06d}.jpg").is_file()]

    def write(index: int) -> None:
        temporary = folder / f".{index:06d}.tmp"
        temporary.write_bytes(_image(index))
        temporary.replace(folder / f"{index:06d}.jpg")

    with ThreadPoolExecutor(2) as pool:  # PIL and numpy release the GIL while encoding
        list(pool.map(write, missing))
    return folder


def read_images(folder: Path, count: int) -> list[bytes]:
    return [(folder / f"{index:06d}.jpg").read_bytes() for index in range(count)]


def upload_dataset(images: list[bytes], endpoint_url: str) -> ShardIndex:
    """Create the bucket and write the per-object copy and the skylift shards."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint_url)
    client.create_bucket(Bucket=BUCKET)

    def put(index: int) -> None:
        client.put_object(Bucket=BUCKET, Key=object_key(index), Body=images[index])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(len(images))))
    writer = ShardWriter(S3Store(f"s3://{BUCKET}/shards", endpoint_url=endpoint_url), shard_size_bytes=SHARD_SIZE_BYTES)
    for index, data in enumerate(images):
        writer.add({"jpg": data, "cls": str(label_of(index)).encode()})
    return writer.close(metadata={"classes": [str(label) for label in range(NUM_CLASSES)]})
