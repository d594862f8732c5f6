"""The package's shape: imports run one way, with no cycles, and modules stay small.

The import graph is read from the source with ``ast``: every ``import`` and ``from ...
import`` of a skylift module, at module level, inside functions and under ``if
TYPE_CHECKING:`` alike (a type-only import still ties the two modules together), relative
imports resolved. ``from package import name`` counts as an import of the submodule
``package.name`` when there is one, else of the package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "skylift"

LAYERS: list[tuple[str, ...]] = [
    ("skylift", "errors", "logs", "run_dir"),
    ("cloud",),
    ("loop", "config", "storage", "machine"),
    ("catalog", "data", "checkpoint"),
    ("monitor",),
    ("recipes",),
    ("train",),
    ("launch",),
    ("doctor", "submit", "integrations"),
    ("plan", "image"),
    ("cli",),
    ("__main__",),
]
"""Bottom first. A module imports only its own top-level package (``skylift.data.*`` from
``skylift.data.*``) and packages of a lower layer; the packages of one layer are
independent of each other. ``skylift`` is the root package's ``__init__`` (its names load
lazily, by ``importlib``, which is not an import edge).

Why this order: ``loop`` holds the training loop's primitives (events, the process group,
the ranks' agreement) that data loaders, checkpoints and monitors take part in;
``machine`` the facts of the machine (doctor's facts schema, the NCCL plan, GPU
data-sheet figures) that doctor, the launcher, the monitor and the planner all read;
``cloud`` the vendors' metadata services, spot notices and credential redaction, and the
cloud registry (``cloud.vendors``, filled by one module per vendor). It sits below
``config`` so that the config can check a cloud's name (``preemption.cloud``,
``plan.interruptions_per_hour``, ``submit.kubernetes.cloud``) against the registry
itself, with no list of its own; ``cloud`` needs nothing but the standard library and
``errors``. The
Trainer (``train``) composes data, checkpoints, monitors and recipes, all inside a worker;
``launch`` starts the workers (torchrun's arguments, the elastic agent, the checks before
any worker) and never runs in one; ``doctor`` checks a
machine and a job for it (and reads ``train``'s precision rules), ``submit`` sends the job
to a platform, ``integrations`` gives a framework's own loop (Hugging Face, Lightning)
``train``'s services; ``plan`` ranks instances with doctor's memory estimate; ``image`` writes the job's Dockerfile
(sized with doctor's data-loader rules, started by launch's command); the CLI sits on
top of everything."""

MAX_MODULE_LINES = 500


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(SOURCE.parents[1])}:{self.line}"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    submodules = [f"{origin}.{alias.name}" for alias in node.names if f"{origin}.{alias.name}" in modules]
    return submodules or [origin]


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The skylift module an imported dotted name lives in (``skylift.x.y.Name`` -> ``skylift.x.y``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges() -> list[Edge]:
    modules = _modules()
    edges = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_names(node, module, path, modules):
                owner = _owner(name, modules) if name.split(".")[0] == "skylift" else None
                if owner and owner != module:
                    edges.append(Edge(module, owner, path, node.lineno))
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer_of(package: str) -> int:
    for index, layer in enumerate(LAYERS):
        if package in layer:
            return index
    raise AssertionError(f"skylift.{package} is in no layer: add it to LAYERS in {Path(__file__).name}")


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for neighbour in sorted(graph[node]):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_graph_is_read():
    """A guard against a reader that silently finds nothing (and so passes everything)."""
    edges = {(edge.importer, edge.imported) for edge in import_edges()}
    assert ("skylift.train.trainer", "skylift.loop.events") in edges
    assert ("skylift.recipes", "skylift.recipes.base") in edges  # an import inside a function
    assert ("skylift.plan.render", "skylift.plan.planning") in edges  # a TYPE_CHECKING import


def test_no_import_reaches_up_a_layer():
    upward = []
    for edge in import_edges():
        source, target = _package(edge.importer), _package(edge.imported)
        if source != target and _layer_of(target) >= _layer_of(source):
            upward.append(f"{edge.where()}: {edge.importer} imports {edge.imported} "
                          f"(layer {_layer_of(source)} -> layer {_layer_of(target)})")  # fmt: skip
    assert not upward, (
        "imports from a lower layer to a higher one (or across one layer):\n  " + "\n  ".join(upward)
        + "\nMove what both need into the lower package (or a package below both), or pass it in as an "
        "argument; LAYERS in tests/test_architecture.py gives the order."
    )


def test_no_import_cycles():
    edges = import_edges()
    described = []
    for component in _cycles(edges):
        members = set(component)
        inside = [f"{edge.where()}: {edge.importer} -> {edge.imported}"
                  for edge in edges if edge.importer in members and edge.imported in members]  # fmt: skip
        described.append(" <-> ".join(component) + "\n    " + "\n    ".join(inside))
    assert not described, (
        "import cycles (imports inside functions count):\n  " + "\n  ".join(described)
        + "\nSplit what both sides need into a module below them, so the imports run one way."
    )


def test_every_module_is_at_most_500_lines():
    long = [f"{path.relative_to(SOURCE.parents[1])}: {lines} lines"
            for path in _modules().values() if (lines := len(path.read_text(encoding="utf-8").splitlines()))
            > MAX_MODULE_LINES]  # fmt: skip
    assert not long, (
        f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(long)
        + "\nSplit each by what changes together into modules of its package."
    )


_WITHOUT_TORCH = """
import sys
from skylift.cli.main import main

code = main(sys.argv[1:])
heavy = sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "torchvision"))
assert not heavy, f"{sys.argv[1:]} imported {heavy[:3]}"
sys.exit(code)
"""

_COMMANDS = [
    ["check", "examples/quickstart.yaml"],
    ["catalog"],
    ["submit", "examples/spot_s3.yaml", "--platform", "sagemaker", "--instance", "ml.p3.16xlarge", "--count", "2",
     "--spot", "--region", "us-east-1", "--image", "123456789012.dkr.ecr.us-east-1.amazonaws.com/skylift:0.1.0",
     "--set", "submit.sagemaker.role_arn=arn:aws:iam::123456789012:role/SkyliftTraining", "--dry-run"],
]


def test_check_catalog_and_submit_dry_run_do_not_import_torch():
    """These only read YAML, the catalog and a platform's request shape: torch's ~2 s import
    is not theirs to pay."""
    root = SOURCE.parents[1]
    for command in _COMMANDS:
        result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *command], cwd=root,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert result.returncode == 0, f"skylift {' '.join(command)}:\n{result.stderr[-2000:]}"
