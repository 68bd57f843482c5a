"""A tiny by-name registry, shared by models, data sets and strategies."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from refdl.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a name to a factory; unknown names raise a UsageError listing the valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@MODELS.register("mlp")``."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a test's or a notebook's own entry, registered again later)."""
        self._items.pop(name, None)

    def get(self, name: str) -> T:
        """The entry for ``name``, or a UsageError that lists the valid names."""
        try:
            return self._items[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self.names(), n=1, cutoff=0.6)
            guess = f"; did you mean {close[0]}?" if close else ""
            raise UsageError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}{guess}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
