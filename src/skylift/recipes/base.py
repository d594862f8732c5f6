"""What a recipe gives the Trainer: a model, data, a loss and evaluation sums."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from skylift.data.datasets import DatasetSplit

__all__ = ["Recipe"]


class Recipe:
    """Subclass and implement the four methods; the Trainer does the rest.

    Evaluation returns *sums* per batch (``{"loss_sum": ..., "correct": ...,
    "count": ...}``) rather than means, so the Trainer can add them across batches and
    ranks with one all-reduce and get exact metrics however the data was sharded.
    """

    def build_datasets(self) -> DatasetSplit:
        raise NotImplementedError

    def build_model(self, data: DatasetSplit) -> nn.Module:
        raise NotImplementedError

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss over the micro-batch."""
        raise NotImplementedError

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Turn summed evaluation counts into the reported metrics."""
        count = max(sums.get("count", 0.0), 1.0)
        return {key.removesuffix("_sum"): value / count for key, value in sums.items() if key != "count"}

    def collate(self, train: bool) -> Any:
        """How the loader joins samples into a batch (``train``: the training loader);
        ``None``: PyTorch's default, which stacks equal-shaped tensors."""
        return None

    def decoder(self, fields: list[str]) -> Any:
        """How to turn a streamed sample (field -> bytes) into what ``training_loss`` takes."""
        raise NotImplementedError(f"{type(self).__name__} cannot read sharded datasets")

    def batch_size(self, batch: Any) -> int:
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()))
        return int(first.shape[0])
