"""Imports run one way: exgrpo_pl's modules import each other without a cycle.

The graph is read from the source (no import runs): every `import exgrpo_pl.x` and `from exgrpo_pl.x import
y` in the files under exgrpo_pl/ and callbacks/ (installed as `exgrpo_pl.callbacks`), at the top level or
inside functions and classes, relative imports included. `from exgrpo_pl.x import y` is an edge to the
module `exgrpo_pl.x.y` when that is a module, else to `exgrpo_pl.x`. A package's own `__init__` is not an
implicit dependency of its submodules (importing `exgrpo_pl.x` runs `exgrpo_pl/__init__.py` first, but that
is the interpreter's order, not a dependency either file states).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# source folder -> the package its files are installed under
SOURCES = {ROOT / "exgrpo_pl": "exgrpo_pl", ROOT / "callbacks": "exgrpo_pl.callbacks"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every Python file of the package."""
    modules = {}
    for folder, package in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that the file of module `name` imports anywhere in it."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # the nearest enclosing module; "" outside the package
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (`[a, b, ..., a]`) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [shortest_cycle(graph, component) for component in components]


def shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (by name), as a path that returns to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for other in sorted(graph[node] & component):
                if other == start:
                    return [*paths[node], start]
                if other not in paths:
                    paths[other] = [*paths[node], other]
                    following.append(other)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_graph_sees_every_module_and_known_edges():
    graph = import_graph()
    assert "exgrpo_pl.callbacks.replay" in graph and "exgrpo_pl.engines.hf" in graph
    # a top-level `from exgrpo_pl.x import y`
    assert "exgrpo_pl.experience.buffer" in graph["exgrpo_pl.experience.replay"]
    assert "exgrpo_pl.experience.buffer" in graph["exgrpo_pl"]  # the package's __init__


@pytest.mark.parametrize(
    ("graph", "cycles"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c", "a"]]),
        ({"a": {"b", "c"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["c", "d", "c"], ["a", "b", "a"]]),
    ],
)
def test_find_cycles(graph, cycles):
    assert find_cycles(graph) == cycles


def test_imports_run_one_way():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)
