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
        if not module.startswith(("tokenloom.bench", "tokenloom.cli", "tokenloom.advisor.capacity")):
            assert not {i for i in imported if i.startswith("tokenloom.bench")}, f"{module} imports the bench"
        if module.startswith("tokenloom.core"):
            assert not {i for i in imported if i.startswith(("tokenloom.model", "tokenloom.engine"))}, module


MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def oversized(source: str, max_module: int = MAX_MODULE_LINES, max_function: int = MAX_FUNCTION_LINES) -> list[str]:
    """What in one module's source is longer than the limits: the module itself, or a function (decorators aside)."""
    found = []
    if len(source.splitlines()) > max_module:
        found.append(f"module: {len(source.splitlines())} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > max_function:
                found.append(f"{node.name}: {length} lines")
    return found


def test_no_module_over_450_lines_and_no_function_over_60():
    found = {str(path.relative_to(ROOT)): oversized(path.read_text()) for path in ROOT.rglob("*.py")}
    assert {path: items for path, items in found.items() if items} == {}


def test_the_size_check_counts_modules_and_nested_functions():
    body = "\n".join(f"        x{i} = {i}" for i in range(3))
    source = f"def outer():\n    def inner():\n{body}\n        return 1\n    return inner\n"  # inner: 5 lines
    assert oversized(source, max_module=7, max_function=7) == []
    assert oversized(source, max_module=6, max_function=5) == ["module: 7 lines", "outer: 7 lines"]
    assert oversized(source, max_function=4) == ["outer: 7 lines", "inner: 5 lines"]


WHOLE_PROJECT_TESTS = ("test_layout.py", "test_readme.py", "test_real_model.py")


def test_the_tests_are_laid_out_like_the_package():
    """Each folder of tests is named after the package it tests (tests/core for tokenloom/core, ...); at the top
    only the tests of the whole: the layout, the README's commands, the real model end to end."""
    tests = Path(__file__).parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders and folders <= packages, folders - packages
    assert {p.name for p in tests.glob("test_*.py")} <= set(WHOLE_PROJECT_TESTS)
