"""Algorithm presets: a registered algorithm under another name, with other defaults.

A variant that differs from an algorithm only in values of its ``algo`` section (FedRD
without φ is FedRD with ``reprogram: false``; the ungated KD baseline is FedeKD with
``gate: ungated``) is not a subclass: :func:`register_preset` registers the base algorithm's
class under the variant's name in ``ALGORITHMS`` and keeps its values, and the engine
validates a run's ``algo`` section with them (:func:`algo_section`), so
``algorithm: fedrd-nophi`` works in a config as any algorithm name does. A default yields to
a key the config sets; a fixed value is what makes the variant, and a config that sets it to
another value is refused, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedfm.algorithms.base import ALGORITHMS
from fedfm.errors import ConfigError

PRESET_DEFAULTS: dict[str, dict[str, Any]] = {}
"""Preset name -> the ``algo`` defaults it sets over its base algorithm's."""
PRESET_FIXED: dict[str, tuple[str, dict[str, Any]]] = {}
"""Preset name -> (its base algorithm, the ``algo`` values that define it)."""


def register_preset(
    name: str, base: str, help: str, fixed: Mapping[str, Any] | None = None, **defaults: Any
) -> None:
    """Registers algorithm ``base`` as ``name`` with other ``algo`` values.

    Args:
        name: The preset's algorithm name (``algorithm: NAME``).
        base: A registered algorithm.
        help: One-line description (``fedfm list``).
        fixed: Values that define the variant: a config may repeat them, not change them.
        **defaults: Fields of the base algorithm's config and the preset's values for them.

    Raises:
        pydantic.ValidationError: A value the base algorithm's config refuses (at import).
    """
    algo = ALGORITHMS.get(base)
    algo.Config.model_validate({**defaults, **(fixed or {})})
    ALGORITHMS.register(name, help)(algo)
    PRESET_DEFAULTS[name] = dict(defaults)
    if fixed:
        PRESET_FIXED[name] = (base, dict(fixed))


def algo_section(name: str, section: Mapping[str, Any]) -> dict[str, Any]:
    """A run's ``algo`` section for algorithm ``name``, with the values of its preset.

    Raises:
        ConfigError: ``section`` changes a value the preset fixes.
    """
    base, fixed = PRESET_FIXED.get(name, (name, {}))
    for key, value in fixed.items():
        if key in section and section[key] != value:
            raise ConfigError(
                f"algo.{key}",
                f"algorithm '{name}' is {base} with {key}={value!r}, got {section[key]!r};"
                f" for another {key}, run algorithm {base}",
            )
    return {**PRESET_DEFAULTS.get(name, {}), **section, **fixed}
