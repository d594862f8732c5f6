"""Inputs ``skylift shard`` converts: an image folder, JSONL/CSV text, scikit-learn's digits."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from skylift.data.codecs import encode_array
from skylift.errors import SkyliftConfigError

__all__ = ["IMAGE_SUFFIXES", "describe_source", "digits_samples", "image_folder_samples", "text_samples"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


def image_folder_samples(root: Path) -> tuple[list[str], Iterator[dict[str, bytes]]]:
    """Class names and samples of a ``root/<class>/<image>`` folder (sorted, deterministic)."""
    classes = sorted(path.name for path in root.iterdir() if path.is_dir())
    if not classes:
        raise SkyliftConfigError(f"{root} has no class subfolders; the layout is {root}/<class name>/<image files>")

    def samples() -> Iterator[dict[str, bytes]]:
        for label, name in enumerate(classes):
            for path in sorted((root / name).iterdir()):
                if path.suffix.lower() not in IMAGE_SUFFIXES:
                    continue
                try:
                    data = path.read_bytes()
                except OSError as error:
                    raise SkyliftConfigError(f"cannot read {path}: {error.strerror}") from None
                yield {path.suffix.lower().lstrip(".").replace("jpeg", "jpg"): data, "cls": str(label).encode()}

    return classes, samples()


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


def digits_samples(split: str, val_fraction: float = 0.2, seed: int = 0) -> Iterator[dict[str, bytes]]:
    """The digits split the quickstart uses, as ``npy`` (1x8x8 float32) + ``cls`` samples."""
    from skylift.data.datasets import digits

    data = digits(val_fraction, seed)
    dataset = data.train if split == "train" else data.val
    images, labels = dataset.tensors  # type: ignore[union-attr]
    for image, label in zip(images, labels, strict=True):
        yield {"npy": encode_array(image.numpy().astype(np.float32)), "cls": str(int(label)).encode()}


def describe_source(source: str) -> str:
    path = Path(source)
    if source == "digits":
        return "digits"
    if path.is_dir():
        return "image_folder"
    if path.is_file() and path.suffix in (".jsonl", ".json", ".csv"):
        return "text"
    raise SkyliftConfigError(
        f"shard source {source!r} is not 'digits', an image folder (<class>/<image>), or a .jsonl/.csv file"
    )
