"""Docs that show what the code says: the pipeline's words are the package names, and the
catalog example prints what `skylift catalog` prints today."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {path.name for path in (ROOT / "src" / "skylift").iterdir() if (path / "__init__.py").is_file()}


def _pipeline(text: str) -> str:
    return re.search(r"## The pipeline\n.*?```text\n(.*?)```", text, re.DOTALL).group(1)


def test_the_pipeline_names_packages_and_readme_and_index_agree():
    readme = _pipeline((ROOT / "README.md").read_text(encoding="utf-8"))
    index = _pipeline((ROOT / "docs" / "index.md").read_text(encoding="utf-8"))
    assert readme == index
    steps = re.findall(r"[a-z]+", next(line for line in readme.splitlines() if "──►" in line))
    assert steps == ["doctor", "plan", "data", "launch", "train", "checkpoint", "monitor"]
    named = set(steps) | {"recipes", "integrations", "image", "submit"}
    assert named <= PACKAGES
    for word in ("recipes:", "integrations:", "image + submit:"):
        assert word in readme


def test_the_catalog_example_is_what_the_catalog_prints(capsys):
    from skylift.cli.main import main

    page = (ROOT / "docs" / "plan.md").read_text(encoding="utf-8")
    shown = re.search(r"```\n\$ skylift catalog --gpu T4\n(.*?)```", page, re.DOTALL).group(1)
    assert main(["catalog", "--gpu", "T4"]) == 0
    assert capsys.readouterr().out == shown


def test_the_docs_run_no_example_from_tests():
    """A wheel or a clone without tests/ still has what the docs run."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    runs_from_tests = [f"{page.relative_to(ROOT)}: {line.strip()}" for page in pages if page.name != "development.md"
                       for line in page.read_text(encoding="utf-8").splitlines()
                       if re.search(r"python (\S+/)?tests/\S+\.py", line)]
    assert runs_from_tests == []


def test_no_machine_paths_in_user_pages():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(ROOT)}: {line.strip()[:80]}" for page in pages if page.name != "development.md"
             for line in page.read_text(encoding="utf-8").splitlines()
             if re.search(r"(^|[\s'\"(=])(/tmp/|/work/|/root/|/home/)", line)]
    assert found == []
