"""Datasets that need no download: scikit-learn's digits and synthetic images."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, TensorDataset

__all__ = ["DatasetSplit", "digits", "synthetic_images"]


@dataclass(frozen=True)
class DatasetSplit:
    """Training and validation sets plus what a model needs to know about them."""

    train: Dataset
    val: Dataset | None
    num_classes: int
    in_channels: int


def digits(val_fraction: float, seed: int) -> DatasetSplit:
    """The 1,797 real 8x8 handwritten digits that ship inside scikit-learn.

    Pixels (0..16) are scaled to [0, 1]; the split is stratified and seeded, so it is
    the same on every rank and every run.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    train_index, val_index = train_test_split(
        list(range(len(labels))), test_size=val_fraction, random_state=seed, stratify=bunch.target
    )
    return DatasetSplit(
        train=TensorDataset(images[train_index], labels[train_index]),
        val=TensorDataset(images[val_index], labels[val_index]),
        num_classes=10,
        in_channels=1,
    )


def synthetic_images(num_samples: int, image_size: int, num_classes: int, seed: int) -> DatasetSplit:
    """Random normal images with random labels, generated in memory (benchmarks)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
    return DatasetSplit(train=TensorDataset(images, labels), val=None, num_classes=num_classes, in_channels=3)
