"""Recipes' settings: the keys beside ``recipe.name``, validated by the recipe's ``Settings``.

Torch-free: the built-in recipes' settings classes are named here with their recipes'
class names, so ``skylift check`` and ``skylift submit --dry-run`` check them without
importing a recipe (and with it torch). A recipe of the user's is imported to find its
``Settings``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from skylift.config.describe import describe_errors
from skylift.errors import SkyliftConfigError
from skylift.recipes.settings.base import RecipeSettings
from skylift.recipes.settings.causal_lm import TINY_LLAMA, CausalLMSettings
from skylift.recipes.settings.image_classification import ImageClassificationSettings
from skylift.recipes.settings.text_classification import TextClassificationSettings

__all__ = [
    "BUILTIN_SETTINGS",
    "TINY_LLAMA",
    "CausalLMSettings",
    "ImageClassificationSettings",
    "RecipeSettings",
    "TextClassificationSettings",
    "builtin_settings",
    "validate_settings",
]

BUILTIN_SETTINGS: dict[str, tuple[str, type[RecipeSettings]]] = {
    "image_classification": ("ImageClassification", ImageClassificationSettings),
    "text_classification": ("TextClassification", TextClassificationSettings),
    "causal_lm": ("CausalLM", CausalLMSettings),
}
"""Built-in recipe name -> (its class's name, its ``Settings``); the classes' own
``Settings`` attributes are these (a test holds them equal)."""


def validate_settings(recipe_name: str, settings_class: type[BaseModel] | None, config: Any) -> Any:
    """The settings ``config.recipe`` gives (every key beside ``name``) as a
    ``settings_class`` instance (``None`` for a recipe without settings), checked against
    the rest of ``config`` (:meth:`RecipeSettings.check_run`); ``config.recipe`` is then
    rewritten to list every setting, defaults included, so the run's ``config.yaml``,
    ``skylift check`` and a checkpoint's recorded config show what the recipe used.

    Raises:
        SkyliftConfigError: naming each bad key as ``recipe.KEY`` and the closest valid one.
    """
    given = dict(config.recipe.model_extra or {})
    if settings_class is None:
        if given:
            raise SkyliftConfigError(f"recipe: {recipe_name} takes no settings (got {', '.join(sorted(given))})",
                                     hint=f"Remove them, or give {recipe_name} a Settings class (a subclass of "
                                     "skylift.recipes.RecipeSettings)")  # fmt: skip
        return None
    if "name" in settings_class.model_fields:
        raise SkyliftConfigError(f"recipe.name: {recipe_name}.Settings defines a setting 'name', which recipe.name "
                                 "holds", hint="Rename that field of the Settings class")  # fmt: skip
    try:
        settings = settings_class.model_validate(given)
    except ValidationError as error:
        raise SkyliftConfigError(describe_errors(error, settings_class, ("recipe",)),
                                 hint=f"Fix recipe; {recipe_name}.Settings defines its keys: "
                                 f"{', '.join(settings_class.model_fields)}") from None  # fmt: skip
    check = getattr(settings, "check_run", None)
    if callable(check):
        check(config)
    resolved = settings.model_dump(mode="json")
    if given != resolved:
        config.recipe = type(config.recipe)(name=config.recipe.name, **resolved)
    return settings


def builtin_settings(config: Any) -> Any:
    """The validated settings of a built-in ``recipe.name`` (see :func:`validate_settings`)."""
    class_name, settings_class = BUILTIN_SETTINGS[config.recipe.name]
    return validate_settings(class_name, settings_class, config)
