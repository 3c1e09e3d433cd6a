"""A full sync over a listed table, as ordered steps of one transaction each.

Layer: nft (pure; no kernel access). One job: plan the chunked full sync over
tables that already exist (agent restart, drift repair, periodic resync), so
that no transaction holds the whole cluster. `resyncable` says whether the
listing allows it; a `ResyncPlan` turns the rendered steps into `Staged`
transactions:

  0  the skeleton: `add table`; its chains written (flushed first if
     listed); its sets and maps that are not listed added EMPTY -- among
     them the endpoints, vip-endpoints and nodeport-endpoints maps of the
     generation the table does not use (rules/skeleton.py GENERATIONS),
     with that generation's shared choosers (rules/dispatch.py: no element points at
     them before the final step), the hairpin sets a table of ruleset
     v5 lacks, the shared affinity set where a table of ruleset v3
     lacks it, the masquerade sets of the shared choosers where a
     table of ruleset v6 lacks them, and the affinity table (ruleset v9)
     where a table of an older ruleset has none
  1..k  per chunk of service ports: each owner's chains written (flushed
     first if listed), and its elements of the new generation's endpoints
     and vip-endpoints and nodeport-endpoints maps, which its rewritten
     choosers and the new shared choosers pick from, and of its hairpin set
     (KUBE-POSTROUTING looks up every generation's). No other shared-set
     element yet.
  final  every other desired non-dynamic set and map flushed (if listed) and
     filled with its static and effective (winner) elements, in ONE
     transaction, so the dispatch, firewall and no-endpoint maps switch at
     once, and the other generations' hairpin sets are emptied (one flush
     each: the final step carries no hairpin element, most of a cluster's
     elements); listed chains not desired flushed, then deleted after
     the element flush (vmap elements may point at them) -- or, with
     `defer_deletes` (EBUSY, kernels < 6.2), left flushed for `stage_gc`;
     listed sets not desired deleted after the chains using them are flushed.
     Listed dynamic sets that are desired are never touched: clients keep
     their affinity. The old generation's endpoints maps go with the chains
     that used them.

Between steps every service port is either wholly old (old chains, old
elements) or runs its new chains behind the old elements of the shared maps,
until the final step switches them all (its new endpoints' hairpin elements
come with its chunk), and where its chain names
change, its old elements still point at its old chains (left as they were,
and they may jump into its rewritten ones). A new service becomes
reachable, and a deleted one unreachable, at the final step. Only the final step records
(the fresh `TableState` of every desired fragment, exactly as `stage_full`
would); the earlier ones record nothing, so a refused step leaves the record
as it was and the next (full) sync lists again: every step is idempotent
over any intermediate table.

Uses plan.py's private `_Batch`, `_add_set`, `_add_winners`, `_remove_chain`,
`_remove_set`, `_write_chain` and `_same_declaration` (one planner, two ways to cut it).
"""

from __future__ import annotations

from collections.abc import Mapping

from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.plan import (
    Owner,
    Staged,
    TableState,
    _add_set,
    _add_winners,
    _Batch,
    _remove_chain,
    _remove_set,
    _same_declaration,
    _write_chain,
)
from nftproxy.core.rules import picks
from nftproxy.core.rules.fragment import (
    CompactFragment,
    Element,
    Fragment,
    SetDecl,
    in_affinity_table,
)
from nftproxy.core.rules.names import is_affinity_set
from nftproxy.core.rules.skeleton import (
    AFFINITY,
    MASQUERADE_NODEPORTS,
    MASQUERADE_VIPS,
    chain_generation,
    generation_of,
    is_unsharded_endpoints_map,
)

__all__ = ["ResyncPlan", "resyncable"]


def resyncable(t: Table, listing: TableListing, skeleton: Fragment) -> bool:
    """Whether a listed table can be resynced in steps: it has the skeleton's
    layout -- every skeleton chain and set listed (but those of another
    generation: the step adds them), the sets with the same declaration,
    each listed base chain a skeleton chain with the same hook, and no other
    listed set but the leftovers of older rulesets that only service chains
    use (`_leftover`: the final step deletes them). Service ports declare
    no sets.

    A table of another layout (a rollback or upgrade across ruleset versions:
    ruleset v1's `firewall-ips` vmap, or v2's `firewall-vips` missing) is
    rewritten in one transaction: step 0 would switch the skeleton's rules
    onto sets the old service chains do not fill (source ranges unenforced
    until the final step)."""
    skeleton_sets = {decl.name: decl for decl in skeleton.sets}
    for decl in skeleton.sets:
        listed = listing.sets.get(decl.name)
        if listed is None:
            if not _added_in_steps(decl):
                return False
        elif not _same_declaration(t, decl, listed):
            return False
    if any(n not in skeleton_sets and not _leftover(n) for n in listing.sets):
        return False
    hooks = {c.name: c.hook for c in skeleton.chains}
    if any(
        n not in listing.chains and chain_generation(n) is None and not in_affinity_table(n)
        for n in hooks
    ):
        return False
    for name, hook in listing.chains.items():
        if (hooks[name] != hook) if name in hooks else (hook is not None):
            return False
    return True


