"""Recipes: tasks that tie a model, data and a loss to the Trainer.

Looked up by ``recipe.name``; each is imported only when used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig
    from skylift.recipes.base import Recipe

__all__ = ["RECIPES", "build_recipe"]

RECIPES: dict[str, str] = {
    "image_classification": "skylift.recipes.image_classification:ImageClassification",
    "text_classification": "skylift.recipes.text_classification:TextClassification",
}


def build_recipe(config: RunConfig) -> Recipe:
    module_name, _, class_name = RECIPES[config.recipe.name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)(config)
