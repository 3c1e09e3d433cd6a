"""Who claims which element of the shared sets and maps.

Layer: nft (pure). One job: the element index of a `TableState` (plan.py).
Two owners (service ports, or the skeleton) may claim the same key of a
shared set: one port deleted and one created with the same cluster IP in
one sync, two ports of one endpoint in `hairpin-endpoints`. The owner whose
name sorts first wins, deterministically, and the next takes over when it
leaves.

The index holds owners, not elements: an owner's elements are in its
committed fragment (`Resolver`), and a table of 10,000 services holds
~120,000 claims. Per set name one dict, key -> the owner itself (the
overwhelmingly common single claim: no wrapper) or `_Owners` (two or more,
winner first). A claim costs a dict slot (~30 bytes), where an (set name,
key) -> ((owner, element), ...) dict cost ~190 (10,000 services x 10
endpoints: one table's committed state 55.7 -> 35.2 MB).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from nftproxy.core.model import ServicePortName
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


_NOBODY: Mapping[Key, Owner | _Owners] = {}


class ElementIndex:
    """(set name, key) -> its claimants, winner first."""

    __slots__ = ("_sets",)

    def __init__(self) -> None:
        self._sets: dict[str, dict[Key, Owner | _Owners]] = {}

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._sets.values())

    def items(self) -> Iterator[tuple[ElemId, tuple[Owner, ...]]]:
        """Every claimed element and its claimants, winner first."""
        for name, keys in self._sets.items():
            for key, claim in keys.items():
                yield (name, key), _as_tuple(claim)

    def ids(self) -> Iterator[ElemId]:
        return (elem_id for elem_id, _ in self.items())

    def owners(self, set_name: str, key: Key) -> tuple[Owner, ...]:
        """Who claims the element, the winner first (empty: nobody)."""
        claim = self._sets.get(set_name, _NOBODY).get(key)
        return () if claim is None else _as_tuple(claim)

    def winner(self, set_name: str, key: Key) -> Owner | None:
        claim = self._sets.get(set_name, _NOBODY).get(key)
        return None if claim is None else _head(claim)

    def won(self, owner: Owner, elements: Iterable[Element]) -> Iterator[Element]:
        """Those of `owner`'s elements that it wins (all claimed by it)."""
        sets = self._sets
        for e in elements:
            winner = _head(sets[e.set_name][e.key])
            if winner is owner or winner == owner:
                yield e

    def claim(self, owner: Owner, set_name: str, key: Key) -> None:
        keys = self._sets.get(set_name)
        if keys is None:
            keys = self._sets[set_name] = {}
        claim = keys.get(key)
        if claim is None:
            keys[key] = owner
        elif claim is not owner and claim != owner:  # a re-claim moves to the end
            keys[key] = _order([*(o for o in _as_tuple(claim) if o != owner), owner])

    def release(self, owner: Owner, set_name: str, key: Key) -> None:
        keys = self._sets.get(set_name)
        if keys is None or (claim := keys.get(key)) is None:
            return
        if isinstance(claim, _Owners):
            keys[key] = _order(o for o in claim if o != owner)
        elif claim is owner or claim == owner:
            del keys[key]
            if not keys:
                del self._sets[set_name]

    def replace(self, owner: Owner, old: Iterable[Element], new: Iterable[Element]) -> None:
        """`owner` claimed `old` (its previous record) and claims `new` now."""
        for e in old:
            self.release(owner, e.set_name, e.key)
        for e in new:
            self.claim(owner, e.set_name, e.key)


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
