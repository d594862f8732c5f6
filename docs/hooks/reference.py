"""MkDocs hook: the API and configuration reference pages, generated at build time.

Nothing here names a module by hand, so moving or splitting modules in ``src/skylift``
never breaks the docs build:

- ``reference/api/*.md``: one page per top-level package of ``src/skylift``, found by
  walking the source tree, with one mkdocstrings block (``::: module``) per public
  module. mkdocstrings reads the docstrings with griffe's static analysis: nothing is
  imported, torch included.
- ``reference/config.md``: every field of ``skylift.config.RunConfig``, section by
  section, and every built-in recipe's settings (``skylift.recipes.settings``), with its
  YAML key, type, default and docstring, read from the pydantic models themselves (``use_attribute_docstrings`` turns each field's docstring into
  its ``description``). Importing ``skylift.config`` and ``skylift.recipes.settings``
  does not import torch.
"""

from __future__ import annotations

import enum
import json
import re
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = "skylift"


# --- API reference -------------------------------------------------------------------


def _public(parts: tuple[str, ...]) -> bool:
    return not any(part.startswith("_") for part in parts)


def _modules() -> dict[str, list[str]]:
    """Top-level package (or module) name -> its public modules, dotted, sorted."""
    groups: dict[str, list[str]] = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = rel.parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not _public(parts[1:]) or parts[-1] == "__main__":
            continue
        if len(parts) == 1:
            continue  # skylift/__init__.py: shown on the index page
        # a package's own __init__ only when it has a docstring or exports something
        if path.name == "__init__.py" and not path.read_text(encoding="utf-8").strip():
            continue
        # griffe finds a module only through packages with an __init__.py
        if any(not SRC.joinpath(*parts[:i], "__init__.py").exists() for i in range(1, len(rel.parts))):
            continue
        groups.setdefault(parts[1], []).append(".".join(parts))
    return groups


def _first_line(module: str) -> str:
    """The first line of a module's docstring, read from its source (not imported)."""
    import ast

    parts = module.split(".")
    base = SRC.joinpath(*parts)
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError):
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _api_pages() -> dict[str, str]:
    groups = _modules()
    pages: dict[str, str] = {}
    index = [
        "# API reference",
        "",
        "Generated from the docstrings in `src/skylift` at every docs build (mkdocstrings,",
        "static analysis: nothing is imported). One page per package; each lists its public",
        "modules. The stable entry points are `skylift.Runtime`, `skylift.Trainer`,",
        "`skylift.recipes.Recipe` and the configuration models (see the",
        "[configuration reference](../config.md)).",
        "",
        "| package | modules | what it is |",
        "|---|---:|---|",
    ]
    for group, modules in sorted(groups.items()):
        name = f"{PACKAGE}.{group}"
        index.append(f"| [`{name}`]({group}.md) | {len(modules)} | {_first_line(modules[0]) or ''} |")
        body = [f"# `{name}`", ""]
        for module in modules:
            heading = [] if module == name else [f"## `{module}`", ""]  # the page's title names the package
            body += heading + [f"::: {module}", "    options:", "      show_root_heading: false"]
            if module == name and len(modules) > 1:
                body.append("      members: false  # its re-exports are documented in their own modules")
            body.append("")
        pages[f"reference/api/{group}.md"] = "\n".join(body)
    pages["reference/api/index.md"] = "\n".join(index) + "\n"
    return pages


# --- configuration reference -----------------------------------------------------------


