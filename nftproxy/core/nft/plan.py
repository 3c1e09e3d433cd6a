"""Last committed state + desired fragments -> one ordered JSON transaction.

Layer: nft (pure; no kernel access). One job: diff. `TableState` is the
in-memory record of what the last successful commit put in one family's
table. `stage_partial` (changed owners only), `stage_full` (everything,
against a `TableListing` of what the kernel holds) and `stage_gc` (deferred deletes)
return a `Staged` value: the commands, and a `commit()` that records them in
the state once the kernel has accepted them. Nothing is recorded for a
transaction the kernel refused, so a failed commit leaves the state as it was.

Command order inside one transaction (docs/nft-python-notes.md §2):
  1 add table (full) / delete base chains whose hook changed
  2 flush chains that are rewritten or go away
  3 delete map/set elements that go away or change verdict (delete + add)
  4 delete sets that go away or are re-declared (their rules were flushed in 2)
  5 add sets, refill changed static sets
  6 add chains, add rules
  7 add elements (their goto targets exist since 6)
  8 delete chains that went away -- or, after the kernel refused that with
    EBUSY (kernels < 6.2 notice a lost vmap reference asynchronously), leave
    them flushed and delete them in a later `stage_gc` transaction.
A chain or set several owners share (`fragment.Shared`: a chooser, the map
it picks from) is added by the transaction that gives it its first user and
deleted by the one that takes its last (`TableState.users`). Affinity sets
are dynamic (filled by the datapath): never flushed, so a full sync keeps
every client's affinity.

The state is lean (`CompactFragment`): per chain a digest, no rules; per
owner its elements packed, unpacked only for an owner that changes. Every
rule and element a transaction adds comes from the freshly rendered
fragments handed in; the state only decides what changed and what to
delete. Its element index (claims.py) records who claims each shared-set
key, not the elements: those are in the owners' records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from nftproxy.core.model import IPFamily
from nftproxy.core.nft.claims import ElementIndex, ElemId, Owner, Resolver, winner_of
from nftproxy.core.nft.commands import Command
from nftproxy.core.nft.listing import ListedSet, TableListing
from nftproxy.core.nft.ops import Table
from nftproxy.core.rules.fragment import (
    Chain,
    CompactChain,
    CompactFragment,
    Element,
    Fragment,
    SetDecl,
    Shared,
    compact,
)

__all__ = [
    "SKELETON",
    "ElementIndex",
    "Owner",
    "Staged",
    "TableState",
    "stage_full",
    "stage_gc",
    "stage_partial",
]

SKELETON = "skeleton"


def _same_key(t: Table, decl: SetDecl, ks: ListedSet) -> bool:
    """A key listed by typeof (1.1.x) must be the one `t` declares; one
    listed by datatypes (1.0.6 lists every set so) must have decl's."""
    if ks.typeof is not None:
        return ks.typeof == t.declared_typeof(decl)
    return ks.type == decl.type


def _same_declaration(t: Table, decl: SetDecl, ks: ListedSet) -> bool:
    flags = {f for f in decl.flags if f != "dynamic"}
    kflags = {f for f in ks.flags if f != "dynamic"}
    same = (decl.map, flags, decl.timeout) == (ks.map, kflags, ks.timeout)
    return same and _same_key(t, decl, ks)


