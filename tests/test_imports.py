"""The package's shape: no import cycle between its modules, no function too long to read.

Both read the source with ``ast`` (nothing is imported). An import counts when it runs as its
module is imported: at module level, in a class body or under a module-level ``if`` / ``try``;
not inside a function (a lazy import) and not under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sglang_tree_spec"
MAX_FUNCTION_LINES = 80  # def line to last line: a longer function reads as several


def module_name(path: Path) -> str:
    """``.../sglang_tree_spec/plugin/hooks.py`` -> ``sglang_tree_spec.plugin.hooks``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def eager_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                pending += node.body
            pending += node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            pending += [stmt for handler in node.handlers for stmt in handler.body]
        elif isinstance(node, ast.ClassDef | ast.With):
            pending += node.body
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports eagerly (``from pkg import mod`` is ``pkg.mod``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in eager_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        for alias in node.names:
            edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {edge for edge in edges if edge in known and edge != name}


@cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports eagerly."""
    paths = modules()
    return {name: imported_modules(name, path, set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per back edge of a depth-first walk; none for a DAG."""
    found: list[list[str]] = []
    state: dict[str, str] = {}  # "open" on the walk's path, "done" once left
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return found


def test_the_import_graph_is_read_from_the_source():
    graph = import_graph()
    assert "sglang_tree_spec.plugin.hook" in graph["sglang_tree_spec.plugin.hooks"]
    assert "sglang_tree_spec.plugin.compat" in graph["sglang_tree_spec.plugin.entry"]
    # ``from sglang_tree_spec.plugin import compat`` imports the module, not the package
    assert "sglang_tree_spec.plugin.compat" in graph["sglang_tree_spec.plugin.worker"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in found)


def function_lengths() -> list[tuple[str, int]]:
    """``(module.function, lines from its def line to its last line)`` of every function,
    methods and nested functions included."""
    lengths = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths.append((f"{name}.{node.name}", node.end_lineno - node.lineno + 1))
    return lengths


def test_no_function_is_longer_than_the_limit():
    lengths = function_lengths()
    assert "sglang_tree_spec.plugin.worker._decode" in dict(lengths)  # methods count too
    long = [f"{name} ({lines} lines)" for name, lines in lengths if lines > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"
