"""A read-only, hashable mapping, so that frozen spec dataclasses stay hashable."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenDict(Mapping[K, V]):
    """An immutable ``dict`` view that keeps insertion order and can be hashed.

    ``Mapping`` supplies ``==`` against any mapping (a plain ``dict`` included).
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[K, V] | None = None, /) -> None:
        self._data: dict[K, V] = dict(data or {})
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (self._data,))