def _leftover(name: str) -> bool:
    """A listed set the steps may leave to the final step's deletes: another
    generation's endpoints, vip-endpoints or nodeport-endpoints map, or a
    set of an older ruleset that only service chains use (v3's per-endpoint
    affinity sets, v3/v4's unsharded endpoints maps, v4-v8's shared affinity
    set in the main table: its clients are not carried over)."""
    return (
        generation_of(name) is not None
        or is_affinity_set(name)
        or is_unsharded_endpoints_map(name)
        or name == AFFINITY
    )


def _added_in_steps(decl: SetDecl) -> bool:
    """Whether a skeleton set the listing lacks can simply be added, empty:
    a set of another generation (an endpoints map: only the choosers the
    steps rewrite use it; a hairpin set: KUBE-POSTROUTING looks up every
    generation's, and a table of ruleset v5 has only generation a's), the
    shared affinity set (new in ruleset v4; v3 had a set per endpoint),
    whose users are the chooser chains the steps rewrite, a masquerade
    set of the shared choosers (`_MARKING`), or an object of the affinity
    table (ruleset v9), which nothing reaches before the final step puts
    the `accept` elements in the main table's maps."""
    return (
        generation_of(decl.name) is not None
        or decl.dynamic
        or decl.name in _MARKING
        or decl.name in _PICKING
        or in_affinity_table(decl.name)
    )


_MARKING = frozenset({MASQUERADE_VIPS, MASQUERADE_NODEPORTS})
"""The shared choosers' masquerade sets (new in ruleset v7), added empty in
step 0: until the final step switches the dispatch maps no destination
goes to a shared chooser, and the KUBE-EXT chains still in use mark their
own traffic."""

_PICKING = picks.root_maps()
"""The pick trees' root maps (new in ruleset v10; the trees' sets come in
generations), added in step 0 where a table of ruleset v9 lacks them,
with their elements, which jump to the new generation's tree: its root
returns every destination (a full sync fills no tree set: it writes
gotos), and the table's goto elements serve until the final step
switches the verdict maps to the new generation's gotos."""


def _filled_in_steps(name: str) -> bool:
    return generation_of(name) is not None


class ResyncPlan:
    """The steps of one family's chunked full sync over `listing` (None: the
    table is absent, every object is added). Take `step` for the skeleton
    (first=True), then for each chunk, then `final`, committing each before
    taking the next; only `final` records into `state`. The steps are
    rendered with `generation`, whose endpoints maps the listing must not
    hold (`Chunked` picks the other one)."""

    def __init__(
        self,
        state: TableState,
        listing: TableListing | None,
        generation: str,
        *,
        defer_deletes: bool = False,
    ) -> None:
        self._state = state
        self._listing = listing or TableListing({}, {})
        self._defer = defer_deletes
        self._fresh = TableState(state.family, state.table, generation=generation)
        self._final_elements: list[tuple[Owner, list[Element]]] = []
        """The steps' elements `final` adds (as rendered: the fresh state
        keeps them packed)."""

    def step(
        self,
        desired: Mapping[Owner, Fragment],
        *,
        first: bool = False,
        records: Mapping[Owner, CompactFragment] | None = None,
    ) -> Staged:
        """Write the chains of `desired`'s owners, add their unlisted sets
        (empty) and their elements of the new generation's endpoints maps
        and hairpin set (each key once; re-adding a hairpin element another
        step added is a no-op); `first` adds the table too. `records`:
        compact forms of some owners, already made."""
        t, listed = self._state.table, self._listing
        b = _Batch(head=t.add_tables() if first else [])
        added: set[tuple[str, object]] = set()
        made = records or {}
        for owner, fragment in desired.items():
            self._fresh.adopt(owner, fragment, made.get(owner))
            for decl in fragment.sets:
                if decl.name not in listed.sets:
                    _add_set(b, t, decl)
            for chain in fragment.chains:
                _write_chain(b, t, chain, exists=chain.name in listed.chains)
            later: list[Element] = []
            for e in fragment.elements:
                if not _filled_in_steps(e.set_name):
                    later.append(e)
                elif (e.set_name, e.key) not in added:
                    added.add((e.set_name, e.key))
                    b.add_elems.setdefault(e.set_name, []).append(e)
            if later:
                self._final_elements.append((owner, later))
        return Staged(b.commands(t), lambda: None, {"owners": len(desired)}, b.declare)

    def final(self) -> Staged:
        """Switch every shared set to its desired elements; remove what the
        listing shows and nothing desires; record the fresh state."""
        t, listed, fresh = self._state.table, self._listing, self._fresh
        fresh.stale_chains, fresh.stale_sets = set(), {}
        b = _Batch()
        wanted = {c for f in fresh.fragments.values() for c in f.chain_names()}
        for name in listed.chains:
            if name not in wanted:
                _remove_chain(b, t, name, defer=self._defer, stale=fresh.stale_chains)
        for name, ks in listed.sets.items():
            if name not in fresh.sets:
                _remove_set(b, t, name, ks.map, defer=self._defer, stale=fresh.stale_sets)
        for decl in fresh.sets.values():
            if decl.dynamic or generation_of(decl.name) == fresh.generation:
                continue
            if decl.name in listed.sets:
                b.flush.append(t.flush_set(decl))
            b.static_elems += t.add_set_elements(decl.name, decl.elements)
        _add_winners(b, fresh.index, self._final_elements)
        counts = {"owners": len(fresh.fragments), "elements": len(fresh.index)}
        return Staged(b.commands(t), lambda: self._state.take(fresh), counts)
