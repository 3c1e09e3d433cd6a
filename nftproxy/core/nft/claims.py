"""Who claims which element of the shared sets and maps.

Layer: nft (pure). One job: the element index of a `TableState` (plan.py).
Two owners (service ports, or the skeleton) may claim the same key of a
shared set: one port deleted and one created with the same cluster IP in
one sync, two ports of one endpoint in `hairpin-endpoints`. The owner whose
name sorts first wins, deterministically, and the next takes over when it
leaves.

The index holds owners, not elements: an owner's elements are in its
committed fragment (`Resolver`), and a table of 10,000 services x 10
endpoints holds ~180,000 claims. Per set name one store, key -> the owner
itself (the overwhelmingly common single claim: no wrapper) or `_Owners`
(two or more, winner first). A claim costs a dict slot (~30 bytes) where an
(set name, key) -> ((owner, element), ...) dict cost ~190; an indexed map's
claim (a chooser's key . endpoint index) costs a list slot in its chooser's
list, and no key tuple.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from nftproxy.core.model import ServicePortName
from nftproxy.core.rules.dispatch import is_indexed_map
from nftproxy.core.rules.fragment import CompactFragment, Element, Key

__all__ = ["ElemId", "ElementIndex", "Owner", "Resolver", "winner_of"]

Owner = ServicePortName | str
ElemId = tuple[str, Key]


class _Owners(tuple[Owner, ...]):
    """Two or more claimants of one key, the winner (first by str) first."""

    __slots__ = ()


def winner_of(owners: Sequence[Owner]) -> Owner | None:
    """Who wins a key the `owners` claim: the first by name (the first of
    equal names), None for nobody."""
    if len(owners) < 2:
        return owners[0] if owners else None
    return min(owners, key=str)


def _order(owners: Iterable[Owner]) -> Owner | _Owners:
    """One claimant bare, more in winner order (stable: equal names keep
    the order they claimed in, so the head is `winner_of` them)."""
    out = tuple(owners)
    return out[0] if len(out) == 1 else _Owners(sorted(out, key=str))


def _as_tuple(claim: Owner | _Owners) -> tuple[Owner, ...]:
    return claim if isinstance(claim, _Owners) else (claim,)


def _head(claim: Owner | _Owners) -> Owner:
    """The winner of a stored claim."""
    return claim[0] if isinstance(claim, _Owners) else claim


Claim = Owner | _Owners


def _with(claim: Claim, owner: Owner) -> Claim:
    """`claim` once `owner` claims the key too (a re-claim moves to the end)."""
    if claim is owner or claim == owner:
        return claim
    return _order([*(o for o in _as_tuple(claim) if o != owner), owner])


def _without(claim: Claim, owner: Owner) -> Claim | None:
    """`claim` once `owner` lets the key go (None: nobody claims it)."""
    if isinstance(claim, _Owners):
        return _order(o for o in claim if o != owner)
    return None if claim is owner or claim == owner else claim


class _FlatClaims(dict[Key, Claim]):
    """A set's claims by key: one dict slot each."""

    __slots__ = ()

    def claim(self, owner: Owner, key: Key) -> None:
        claim = self.get(key)
        if claim is None:
            self[key] = owner
        elif claim is not owner:
            self[key] = _with(claim, owner)

    def release(self, owner: Owner, key: Key) -> bool:
        """Let `owner`'s claim of `key` go; whether no key is claimed now."""
        claim = self.get(key)
        if claim is not None:
            rest = _without(claim, owner)
            if rest is None:
                del self[key]
            else:
                self[key] = rest
        return not self

    def claims(self) -> Iterator[tuple[Key, Claim]]:
        return iter(self.items())


def _split(key: Key) -> tuple[Key, int]:
    index = key[-1]
    if not isinstance(index, int):
        raise TypeError(f"key {key!r} does not end in an endpoint index")
    return key[:-1], index


