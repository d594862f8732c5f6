"""A recipe of your own: a small MLP on 8x8 digits, trained by ``skylift run``.

``recipe.name: ./tasks.py:DigitsMLP`` in ``own_recipe.yaml`` names this class; its
``Settings`` validates the keys beside it (``recipe.hidden``, ``recipe.layers``). skylift brings the rest: DDP, precision,
accumulation, streaming from shards (``data.url``, through :meth:`decoder`),
checkpoints with exact resume, spot notices, monitoring and the report.

    skylift run examples/own_recipe/own_recipe.yaml --nproc 2
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from skylift.data.datasets import DatasetSplit, digits
from skylift.recipes import Recipe, RecipeSettings
from skylift.recipes.base import classification_sums


class DigitsMLP(Recipe):
    """Cross-entropy over the 10 digit classes; validation loss and accuracy."""

    class Settings(RecipeSettings):
        """Refuses an unknown key with the closest valid one, as skylift's sections do."""

        hidden: int = Field(default=64, ge=8)
        """Width of the hidden layers."""

        layers: int = Field(default=2, ge=1, le=8)
        """Hidden layers."""

    def build_datasets(self) -> DatasetSplit:
        return digits(self.config.data.val_fraction, self.config.seed)

    def build_model(self, data: DatasetSplit) -> nn.Module:
        width, blocks = self.settings.hidden, []
        for index in range(self.settings.layers):
            blocks += [nn.Linear(64 if index == 0 else width, width), nn.ReLU()]
        return nn.Sequential(nn.Flatten(), *blocks, nn.Linear(width, data.num_classes))

    def decoder(self, fields: list[str]) -> Any:
        """Streamed samples as ``skylift shard digits`` writes them: ``npy`` image, ``cls`` label."""
        from skylift.data.codecs import decode_field

        def decode(sample: dict[str, bytes]) -> tuple[torch.Tensor, int]:
            return decode_field("npy", sample["npy"]), decode_field("cls", sample["cls"])

        return decode

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        images, labels = batch
        return classification_sums(model(images), labels)  # summed loss, correct, count: exact across ranks