@dataclass
class TableState:
    """The last committed content of one family's table (mutable, owned by
    the proxier, changed only through Staged.commit)."""

    family: IPFamily
    table: Table
    fragments: dict[Owner, CompactFragment] = field(default_factory=dict)
    chains: dict[str, CompactChain] = field(default_factory=dict)
    sets: dict[str, SetDecl] = field(default_factory=dict)
    index: ElementIndex = field(default_factory=ElementIndex)
    stale_chains: set[str] = field(default_factory=set)
    stale_sets: dict[str, bool] = field(default_factory=dict)
    """Flushed-but-not-deleted objects awaiting stage_gc (set name -> is map)."""
    rule_count: int = 0
    """Rules in `chains`, kept as owners are adopted."""
    users: Counter[str] = field(default_factory=Counter)
    """How many owners' records use each shared chain and set (`_keyed`)."""

    def adopt(
        self, owner: Owner, fragment: Fragment | None, record: CompactFragment | None = None
    ) -> None:
        """Record `owner`'s freshly rendered fragment (None: it is gone);
        `record`: its compact form, if already made."""
        if fragment is None:
            self.keep(owner, None, ())
        else:
            self.keep(owner, record or compact(fragment), fragment.elements)

    def keep(
        self,
        owner: Owner,
        fragment: CompactFragment | None,
        elements: Sequence[Element],
        old_elements: Sequence[Element] | None = None,
    ) -> None:
        """Record `fragment` for `owner`; `elements` are its elements as
        rendered (the index keeps their keys: none is unpacked for it),
        `old_elements` those of its record, if already unpacked."""
        old = self.fragments.pop(owner, None)
        if old is not None:
            for c in old.chains:
                self._drop_chain(c.name)
            for s in old.sets:
                self.sets.pop(s.name, None)
            self._release(old.shared)
        if fragment is not None:
            self.fragments[owner] = fragment
            for c in fragment.chains:
                self._add_chain(c)
            self.sets.update((s.name, s) for s in fragment.sets)
            self._use(fragment.shared)
        if old_elements is None:
            old_elements = old.elements if old else ()
        self.index.replace(owner, old_elements, elements)

    def take(self, fresh: TableState) -> None:
        """Become `fresh` (a state built for a full sync), keeping identity."""
        self.fragments, self.chains, self.sets = fresh.fragments, fresh.chains, fresh.sets
        self.index, self.stale_chains, self.stale_sets = (
            fresh.index,
            fresh.stale_chains,
            fresh.stale_sets,
        )
        self.rule_count, self.users = fresh.rule_count, fresh.users

    def effective(self, elem_id: ElemId) -> Element | None:
        """The element the kernel holds for the id: its winner's."""
        owner = self.index.winner(*elem_id)
        return None if owner is None else Resolver(self.fragments).element(owner, elem_id)

    def _add_chain(self, chain: CompactChain) -> None:
        self._drop_chain(chain.name)
        self.chains[chain.name] = chain
        self.rule_count += chain.size

    def _drop_chain(self, name: str) -> None:
        gone = self.chains.pop(name, None)
        if gone is not None:
            self.rule_count -= gone.size

    def _use(self, shared: Sequence[Shared]) -> None:
        for key, obj in _keyed(shared, _records):
            if not self.users[key]:
                if isinstance(obj, SetDecl):
                    self.sets[obj.name] = obj
                else:
                    self._add_chain(obj)
            self.users[key] += 1

    def _release(self, shared: Sequence[Shared]) -> None:
        for key, obj in _keyed(shared, _records):
            self.users[key] -= 1
            if not self.users[key]:
                del self.users[key]
                if isinstance(obj, SetDecl):
                    self.sets.pop(obj.name, None)
                else:
                    self._drop_chain(obj.name)

_C = TypeVar("_C", Chain, CompactChain)


def _keyed(
    shared: Sequence[Shared], chains: Callable[[Shared], Sequence[_C]]
) -> Iterator[tuple[str, _C | SetDecl]]:
    """Each object of the bundles with its key in `TableState.users` (a set's
    name behind "@": chains and sets are named apart), each chain as
    `chains` gives it (its record, or as rendered)."""
    for s in shared:
        yield from ((c.name, c) for c in chains(s))
        yield from (("@" + d.name, d) for d in s.sets)


def _records(shared: Shared) -> Sequence[CompactChain]:
    return shared.records


def _rendered(shared: Shared) -> Sequence[Chain]:
    return shared.chains


