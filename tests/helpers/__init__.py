"""Shared test support: config builders, run-file readers, tiny models, the Flower grid.

Test modules import from here (``from helpers.config import make_config``), never from each other;
fixtures live in ``tests/conftest.py``. Plugin modules that Flower processes import by name
(``helpers.flower``, ``helpers.seed_probe``) are importable from the ``tests`` folder, which
``plugin_pythonpath`` puts on a child's ``PYTHONPATH``.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # the tests folder: ``helpers`` imports from it
REPO = TESTS.parent  # the checkout: src/, docs/, benchmarks/
