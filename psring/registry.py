"""Name -> class registries (strategies, models).

A registry refuses a second registration under the same name (two plugins fighting
over a flag value is a bug to catch at import time) and answers an unknown name with
the list of valid ones.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from psring.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice "
                                 f"({self._items[name]!r} and {obj!r})")
            self._items[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; valid {self.kind} names are: "
                f"{', '.join(self.names())}.") from None

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