def _type_name(annotation: object) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " \\| ".join(repr(member.value) for member in annotation)
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{arg!r}`".replace("'", '"') for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is not None:
        inner = ", ".join(_type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return str(annotation).replace("typing.", "")


def _default(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        if hasattr(type(value), "model_fields"):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        value = str(value)
    text = "null" if value is None else json.dumps(value) if isinstance(value, str) else repr(value)
    if isinstance(value, bool):
        text = str(value).lower()
    return f"`{text}`".replace("|", "\\|")


_ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|exc|obj):`~?([^`]+)`")


_CODE = re.compile(r"(``.+?``|`[^`]+`)")


def _cell(text: str) -> str:
    text = _ROLE.sub(lambda m: f"``{m.group(1)}``", text)
    # <, > and & outside code spans are text, not HTML
    parts = _CODE.split(text)
    text = "".join(
        part if i % 2 else part.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        for i, part in enumerate(parts)
    )
    return " ".join(text.split()).replace("|", "\\|")


def _models_in(annotation: object) -> list[type]:
    """The pydantic models an annotation holds (a section, or a model inside a union/list)."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return [annotation]
    found: list[type] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _config_page() -> str:
    sys.path.insert(0, str(SRC))
    from skylift.config import RunConfig

    lines = [
        "# Configuration reference",
        "",
        "Every field of `RunConfig`, generated from the pydantic models at each docs build,",
        "so this page and the code cannot drift. A YAML key is the dotted path below; on the",
        "command line any of them is `--set KEY=VALUE` (the value is parsed as YAML and",
        "validated like the file). Unknown keys are refused with the closest valid one.",
        "`skylift check CONFIG` prints a config with every field resolved.",
        "",
    ]
    sections: list[tuple[str, type]] = [("", RunConfig)]
    seen: set[tuple[str, type]] = set()
    while sections:
        prefix, model = sections.pop(0)
        if (prefix, model) in seen:
            continue
        seen.add((prefix, model))
        title = f"`{prefix}`" if prefix else "Top level"
        lines += [f"## {title}", ""]
        doc = (model.__doc__ or "").strip()
        if doc and not doc.startswith("!!! abstract") and "BaseModel" not in doc:
            lines += [" ".join(doc.split()), ""]
        lines += [f"Model: `{model.__module__}.{model.__qualname__}`", ""]
        rows = ["| key | type | default | description |", "|---|---|---|---|"]
        nested: list[tuple[str, type]] = []
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            models = _models_in(field.annotation)
            kind = _type_name(field.annotation)
            if models:
                kind = ", ".join(f"[{m.__name__}](#{_anchor(key)})" for m in models[:1]) + (
                    " \\| null" if type(None) in typing.get_args(field.annotation) else ""
                )
                nested += [(key, m) for m in models[:1]]
            rows.append(f"| `{key}` | {kind} | {_default(field)} | {_cell(field.description or '')} |")
        lines += rows + [""]
        sections = nested + sections
    return "\n".join(lines + _recipe_settings_sections()) + "\n"


def _recipe_settings_sections() -> list[str]:
    """One section per built-in recipe: its settings, the keys beside ``recipe.name``
    (its ``Settings`` class, torch-free like the schema)."""
    from skylift.recipes.settings import BUILTIN_SETTINGS

    lines = [
        "## The recipes' settings",
        "",
        "A recipe's own settings sit flat under `recipe:`, beside `recipe.name`, and its",
        "`Settings` class validates them (`skylift check` and `skylift submit` check a built-in",
        "recipe's without importing torch). A recipe of your own declares its `Settings`",
        "(a subclass of `skylift.recipes.RecipeSettings`; see [your own code](../own-code.md)).",
        "",
    ]
    for name, (_, settings_class) in BUILTIN_SETTINGS.items():
        lines += [f"### `recipe.name: {name}`", ""]
        doc = (settings_class.__doc__ or "").strip()
        if doc:
            lines += [" ".join(doc.split()), ""]
        lines += [f"Model: `{settings_class.__module__}.{settings_class.__qualname__}`", "",
                  "| key | type | default | description |", "|---|---|---|---|"]
        for key, field in settings_class.model_fields.items():
            lines.append(f"| `recipe.{key}` | {_type_name(field.annotation)} | {_default(field)} | "
                         f"{_cell(field.description or '')} |")
        lines.append("")
    return lines


def _anchor(key: str) -> str:
    # Python-Markdown's toc slug for a heading "`a.b`": "ab"
    return "".join(ch for ch in key.lower() if ch.isalnum() or ch in "-_")


# --- mkdocs events --------------------------------------------------------------------


def _expand_api(nav):
    """Replace the nav entry of ``reference/api/index.md`` with it and every package page."""
    if isinstance(nav, list):
        return [_expand_api(item) for item in nav]
    if isinstance(nav, dict):
        out = {}
        for title, value in nav.items():
            if value == "reference/api/index.md":
                value = [{"Overview": value}] + [
                    {f"{PACKAGE}.{group}": f"reference/api/{group}.md"} for group in sorted(_modules())
                ]
            else:
                value = _expand_api(value)
            out[title] = value
        return out
    return nav


def on_config(config):
    if config.nav:
        config.nav = _expand_api(config.nav)
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    pages = _api_pages()
    pages["reference/config.md"] = _config_page()
    for src_uri, content in pages.items():
        existing = files.get_file_from_path(src_uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, src_uri, content=content))
    return files