@dataclass
class _Batch:
    """Commands collected per phase, concatenated in phase order."""

    head: list[Command] = field(default_factory=list)
    flush: list[Command] = field(default_factory=list)
    del_elems: dict[str, list[Element]] = field(default_factory=dict)
    del_sets: list[Command] = field(default_factory=list)
    add_sets: list[Command] = field(default_factory=list)
    add_chains: list[Command] = field(default_factory=list)
    add_rules: list[Command] = field(default_factory=list)
    static_elems: list[Command] = field(default_factory=list)
    """The skeleton's own elements, after the chains (a root map's goto)."""
    add_elems: dict[str, list[Element]] = field(default_factory=dict)
    del_chains: list[Command] = field(default_factory=list)

    def commands(self, table: Table) -> list[Command]:
        out = [*self.head, *self.flush]
        for name, elems in self.del_elems.items():
            out += table.delete_elements(name, elems)
        out += [*self.del_sets, *self.add_sets, *self.add_chains, *self.add_rules]
        out += self.static_elems
        for name, elems in self.add_elems.items():
            out += table.add_elements(name, elems)
        return out + self.del_chains


@dataclass
class Staged:
    """A planned transaction for one table and how to record it once committed."""

    commands: list[Command]
    record: Callable[[], None]
    counts: dict[str, int] = field(default_factory=dict)

    def commit(self) -> None:
        self.record()


def _write_chain(b: _Batch, t: Table, chain: Chain, *, exists: bool) -> None:
    if exists:
        b.flush.append(t.flush_chain(chain.name))
    b.add_chains.append(t.add_chain(chain))
    b.add_rules += t.add_rules(chain)


def _remove_chain(b: _Batch, t: Table, name: str, *, defer: bool, stale: set[str]) -> None:
    b.flush.append(t.flush_chain(name))
    if defer:
        stale.add(name)
    else:
        b.del_chains.append(t.delete_chain(name))


def _remove_set(
    b: _Batch,
    t: Table,
    name: str,
    map_type: str | None,
    *,
    defer: bool,
    stale: dict[str, bool],
) -> None:
    """Delete a set (`map_type`: a map's value type, None for a set), or
    with `defer` leave it to stage_gc -- a verdict map flushed now, so that
    no element of it holds the chains stage_gc deletes in the same
    transaction (EBUSY on kernels < 6.2)."""
    is_map = map_type is not None
    if defer:
        stale[name] = is_map
        if map_type == "verdict":
            b.flush.append(t.flush_set(name, is_map=True))
    else:
        b.del_sets.append(t.delete_set(name, is_map=is_map))


def _add_set(b: _Batch, t: Table, decl: SetDecl) -> None:
    b.add_sets.append(t.add_set(decl))
    b.static_elems += t.add_set_elements(decl)


def _diff_sets(
    b: _Batch,
    t: Table,
    old: Mapping[str, SetDecl],
    new: Mapping[str, SetDecl],
    stale_sets: dict[str, bool],
    defer: bool,
) -> set[str]:
    """Emit set changes; returns the names of re-declared sets."""
    redeclared: set[str] = set()
    for name, decl in new.items():
        prev = old.get(name)
        if prev is None:
            if stale_sets.pop(name, None) is not None:
                # A flushed leftover may be a kernel-"dynamic" set: re-create it.
                b.del_sets.append(t.delete_set(name, is_map=bool(decl.map)))
            _add_set(b, t, decl)
        elif prev.declaration() != decl.declaration():
            redeclared.add(name)
            b.del_sets.append(t.delete_set(name, is_map=bool(prev.map)))
            _add_set(b, t, decl)
        elif prev.elements != decl.elements and not decl.dynamic:
            b.add_sets.append(t.flush_set(name, is_map=decl.map is not None))
            b.static_elems += t.add_set_elements(decl)
    for name, prev in old.items():
        if name not in new:
            _remove_set(b, t, name, prev.map, defer=defer, stale=stale_sets)
    return redeclared


