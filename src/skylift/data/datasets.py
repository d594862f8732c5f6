"""Datasets that need no download: scikit-learn's digits and synthetic images."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from skylift.errors import SkyliftConfigError

__all__ = ["DatasetSplit", "digits", "stratified_split", "synthetic_images"]


@dataclass(frozen=True)
class DatasetSplit:
    """Training and validation sets plus what a model needs to know about them."""

    train: Dataset
    val: Dataset | None
    num_classes: int
    in_channels: int


def digits(val_fraction: float, seed: int) -> DatasetSplit:
    """The 1,797 real 8x8 handwritten digits that ship inside scikit-learn.

    Read straight from the package's data file: importing scikit-learn itself would
    add 1.5-2 s to every worker's start. Pixels (0..16) are scaled to [0, 1]; the
    split is stratified and seeded, so it is the same on every rank and every run.
    """
    table = torch.from_numpy(np.loadtxt(_digits_file(), delimiter=",", dtype=np.float32))
    images = (table[:, :-1] / 16.0).reshape(-1, 1, 8, 8)
    labels = table[:, -1].long()
    train_index, val_index = stratified_split(labels, val_fraction, seed)
    return DatasetSplit(
        train=TensorDataset(images[train_index], labels[train_index]),
        val=TensorDataset(images[val_index], labels[val_index]),
        num_classes=10,
        in_channels=1,
    )


def stratified_split(labels: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded split that keeps each class's share in both parts (sorted indices)."""
    generator = torch.Generator().manual_seed(seed)
    train_parts, val_parts = [], []
    for label in labels.unique(sorted=True):
        members = torch.nonzero(labels == label).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        num_val = round(len(members) * val_fraction)
        val_parts.append(members[:num_val])
        train_parts.append(members[num_val:])
    return torch.cat(train_parts).sort().values, torch.cat(val_parts).sort().values


def _digits_file() -> str:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SkyliftConfigError(
            "recipe.dataset: digits needs scikit-learn, which ships the data; install it with: pip install scikit-learn"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise SkyliftConfigError(f"recipe.dataset: digits: {path} is missing; reinstall scikit-learn")
    return str(path)


def synthetic_images(num_samples: int, image_size: int, num_classes: int, seed: int) -> DatasetSplit:
    """Random normal images with random labels, generated in memory (benchmarks)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
    return DatasetSplit(train=TensorDataset(images, labels), val=None, num_classes=num_classes, in_channels=3)
