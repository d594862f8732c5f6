"""Rows of a JSONL or CSV text file, and their labels numbered the same way everywhere.

Torch-free: ``skylift shard`` (which converts the file) and the text recipe (which
reads it) both number labels here, so a sharded file and the file itself agree.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from skylift.errors import SkyliftConfigError

__all__ = ["number_labels", "text_classes", "text_samples"]


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
    labels, rows = [], 0
    for sample in text_samples(path):
        rows += 1
        row = json.loads(sample["json"])
        labels.append(row.get("label") if isinstance(row, dict) else None)
    if not labels or any(label is None for label in labels):
        return rows, []
    return rows, number_labels(labels)[1]


def number_labels(raw_labels: Sequence[Any]) -> tuple[list[int], list[str]]:
    """Label indices and class names: integer labels as they are (classes "0".."max"),
    any others sorted and numbered, so the mapping is the same on every rank and run."""
    if all(_is_int(label) for label in raw_labels):
        labels = [int(label) for label in raw_labels]
        return labels, [str(number) for number in range(max(labels) + 1)]
    classes = sorted({str(label) for label in raw_labels})
    number = {name: index for index, name in enumerate(classes)}
    return [number[str(label)] for label in raw_labels], classes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit())
