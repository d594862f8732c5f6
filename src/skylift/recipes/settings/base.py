"""The base of a recipe's settings: the keys beside ``recipe.name``, typed and documented.

Torch-free (pydantic only), so a built-in recipe's settings are checked by ``skylift
check`` and ``skylift submit --dry-run`` without importing the recipe.
"""

from __future__ import annotations

from typing import Any

from skylift.config.section import Section

__all__ = ["RecipeSettings"]


class RecipeSettings(Section):
    """Subclass it as your recipe's ``Settings``: one field per key, each with a docstring.

    Like skylift's own sections it refuses an unknown key (naming the closest valid one),
    ``.inf`` and ``.nan``. ``name`` is reserved (``recipe.name``). :meth:`check_run` sees
    the whole run config, for rules that tie a setting to another section."""

    def check_run(self, config: Any) -> None:
        """Raise :class:`~skylift.errors.SkyliftConfigError` when the rest of ``config``
        (a :class:`~skylift.config.schema.RunConfig`) does not fit these settings."""
