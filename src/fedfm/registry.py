"""Named registries for algorithms, tasks, models, datasets, partitioners and metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from fedfm.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to objects, with a helpful error for unknown names.

    Args:
        kind: What the registry holds, used in messages (e.g. ``"dataset"``).
        field: Config field that selects from it, used in error messages.
    """

    def __init__(self, kind: str, field: str | None = None) -> None:
        self.kind = kind
        self.field = field or kind
        self._items: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        """Decorator that registers ``obj`` under ``name``.

        Args:
            name: Registry key.
            help: One-line description shown by ``fedfm list``.
        """

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self._items[name] = obj
            doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
            self._help[name] = help or (doc[0] if doc else "")
            return obj

        return deco

    def get(self, name: str) -> T:
        """Returns the object registered as ``name``.

        Raises:
            UnknownNameError: ``name`` is not registered.
        """
        if name not in self._items:
            choices = ", ".join(sorted(self._items)) or "none registered"
            raise UnknownNameError(
                self.field, f"unknown {self.kind} '{name}' (choose from {choices})"
            )
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def describe(self) -> list[tuple[str, str]]:
        """Returns ``(name, one-line help)`` pairs sorted by name."""
        return [(n, self._help[n]) for n in self]
