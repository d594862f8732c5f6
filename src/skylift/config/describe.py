"""Validation errors as one line per problem: the dotted key, what is wrong, the fix.

A leaf of :mod:`skylift.config` (pydantic and difflib only), so whatever formats a
pydantic error the way the run config's are (recipes' own ``Settings``, the loader) can
import it without importing the schema or anything the schema names.
"""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

__all__ = ["describe_errors"]


def describe_errors(error: ValidationError, root: type[BaseModel],
                    prefix: tuple[str, ...] = ()) -> list[str]:
    """One line per problem of a validation of ``root``: the dotted key (under ``prefix``,
    e.g. ``("recipe",)`` for a recipe's own settings), what is wrong, the allowed
    values or the closest valid key."""
    return [_describe(item, root, prefix) for item in error.errors()]


def _describe(item: ErrorDetails, root: type[BaseModel], prefix: tuple[str, ...] = ()) -> str:
    location = [str(part) for part in item["loc"]]
    dotted = ".".join([*prefix, *location]) or "config"
    if not location:
        message = str(item["msg"]).removeprefix("Value error, ")
        named = not prefix or message.startswith(f"{'.'.join(prefix)}.")  # it names its own keys
        return message if named else f"{'.'.join(prefix)}: {message}"
    if item["type"] == "extra_forbidden":
        return _unknown_key(location, root, prefix)
    allowed = _allowed_values(location, root)
    message = f"{dotted}: {item['msg']}"
    if "input" in item and item["type"] != "missing" and not isinstance(item["input"], dict):
        message += f" (got {item['input']!r})"
    if allowed:
        message += f"; allowed: {allowed}"
    return message


def _unknown_key(location: list[str], root: type[BaseModel], prefix: tuple[str, ...]) -> str:
    *parent_path, key = location
    valid = _field_names(parent_path, root)
    dotted = ".".join([*prefix, *location])
    closest = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    text = f"{dotted}: unknown key."
    if closest:
        text += f" Did you mean {'.'.join([*prefix, *parent_path, closest[0]])!r}?"
    return text + f" Valid keys here: {', '.join(sorted(valid))}"


def _section_model(path: list[str], root: type[BaseModel]) -> type[BaseModel] | None:
    model: type[BaseModel] = root
    for part in path:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _field_names(path: list[str], root: type[BaseModel]) -> list[str]:
    model = _section_model(path, root)
    return list(model.model_fields) if model else []


def _allowed_values(location: list[str], root: type[BaseModel]) -> str:
    model = _section_model(location[:-1], root)
    field = model.model_fields.get(location[-1]) if model else None
    if field is None:
        return ""
    args = getattr(field.annotation, "__args__", ())
    if getattr(field.annotation, "__origin__", None) is not None and "Literal" in repr(field.annotation):
        return ", ".join(repr(arg) for arg in args)
    return ""
