"""The settings (``recipe.args``) of the built-in recipes, and how any recipe's are checked.

Torch-free, so ``skylift check`` and ``skylift submit --dry-run`` can refuse a bad
built-in recipe arg without importing the recipe (and with it torch and torchvision).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from skylift.config.describe import describe_errors
from skylift.errors import SkyliftConfigError

__all__ = [
    "BUILTIN_RECIPE_ARGS",
    "TINY_LLAMA",
    "CausalLMArgs",
    "ImageClassificationArgs",
    "check_builtin_recipe_args",
    "check_causal_lm_config",
    "validate_recipe_args",
]

TINY_LLAMA = "builtin:tiny-llama"
"""``recipe.args.model_path`` of the built-in tiny Llama (:mod:`skylift.recipes.tiny_lm`)."""


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


class CausalLMArgs(BaseModel):
    """``recipe.args`` of ``causal_lm``."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    """The model and tokenizer: a local Hugging Face folder that ``save_pretrained`` wrote
    (``config.json``, safetensors weights, tokenizer files) for ``AutoModelForCausalLM``
    and ``AutoTokenizer``, read offline and never downloaded; or ``builtin:tiny-llama``,
    a 2-layer Llama of 0.15 M parameters initialised from the run's seed, with a
    byte-level BPE tokenizer trained on skylift's generated corpus (the CPU preset's
    model: it trains from scratch, in seconds)."""
    train_path: str = Field(min_length=1)
    """The training documents: a JSONL file whose rows hold ``text`` (every token
    learned) or ``prompt`` and ``completion`` (only the completion's tokens learned)."""
    val_path: str | None = None
    """Validation documents in the same form; ``null`` holds out ``data.val_fraction`` of
    the training documents (a seeded draw)."""
    sequence_length: int = Field(default=2048, ge=8, le=1_048_576)
    """Tokens per training sequence: the length of each packed block, or, unpacked, the
    longest document kept (longer ones are cut there; the run logs how many)."""
    packing: bool = True
    """Concatenate the documents and cut them into blocks of ``sequence_length`` (no
    padding; attention crosses document boundaries inside a block). ``false``: one
    document per sequence, padded per batch; needed with ``data.batching: token_budget``."""
    mask_prompt: bool = True
    """Leave a ``prompt``'s tokens out of the loss (labels -100), so only the completion is
    learned; ``false`` learns the prompt too."""


BUILTIN_RECIPE_ARGS: dict[str, tuple[str, type[BaseModel] | None]] = {
    "image_classification": ("ImageClassification", ImageClassificationArgs),
    "text_classification": ("TextClassification", None),
    "causal_lm": ("CausalLM", CausalLMArgs),
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
        args = validate_recipe_args(class_name, args_model, config.recipe.args)
        if config.recipe.name == "causal_lm":
            check_causal_lm_config(config, args)


def check_causal_lm_config(config: Any, args: CausalLMArgs) -> None:
    """What ``causal_lm`` needs of the rest of the config (raises SkyliftConfigError)."""
    data = config.data
    if data.url or data.val_url:
        raise SkyliftConfigError("data.url: causal_lm reads JSONL files (recipe.args.train_path, val_path), not "
                                 "streamed shards", hint="Remove data.url and data.val_url")  # fmt: skip
    if data.batching == "token_budget" and args.packing:
        raise SkyliftConfigError(
            "recipe.args.packing: packed blocks all hold recipe.args.sequence_length tokens, so data.batching: "
            "token_budget has nothing to sort", hint="Set recipe.args.packing: false, or data.batching: fixed")
    if data.batching == "token_budget" and args.sequence_length > data.max_tokens:
        raise SkyliftConfigError(
            f"recipe.args.sequence_length ({args.sequence_length}) exceeds data.max_tokens ({data.max_tokens}): "
            "the longest document would not fit a micro-batch", hint="Raise data.max_tokens or lower sequence_length")
