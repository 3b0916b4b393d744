"""The engine's modules, and the load tester's, import one another one way: no import cycle,
counting the imports inside functions (a lazy import still ties two modules together) and the ones
under `if TYPE_CHECKING:`.

An edge goes from a module to each checked module it names: `import a.b`, `from a import b` (to a.b
when a.b is a module, else to a), relative imports resolved. Importing a module also runs its
packages' __init__, but that is not an edge here: `engine/__init__.py` re-exports the engine, and
every module would otherwise sit in one cycle with it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the packages checked, each with the modules directly in its folder
PACKAGES = ["engine", "engine.backends", "engine.backends.cuda", "engine.server", "loadtest"]


def modules(packages: list[str]) -> dict[str, Path]:
    """{dotted name: file} of every module directly in the packages' folders (a package by its own name)."""
    found = {}
    for package in packages:
        for path in sorted((ROOT / Path(*package.split("."))).glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def imported_names(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module `module` imports, anywhere in its file, as dotted names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return names


def import_graph(packages: list[str]) -> dict[str, set[str]]:
    """{module: the checked modules it imports}."""
    known = modules(packages)
    return {m: {n for n in imported_names(m, p, known) if n in known and n != m} for m, p in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_module_level_lazy_and_relative_imports() -> None:
    graph = import_graph(PACKAGES)
    assert "engine.backends.executor" in graph["engine.backends.executors"]  # module level
    assert "engine.backends.cpu_executor" in graph["engine.backends.executors"]  # inside a function
    assert "engine.backends.cuda" in graph["engine.backends"]  # `from engine.backends import cuda`, lazily
    assert "loadtest.html_report" in graph["loadtest.run"]  # `from loadtest import html_report`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("packages", [PACKAGES], ids=["+".join(PACKAGES)])
def test_no_import_cycle(packages: list[str]) -> None:
    cycle = find_cycle(import_graph(packages))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_an_executor_knows_no_tensor_parallel_group() -> None:
    graph = import_graph(PACKAGES)
    backends = [m for m in graph if m.startswith("engine.backends")]
    reached = {m for b in backends for m in graph[b] if m.startswith("engine.tp_")}
    assert reached == set(), f"engine/backends imports the tensor-parallel group: {sorted(reached)}"
