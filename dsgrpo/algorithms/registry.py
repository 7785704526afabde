"""A tiny name → function registry: one fixed signature per registry, duplicate names refused, unknown
names answered with the known ones. Callers never special-case a variant's name."""

from __future__ import annotations

from typing import Callable, Dict, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: Dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def wrap(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._items[name]!r}).")
            self._items[name] = fn
            return fn

        return wrap

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"Unknown {self.kind} {name!r}; known: {sorted(self._items)}.") from None

    def names(self) -> list:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
