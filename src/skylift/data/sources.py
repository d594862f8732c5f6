"""Inputs ``skylift shard`` converts: an image folder (local or in an object store), JSONL/CSV text,
scikit-learn's digits."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from skylift.data.codecs import encode_array
from skylift.errors import SkyliftConfigError

__all__ = ["IMAGE_SUFFIXES", "describe_source", "digits_samples", "image_folder_samples", "text_classes",
           "text_samples"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


def image_folder_samples(root: Path) -> tuple[list[str], Iterator[dict[str, bytes]]]:
    """Class names and samples of a local ``root/<class>/<image>`` folder (sorted, deterministic).

    Object stores too: :func:`skylift.data.image_sources.open_image_folder`.
    """
    from skylift.data.image_sources import open_image_folder

    folder = open_image_folder(str(root))
    return folder.classes, folder.samples()


def text_samples(path: Path) -> Iterator[dict[str, bytes]]:
    """One ``json`` field per JSONL line or CSV row; a bad line fails naming file and line."""
    if path.suffix == ".csv":
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                yield {"json": json.dumps(row, sort_keys=True).encode()}
        return
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                raise SkyliftConfigError(f"{path}:{number} is not valid JSON: {error.msg}") from None
            yield {"json": line.strip().encode()}


def text_classes(path: Path) -> tuple[int, list[str]]:
    """Rows of a JSONL/CSV file and the class names of its ``label`` field, numbered as
    the text recipe numbers them (integers as they are, else names sorted); no classes
    when some row has no label (a file of other fields shards as it is)."""
    import json

    labels, rows = [], 0
    for sample in text_samples(path):
        rows += 1
        row = json.loads(sample["json"])
        labels.append(row.get("label") if isinstance(row, dict) else None)
    if not labels or any(label is None for label in labels):
        return rows, []
    from skylift.data.text import number_labels

    return rows, number_labels(labels)[1]


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
