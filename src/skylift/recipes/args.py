"""The settings (``recipe.args``) of the built-in recipes, and how any recipe's are checked.

Torch-free, so ``skylift check`` and ``skylift submit --dry-run`` can refuse a bad
built-in recipe arg without importing the recipe (and with it torch and torchvision).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from skylift.config.describe import describe_errors
from skylift.errors import SkyliftConfigError

__all__ = ["BUILTIN_RECIPE_ARGS", "ImageClassificationArgs", "check_builtin_recipe_args", "validate_recipe_args"]


class ImageClassificationArgs(BaseModel):
    """``recipe.args`` of ``image_classification``."""

    model_config = ConfigDict(extra="forbid")

    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Cross-entropy label smoothing (the torchvision and NVIDIA ResNet recipes: 0.1)."""
    crop_size: int | None = Field(default=None, ge=8)
    """Training and evaluation crop in pixels; default ``data.image_size``."""
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

    @model_validator(mode="after")
    def _scale_ordered(self) -> ImageClassificationArgs:
        low, high = self.crop_scale
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1 (got {self.crop_scale})")
        return self


BUILTIN_RECIPE_ARGS: dict[str, tuple[str, type[BaseModel] | None]] = {
    "image_classification": ("ImageClassification", ImageClassificationArgs),
    "text_classification": ("TextClassification", None),
}
"""Built-in recipe name -> (its class's name, its ``Args`` model); the classes' own
``Args`` attributes are these models (a test holds them equal)."""


def validate_recipe_args(recipe_name: str, args_model: type[BaseModel] | None, given: dict[str, Any]) -> Any:
    """``given`` (the ``recipe.args`` mapping) as an ``args_model`` instance, or ``None``.

    Raises:
        SkyliftConfigError: naming each bad key under ``recipe.args`` and the closest valid one.
    """
    if args_model is None:
        if given:
            raise SkyliftConfigError(f"recipe.args: {recipe_name} takes no args (got {sorted(given)})",
                                     hint=f"Remove recipe.args, or give {recipe_name} an Args pydantic model")
        return None
    try:
        return args_model.model_validate(given)
    except ValidationError as error:
        raise SkyliftConfigError(describe_errors(error, args_model, ("recipe", "args")),
                                 hint=f"Fix recipe.args; {recipe_name}.Args defines them") from None


def check_builtin_recipe_args(config: Any) -> None:
    """Validate ``recipe.args`` of a built-in recipe (a recipe of the user's is left to
    :func:`skylift.recipes.check_recipe_args`, which imports it)."""
    if config.recipe.name in BUILTIN_RECIPE_ARGS:
        class_name, args_model = BUILTIN_RECIPE_ARGS[config.recipe.name]
        validate_recipe_args(class_name, args_model, config.recipe.args)