class _Change(NamedTuple):
    """One owner's change: its record, its new record, the fresh render the
    commands come from (None: the owner is gone), and its record's
    elements, unpacked once."""

    old: CompactFragment | None
    new: CompactFragment | None
    rendered: Fragment | None
    old_elements: tuple[Element, ...] = ()


def _diff_chains(
    b: _Batch, t: Table, change: _Change, redeclared: set[str], stale: set[str], defer: bool
) -> None:
    old_chains = {c.name: c for c in change.old.chains} if change.old else {}
    new_chains = change.rendered.chains if change.rendered else ()
    records = change.new.chains if change.new else ()
    for chain, record in zip(new_chains, records, strict=True):
        prev = old_chains.get(chain.name)
        if prev is None:
            existed = chain.name in stale
            stale.discard(chain.name)
            _write_chain(b, t, chain, exists=existed)
        elif prev != record or not redeclared.isdisjoint(record.refs):
            _write_chain(b, t, chain, exists=True)
    new_names = change.new.chain_names() if change.new else frozenset()
    for name in old_chains:
        if name not in new_names:
            _remove_chain(b, t, name, defer=defer, stale=stale)


def _claimed(
    owner: Owner, elem_id: ElemId, changed: Mapping[Owner, Element], committed: Resolver
) -> Element | None:
    """The owner's element: from `changed` (its old or new record in this
    stage) if there, else as committed."""
    e = changed.get(owner)
    return e if e is not None else committed.element(owner, elem_id)


_Claims = tuple[dict[Owner, Element], dict[Owner, Element]]
"""An element id's claims in one stage: by the changed owners' old records,
and by their new ones."""


_Slot = tuple[Owner, Element] | _Claims
"""What `_touched` holds for an element id: a bare (owner, new element), or its claims."""


def _as_claims(slot: _Slot) -> _Claims:
    """The slot as claims: a bare (owner, element) is one new claim."""
    if isinstance(slot[1], Element):
        return ({}, {slot[0]: slot[1]})
    return slot


def _claims_of(touched: dict[ElemId, _Slot], elem_id: ElemId) -> _Claims:
    """The id's claims in `touched`, stored as claims from now on."""
    slot = touched.get(elem_id)
    claims = ({}, {}) if slot is None else _as_claims(slot)
    touched[elem_id] = claims
    return claims


def _touched(changes: Mapping[Owner, _Change]) -> dict[ElemId, _Slot]:
    """Every element id the changed owners' old records and new renders
    name. An id named once, by a new render, stays a bare (owner, element):
    what a fresh chunk is made of, ~250,000 at 10,000 x 10, without two
    dicts each."""
    touched: dict[ElemId, _Slot] = {}
    for owner, (_, _, rendered, old_elements) in changes.items():
        for e in old_elements:
            _claims_of(touched, (e.set_name, e.key))[0][owner] = e
        for e in rendered.elements if rendered else ():
            elem_id = (e.set_name, e.key)
            if elem_id in touched:
                _claims_of(touched, elem_id)[1][owner] = e
            else:
                touched[elem_id] = (owner, e)
    return touched


def _diff_elements(b: _Batch, state: TableState, changes: Mapping[Owner, _Change]) -> int:
    """Resolve claims of the changed owners against everyone's; emit the
    effective changes (a new winner with the same verdict too: its comment
    names the owner, which `dump` reads). Returns the number of element changes."""
    committed, n = Resolver(state.fragments), 0
    for elem_id, slot in _touched(changes).items():
        if isinstance(slot[1], Element) and state.index.winner(*elem_id) is None:
            b.add_elems.setdefault(elem_id[0], []).append(slot[1])  # new, nobody else's
            n += 1
            continue
        else:
            before, after = _settled(state, elem_id, _as_claims(slot), committed)
        if before == after:
            continue
        if before is not None:
            b.del_elems.setdefault(elem_id[0], []).append(before)
            n += 1
        if after is not None:
            b.add_elems.setdefault(elem_id[0], []).append(after)
            n += 1
    return n


