"""Inputs ``skylift shard`` converts: an image folder (local or in an object store), scikit-learn's
digits; JSONL/CSV text rows are read by :mod:`skylift.data.text_rows`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from skylift.data.codecs import encode_array
from skylift.errors import SkyliftConfigError

__all__ = ["describe_source", "digits_samples"]


def digits_samples(split: str, val_fraction: float = 0.2, seed: int = 0) -> Iterator[dict[str, bytes]]:
    """The digits split the quickstart uses, as ``npy`` (1x8x8 float32) + ``cls`` samples."""
    from skylift.data.datasets import digits

    data = digits(val_fraction, seed)
    dataset = data.train if split == "train" else data.val
    images, labels = dataset.tensors  # type: ignore[union-attr]
    for image, label in zip(images, labels, strict=True):
        yield {"npy": encode_array(image.numpy().astype(np.float32)), "cls": str(int(label)).encode()}


def describe_source(source: str) -> str:
    """``digits``, ``image_folder`` (a local folder or an object-store URL) or ``text``."""
    path = Path(source)
    if source == "digits":
        return "digits"
    if "://" in source and not source.startswith("file://"):
        if source.rstrip("/").endswith((".jsonl", ".json", ".csv")):
            raise SkyliftConfigError(f"shard source {source}: a text file is read from a local path; copy it here")
        return "image_folder"  # s3://, oss://, cos://: open_image_folder checks the scheme and the layout
    if source.startswith("file://") or path.is_dir():
        return "image_folder"
    if path.is_file() and path.suffix in (".jsonl", ".json", ".csv"):
        return "text"
    raise SkyliftConfigError(
        f"shard source {source!r} is not 'digits', an image folder (<class>/<image>) in a local folder or at an "
        "s3://, oss://, cos:// URL, or a .jsonl/.csv file"
    )
