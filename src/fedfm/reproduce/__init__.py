"""Reproduction studies: one command runs a grid of experiments and writes a report in docs/.

Each study is a module in this package that registers a function
``(out: Path, quick: bool) -> Path`` returning the report it wrote.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path

from fedfm.registry import Registry

Study = Callable[[Path, bool], Path]
STUDIES: Registry[Study] = Registry("reproduction", "study")


def load_studies() -> None:
    """Imports every study module so that it registers itself."""
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