def _winners(owners: Sequence[Owner], claims: _Claims) -> tuple[Owner | None, Owner | None]:
    """An id's winner before the stage (the first of its `owners`) and after
    it (of the owners that stay and the new claims)."""
    olds, news = claims
    stay = [o for o in owners if o not in olds]
    return (owners[0] if owners else None), winner_of([*stay, *news])


def _settled(
    state: TableState, elem_id: ElemId, claims: _Claims, committed: Resolver
) -> tuple[Element | None, Element | None]:
    """The id's effective element before and after the stage: its winner's."""
    olds, news = claims
    first, winner = _winners(state.index.owners(*elem_id), claims)
    before = None if first is None else _claimed(first, elem_id, olds, committed)
    after = None if winner is None else _claimed(winner, elem_id, news, committed)
    return before, after


def _diff_shared(
    b: _Batch,
    state: TableState,
    changes: Mapping[Owner, _Change],
    stale: set[str],
    stale_sets: dict[str, bool],
    defer: bool,
) -> None:
    """Add the shared chains and sets the changes give their first user,
    delete those they take the last user from."""
    delta: Counter[str] = Counter()
    objects: dict[str, Chain | SetDecl] = {}
    for change in changes.values():
        for sign, record in ((-1, change.old), (1, change.new)):
            for key, obj in _keyed(record.shared if record else (), _rendered):
                delta[key] += sign
                objects[key] = obj
    t = state.table
    for key, d in delta.items():
        before = state.users[key]
        after = before + d
        if (before == 0) == (after == 0):
            continue
        obj = objects[key]
        if isinstance(obj, Chain):
            if after:
                existed = obj.name in stale
                stale.discard(obj.name)
                _write_chain(b, t, obj, exists=existed)
            else:
                _remove_chain(b, t, obj.name, defer=defer, stale=stale)
        elif after:
            # A leftover awaiting stage_gc is the same declaration, emptied: reuse it.
            if stale_sets.pop(obj.name, None) is None:
                _add_set(b, t, obj)
        elif defer:
            # No flush: its last users' elements are deleted in this transaction.
            stale_sets[obj.name] = obj.map is not None
        else:
            b.del_sets.append(t.delete_set(obj.name, is_map=obj.map is not None))


def stage_partial(
    state: TableState,
    desired: Mapping[Owner, Fragment | None],
    *,
    records: Mapping[Owner, CompactFragment] | None = None,
    defer_deletes: bool = False,
) -> Staged:
    """Plan the changes of the owners in `desired` (freshly rendered; None =
    owner gone); `records`: compact forms of some of them, already made
    (a full sync's chunks are compacted as they are rendered)."""
    changes: dict[Owner, _Change] = {}
    made = records or {}
    for owner, fragment in desired.items():
        new = None if fragment is None else made.get(owner) or compact(fragment)
        old = state.fragments.get(owner)
        if old != new:
            changes[owner] = _Change(old, new, fragment, old.elements if old else ())
    b = _Batch()
    stale, stale_sets = set(state.stale_chains), dict(state.stale_sets)
    for change in changes.values():
        old, new = change.old, change.new
        redeclared = _diff_sets(
            b,
            state.table,
            {s.name: s for s in old.sets} if old else {},
            {s.name: s for s in new.sets} if new else {},
            stale_sets,
            defer_deletes,
        )
        _diff_chains(b, state.table, change, redeclared, stale, defer_deletes)
    _diff_shared(b, state, changes, stale, stale_sets, defer_deletes)
    n_elems = _diff_elements(b, state, changes)
    commands = b.commands(state.table)

    def record() -> None:
        for owner, change in changes.items():
            rendered = change.rendered.elements if change.rendered else ()
            state.keep(owner, change.new, rendered, change.old_elements)
        state.stale_chains, state.stale_sets = stale, stale_sets

    counts = {"owners": len(changes), "elements": n_elems}
    return Staged(commands, record, counts)


