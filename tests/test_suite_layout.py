"""The test suite's own shape: test modules share through ``helpers`` and ``conftest.py``.

No test module imports another (its fixtures would run, or not, depending on what else was
collected, and a helper's change would ripple through unrelated files), nor names one as a
plugin for Flower processes to import. Unit tests lie in ``tests/unit/<package>``, the tests
that run several parts together (processes, resume, the documentation's commands) in
``tests/integration``; module names are unique across the tree, as pytest's import of
test files without packages requires.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from helpers import REPO, TESTS

# Test folders of fedfm's parts: its packages, and "cli" for the command and the top-level
# modules behind it (config, plan, report, html_report, devices, harness).
UNIT = {
    "algorithms", "cli", "core", "data", "eval", "fm", "integrations", "models", "reproduce",
    "runtime", "tasks",
}  # fmt: skip
TOP = {"test_imports.py", "test_suite_layout.py"}  # checks of the whole tree


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "helpers" not in p.parts)


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "lm_eval_tasks" not in p.parts)


def _imported(tree: ast.AST, strings: bool = True) -> set[str]:
    """Top-level names of every module imported anywhere in ``tree``, and (with ``strings``)
    every string that could name one (the ``imports`` option lists modules as strings)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value.split(".")[0])
    return found


def test_no_test_module_imports_another() -> None:
    tests = {p.stem for p in _test_files()} | {"conftest"}
    bad = []
    for path in _python_files():
        # This module's strings name test modules to check the check itself.
        tree = ast.parse(path.read_text(), str(path))
        named = (_imported(tree, strings=path != Path(__file__)) & tests) - {path.stem}
        bad += [f"{path.relative_to(TESTS)} imports {n}" for n in sorted(named)]
    assert not bad, "share through tests/helpers or conftest.py instead:\n" + "\n".join(bad)


def test_the_check_sees_an_import_between_test_modules() -> None:
    code = "from test_flower import FakeGrid\n\ndef f():\n    import test_fm\n"
    opts = '{"imports": ["helpers.flower", "test_federation"]}'
    assert _imported(ast.parse(code)) >= {"test_flower", "test_fm"}
    assert "test_federation" in _imported(ast.parse(opts))


def test_tests_lie_by_package_and_integration_apart() -> None:
    misplaced = []
    for path in _test_files():
        rel = path.relative_to(TESTS).parts
        ok = (
            (len(rel) == 1 and rel[0] in TOP)
            or (len(rel) == 3 and rel[0] == "unit" and rel[1] in UNIT)
            or (len(rel) == 2 and rel[0] == "integration")
        )
        if not ok:
            misplaced.append("/".join(rel))
    assert not misplaced, misplaced
    assert {p.name for p in (TESTS / "unit").iterdir() if p.is_dir()} <= UNIT
    # Each unit folder names a part of fedfm that exists.
    src = REPO / "src" / "fedfm"
    assert all((src / d).is_dir() or (src / f"{d}.py").is_file() for d in UNIT - {"cli"})


def test_test_module_names_are_unique() -> None:
    names = Counter(p.name for p in _test_files())
    assert [n for n, c in names.items() if c > 1] == []
