"""Image classification: a small CNN on digits, torchvision ResNets on encoded photos."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from skylift.config.schema import RunConfig
from skylift.data import datasets
from skylift.data.datasets import DatasetSplit
from skylift.data.images import DeviceDecoder, EncodedBatch, ImageDecoder, ImageTransformSpec, RawJpeg, encoded_collate
from skylift.recipes.base import Recipe, classification_sums
from skylift.recipes.settings.image_classification import ImageClassificationSettings

__all__ = ["ImageClassification", "SmallCNN", "build_model"]


def build_model(name: str, model_args: dict[str, Any], num_classes: int | None, *, in_channels: int = 3) -> nn.Module:
    """``recipe.model`` as a module: a torchvision classification model (random weights) or
    the user's callable by import path, called with ``recipe.model_args`` and ``num_classes``."""
    from skylift.config.schema import is_import_path

    if is_import_path(name):
        from skylift.recipes.loading import load_object

        factory = load_object(name, field="recipe.model")
        kwargs = {**model_args, **({"num_classes": num_classes} if num_classes is not None else {})}
        model = factory(**kwargs)
        if not isinstance(model, nn.Module):
            raise TypeError(f"recipe.model: {name} returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    import torchvision

    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **model_args)
    if in_channels != 3:
        _first_conv_for(model, in_channels)
    return model


def _first_conv_for(model: nn.Module, in_channels: int) -> None:
    """Replace the first convolution so the net takes ``in_channels`` (digits are grey)."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                # torch types the attributes wider than the 2-D values a Conv2d holds.
                kernel, stride = cast(tuple[int, int], child.kernel_size), cast(tuple[int, int], child.stride)
                padding = cast("str | tuple[int, int]", child.padding)
                setattr(parent, name, nn.Conv2d(in_channels, child.out_channels, kernel, stride, padding,
                                                bias=child.bias is not None))
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
    """Cross-entropy classification (optionally label-smoothed); reports validation loss
    and accuracy. Encoded images (``shapes``, or shards with ``jpg``/``png`` fields) are
    decoded and augmented in the DataLoader workers by torchvision v2 transforms:
    RandomResizedCrop + flip for training, Resize + CenterCrop for evaluation."""

    Settings = ImageClassificationSettings

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.settings: ImageClassificationSettings
        self._device_decoders: dict[bool, DeviceDecoder] = {}

    def transforms(self) -> ImageTransformSpec:
        settings = self.settings
        crop = settings.crop_size or settings.image_size
        return ImageTransformSpec(crop_size=crop, resize_size=settings.resize_size or round(crop / 0.875),
                                  scale=settings.crop_scale, hflip=settings.hflip)

    def decoder(self, fields: list[str]) -> Any:
        """(image as float CHW, label) from an ``npy`` (float) or encoded image plus ``cls``."""
        return self._decoder(fields, train=True)

    def eval_decoder(self, fields: list[str]) -> Any:
        return self._decoder(fields, train=False)

    def _decoder(self, fields: list[str], train: bool) -> Any:
        from skylift.data.codecs import decode_field

        image_field = next((name for name in fields if name != "cls"), None)
        if image_field is None or "cls" not in fields:
            raise ValueError(f"image classification needs an image field and 'cls'; the shards have {fields}")
        if image_field == "npy":
            return lambda sample: (decode_field("npy", sample["npy"]), decode_field("cls", sample["cls"]))
        image = self._worker_decoder(train)
        return lambda sample: (image(sample[image_field]), decode_field("cls", sample["cls"]))

    def _worker_decoder(self, train: bool) -> ImageDecoder | RawJpeg:
        return RawJpeg(train) if self.settings.decode_on == "device" else ImageDecoder(self.transforms(), train)

    def collate(self, train: bool) -> Any:
        return encoded_collate if self.settings.decode_on == "device" else None

    def _on_device(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(batch, EncodedBatch):
            return batch
        train = model.training
        if self._device_decoders.get(train) is None:
            self._device_decoders[train] = DeviceDecoder(self.transforms(), train, self.config.channels_last)
        return self._device_decoders[train](batch, next(model.parameters()).device)

    def batch_size(self, batch: Any) -> int:
        return len(batch) if isinstance(batch, EncodedBatch) else super().batch_size(batch)

    def build_datasets(self) -> DatasetSplit:
        settings, data = self.settings, self.config.data
        if settings.dataset == "digits":
            return datasets.digits(data.val_fraction, self.config.seed)
        if settings.dataset == "shapes":
            return self._shapes()
        num_classes = settings.num_classes or 10
        return datasets.synthetic_images(settings.num_samples, settings.image_size, num_classes, self.config.seed)

    def _shapes(self) -> DatasetSplit:
        from skylift.data.images import SHAPE_CLASSES, EncodedImages, shapes

        images, labels = shapes(self.settings.num_samples, self.config.seed)
        train_index, val_index = datasets.stratified_split(torch.tensor(labels), self.config.data.val_fraction,
                                                            self.config.seed)
        def part(indices: torch.Tensor, train: bool) -> EncodedImages:
            chosen = indices.tolist()
            return EncodedImages([images[i] for i in chosen], [labels[i] for i in chosen],
                                 self._worker_decoder(train), self.config.seed)

        return DatasetSplit(train=part(train_index, True), val=part(val_index, False),
                            num_classes=len(SHAPE_CLASSES), in_channels=3)

    def build_model(self, data: DatasetSplit) -> nn.Module:
        settings = self.settings
        num_classes = settings.num_classes or data.num_classes
        if settings.model == "small_cnn":
            return SmallCNN(data.in_channels, num_classes, settings.width)
        return build_model(settings.model, settings.model_args, num_classes, in_channels=data.in_channels)

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels = self._on_device(model, batch)
        return F.cross_entropy(model(images), labels, label_smoothing=self.settings.label_smoothing)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        images, labels = self._on_device(model, batch)
        return classification_sums(model(images), labels)
