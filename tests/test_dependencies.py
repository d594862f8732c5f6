"""Declared dependencies are used ones: every core dependency, and every package of the
``s3`` extra, is imported by skylift's source (a package installed for nothing costs every
user its download and its conflicts), and no extra lists a package twice."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "skylift"
USED_THROUGH = {"tensorboard": "torch.utils.tensorboard"}
"""Distributions skylift uses through another package's module (torch's TensorBoard writer)."""
_LOOKUPS = {"find_spec", "import_module"}


def _name(requirement: str) -> str:
    """``s3fs[boto3]>=2024.2`` -> ``s3fs``, normalised as pip compares names."""
    return re.split(r"[\[<>=!~; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _imported_modules(folder: Path) -> set[str]:
    """Every module the source under ``folder`` imports, by statement or by a literal
    ``importlib.util.find_spec("...")`` / ``importlib.import_module("...")``."""
    modules: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module)
            elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
                  and getattr(node.func, "attr", getattr(node.func, "id", None)) in _LOOKUPS
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                modules.add(node.args[0].value)
    return modules


def _distributions_used(folder: Path) -> set[str]:
    by_module = importlib.metadata.packages_distributions()
    modules = _imported_modules(folder)
    used = {_name(distribution) for module in modules for distribution in by_module.get(module.split(".")[0], [])}
    return used | {name for name, module in USED_THROUGH.items() if module in modules}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_every_core_dependency_is_imported_by_skylift():
    declared = {_name(requirement) for requirement in _project()["dependencies"]}
    unused = declared - _distributions_used(SOURCE)
    assert not unused, f"declared in [project] dependencies but never imported by src/skylift: {sorted(unused)}"


def test_the_s3_extra_installs_what_the_s3_store_imports():
    extra = {_name(requirement) for requirement in _project()["optional-dependencies"]["s3"]}
    unused = extra - _distributions_used(SOURCE / "storage")
    assert not unused, f"the s3 extra installs {sorted(unused)}, which skylift.storage never imports"


def test_no_extra_lists_a_package_twice():
    for extra, requirements in _project()["optional-dependencies"].items():
        names = [_name(requirement) for requirement in requirements]
        assert len(names) == len(set(names)), f"[{extra}] lists {sorted({n for n in names if names.count(n) > 1})} twice"
