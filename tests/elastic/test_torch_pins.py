"""skylift's elastic agent copies and reaches into private torch code (no public hook
exists for its monitoring loop, a restart's stop timeout, or leaving a rendezvous without
closing it). Each piece is pinned here against the installed torch: an upgrade that
changes one fails in the suite, naming what to re-check, instead of on a cluster."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import sys
import textwrap
from pathlib import Path

import torch

from skylift.launch.elastic_agent import TORCH_PINS

LAUNCH = Path(__file__).resolve().parents[2] / "src" / "skylift" / "launch"


def _source_digest(name: str) -> str:
    """The first 16 hex digits of the sha256 of ``module:qualified.name``'s AST (comments and layout left out)."""
    module, _, qualified = name.partition(":")
    target = importlib.import_module(module)
    for part in qualified.split("."):
        target = getattr(target, part)
    tree = ast.parse(textwrap.dedent(inspect.getsource(target)))
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:16]


def test_the_private_torch_code_the_agent_relies_on_is_as_pinned():
    changed = [f"{name}: {why}" for name, (digest, why) in TORCH_PINS.items() if _source_digest(name) != digest]
    assert not changed, (
        f"torch {torch.__version__} changed code skylift's elastic agent copied or calls privately "
        "(src/skylift/launch/elastic_agent.py TORCH_PINS). Re-check each, run tests/elastic (slow lane too), "
        "then update its digest:\n  " + "\n  ".join(changed))


def test_every_private_torch_name_the_launcher_imports_is_pinned():
    """A new ``from torch... import _name`` in launch/ must be added to TORCH_PINS."""
    pinned = {name.partition(":")[2].split(".")[0] for name in TORCH_PINS}
    unpinned = []
    for path in sorted(LAUNCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                unpinned += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                             if alias.name.startswith("_") and alias.name not in pinned]  # fmt: skip
    assert not unpinned, f"pin these in TORCH_PINS: {unpinned}"


def test_a_changed_source_is_caught(tmp_path, monkeypatch):
    """The digest sees code, not layout: a reformatted copy matches, an edited one does not."""
    module = tmp_path / "pinned_probe.py"
    module.write_text("def run(x):\n    # a comment\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = _source_digest("pinned_probe:run")
    module.write_text("def run(x):\n\n    return (x +\n            1)\n")
    sys.modules.pop("pinned_probe", None)
    assert _source_digest("pinned_probe:run") == first
    module.write_text("def run(x):\n    return x + 2\n")
    sys.modules.pop("pinned_probe", None)
    assert _source_digest("pinned_probe:run") != first
