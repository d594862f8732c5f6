"""Turn a sample's fields (name -> bytes) into tensors, by field extension. Never unpickles."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["decode_field", "encode_array", "tuple_decoder"]

_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp")


def decode_field(name: str, data: bytes) -> Any:
    extension = name.rsplit(".", 1)[-1].lower()
    if extension == "npy":
        return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
    if extension in ("cls", "idx"):
        return int(data)
    if extension in _IMAGE_EXTENSIONS:
        from torchvision.io import ImageReadMode, decode_image

        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    if extension == "json":
        return json.loads(data)
    if extension == "txt":
        return data.decode()
    return data


def tuple_decoder(*fields: str) -> Callable[[dict[str, bytes]], tuple[Any, ...]]:
    """A decoder returning the named fields in order, e.g. ``tuple_decoder("npy", "cls")``."""

    def decode(sample: dict[str, bytes]) -> tuple[Any, ...]:
        missing = [name for name in fields if name not in sample]
        if missing:
            raise KeyError(f"sample has no field {missing[0]!r}; it has {sorted(sample)}")
        return tuple(decode_field(name, sample[name]) for name in fields)

    return decode


def encode_array(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()
