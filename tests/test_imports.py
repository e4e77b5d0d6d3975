"""The package's imports point one way: no cycle, and every edge goes down the layer order.

A static walk: every module under ``src/fedfm`` is parsed and every ``import`` statement in
it counts, those inside functions (a lazy import hides a cycle from Python, not from a reader)
and those under ``if TYPE_CHECKING:`` (a type named in an annotation is a dependency all the
same) included. ``from a import b`` is an edge to ``a.b`` when ``a.b`` is a module, else to
``a``. A package's ``__init__`` running on import of one of its modules is not an edge: it is
how Python loads packages, and registering packages import their own modules.

The layers (DESIGN.md principle 16, :data:`LAYERS`): a module may import its own top-level
package or module and those listed before it, never one listed after it. The core sits below
``config`` and ``data``: it owns the config sections it reads (``core.settings``) and the batch
format it trains on (``core.batching``), which ``config`` and ``data`` re-export.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

SRC = REPO / "src"

LAYERS = (
    "errors",
    "registry",
    "devices",
    "allocator",
    "tblog",
    "core",
    "config",
    "data",
    "models",
    "eval",
    "fm",
    "tasks",
    "algorithms",
    "progress",
    "plots",
    "report",
    "html_report",
    "engine",
    "plan",
    "runtime",
    "harness",
    "measure",
    "analyze",
    "reproduce",
    "integrations",
    "catalog",
    "cli",
    "__main__",
)
"""fedfm's top-level packages and modules, lowest first (docs/design.md draws them)."""


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
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def import_graph() -> dict[str, set[str]]:
    """Module -> fedfm modules it imports anywhere in its text."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def unit(module: str) -> str:
    """The top-level package or module of a fedfm module (``fedfm.core.train`` -> ``core``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level unit -> the other units it imports."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(unit(module), set()).update(
            unit(t) for t in targets if unit(t) != unit(module)
        )
    return out


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


def upward_edges(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Every import of a unit listed after the importing one (or of an unlisted unit)."""
    rank = {name: i for i, name in enumerate(layers)}
    out = []
    for module, targets in sorted(graph.items()):
        me = unit(module)
        for target in sorted(targets):
            them = unit(target)
            if me and them != me and rank.get(them, len(layers)) >= rank.get(me, -1):
                out.append(f"{module} -> {target}")
    return out


def test_the_walk_sees_lazy_and_type_only_imports_and_finds_cycles() -> None:
    graph = import_graph()
    assert "fedfm.core.federation" in graph["fedfm.engine"]
    # An import inside a function body counts (fedfm.cli imports fedfm.report lazily) ...
    assert "fedfm.report" in graph["fedfm.cli"]
    # ... and so does one that only names a type (algorithms.base: `task: Task`).
    assert "fedfm.tasks.base" in graph["fedfm.algorithms.base"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert upward_edges({"fedfm.core.x": {"fedfm.tasks.y"}}, LAYERS) == [
        "fedfm.core.x -> fedfm.tasks.y"
    ]
    assert upward_edges({"fedfm.tasks.y": {"fedfm.core.x"}}, LAYERS) == []


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_cycle_between_packages() -> None:
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package cycle: " + " -> ".join(cycle or [])


def test_every_unit_has_a_layer() -> None:
    units = {unit(m) for m in import_graph()} - {""}
    assert units == set(LAYERS), f"unlisted: {units - set(LAYERS)}, gone: {set(LAYERS) - units}"


def test_imports_go_down_the_layers() -> None:
    up = upward_edges(import_graph(), LAYERS)
    assert not up, "imports against the layer order:\n" + "\n".join(up)


def test_the_engine_imports_no_runtime() -> None:
    assert not {m for m in import_graph()["fedfm.engine"] if m.startswith("fedfm.runtime")}


def test_the_design_doc_draws_the_layers_in_order() -> None:
    doc = (SRC.parent / "docs" / "design.md").read_text(encoding="utf-8")
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    drawn = [
        name.strip("`").removesuffix("/").removesuffix(".py")
        for line in section.splitlines()
        if line.startswith("| `")
        for name in line.split("|")[1].replace(",", " ").split()
    ]
    assert tuple(drawn) == LAYERS
