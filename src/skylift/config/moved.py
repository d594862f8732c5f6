"""Keys that moved: each old key of a config, and the key that holds its setting now.

A recipe's settings sit flat under ``recipe:``, beside ``recipe.name`` (the recipe's own
``Settings`` class validates them); the ``model:`` section, the dataset keys of ``data:``
and the ``recipe.args`` mapping held them before. A config that still names an old key
fails with one line per key naming the new one, before anything else is validated.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MOVED_HINT", "MOVED_KEYS", "moved_key_problems"]

MOVED_KEYS: dict[str, str] = {
    "model.name": "recipe.model",
    "model.args": "recipe.model_args",
    "model.path": "recipe.model_path",
    "model.add_unknown_characters": "recipe.add_unknown_characters",
    "model.width": "recipe.width",
    "model.num_classes": "recipe.num_classes",
    "data.dataset": "recipe.dataset",
    "data.text_path": "recipe.text_path",
    "data.max_length": "recipe.max_length",
    "data.image_size": "recipe.image_size",
    "data.num_samples": "recipe.num_samples",
}
"""Old dotted key -> new dotted key. ``recipe.args.X`` moved to ``recipe.X`` (every key of
the mapping), and the ``model`` section is gone as a whole."""

MOVED_HINT = ("Rename each key as shown: a recipe's settings sit flat under recipe:, beside recipe.name "
              "(e.g. recipe: {name: image_classification, model: resnet18, dataset: shapes})")


def moved_key_problems(raw: Any) -> list[str]:
    """One line per old key ``raw`` (a config mapping, before validation) still uses."""
    if not isinstance(raw, dict):
        return []
    problems = []
    for section in ("model", "data"):
        given = raw.get(section)
        if not isinstance(given, dict):
            if section == "model" and section in raw:
                problems.append("model: the section is gone; its keys are the recipe's settings, under recipe")
            continue
        for key in given:
            new = MOVED_KEYS.get(f"{section}.{key}")
            if new is not None:
                problems.append(f"{section}.{key}: moved to {new}")
            elif section == "model":
                problems.append(f"model.{key}: the model section is gone; a recipe's settings sit under recipe")
    recipe = raw.get("recipe")
    args = recipe.get("args") if isinstance(recipe, dict) else None
    if isinstance(args, dict):
        problems += [f"recipe.args.{key}: moved to recipe.{key}" for key in args] or [
            "recipe.args: moved: a recipe's settings sit flat under recipe, beside recipe.name"]
    return problems
