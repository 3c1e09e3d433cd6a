"""A key -> object store that keeps each object packed as canonical JSON bytes.

Layer: sources (pure: no I/O, imports cluster.events only). One job: hold
an informer's objects (cluster/informer.py) compactly and read them back:
`PackedStore` maps a key to one packed object, `PackedStore.view` is a
read-only `Mapping[str, Obj]` over it that decodes on access, `Changes` is
a sequence of (previous, current) pairs kept packed and decoded when read,
and `difference` is what changed from one store to another.

Packed form (`pack`): JSON with compact separators, sorted keys and ASCII
only. Canonical, so equal objects pack to equal bytes whatever their key
order, and "did this object change?" is a comparison of bytes; ASCII
(\\u escapes), so every string `json.loads` accepts -- a lone surrogate
included -- packs without error. Decoded objects (`unpack`) are equal to
the packed ones, with their keys in sorted order.

Why: packed, the two stores take a fraction of the memory they take as
dicts, and packing or decoding one object costs microseconds
(bench/RESULTS.md, "What moved the numbers"). zlib on top halves the bytes
again but doubles the packing time, and marshal or pickle (after sorting
keys) save a fifth for more time; so plain canonical JSON.

Metadata only (`PackedStore(metadata_only=True)`, EndpointSlices): the
store keeps, of each object, a digest of its packed form (16 bytes of
BLAKE2b: "did it change?" stays a comparison of bytes) and its kind,
apiVersion and metadata packed; the previous object it gives back (a delete,
an update's `previous`, `view`) is that head. The proxier reads only the
name, namespace and labels of a slice it is told is gone, and a digest
and head are a small part of a slice's packed form.

Not thread-safe: one thread writes a store (the informer's); readers of
`view` run in that thread (its `deliver` callback).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import overload

from nftproxy.cluster.events import Obj

__all__ = [
    "Change", "Changes", "PackedChange", "PackedStore", "difference", "head", "pack", "unpack",
    "unpacked",
]

Change = tuple[Obj | None, Obj | None]
"""(previous, current): previous None is an add, current None a delete."""
PackedChange = tuple[bytes | None, bytes | None]

_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True)


def pack(obj: Obj) -> bytes:
    """`obj` as canonical JSON bytes (compact, sorted keys, ASCII)."""
    return _ENCODER.encode(obj).encode("ascii")


def unpack(data: bytes) -> Obj:
    """The object `pack` packed into `data`."""
    obj: Obj = json.loads(data)
    return obj


_DIGEST = 16
"""Bytes of BLAKE2b that stand for a metadata-only store's object."""

_HEAD = ("apiVersion", "kind", "metadata")


def head(obj: Obj) -> Obj:
    """What a metadata-only store keeps of `obj`: kind, apiVersion, metadata."""
    return {k: obj[k] for k in _HEAD if k in obj}


def unpacked(data: bytes | None) -> Obj | None:
    """`unpack`, None for None (an absent side of a change)."""
    return None if data is None else unpack(data)


class _View(Mapping[str, Obj]):
    """A read-only Mapping over a store's values: decodes each on access."""

    __slots__ = ("_data", "_skip")

    def __init__(self, data: Mapping[str, bytes], skip: int) -> None:
        self._data = data
        self._skip = skip

    def __getitem__(self, key: str) -> Obj:
        return unpack(self._data[key][self._skip:])

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data


class PackedStore:
    """key -> one stored value: the packed object (`pack`), or with
    `metadata_only` its digest and packed head; `view` reads the objects
    (or heads) back."""

    __slots__ = ("_data", "_skip", "view")

    def __init__(self, *, metadata_only: bool = False) -> None:
        self._data: dict[str, bytes] = {}
        self._skip = _DIGEST if metadata_only else 0
        self.view: Mapping[str, Obj] = _View(self._data, self._skip)

    def __len__(self) -> int:
        return len(self._data)

    def value(self, obj: Obj, data: bytes) -> bytes:
        """What this store keeps for `obj`, packed as `data` (equal objects,
        equal values; a changed object, a changed value)."""
        if not self._skip:
            return data
        return hashlib.blake2b(data, digest_size=_DIGEST).digest() + pack(head(obj))

    def kept(self, value: bytes | None) -> bytes | None:
        """The packed object (or head) in a stored `value`."""
        return None if value is None else value[self._skip:]

    def packed(self, key: str) -> bytes | None:
        """The value stored at `key`, or None."""
        return self._data.get(key)

    def put(self, key: str, value: bytes) -> bytes | None:
        """Store `value` (see `value`) at `key`; the value it replaces, or None."""
        old = self._data.get(key)
        self._data[key] = value
        return old

    def pop(self, key: str) -> bytes | None:
        """Remove `key`; the value it held, or None."""
        return self._data.pop(key, None)

    def items(self) -> Iterator[tuple[str, bytes]]:
        """(key, stored value) pairs."""
        return iter(self._data.items())


class Changes(Sequence[Change]):
    """(previous, current) pairs kept packed; each is decoded when read, so
    a long list (an informer's first list) never holds its objects decoded
    all at once."""

    __slots__ = ("_pairs",)

    def __init__(self, pairs: Sequence[PackedChange]) -> None:
        self._pairs = pairs

    def __len__(self) -> int:
        return len(self._pairs)

    def __iter__(self) -> Iterator[Change]:
        for previous, current in self._pairs:
            yield unpacked(previous), unpacked(current)

    @overload
    def __getitem__(self, index: int) -> Change: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Change]: ...

    def __getitem__(self, index: int | slice) -> Change | Sequence[Change]:
        if isinstance(index, slice):
            return Changes(self._pairs[index])
        previous, current = self._pairs[index]
        return unpacked(previous), unpacked(current)


def difference(old: PackedStore, new: PackedStore, current: Mapping[str, bytes]) -> Changes:
    """From `old` to `new`: deletes, then adds and updates of the objects
    whose stored values differ; `current` holds the packed objects of `new`
    (a metadata-only store does not), a deleted object is what `old` kept."""
    pairs: list[PackedChange] = [(old.kept(value), None) for key, value in old.items()
                                 if new.packed(key) is None]
    pairs += [(old.kept(before), current[key]) for key, value in new.items()
              if (before := old.packed(key)) != value]
    return Changes(pairs)
