"""Recipes: tasks that tie a model, data and a loss to the Trainer.

Looked up by ``recipe.name``; each is imported only when used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig
    from skylift.recipes.base import Recipe

__all__ = ["RECIPES", "Recipe", "RecipeSettings", "build_recipe", "check_recipe_settings", "recipe_class",
           "recipe_class_named"]


def __getattr__(name: str):
    if name == "Recipe":
        from skylift.recipes.base import Recipe

        return Recipe
    if name == "RecipeSettings":
        from skylift.recipes.settings.base import RecipeSettings

        return RecipeSettings
    raise AttributeError(name)

RECIPES: dict[str, str] = {
    "image_classification": "skylift.recipes.image_classification:ImageClassification",
    "text_classification": "skylift.recipes.text_classification:TextClassification",
    "causal_lm": "skylift.recipes.causal_lm:CausalLM",
}


def recipe_class_named(name: str) -> type[Recipe]:
    """The built-in recipe class ``name`` (a key of :data:`RECIPES`)."""
    module_name, _, class_name = RECIPES[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def recipe_class(config: RunConfig) -> type[Recipe]:
    """The class ``recipe.name`` names: a built-in one, or the user's by import path."""
    from skylift.recipes.base import Recipe
    from skylift.recipes.loading import load_object

    name = config.recipe.name
    if name in RECIPES:
        return recipe_class_named(name)
    found = load_object(name, field="recipe.name")
    if not (isinstance(found, type) and issubclass(found, Recipe)):
        from skylift.errors import SkyliftConfigError

        raise SkyliftConfigError(
            f"recipe.name: {name!r} is a {type(found).__name__}, not a subclass of skylift.recipes.Recipe",
            hint="Define `class MyTask(skylift.recipes.Recipe)` with build_datasets, build_model, training_loss "
            "and eval_sums (see examples/own_recipe/)",
        )
    return found


def check_recipe_settings(config: RunConfig) -> Any:
    """The recipe's settings (the keys beside ``recipe.name``) validated by its ``Settings``
    and checked against the rest of ``config`` (raises SkyliftConfigError naming each
    key); ``config.recipe`` then lists every setting, defaults included. A built-in
    recipe's are checked without importing it (no torch); the user's recipe is imported,
    so a bad import path fails here too."""
    from skylift.recipes.settings import builtin_settings

    if config.recipe.name in RECIPES:
        return builtin_settings(config)
    return recipe_class(config).parse_settings(config)


def build_recipe(config: RunConfig) -> Recipe:
    """The recipe of ``config``, its settings validated (raises SkyliftConfigError)."""
    return recipe_class(config)(config)
