"""Algorithm presets: a registered algorithm under another name, with other defaults.

A variant that differs from an algorithm only in defaults of its ``algo`` section (FedRD
without φ is FedRD with ``reprogram: false``) is not a subclass: :func:`register_preset`
registers the base algorithm's class under the variant's name in ``ALGORITHMS`` and keeps
the defaults, and the engine validates a run's ``algo`` section with them underneath
(:func:`algo_section`), so ``algorithm: fedrd-nophi`` works in a config as any algorithm
name does, and a key the config sets wins over the preset's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedfm.algorithms.base import ALGORITHMS

PRESET_DEFAULTS: dict[str, dict[str, Any]] = {}
"""Preset name -> the ``algo`` defaults it sets over its base algorithm's."""


def register_preset(name: str, base: str, help: str, **defaults: Any) -> None:
    """Registers algorithm ``base`` as ``name`` with other ``algo`` defaults.

    Args:
        name: The preset's algorithm name (``algorithm: NAME``).
        base: A registered algorithm.
        help: One-line description (``fedfm list``).
        **defaults: Fields of the base algorithm's config and the preset's values for them.

    Raises:
        pydantic.ValidationError: A default the base algorithm's config refuses (at import).
    """
    algo = ALGORITHMS.get(base)
    algo.Config.model_validate(defaults)
    ALGORITHMS.register(name, help)(algo)
    PRESET_DEFAULTS[name] = dict(defaults)


def algo_section(name: str, section: Mapping[str, Any]) -> dict[str, Any]:
    """A run's ``algo`` section for algorithm ``name``, over the defaults of its preset."""
    return {**PRESET_DEFAULTS.get(name, {}), **section}
