"""README's install works outside this checkout: the wheel built from the source carries
what an installed skylift reads (its package data) and its CLI runs from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Read through importlib.resources at run time: a wheel without them breaks catalog and plan.
PACKAGE_DATA = ("skylift/catalog/instances.csv", "skylift/plan/published.csv", "skylift/plan/published_structure.csv")


@pytest.mark.slow
def test_the_built_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    # A copy of what the build reads, so the build writes nothing into the checkout.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # --no-build-isolation: setuptools from this venv, so the build needs no network.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("skylift-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert set(PACKAGE_DATA) <= names
    assert not [name for name in names if name.startswith(("tests/", "examples/", "benchmarks/"))]

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-index",
                    "--target", str(target), str(wheel)], check=True, timeout=120)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    installed = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target)}

    def skylift(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "skylift", *args], cwd=outside, env=installed,
                              capture_output=True, text=True, timeout=120)

    where = subprocess.run([sys.executable, "-c", "import skylift; print(skylift.__file__)"], cwd=outside,
                           env=installed, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(target / "skylift" / "__init__.py")  # not this checkout
    assert "usage: skylift" in skylift("--help").stdout
    catalog = skylift("catalog")  # reads skylift/catalog/instances.csv through importlib.resources
    assert catalog.returncode == 0 and "p4d.24xlarge" in catalog.stdout, catalog.stderr
    published = subprocess.run(
        [sys.executable, "-c", "from skylift.plan.published import load_published; print(len(load_published()))"],
        cwd=outside, env=installed, capture_output=True, text=True, timeout=120)
    assert published.returncode == 0 and int(published.stdout) > 0, published.stderr