def _full_sets(
    b: _Batch,
    t: Table,
    kernel: TableListing,
    desired: Mapping[str, SetDecl],
    stale_sets: dict[str, bool],
    defer: bool,
) -> None:
    kept: set[str] = set()
    for name, ks in kernel.sets.items():
        decl = desired.get(name)
        if decl is None and defer:
            # Emptied for stage_gc: no owner deletes its elements one by one here.
            b.flush.append(t.flush_set(name, is_map=ks.map is not None))
            stale_sets[name] = ks.map is not None
        elif decl is None or not _same_declaration(t, decl, ks):
            b.del_sets.append(t.delete_set(name, is_map=ks.map is not None))
        elif decl.dynamic:
            # Keep it untouched, with its clients: re-adding it would fail with
            # EEXIST. It was created in one transaction with its update rule,
            # so libnftables 1.0.6 made it "dynamic", which a plain JSON `add
            # set` cannot say (nft-python-notes §2; kernel/fake.py models it).
            kept.add(name)
        else:
            b.flush.append(t.flush_set(name, is_map=decl.map is not None))
    for decl in desired.values():
        if decl.name not in kept:
            _add_set(b, t, decl)


def _full_chains(
    b: _Batch,
    t: Table,
    kernel: TableListing,
    desired: Mapping[str, Chain],
    stale: set[str],
    defer: bool,
) -> None:
    for name, hook in kernel.chains.items():
        chain = desired.get(name)
        if chain is None:
            _remove_chain(b, t, name, defer=defer, stale=stale)
        elif hook != chain.hook:
            b.head += [t.flush_chain(name), t.delete_chain(name)]
    for chain in desired.values():
        exists = chain.name in kernel.chains and kernel.chains[chain.name] == chain.hook
        _write_chain(b, t, chain, exists=exists)


def _add_winners(
    b: _Batch, index: ElementIndex, rendered: Iterable[tuple[Owner, Sequence[Element]]]
) -> None:
    """Add each of the `rendered` elements its owner wins in `index`, each
    once (where an owner rendered a key twice, its last)."""
    for owner, elements in rendered:
        won = {(e.set_name, e.key): e for e in index.won(owner, elements)}
        for e in won.values():
            b.add_elems.setdefault(e.set_name, []).append(e)


def stage_full(
    state: TableState,
    kernel: TableListing | None,
    desired: Mapping[Owner, Fragment],
    *,
    defer_deletes: bool = False,
) -> Staged:
    """Rebuild the whole table from the freshly rendered `desired`:
    everything desired is (re)written, everything else the kernel holds in
    our tables (the family's main and affinity tables) is flushed and deleted."""
    fresh = TableState(state.family, state.table)
    for owner, fragment in desired.items():
        fresh.adopt(owner, fragment)
    kernel = kernel or TableListing({}, {})
    t, b = state.table, _Batch(head=state.table.add_tables())
    # Rules are emitted from the rendered chains (no JSON round trip).
    chains = {c.name: c for f in desired.values() for c in _all_chains(f)}
    _full_chains(b, t, kernel, chains, fresh.stale_chains, defer_deletes)
    _full_sets(b, t, kernel, fresh.sets, fresh.stale_sets, defer_deletes)
    _add_winners(b, fresh.index, ((o, f.elements) for o, f in desired.items()))
    commands = b.commands(t)

    counts = {"owners": len(desired), "elements": len(fresh.index)}
    return Staged(commands, lambda: state.take(fresh), counts)


def _all_chains(fragment: Fragment) -> Iterable[Chain]:
    yield from fragment.chains
    for shared in fragment.shared:
        yield from shared.chains


def stage_gc(state: TableState) -> Staged:
    """Delete the chains and sets earlier transactions left flushed."""
    t = state.table
    commands = [t.delete_chain(n) for n in sorted(state.stale_chains)]
    commands += [t.delete_set(n, is_map=m) for n, m in sorted(state.stale_sets.items())]

    def record() -> None:
        state.stale_chains, state.stale_sets = set(), {}

    return Staged(commands, record, {"deleted": len(commands)})