class _IndexedClaims:
    """An indexed map's claims (keys chooser key . endpoint index 0..N-1),
    by the chooser's key: a list by index, None where nobody claims. A
    chooser of N endpoints costs one dict slot and a list of N, where N
    keys would cost N key tuples and N dict slots."""

    __slots__ = ("_count", "_groups")

    def __init__(self) -> None:
        self._groups: dict[Key, list[Claim | None]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def get(self, key: Key) -> Claim | None:
        index = key[-1]
        group = self._groups.get(key[:-1])
        if group is None or not isinstance(index, int) or index >= len(group):
            return None
        return group[index]

    def __getitem__(self, key: Key) -> Claim:
        claim = self.get(key)
        if claim is None:
            raise KeyError(key)
        return claim

    def claim(self, owner: Owner, key: Key) -> None:
        prefix, index = _split(key)
        group = self._groups.get(prefix)
        if group is None:
            group = self._groups[prefix] = []
        if index >= len(group):
            if index == len(group):  # the common case: claimed in index order
                self._count += 1
                group.append(owner)
                return
            group.extend([None] * (index + 1 - len(group)))
        claim = group[index]
        if claim is None:
            self._count += 1
            group[index] = owner
        elif claim is not owner:
            group[index] = _with(claim, owner)

    def release(self, owner: Owner, key: Key) -> bool:
        """Let `owner`'s claim of `key` go; whether no key is claimed now."""
        prefix, index = _split(key)
        group = self._groups.get(prefix)
        claim = group[index] if group is not None and index < len(group) else None
        if group is None or claim is None:
            return not self._count
        group[index] = rest = _without(claim, owner)
        if rest is None:
            self._count -= 1
            while group and group[-1] is None:
                group.pop()
            if not group:
                del self._groups[prefix]
        return not self._count

    def claims(self) -> Iterator[tuple[Key, Claim]]:
        for prefix, group in self._groups.items():
            for index, claim in enumerate(group):
                if claim is not None:
                    yield (*prefix, index), claim


_Claims = _FlatClaims | _IndexedClaims


class ElementIndex:
    """(set name, key) -> its claimants, winner first. The keys of the maps
    `indexed` names (rules/dispatch.py) are grouped by chooser."""

    __slots__ = ("_indexed", "_sets")

    def __init__(self, indexed: Callable[[str], bool] = is_indexed_map) -> None:
        self._sets: dict[str, _Claims] = {}
        self._indexed = indexed

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._sets.values())

    def items(self) -> Iterator[tuple[ElemId, tuple[Owner, ...]]]:
        """Every claimed element and its claimants, winner first."""
        for name, keys in self._sets.items():
            for key, claim in keys.claims():
                yield (name, key), _as_tuple(claim)

    def ids(self) -> Iterator[ElemId]:
        return (elem_id for elem_id, _ in self.items())

    def _claim(self, set_name: str, key: Key) -> Claim | None:
        keys = self._sets.get(set_name)
        return None if keys is None else keys.get(key)

    def owners(self, set_name: str, key: Key) -> tuple[Owner, ...]:
        """Who claims the element, the winner first (empty: nobody)."""
        claim = self._claim(set_name, key)
        return () if claim is None else _as_tuple(claim)

    def winner(self, set_name: str, key: Key) -> Owner | None:
        claim = self._claim(set_name, key)
        return None if claim is None else _head(claim)

    def won(self, owner: Owner, elements: Iterable[Element]) -> Iterator[Element]:
        """Those of `owner`'s elements that it wins (all claimed by it)."""
        sets = self._sets
        for e in elements:
            winner = _head(sets[e.set_name][e.key])
            if winner is owner or winner == owner:
                yield e

    def _keys(self, set_name: str) -> _Claims:
        keys = self._sets.get(set_name)
        if keys is None:
            indexed = self._indexed(set_name)
            keys = self._sets[set_name] = _IndexedClaims() if indexed else _FlatClaims()
        return keys

    def claim(self, owner: Owner, set_name: str, key: Key) -> None:
        self._keys(set_name).claim(owner, key)

    def release(self, owner: Owner, set_name: str, key: Key) -> None:
        keys = self._sets.get(set_name)
        if keys is not None and keys.release(owner, key):
            del self._sets[set_name]

    def replace(self, owner: Owner, old: Iterable[Element], new: Iterable[Element]) -> None:
        """`owner` claimed `old` (its previous record) and claims `new` now."""
        for e in old:
            self.release(owner, e.set_name, e.key)
        sets = self._sets
        for e in new:
            keys = sets.get(e.set_name) or self._keys(e.set_name)
            keys.claim(owner, e.key)


class Resolver:
    """Owner + element id -> the owner's element, from the committed
    fragments (the last it rendered for the key, as the index claimed them
    in order); each owner's elements are indexed once, when first asked."""

    def __init__(self, fragments: Mapping[Owner, CompactFragment]) -> None:
        self._fragments = fragments
        self._by_owner: dict[Owner, dict[ElemId, Element]] = {}

    def element(self, owner: Owner, elem_id: ElemId) -> Element | None:
        mine = self._by_owner.get(owner)
        if mine is None:
            fragment = self._fragments.get(owner)
            elements = fragment.elements if fragment is not None else ()
            mine = self._by_owner[owner] = {(e.set_name, e.key): e for e in elements}
        return mine.get(elem_id)
