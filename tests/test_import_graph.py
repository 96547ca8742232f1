"""Imports run one way: exgrpo_pl's modules import each other without a cycle, and each part of the package
(a top-level module or a folder) imports only the parts below it in `LAYERS`.

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
# The package's parts, bottom to top: a module may import its own part and the parts before it, never one
# after it. The top-level exgrpo_pl/__init__.py is the facade over all of them, and exempt.
LAYERS = [
    # the shared basics, at the top level
    "batch", "ragged", "seeding", "validation", "contract", "contract_checks", "models",
    "lightning_internals", "moved", "renamed", "run_names",
    "rewards",  # verifiers
    "engines",  # what samples the completions
    "data",  # prompt data, the synthetic tasks
    "evaluation",  # the paper's metrics and table
    "experience",  # the replay memory
    "step",  # one training step
    "checkpoints",  # kill-proof checkpoints, exact resume
    "module",  # the LightningModule, ReplayMixin
    "callbacks",  # ReplayCallback, DifficultyMonitor
    "cli",  # the `exgrpo` command
]  # fmt: skip


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


def part_of(module: str) -> str:
    """The part of the package a module is in: `exgrpo_pl.step.losses` -> "step", `exgrpo_pl.cli` -> "cli"."""
    return module.split(".")[1]


def upward_imports(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    """Each import of a part above the importer's own in `layers`, as "importer -> imported (part > part)"."""
    rank = {part: i for i, part in enumerate(layers)}
    return [
        f"{module} -> {target} ({part_of(target)} is above {part_of(module)})"
        for module in sorted(graph)
        if module != "exgrpo_pl"  # the facade
        for target in sorted(graph[module])
        if rank[part_of(target)] > rank[part_of(module)]
    ]


def test_the_graph_sees_every_module_and_known_edges():
    graph = import_graph()
    assert "exgrpo_pl.callbacks.replay" in graph and "exgrpo_pl.engines.hf" in graph
    # a top-level `from exgrpo_pl.x import y`
    assert "exgrpo_pl.experience.buffer" in graph["exgrpo_pl.experience.replay"]
    assert "exgrpo_pl.experience.buffer" in graph["exgrpo_pl"]  # the package's __init__
    assert "exgrpo_pl.engines.generation" in graph["exgrpo_pl.step.rollout"]  # a folder below
    assert {"exgrpo_pl.step.update", "exgrpo_pl.checkpoints.resume"} <= graph["exgrpo_pl.module.grpo"]
    assert "exgrpo_pl.module.logging_steps" in graph["exgrpo_pl.callbacks.replay"]
    assert "exgrpo_pl.moved" in graph["exgrpo_pl.cli"]


def test_upward_imports_are_named():
    layers = ["base", "low", "high"]
    graph = {
        "exgrpo_pl": {"exgrpo_pl.high"},
        "exgrpo_pl.base": set(),
        "exgrpo_pl.low.a": {"exgrpo_pl.base", "exgrpo_pl.low.b", "exgrpo_pl.high"},
        "exgrpo_pl.low.b": set(),
        "exgrpo_pl.high": {"exgrpo_pl.low.a"},
    }
    assert upward_imports(graph, layers) == ["exgrpo_pl.low.a -> exgrpo_pl.high (high is above low)"]


def test_every_part_has_a_layer_and_imports_only_lower_ones():
    graph = import_graph()
    parts = {part_of(module) for module in graph if module != "exgrpo_pl"}
    assert parts == set(LAYERS), "a part without a layer (add it to LAYERS), or a layer without a part"
    upward = upward_imports(graph, LAYERS)
    assert not upward, f"imports against the layers ({' < '.join(LAYERS)}): " + "; ".join(upward)


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
