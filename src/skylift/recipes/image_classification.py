"""Image classification: small CNN on digits, or torchvision ResNets."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skylift.config.schema import RunConfig
from skylift.data import datasets
from skylift.data.datasets import DatasetSplit
from skylift.recipes.base import Recipe, classification_sums

__all__ = ["ImageClassification", "SmallCNN", "build_model"]


def build_model(spec: Any, num_classes: int | None, *, in_channels: int = 3) -> nn.Module:
    """``model.name`` as a module: a torchvision classification model (random weights) or
    the user's callable by import path, called with ``model.args`` and ``num_classes``."""
    from skylift.config.schema import is_import_path

    if is_import_path(spec.name):
        from skylift.recipes.loading import load_object

        factory = load_object(spec.name, field="model.name")
        kwargs = {**spec.args, **({"num_classes": num_classes} if num_classes is not None else {})}
        model = factory(**kwargs)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model.name: {spec.name} returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    import torchvision

    model = torchvision.models.get_model(spec.name, weights=None, num_classes=num_classes, **spec.args)
    if in_channels != 3:
        _first_conv_for(model, in_channels)
    return model


def _first_conv_for(model: nn.Module, in_channels: int) -> None:
    """Replace the first convolution so the net takes ``in_channels`` (digits are grey)."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, name, nn.Conv2d(in_channels, child.out_channels, child.kernel_size, child.stride,
                                                child.padding, bias=child.bias is not None))
                return


class SmallCNN(nn.Module):
    """Three 3x3 convolutions, global pooling and a linear head.

    GroupNorm instead of BatchNorm: its output does not depend on how the global
    batch is split into micro-batches or ranks, so accumulation and DDP reproduce a
    single large batch exactly.
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU())

        self.features = nn.Sequential(
            block(in_channels, width), block(width, 2 * width), nn.MaxPool2d(2), block(2 * width, 2 * width)
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (N, C, H, W) -> (N, classes)
        return self.head(self.features(images).mean(dim=(2, 3)))


class ImageClassification(Recipe):
    """Cross-entropy classification; reports validation loss and accuracy."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def decoder(self, fields: list[str]) -> Any:
        """(image as float CHW, label) from an ``npy`` (float) or encoded image plus ``cls``."""
        from skylift.data.codecs import decode_field

        image_field = next((name for name in fields if name != "cls"), None)
        if image_field is None or "cls" not in fields:
            raise ValueError(f"image classification needs an image field and 'cls'; the shards have {fields}")

        def decode(sample: dict[str, bytes]) -> tuple[torch.Tensor, int]:
            image = decode_field(image_field, sample[image_field])
            if image.dtype == torch.uint8:
                image = image.float() / 255.0
            return image, decode_field("cls", sample["cls"])

        return decode

    def build_datasets(self) -> DatasetSplit:
        data = self.config.data
        if data.dataset == "digits":
            return datasets.digits(data.val_fraction, self.config.seed)
        num_classes = self.config.model.num_classes or 10
        return datasets.synthetic_images(data.num_samples, data.image_size, num_classes, self.config.seed)

    def build_model(self, data: DatasetSplit) -> nn.Module:
        spec = self.config.model
        num_classes = spec.num_classes or data.num_classes
        if spec.name == "small_cnn":
            return SmallCNN(data.in_channels, num_classes, spec.width)
        return build_model(spec, num_classes, in_channels=data.in_channels)

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        images, labels = batch
        return classification_sums(model(images), labels)
