"""The source registry: what a source is, what loading one gives, and the loader.

A source is a :class:`SourceInfo`, loading one gives a :class:`LoadedSource`, and
:func:`load_source` caches per process on (name, options).
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets

from fedfm.errors import ConfigError
from fedfm.registry import Registry

KINDS = (
    "tabular-classification",
    "tabular-regression",
    "image-classification",
    "text-classification",
    "instruction",
    "text",
)


@dataclass(frozen=True)
class SourceInfo:
    """What a source is and where it comes from.

    Attributes:
        name: Registry name.
        kind: One of :data:`KINDS`.
        package: Pinned package (or Debian package) that carries the data.
        license: Licence of the package and, where known, of the upstream data.
        description: One line: content and size.
    """

    name: str
    kind: str
    package: str
    license: str
    description: str


@dataclass
class LoadedSource:
    """A loaded source.

    Attributes:
        info: Its :class:`SourceInfo`.
        train: Training rows.
        test: The source's own held-out split, or ``None`` (the task then splits ``train``).
        num_classes: Number of classes for classification sources, else ``None``.
        class_names: Class names, index = label, else ``None``.
        feature_names: Names of the entries of ``x`` (tabular only).
    """

    info: SourceInfo
    train: datasets.Dataset
    test: datasets.Dataset | None
    num_classes: int | None = None
    class_names: list[str] | None = None
    feature_names: list[str] | None = None


SOURCES: Registry[Callable[..., LoadedSource]] = Registry("dataset", "task.dataset")
_INFOS: dict[str, SourceInfo] = {}
OPTIONS_FIELD = "task.source_options"


def register_source(info: SourceInfo) -> Callable[[Callable[..., LoadedSource]], Any]:
    """Decorator registering a loader under ``info.name`` with help naming package and licence."""
    if info.kind not in KINDS:
        raise ValueError(f"source '{info.name}': unknown kind '{info.kind}'")

    def deco(fn: Callable[..., LoadedSource]) -> Callable[..., LoadedSource]:
        _INFOS[info.name] = info
        help_line = f"{info.description} [{info.package}; {info.license}]"
        return SOURCES.register(info.name, help=help_line)(fn)

    return deco


def source_info(name: str) -> SourceInfo:
    """Returns the :class:`SourceInfo` of a registered source (raises UnknownNameError)."""
    SOURCES.get(name)
    return _INFOS[name]


def load_source(name: str, **options: Any) -> LoadedSource:
    """Loads a registered source, cached in-process on ``(name, options)``.

    Args:
        name: Registry name, e.g. ``"breast_cancer"``.
        **options: Source-specific options (JSON-serialisable), e.g. ``drop_plot=False``.

    Raises:
        UnknownNameError: No such source.
        ConfigError: An option the source does not take, or a missing required one.
        AssetMissingError: The package or file carrying the data is not installed.
    """
    loader = SOURCES.get(name)
    params = inspect.signature(loader).parameters
    for key in options:
        if key not in params:
            known = ", ".join(params) or "none"
            raise ConfigError(
                f"{OPTIONS_FIELD}.{key}", f"source '{name}' takes no option '{key}' ({known})"
            )
    for key, p in params.items():
        if p.default is inspect.Parameter.empty and key not in options:
            raise ConfigError(f"{OPTIONS_FIELD}.{key}", f"source '{name}' needs option '{key}'")
    try:
        frozen = json.dumps(options, sort_keys=True)
    except TypeError as exc:
        raise ConfigError(OPTIONS_FIELD, f"options must be plain values: {exc}") from None
    return _load_cached(name, frozen)


@functools.lru_cache(maxsize=32)
def _load_cached(name: str, frozen_options: str) -> LoadedSource:
    return SOURCES.get(name)(**json.loads(frozen_options))
