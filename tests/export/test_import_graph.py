"""export/ imports form no cycle, counting the imports inside functions: a cycle hidden by an import
in a function still ties the two modules together, and breaks when the import is moved up."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.export.conftest import REPO

PACKAGE = REPO / "export"


def imported_modules(path: Path) -> set[str]:
    """The ``export.*`` modules a file imports anywhere but under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(child) for child in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            # ``from export import onnx`` imports the module export.onnx.
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    modules = set(module_paths())
    return {name for name in found if name in modules}


def module_paths() -> dict[str, Path]:
    """Every module of the package and its subpackages (``export.importers`` for its
    ``__init__.py``) by name."""
    paths = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return paths


def import_graph() -> dict[str, set[str]]:
    # A package naming its own submodules (``from export.importers import timm``) is no cycle.
    return {name: imported_modules(path) - {name} for name, path in module_paths().items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return [*stack[stack.index(successor) :], successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_export_has_no_import_cycle():
    graph = import_graph()
    assert "export.folder" in graph["export.data"]  # the graph is read, not empty
    assert "export.importers.weights" in graph["export.importers"]  # and its subpackages
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
