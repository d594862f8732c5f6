"""The docs hold together without building them: every nav page exists, README's links resolve.

CI's ``make docs`` (``mkdocs build --strict``) checks the links inside the docs; this is the
fast check that needs no MkDocs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
# Pages docs/hooks/reference.py writes at build time: they exist only in the built site.
GENERATED = re.compile(r"^reference/(config\.md|api/.+\.md)$")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _mkdocs() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def test_every_nav_page_exists():
    pages = _nav_pages(_mkdocs()["nav"])
    assert len(pages) >= 15
    missing = [page for page in pages if not GENERATED.match(page) and not (DOCS / page).is_file()]
    assert missing == []


def test_the_reference_hook_is_configured():
    config = _mkdocs()
    assert "docs/hooks/reference.py" in config["hooks"]
    assert (ROOT / "docs/hooks/reference.py").is_file()
    assert config["theme"]["font"] is False  # the build fetches nothing


def test_every_relative_link_in_the_readme_resolves():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [link for link in _LINK.findall(text) if not re.match(r"^[a-z]+:", link)]
    assert links, "README links into the docs"
    broken = [link for link in links if not link.startswith("#") and not (ROOT / link.split("#")[0]).exists()]
    assert broken == []


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def _hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(model, prefix=""):
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        yield key
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            yield from _keys(annotation, key + ".")


def test_the_config_reference_lists_every_field():
    from skylift.config import RunConfig

    page = _hook()._config_page()
    missing = [key for key in _keys(RunConfig) if f"| `{key}` |" not in page]
    assert missing == []


def test_the_config_reference_lists_every_builtin_recipe_setting():
    from skylift.recipes.settings import BUILTIN_SETTINGS

    page = _hook()._config_page()
    missing = [f"{name}: recipe.{key}" for name, (_, settings) in BUILTIN_SETTINGS.items()
               for key in settings.model_fields if f"| `recipe.{key}` |" not in page.split(f"`recipe.name: {name}`")[-1]]
    assert missing == []
    assert all(f"### `recipe.name: {name}`" in page for name in BUILTIN_SETTINGS)


@pytest.mark.parametrize("override", ["optim.learning_rate=0.1", "model.name=resnet18"])
def test_getting_started_shows_the_config_errors_as_printed(capsys, monkeypatch, override):
    from skylift.cli.main import main

    monkeypatch.chdir(ROOT)
    assert main(["run", "examples/quickstart.yaml", "--set", override]) == 2
    printed = capsys.readouterr().err.strip()
    assert f"```\n{printed}\n```" in (DOCS / "getting-started.md").read_text(encoding="utf-8")


def test_the_api_reference_covers_every_package():
    pages = _hook()._api_pages()
    packages = {path.name for path in (ROOT / "src" / "skylift").iterdir() if (path / "__init__.py").is_file()}
    assert {f"reference/api/{name}.md" for name in packages} <= set(pages)
