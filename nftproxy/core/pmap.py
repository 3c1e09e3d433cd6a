"""A read-only mapping whose changed copy shares what did not change.

Layer: core (pure). One job: the value the trackers and the health tally
hand out as "the whole map as of this sync". Snapshots must not see later
changes, and copying the whole dict at each change would make every partial
sync cost in proportion to the cluster (each copy increfs every entry,
spread over the heap).

`PersistentMap` keeps its entries in SHARDS dicts by key hash. `edit()`
returns a `MapEdit` that copies a shard at its first change; `done()` gives
the new map, which shares every other shard with the old one. So a change
costs ~1/SHARDS of a copy, the old map stays valid, and reads are one hash
and one dict lookup.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView
from itertools import chain
from typing import Generic, TypeVar, overload

__all__ = ["SHARDS", "MapEdit", "PersistentMap"]

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")

SHARDS = 64
_MASK = SHARDS - 1


class PersistentMap(Mapping[K, V]):
    """An immutable mapping; `edit()` derives a changed one cheaply."""

    __slots__ = ("_len", "_shards")

    def __init__(self, entries: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        shards: list[dict[K, V]] = [{} for _ in range(SHARDS)]
        pairs = entries.items() if isinstance(entries, Mapping) else entries
        for key, value in pairs:
            shards[hash(key) & _MASK][key] = value
        self._shards: tuple[dict[K, V], ...] = tuple(shards)
        self._len = sum(map(len, shards))

    @classmethod
    def _of(cls, shards: tuple[dict[K, V], ...], size: int) -> PersistentMap[K, V]:
        out: PersistentMap[K, V] = cls.__new__(cls)
        out._shards, out._len = shards, size
        return out

    def __getitem__(self, key: K) -> V:
        return self._shards[hash(key) & _MASK][key]

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, default: V | D, /) -> V | D: ...
    def get(self, key: K, default: object = None, /) -> object:
        return self._shards[hash(key) & _MASK].get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) & _MASK]

    def __iter__(self) -> Iterator[K]:
        return chain.from_iterable(self._shards)

    def __len__(self) -> int:
        return self._len

    def items(self) -> ItemsView[K, V]:
        return _Items(self)

    def values(self) -> ValuesView[V]:
        return _Values(self)

    def edit(self) -> MapEdit[K, V]:
        return MapEdit(self)

    def __repr__(self) -> str:
        return f"PersistentMap({dict(self.items())!r})"


class _Items(ItemsView[K, V]):
    __slots__ = ()
    _mapping: PersistentMap[K, V]

    def __iter__(self) -> Iterator[tuple[K, V]]:
        return chain.from_iterable(s.items() for s in self._mapping._shards)


class _Values(ValuesView[V]):
    __slots__ = ()
    _mapping: PersistentMap[object, V]

    def __iter__(self) -> Iterator[V]:
        return chain.from_iterable(s.values() for s in self._mapping._shards)


class MapEdit(Generic[K, V]):
    """Changes to a PersistentMap: a shard is copied at its first change,
    so the map it started from never changes."""

    __slots__ = ("_copied", "_len", "_shards")

    def __init__(self, base: PersistentMap[K, V]) -> None:
        self._shards = list(base._shards)
        self._copied: set[int] = set()
        self._len = base._len

    def _own(self, index: int) -> dict[K, V]:
        if index not in self._copied:
            self._shards[index] = dict(self._shards[index])
            self._copied.add(index)
        return self._shards[index]

    def __setitem__(self, key: K, value: V) -> None:
        shard = self._own(hash(key) & _MASK)
        if key not in shard:
            self._len += 1
        shard[key] = value

    def pop(self, key: K, default: V | None = None) -> V | None:
        index = hash(key) & _MASK
        if key not in self._shards[index]:
            return default
        self._len -= 1
        return self._own(index).pop(key)

    def __delitem__(self, key: K) -> None:
        index = hash(key) & _MASK
        if key not in self._shards[index]:
            raise KeyError(key)
        self.pop(key)

    def done(self) -> PersistentMap[K, V]:
        """The changed map. Later changes through this edit copy again."""
        self._copied = set()
        return PersistentMap._of(tuple(self._shards), self._len)
