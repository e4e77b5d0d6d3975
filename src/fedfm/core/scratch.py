"""Scratch modules one process builds once and both halves of an algorithm reuse.

On the embedded runtime the server half and every simulated client live in one process; a
model instance that each of them loads with its own tensors before use (the FedAvg family's
model, FedeKD's proxy and private architectures, FedHDS-Turbo's feature model) is built once
and shared, so a process never holds two copies. A scratch module carries no state from one
half to the other: a client handler loads what its message or its own state carries before
it reads the module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

T = TypeVar("T")


class Scratch:
    """Named objects of one process, each built on first use (see the module doc)."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}

    def get(self, key: str, build: Callable[[], T]) -> T:
        """The object named ``key``, built by ``build`` the first time it is asked for.

        Args:
            key: What the object is, including every argument it was built with.
            build: Builds it (called at most once per key).
        """
        if key not in self._items:
            self._items[key] = build()
        return cast(T, self._items[key])

    def __contains__(self, key: object) -> bool:
        return key in self._items
