"""The package's layout holds: no import cycles between modules, and the layers import only downwards.

Imports inside functions count too: a cycle that only a late import breaks is still a cycle to a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tokenloom

ROOT = Path(tokenloom.__file__).parent


def module_imports() -> dict[str, set[str]]:
    """Each tokenloom module -> the tokenloom modules it imports (anywhere in its file)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("tokenloom", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tokenloom"):
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(module_imports()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_commands_import_the_bench_and_the_scheduler_never_imports_the_model():
    """The bench (and its simulator) is used by the command line and the simulated planner, never by the engine."""
    graph = module_imports()
    for module, imported in graph.items():
        if not module.startswith(("tokenloom.bench", "tokenloom.cli", "tokenloom.tools.capacity")):
            assert not {i for i in imported if i.startswith("tokenloom.bench")}, f"{module} imports the bench"
        if module.startswith("tokenloom.core"):
            assert not {i for i in imported if i.startswith(("tokenloom.model", "tokenloom.engine"))}, module
