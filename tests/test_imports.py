"""The package's import graph has no cycle.

A static walk: every module under ``src/fedfm`` is parsed and every ``import`` statement in
it counts, those inside functions included (a lazy import hides a cycle from Python, not from
a reader). Imports under ``if TYPE_CHECKING:`` never run and only name types for annotations,
so they are left out. ``from a import b`` is an edge to ``a.b`` when ``a.b`` is a module, else
to ``a``. A package's ``__init__`` running on import of one of its modules is not an edge: it
is how Python loads packages, and registering packages import their own modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

SRC = REPO / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "fedfm").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` runs a.b.c; keep the longest prefix that is a fedfm module.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if _type_checking(node):
            assert isinstance(node, ast.If)
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> fedfm modules it imports anywhere in its text."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_walk_sees_lazy_imports_and_finds_cycles() -> None:
    graph = import_graph()
    assert "fedfm.core.federation" in graph["fedfm.engine"]
    # An import inside a function body counts (fedfm.cli imports fedfm.report lazily) ...
    assert "fedfm.report" in graph["fedfm.cli"]
    # ... one that only names a type does not (core.federation: `task: Task`).
    assert "fedfm.tasks.base" not in graph["fedfm.core.federation"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_engine_imports_no_runtime() -> None:
    assert not {m for m in import_graph()["fedfm.engine"] if m.startswith("fedfm.runtime")}
