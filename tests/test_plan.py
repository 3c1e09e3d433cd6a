"""Planning transactions (nftproxy.core.nft.plan) with fragments from the real renderers.

Aspects:
- order inside one transaction: a chain exists before anything targets it,
  flushes come before deletes, a verdict change is delete + add;
- removed chains are flushed and deleted, or left flushed for stage_gc;
- the affinity set keeps its clients across full syncs, timeout changes
  and ports with affinity coming and going; it comes with the first such
  port and goes with the last;
- an unchanged service costs nothing, a failed commit records nothing;
- transaction sizes of partial syncs are pinned and do not grow with the
  number of other services (upstream's TestSyncProxyRulesRepeated, §2);
- two service ports claiming one element resolve to one deterministic winner;
- shared choosers on demand: a chooser (dispatch-tcp-3) and the map it picks
  from come with their first user, in its transaction, and go with their
  last; a port whose endpoint count changes moves to the chooser of its new
  count; an empty table holds none;
- property: successive partial syncs end where one full sync of the final
  state ends, in the planner's state and in what the kernel lists (seeded
  sequences check it after every sync), deferred deletes included: a shared
  set left for gc is reused by a user that comes first, and one that loses
  its last user is left to gc unflushed (its elements go with their owners).

The kernel is FakeBackend (kernel/fake.py): it refuses what the kernel
refuses (a missing object, a goto to a missing chain, deleting a chain or set
that is still used, an element that exists with another verdict, re-adding a
set with other flags or one that is "dynamic" -- created in one transaction
with its update rule, docs/nft-python-notes.md §2), as tests/test_backend.py
checks step by step against the real kernel, and keeps the content, so a plan
is checked by what applying it does (what the fake then lists), not by its
text.
"""

from __future__ import annotations

import copy
import json
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from builders import CONFIG, NODE, endpoint, render, service_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    L4Protocol,
    LoadBalancerIngress,
    ServicePort,
    ServicePortName,
    SessionAffinity,
    TrafficPolicy,
)
from nftproxy.core.nft.commands import (
    AddChain,
    AddElements,
    AddRule,
    AddSet,
    Command,
    DeleteChain,
    DeleteElements,
    DeleteSet,
    FlushChain,
    Where,
)
from nftproxy.core.nft.errors import NftBusy, NftExists, NftNotFound, NftRejected
from nftproxy.core.nft.jsontext import command_json
from nftproxy.core.nft.listing import TableListing, list_family_objects
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.plan import (
    SKELETON,
    Owner,
    Staged,
    TableState,
    stage_full,
    stage_gc,
    stage_partial,
)
from nftproxy.core.rules import names
from nftproxy.core.rules.dispatch import is_choosers_map, is_indexed_map, is_shared_chain
from nftproxy.core.rules.fragment import (
    AFFINITY_TABLE,
    BaseHook,
    Element,
    Fragment,
    Rule,
    SetDecl,
    Target,
    Verdict,
    affinity_table_name,
)
from nftproxy.core.rules.skeleton import render_skeleton
from nftproxy.kernel.fake import FakeBackend

V4 = IPFamily.IPV4
Json = Mapping[str, Any]
TABLE = Table("ip", "nftproxy")


# --- the kernel, and what it lists ---------------------------------------------------


def new_kernel(version: str = "1.0.6") -> FakeBackend:
    """The kernel beside libnftables 1.0.6, or 1.1.x (`version` "1.1"): both
    take the planner's transactions in nft's syntax, sets declared by
    typeof; 1.0.6 lists their keys by datatype, 1.1.x by typeof."""
    kernel = FakeBackend(version=version)
    kernel.start()
    return kernel


@dataclass(frozen=True)
class ListedContent:
    """A listed set or map: declaration and elements (element key as JSON -> verdict)."""

    kind: str
    type: Any
    map: str | None
    flags: frozenset[str]
    timeout: int | None
    elems: dict[str, Any]


@dataclass(frozen=True)
class Content:
    """Everything packets see in the table: chains with their rules (expression
    JSON, comment), base-chain hooks, sets with elements. Left out: handles,
    listing order, set and element comments, sizes."""

    chains: dict[str, list[tuple[str, str | None]]]
    hooks: dict[str, BaseHook | None]
    sets: dict[str, ListedContent]


def _walk(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _walk(v)


def _targets(value: Any) -> set[str]:
    return {v[k]["target"] for v in _walk(value) if isinstance(v, dict)
            for k in ("jump", "goto") if k in v}


def _elem_key_data(elem: Any) -> tuple[str, Any]:
    key, data = (elem[0], elem[1]) if isinstance(elem, list) else (elem, None)
    if isinstance(key, dict) and "elem" in key:
        key = key["elem"]["val"]
    return json.dumps(key, sort_keys=True), data


def _listed_set(kind: str, obj: Json) -> ListedContent:
    elems = dict(_elem_key_data(e) for e in obj.get("elem", ()))
    return ListedContent(kind, obj["type"], obj.get("map"), frozenset(obj.get("flags", ())),
                         obj.get("timeout"), elems)


def content(kernel: FakeBackend) -> Content:
    """What the kernel lists of our tables, compared by content; the
    affinity table's objects named as the planner names them."""
    objects = listing(kernel)
    assert objects is not None, "no table"
    chains: dict[str, list[tuple[str, str | None]]] = {name: [] for name in objects.chains}
    sets: dict[str, ListedContent] = {}
    for table, prefix in ((TABLE.name, ""), (TABLE.affinity_table, AFFINITY_TABLE)):
        doc = kernel.list_table(TABLE.family, table)
        for item in doc["nftables"] if doc is not None else ():
            ((kind, obj),) = item.items()
            if kind == "rule":
                chains[prefix + obj["chain"]].append(
                    (json.dumps(obj["expr"], sort_keys=True), obj.get("comment"))
                )
            elif kind in ("set", "map"):
                sets[prefix + obj["name"]] = _listed_set(kind, obj)
    return Content(chains, dict(objects.chains), sets)


def listing(kernel: FakeBackend) -> TableListing | None:
    return list_family_objects(kernel.list_table_objects, TABLE.family, TABLE.name)


# --- order checks --------------------------------------------------------------------


def _ops(commands: Sequence[Command]) -> list[tuple[str, str, str, Any]]:
    """(verb, kind, name, spec) per command, read from its libnftables JSON
    (jsontext.command_json: what the JSON printer sends)."""
    out = []
    for c in commands:
        (verb, body), = command_json(c).items()
        (kind, spec), = body.items()
        out.append((verb, kind, spec.get("name") or spec.get("chain", ""), spec))
    return out


def check_order(commands: Sequence[Command]) -> None:
    """The ordering rules every transaction obeys."""
    ops = _ops(commands)
    first: dict[tuple[str, str, str], int] = {}
    for i, (verb, kind, name, _) in enumerate(ops):
        first.setdefault((verb, kind, name), i)
    for i, (verb, kind, name, spec) in enumerate(ops):
        if kind == "element" and verb == "add":
            for target in _targets(spec["elem"]):
                j = first.get(("add", "chain", target))
                assert j is None or j < i, f"element targeting {target} before its add chain"
        if kind in ("chain", "set", "map") and verb == "delete":
            j = first.get(("flush", kind, name))
            assert j is None or j < i, f"delete {kind} {name} before its flush"
        if kind == "element" and verb == "delete":
            later = [k for k, o in enumerate(ops) if o[:3] == ("add", "element", name) and k < i]
            assert not later, f"add element into {name} before a delete from it"
    flushes = [i for i, o in enumerate(ops) if o[0] == "flush" and o[1] == "chain"]
    deletes = [i for i, o in enumerate(ops) if o[0] == "delete" and o[1] == "chain"
               and not (o[3].get("name") or "").startswith(("nat-", "filter-"))]
    assert not flushes or not deletes or max(flushes) < min(deletes), "a flush after a delete"


@dataclass
class Synced(TableState):
    """A TableState that also keeps the fragments its commits were planned
    from: the planner's record holds digests, not rules, so a test that plans
    the table again (a full sync, assert_same_as_full's reference) plans from
    these, as the proxier plans from a fresh render."""

    rendered: dict[Owner, Fragment] = field(default_factory=dict)
    version: str = "1.0.6"
    """The libnftables its kernel stands beside (`new_kernel`)."""


def apply(state: Synced, kernel: FakeBackend, staged: Staged,
          planned_from: Mapping[Owner, Fragment | None] | None = None, *,
          full: bool = False) -> list[Command]:
    """Commit a planned transaction to the (fake) kernel, as ONE commit,
    then record it (with the fragments it was planned from: all of them if
    `full`)."""
    check_order(staged.commands)
    kernel.commit(staged.commands)
    staged.commit()
    if full:
        state.rendered = {}
    for owner, fragment in (planned_from or {}).items():
        if fragment is None:
            state.rendered.pop(owner, None)
        else:
            state.rendered[owner] = fragment
    return staged.commands


def effective(state: TableState) -> dict[Any, Any]:
    """The element each claimed key resolves to (the winner of its claims)."""
    return {eid: state.effective(eid) for eid in state.index.ids()}


def fresh(desired: Mapping[Owner, Fragment], *,
          version: str = "1.0.6") -> tuple[Synced, FakeBackend]:
    """A full sync of `desired` into a fresh table (`version`: the
    libnftables the kernel stands beside, `new_kernel`)."""
    state, kernel = Synced(V4, TABLE, version=version), new_kernel(version)
    apply(state, kernel, stage_full(state, None, desired), desired, full=True)
    return state, kernel


def full_sync(state: Synced, kernel: FakeBackend, desired: Mapping[Owner, Fragment], *,
              defer: bool = False) -> list[Command]:
    """A full sync of `desired` against what the kernel lists."""
    staged = stage_full(state, listing(kernel), desired, defer_deletes=defer)
    return apply(state, kernel, staged, desired, full=True)


def assert_same_as_full(state: Synced, kernel: FakeBackend) -> None:
    """The state and the kernel equal a full sync of state's fragments into a fresh table."""
    assert set(state.rendered) == set(state.fragments)
    ref_state, ref_kernel = fresh(dict(state.rendered), version=state.version)
    assert state.chains == ref_state.chains
    assert state.sets == ref_state.sets
    assert state.users == ref_state.users
    assert effective(state) == effective(ref_state)
    got, want = content(kernel), content(ref_kernel)
    differing = {n for n in {*got.sets, *want.sets} if got.sets.get(n) != want.sets.get(n)}
    assert got == want, sorted(differing)


# --- the kernel refuses, and keeps nothing of a refused transaction ------------------

HERE = Where("ip", "nftproxy")
SADDR: Json = {"payload": {"protocol": "ip", "field": "saddr"}}


def _chain(name: str, verb: str = "add") -> Command:
    if verb == "flush":
        return FlushChain(HERE, name)
    return DeleteChain(HERE, name) if verb == "delete" else AddChain(HERE, name)


def _rule(chain: str, *expr: Json) -> Command:
    return AddRule(HERE, chain, Rule(tuple(expr)))


def _aff(**fields: Any) -> Command:
    """Declare set "aff" of client addresses."""
    return AddSet(HERE, "aff", SetDecl.keyed("aff", ("ip saddr",), **fields))


def _map() -> Command:
    """Declare verdict map "m" of destination addresses."""
    return AddSet(HERE, "m", SetDecl.keyed("m", ("ip daddr",), map="verdict"))


def _goto_element(ip: str, target: str) -> Command:
    return AddElements(HERE, "m", (Element("m", (ip,), Verdict("goto", target)),))


@pytest.mark.parametrize(
    ("commands", "error"),
    [
        pytest.param([_chain("A"), _rule("A", {"goto": {"target": "B"}})], NftNotFound,
                     id="goto to a missing chain"),
        pytest.param([_chain("A"), _chain("B"), _rule("A", {"jump": {"target": "B"}}),
                      _chain("B", "flush"), _chain("B", "delete")], NftBusy,
                     id="deleting a chain a rule jumps to"),
        pytest.param([_chain("A"), _map(), _goto_element("1.1.1.1", "A"),
                      _chain("A", "delete")], NftBusy,
                     id="deleting a chain a map element targets"),
        pytest.param([_aff(flags=("timeout",), timeout=60), _chain("A"),
                      _rule("A", {"set": {"op": "update", "set": "@aff", "elem": SADDR}}),
                      _aff(flags=("timeout",), timeout=60)], NftExists,
                     id="re-adding a set an update rule made dynamic"),
        pytest.param([_aff(), _chain("A"),
                      _rule("A", {"match": {"op": "==", "left": SADDR, "right": "@aff"}}),
                      DeleteSet(HERE, "aff")], NftBusy,
                     id="deleting a set a rule uses"),
        pytest.param([_aff(), DeleteElements(HERE, "aff", (("1.1.1.1",),))], NftNotFound,
                     id="deleting a missing element"),
        pytest.param([_chain("A"), _chain("B"), _map(), _goto_element("1.1.1.1", "A"),
                      _goto_element("1.1.1.1", "B")],
                     NftExists, id="adding an element that exists with another verdict"),
    ],
)
def test_the_kernel_refuses_and_stays_unchanged(
    commands: list[Command], error: type[NftRejected]
) -> None:
    kernel = new_kernel()
    kernel.commit([*TABLE.add_tables(), _chain("keep")])
    with pytest.raises(error):
        kernel.commit(commands)
    assert content(kernel) == Content({"keep": []}, {"keep": None}, {})


def test_the_kernel_deletes_a_chain_with_its_rules() -> None:
    """Not a refusal (kernel 6.x; tests/test_backend.py): the planner still
    flushes every chain before deleting it (check_order)."""
    kernel = new_kernel()
    kernel.commit([*TABLE.add_tables(), _chain("keep")])
    kernel.commit([_chain("A"), _rule("A", {"accept": None}), _chain("A", "delete")])
    assert content(kernel) == Content({"keep": []}, {"keep": None}, {})


# --- builders ------------------------------------------------------------------------

SKEL = render_skeleton(V4, CONFIG, NODE)
SVC1 = service_port()
EP1, EP2, EP3 = (endpoint(f"10.180.0.{i}", nodeless=True) for i in (1, 2, 3))
"""On no node, so each is a hairpin pair: the pinned sizes count one."""


NODEPORT = replace(SVC1, node_port=30001, external_traffic_policy=TrafficPolicy.LOCAL)
"""SVC1 with an eTP=Local node port: it goes through the shared
nodeport-local chain and its choosers maps, as SVC1 (cluster IP only) and a
node port of eTP=Cluster go through shared choosers (rules/dispatch.py)."""
CHAINED = replace(NODEPORT, session_affinity=SessionAffinity.CLIENT_IP)
"""NODEPORT with ClientIP affinity: it keeps its KUBE-SVC and KUBE-EXT chains."""


SHARED_NODEPORT = replace(SVC1, node_port=30001)


def frag(port: ServicePort, endpoints: Iterable[Endpoint] = ()) -> Fragment:
    """The port's fragment, as a full or a partial sync renders it (the
    same: a shared destination's service-ips element a goto to its chooser)."""
    return render(port, tuple(endpoints)).fragment


def other(i: int) -> ServicePort:
    return service_port(f"svc{i}", ns="other", cluster_ip=f"172.31.{i // 250}.{i % 250 + 1}")


def table(others: int, svc1: Fragment | None = None) -> tuple[Synced, FakeBackend]:
    """The skeleton, `others` ClusterIP services with one endpoint each, and ns1/svc1
    as `svc1` renders it (absent if None), fully synced into a fresh table."""
    desired: dict[Owner, Fragment] = {SKELETON: SKEL}
    for i in range(others):
        desired[other(i).name] = frag(other(i), [endpoint(f"10.181.{i // 250}.{i % 250 + 1}")])
    if svc1 is not None:
        desired[SVC1.name] = svc1
    return fresh(desired)


def partial(state: Synced, kernel: FakeBackend, changes: Mapping[Owner, Fragment | None],
            *, defer: bool = False) -> list[Command]:
    return apply(state, kernel, stage_partial(state, changes, defer_deletes=defer), changes)


def commands_of(commands: Sequence[Command], verb: str, kind: str) -> list[str]:
    return [name for v, k, name, _ in _ops(commands) if (v, k) == (verb, kind)]


# --- order ---------------------------------------------------------------------------


def test_a_new_chain_is_added_before_the_element_that_targets_it() -> None:
    state, kernel = table(0)
    commands = partial(state, kernel, {SVC1.name: frag(CHAINED, [EP1])})
    ops = _ops(commands)
    svc_chain = names.external_chain(SVC1.name)
    add_chain = ops.index(next(o for o in ops if o[:3] == ("add", "chain", svc_chain)))
    add_elem = next(
        i for i, o in enumerate(ops) if o[:3] == ("add", "element", "service-nodeports")
    )
    assert add_chain < add_elem


def test_a_verdict_change_is_delete_then_add_in_one_transaction() -> None:
    """A third endpoint moves a port from the chooser of 2 to the chooser of
    3: its service-ips element is deleted and added again as a goto to
    dispatch-tcp-3, in one transaction that adds that chain first."""
    state, kernel = table(0, svc1=frag(SVC1, [EP1, EP2]))
    commands = partial(state, kernel, {SVC1.name: frag(SVC1, [EP1, EP2, EP3])})
    ops = _ops(commands)
    elems = [(v, name, spec["elem"]) for v, k, name, spec in ops if k == "element"]
    key = {"concat": ["172.30.0.41", "tcp", 80]}
    mine = [e for e in elems if e[1] == "service-ips"]
    assert [(v, n) for v, n, _ in mine] == [("delete", "service-ips"), ("add", "service-ips")]
    assert mine[0][2] == [key]
    assert mine[1][2][0][0]["elem"]["val"] == key
    assert mine[1][2][0][1] == {"goto": {"target": "dispatch-tcp-3"}}
    add_chain = ops.index(next(o for o in ops if o[:3] == ("add", "chain", "dispatch-tcp-3")))
    assert add_chain < ops.index(next(o for o in ops if o[:3] == ("add", "element", "service-ips")))
    assert_same_as_full(state, kernel)


def test_a_removed_chain_is_flushed_then_deleted() -> None:
    state, kernel = table(0, svc1=frag(CHAINED, [EP1, EP2]))
    commands = partial(state, kernel, {SVC1.name: frag(SVC1, [EP1])})
    gone = {names.external_chain(SVC1.name), names.service_chain(SVC1.name)}
    assert all(commands_of(commands, "flush", "chain").count(c) == 1 for c in gone)
    assert set(commands_of(commands, "delete", "chain")) == gone
    assert not gone & set(content(kernel).chains)
    assert_same_as_full(state, kernel)


def test_deferred_deletes_leave_the_chain_flushed_until_gc() -> None:
    state, kernel = table(0, svc1=frag(CHAINED, [EP1, EP2]))
    gone = {names.external_chain(SVC1.name), names.service_chain(SVC1.name)}
    commands = partial(state, kernel, {SVC1.name: frag(SVC1, [EP1])}, defer=True)
    assert gone <= set(commands_of(commands, "flush", "chain"))
    assert commands_of(commands, "delete", "chain") == []
    # a port with ClientIP affinity: its chains are the affinity table's; it
    # was the affinity set's last user: the set is left for gc too
    assert state.stale_chains == {affinity_table_name(c) for c in gone}
    assert state.stale_sets == {AFFINITY_SET: False}
    assert all(content(kernel).chains[affinity_table_name(c)] == [] for c in gone)
    gc = apply(state, kernel, stage_gc(state))
    assert set(commands_of(gc, "delete", "chain")) == gone
    assert commands_of(gc, "delete", "set") == ["affinity"]
    assert state.stale_chains == set() and state.stale_sets == {}
    assert_same_as_full(state, kernel)


def test_a_stale_chain_that_comes_back_before_gc_is_rewritten_and_kept() -> None:
    # another port with affinity keeps the affinity set (a shared set that
    # comes back before gc: test_a_shared_set_left_for_gc_is_used_again_by_a_new_user)
    sticky = replace(other(0), session_affinity=SessionAffinity.CLIENT_IP)
    state, kernel = fresh({SKELETON: SKEL, SVC1.name: frag(CHAINED, [EP1, EP2]),
                           sticky.name: frag(sticky, [EP3])})
    back = names.external_chain(SVC1.name)
    partial(state, kernel, {SVC1.name: frag(SVC1, [EP1])}, defer=True)
    commands = partial(state, kernel, {SVC1.name: frag(CHAINED, [EP1, EP2])}, defer=True)
    assert back in commands_of(commands, "add", "chain")
    # left for gc: only the chooser the port used without affinity, and its map
    assert state.stale_chains == {"dispatch-tcp-1"}
    assert state.stale_sets == {"vip-endpoints-tcp": True}
    apply(state, kernel, stage_gc(state))
    assert_same_as_full(state, kernel)


def test_a_deleted_service_with_deferred_deletes_is_gone_after_gc() -> None:
    port = replace(SVC1, session_affinity=SessionAffinity.CLIENT_IP,
                   load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),),
                   load_balancer_source_ranges=("203.0.113.0/25",))
    state, kernel = table(0, svc1=frag(port, [EP1]))
    partial(state, kernel, {SVC1.name: None}, defer=True)
    # its chains, and the affinity set it was the last user of (a port
    # declares no set of its own)
    assert state.stale_chains == {affinity_table_name(names.service_chain(SVC1.name)),
                                  affinity_table_name(names.external_chain(SVC1.name))}
    assert state.stale_sets == {AFFINITY_SET: False}
    apply(state, kernel, stage_gc(state))
    assert set(content(kernel).chains) == SKEL.chain_names()
    assert set(content(kernel).sets) == {s.name for s in SKEL.sets}


def test_a_service_that_comes_back_with_other_source_ranges_keeps_no_old_range() -> None:
    lb = replace(SVC1, load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),),
                 load_balancer_source_ranges=("203.0.113.0/25",))
    # another port keeps the chooser of 1 and its map (a shared map that
    # comes back before gc: test_a_shared_set_left_for_gc_is_used_again_by_a_new_user)
    state, kernel = table(1, svc1=frag(lb, [EP1]))
    partial(state, kernel, {SVC1.name: None}, defer=True)
    narrowed = replace(lb, load_balancer_source_ranges=("198.51.100.0/24",))
    partial(state, kernel, {SVC1.name: frag(narrowed, [EP1])}, defer=True)
    ranges = content(kernel).sets["firewall-allow"].elems
    allowed = {"concat": ["1.2.3.4", "tcp", 80, {"prefix": {"addr": "198.51.100.0", "len": 24}}]}
    assert [json.loads(e) for e in ranges] == [allowed]
    assert_same_as_full(state, kernel)


# --- the shared affinity set -------------------------------------------------------

AFFINITY = replace(SVC1, session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=600)
CLIENT_KEY = ("192.0.2.7", 1234, 5678)
CLIENT = {"concat": list(CLIENT_KEY)}
"""An entry the datapath recorded: a client . an endpoint's key (as listed)."""


def _record_client(kernel: FakeBackend) -> None:
    """Add the entry the datapath would record (without the per-entry timeout
    its update statement gives, which no command says: nothing here lists it)."""
    kernel.commit(TABLE.add_elements(AFFINITY_SET, [Element(AFFINITY_SET, CLIENT_KEY)]))


def _clients(kernel: FakeBackend) -> list[Any]:
    return [json.loads(e) for e in content(kernel).sets[AFFINITY_SET].elems]


def _forget_client(kernel: FakeBackend) -> None:
    """Expire the recorded entry (so the table equals a fresh one)."""
    kernel.commit(TABLE.delete_elements(AFFINITY_SET, [Element(AFFINITY_SET, CLIENT_KEY)]))


AFFINITY_SET = "affinity:affinity"
"""The shared affinity set, in the affinity table (fragment.AFFINITY_TABLE)."""


def _planner_name(op: tuple[str, str, str, Any]) -> str:
    """The name an `_ops` entry's object has in the planner (commands name
    it in its own table: "affinity" of the affinity table is AFFINITY_SET)."""
    _, _, name, spec = op
    return affinity_table_name(name) if spec.get("table") == TABLE.affinity_table else name


def test_full_resync_never_flushes_or_redeclares_the_affinity_set() -> None:
    state, kernel = table(3, svc1=frag(AFFINITY, [EP1, EP2]))
    _record_client(kernel)
    commands = full_sync(state, kernel, dict(state.rendered))
    touched = {_planner_name(o) for o in _ops(commands) if o[1] == "set"}
    assert AFFINITY_SET not in touched
    assert len(_clients(kernel)) == 1
    # every other set that exists is flushed and refilled
    assert set(commands_of(commands, "flush", "set")) == {
        "cluster-ips", "nodeport-ips", "service-cidrs", "hairpin-endpoints",
        "firewall-vips", "firewall-allow", "masquerade-vips", "masquerade-nodeports",
    }


def _set_ops(staged: Staged) -> list[tuple[str, str, str]]:
    """The set and map commands of a planned transaction, declarations
    included (every one is a command of the one transaction, on 1.0.6 too)."""
    return [o[:3] for o in _ops(staged.commands) if o[1] in ("set", "map")]


def test_the_affinity_set_comes_with_the_first_port_with_affinity_and_goes_with_the_last() -> None:
    """Adding or deleting a port with ClientIP affinity touches no set while
    another one remains: its clients' entries are in the shared set, and a
    deleted port's expire by their timeout (listing the set to find them
    would cost what a partial sync must not: docs/architecture.md). The set
    itself is added with the first such port and deleted with the last."""
    sticky = replace(other(0), session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=600)
    state, kernel = table(0)
    assert AFFINITY_SET not in content(kernel).sets
    staged = stage_partial(state, {SVC1.name: frag(AFFINITY, [EP1, EP2])})
    assert _set_ops(staged) == [("add", "set", "affinity")]
    apply(state, kernel, staged, {SVC1.name: frag(AFFINITY, [EP1, EP2])})
    assert AFFINITY_SET in content(kernel).sets
    staged = stage_partial(state, {sticky.name: frag(sticky, [EP3])})
    assert _set_ops(staged) == []
    apply(state, kernel, staged, {sticky.name: frag(sticky, [EP3])})
    _record_client(kernel)
    staged = stage_partial(state, {SVC1.name: None})
    assert _set_ops(staged) == []
    apply(state, kernel, staged, {SVC1.name: None})
    assert len(_clients(kernel)) == 1
    staged = stage_partial(state, {sticky.name: None})
    assert _set_ops(staged) == [("delete", "set", "affinity")]
    apply(state, kernel, staged, {sticky.name: None})
    assert AFFINITY_SET not in content(kernel).sets
    assert_same_as_full(state, kernel)


@pytest.mark.parametrize("full", [False, True], ids=["partial sync", "full sync"])
def test_a_changed_affinity_timeout_rewrites_the_chooser_and_keeps_the_clients(
    full: bool,
) -> None:
    """The timeout is the rules' (each update gives it): the new one applies
    from each client's next packet, as kube-proxy's recreated sets would
    have it from the client's next connection."""
    state, kernel = table(2, svc1=frag(AFFINITY, [EP1, EP2]))
    _record_client(kernel)
    longer = frag(replace(AFFINITY, affinity_timeout=900), [EP1, EP2])
    if full:
        desired = {**state.rendered, SVC1.name: longer}
        staged = stage_full(state, listing(kernel), desired)
    else:
        staged = stage_partial(state, {SVC1.name: longer})
    commands = apply(state, kernel, staged, {SVC1.name: longer})
    ops = _ops(commands)
    assert not [o for o in ops if _planner_name(o) == AFFINITY_SET]
    svc = names.service_chain(SVC1.name)
    assert ("add", "chain", svc) in {o[:3] for o in ops}
    rules = content(kernel).chains[affinity_table_name(svc)]
    assert sum('"timeout": 900' in expr for expr, _ in rules) == 4
    assert not any('"timeout": 600' in expr for expr, _ in rules)
    assert len(_clients(kernel)) == 1
    _forget_client(kernel)
    assert_same_as_full(state, kernel)


# --- no-ops and failures ---------------------------------------------------------------

VARIETY = [
    pytest.param(SVC1, (EP1, EP2), id="ClusterIP"),
    pytest.param(AFFINITY, (EP1, EP2), id="ClientIP affinity"),
    pytest.param(replace(SVC1, node_port=3001, external_ips=("192.168.99.22",),
                         load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),),
                         load_balancer_source_ranges=("203.0.113.0/25",),
                         external_traffic_policy=TrafficPolicy.LOCAL),
                 (endpoint("10.180.0.1", local=True), EP2), id="everything external, eTP=Local"),
    pytest.param(SVC1, (), id="no endpoints"),
]


@pytest.mark.parametrize(("port", "endpoints"), VARIETY)
def test_an_identical_rerender_plans_zero_commands(
    port: ServicePort, endpoints: tuple[Endpoint, ...]
) -> None:
    state, _ = table(5, svc1=frag(port, endpoints))
    staged = stage_partial(state, {SVC1.name: frag(port, endpoints), SKELETON: SKEL})
    assert staged.commands == []


def test_a_failed_commit_leaves_the_state_as_it_was() -> None:
    state, kernel = table(3, svc1=frag(replace(AFFINITY, node_port=3001), [EP1]))
    partial(state, kernel, {SVC1.name: frag(SVC1, [EP1, EP2])}, defer=True)  # leaves KUBE-EXT
    before = copy.deepcopy(state)
    change: dict[Owner, Fragment | None] = {
        SVC1.name: frag(AFFINITY, [EP2, EP3]), other(0).name: None}
    first = stage_partial(state, change, defer_deletes=True)
    full = stage_full(state, listing(kernel), {SKELETON: SKEL})
    gc = stage_gc(state)
    assert first.commands and full.commands and gc.commands  # none of them committed
    for attr in ("fragments", "chains", "sets", "stale_chains", "stale_sets"):
        assert getattr(state, attr) == getattr(before, attr), attr
    assert dict(state.index.items()) == dict(before.index.items())
    assert stage_partial(state, change, defer_deletes=True).commands == first.commands


# --- transaction sizes -------------------------------------------------------------------


def _one_endpoint() -> Fragment:
    return frag(SVC1, [EP1])


AC, AR, FC, DC = "add chain", "add rule", "flush chain", "delete chain"
AE, DE, AM = "add element", "delete element", "add map"

SIZES = [
    # (starting fragment of ns1/svc1 or None, its new fragment or None, commands by kind)
    # The other services (one endpoint each) already use dispatch-tcp-1 and
    # vip-endpoints-tcp; a chooser another count needs comes with its first user,
    # and so does the map it picks from, declared in the same transaction (on
    # libnftables 1.0.6 too: its integer-keyed declaration is no longer sent
    # in a transaction of its own, so it counts here).
    # A ClusterIP service goes through the shared choosers (rules/dispatch.py):
    # elements only, one command per set
    pytest.param(None, _one_endpoint(), {AE: 4},
                 id="add a ClusterIP service with one endpoint"),
    # cluster-ips, service-ips (goto dispatch-tcp-1), hairpin-endpoints, vip-endpoints-tcp
    pytest.param(_one_endpoint(), frag(SVC1, [EP2]), {DE: 2, AE: 2},
                 id="change one endpoint's IP"),
    # hairpin EP1 . EP1 -> EP2 . EP2, vip-endpoints (VIP, 80, 0) -> EP2
    pytest.param(_one_endpoint(), frag(SVC1, [EP1, EP2]), {DE: 1, AC: 1, AR: 2, AE: 3},
                 id="add a second endpoint"),
    # service-ips goto dispatch-tcp-1 -> goto dispatch-tcp-2 (delete + add), and
    # dispatch-tcp-2 with its masquerade and DNAT rules (its first user);
    # hairpin EP2 . EP2, vip-endpoints (VIP, 80, 1)
    pytest.param(frag(SVC1, [EP1, EP2]), frag(SVC1, [EP1, EP2, EP3]),
                 {FC: 1, DE: 1, AC: 1, AR: 2, AE: 3, DC: 1},
                 id="add a third endpoint"),
    # as above, to dispatch-tcp-3; dispatch-tcp-2 lost its last user: flushed, deleted
    pytest.param(_one_endpoint(), None, {DE: 4}, id="delete the service"),
    # cluster-ips, service-ips, hairpin, vip-endpoints elements deleted
    pytest.param(_one_endpoint(), _one_endpoint(), {}, id="no change"),
    pytest.param(_one_endpoint(), frag(SVC1), {DE: 3, AE: 1},
                 id="endpoints become none"),
    # service-ips -> no-endpoint-services (reject), hairpin and endpoints elements gone
    pytest.param(None, frag(SVC1), {AE: 2}, id="add a service without endpoints"),
    # cluster-ips and no-endpoint-services elements
    pytest.param(frag(SVC1), _one_endpoint(), {DE: 1, AE: 3},
                 id="its first endpoint"),
    # no-endpoint-services -> service-ips + hairpin + endpoints
    # A NodePort service with eTP=Cluster goes through shared choosers too
    pytest.param(None, frag(SHARED_NODEPORT, [EP1]), {AM: 1, AC: 1, AR: 1, AE: 7},
                 id="add a NodePort service with one endpoint"),
    # dispatch-nodeport-tcp-1 and the map it picks from, nodeport-endpoints-tcp
    # (their first user); cluster-ips, service-ips,
    # service-nodeports (goto dispatch-nodeport-tcp-1), masquerade-nodeports,
    # vip-endpoints, nodeport-endpoints, hairpin
    pytest.param(frag(SHARED_NODEPORT, [EP1]), frag(SHARED_NODEPORT, [EP2]), {DE: 3, AE: 3},
                 id="change a NodePort service's endpoint"),
    # vip-endpoints, nodeport-endpoints, hairpin
    # An eTP=Local NodePort service goes through the shared nodeport-local chain
    pytest.param(None, frag(NODEPORT, [EP1]), {AM: 3, AC: 2, AR: 5, AE: 8},
                 id="add an eTP=Local NodePort service with one endpoint"),
    # nodeport-local (4 rules) and its two choosers maps, dispatch-nodeport-tcp-1
    # and nodeport-endpoints-tcp (their first user); cluster-ips, service-ips, vip-endpoints,
    # service-nodeports (goto nodeport-local), nodeport-cluster-choosers,
    # nodeport-endpoints, no-endpoint-nodeports (no local endpoint: drop), hairpin
    pytest.param(frag(NODEPORT, [EP1]), frag(NODEPORT, [EP2]), {DE: 3, AE: 3},
                 id="change an eTP=Local NodePort service's endpoint"),
    # vip-endpoints, nodeport-endpoints, hairpin
    pytest.param(frag(NODEPORT, [EP1]), frag(NODEPORT, [EP1, EP2]),
                 {FC: 1, DE: 2, AC: 2, AR: 3, AE: 5, DC: 1},
                 id="add a second endpoint to an eTP=Local NodePort service"),
    # service-ips and nodeport-cluster-choosers: goto the choosers of 2, which
    # come with their first user; dispatch-nodeport-tcp-1 goes with its last;
    # vip-endpoints, nodeport-endpoints, hairpin
    # A ClientIP affinity NodePort service keeps chains of its own
    pytest.param(frag(CHAINED, [EP1]), frag(CHAINED, [EP2]), {FC: 1, AC: 1, AR: 3, DE: 1, AE: 1},
                 id="change a ClientIP affinity service's endpoint"),
    # KUBE-SVC rewritten (its affinity lookups and cascade DNAT inline); hairpin
]


@pytest.mark.parametrize(("start", "new", "expected"), SIZES)
@pytest.mark.parametrize("others", [100, 1000])
def test_partial_sync_size_is_pinned_and_independent_of_other_services(
    start: Fragment | None, new: Fragment | None, expected: dict[str, int], others: int
) -> None:
    state, kernel = table(others, start)
    commands = partial(state, kernel, {SVC1.name: new})
    kinds = Counter(f"{verb} {kind}" for verb, kind, _, _ in _ops(commands))
    assert kinds == Counter(expected)
    assert len(commands) == sum(expected.values())
    if others == 100:  # the full-sync comparison is slow at 1000
        assert_same_as_full(state, kernel)


# --- shared choosers on demand --------------------------------------------------------

EPS3 = (EP1, EP2, EP3)
TWIN = other(1)
"""Another ClusterIP port: it shares SVC1's chooser when it has as many endpoints."""


def _at(ops: Sequence[tuple[str, str, str, Any]], verb: str, kind: str, name: str) -> int:
    """The index of the first command `verb kind name`."""
    return next(i for i, o in enumerate(ops) if o[:3] == (verb, kind, name))


def _has(ops: Sequence[tuple[str, str, str, Any]], verb: str, kind: str, name: str) -> bool:
    return any(o[:3] == (verb, kind, name) for o in ops)


def _shared_objects(kernel: FakeBackend) -> tuple[set[str], set[str]]:
    """The shared chains and maps the kernel holds (choosers, eTP=Local
    chains; the maps they pick from, the choosers maps, the affinity set)."""
    listed = content(kernel)
    chains = {c for c in listed.chains if is_shared_chain(c)}
    sets = {n for n in listed.sets
            if is_indexed_map(n) or is_choosers_map(n) or n == AFFINITY_SET}
    return chains, sets


def test_an_empty_table_holds_no_shared_chooser_or_map() -> None:
    _, kernel = fresh({SKELETON: SKEL})
    assert _shared_objects(kernel) == (set(), set())
    _, kernel = table(0, svc1=frag(SVC1))  # a port without endpoints uses no chooser
    assert _shared_objects(kernel) == (set(), set())


@pytest.mark.parametrize("version", ["1.0.6", "1.1"], ids=["libnftables 1.0.6", "1.1.x"])
def test_a_chooser_and_its_map_come_with_their_first_user_and_go_with_their_last(
    version: str,
) -> None:
    """The partial sync that gives dispatch-tcp-3 its first user adds it and
    the map it picks from in its own transaction, before the port's elements
    (the map, integer key and all: an `add map` by typeof in that one
    transaction, before its elements and the chooser's rule, beside either
    libnftables); a second port of the same count adds neither; deleting
    the first leaves both; deleting the last deletes both, after the
    elements that referenced them are gone."""
    state, kernel = fresh({SKELETON: SKEL}, version=version)
    first = frag(SVC1, EPS3)
    staged = stage_partial(state, {SVC1.name: first})
    ops = _ops(staged.commands)
    assert _at(ops, "add", "chain", "dispatch-tcp-3") < _at(ops, "add", "element", "service-ips")
    assert _at(ops, "add", "map", "vip-endpoints-tcp") < min(
        _at(ops, "add", "rule", "dispatch-tcp-3"),
        _at(ops, "add", "element", "vip-endpoints-tcp"))
    assert "typeof" in ops[_at(ops, "add", "map", "vip-endpoints-tcp")][3]["type"]
    apply(state, kernel, staged, {SVC1.name: first})
    assert _shared_objects(kernel) == ({"dispatch-tcp-3"}, {"vip-endpoints-tcp"})
    assert _chooser(state, ("service-ips", ("172.30.0.41", "tcp", 80))) == "dispatch-tcp-3"
    assert_same_as_full(state, kernel)

    twin = frag(TWIN, [endpoint(f"10.180.2.{i}") for i in (1, 2, 3)])
    staged = stage_partial(state, {TWIN.name: twin})
    assert {o[1] for o in _ops(staged.commands)} == {"element"}  # no map declared
    apply(state, kernel, staged, {TWIN.name: twin})
    assert_same_as_full(state, kernel)

    commands = partial(state, kernel, {SVC1.name: None})
    assert {o[1] for o in _ops(commands)} == {"element"}
    assert _shared_objects(kernel) == ({"dispatch-tcp-3"}, {"vip-endpoints-tcp"})
    assert _chooser(state, ("service-ips", (TWIN.cluster_ip, "tcp", 80))) == "dispatch-tcp-3"
    assert_same_as_full(state, kernel)

    commands = partial(state, kernel, {TWIN.name: None})
    ops = _ops(commands)
    assert {o[:3] for o in ops if o[1] != "element"} == {
        ("flush", "chain", "dispatch-tcp-3"), ("delete", "chain", "dispatch-tcp-3"),
        ("delete", "map", "vip-endpoints-tcp")}
    assert _at(ops, "delete", "element", "service-ips") < _at(ops, "delete", "chain",
                                                               "dispatch-tcp-3")
    assert _at(ops, "flush", "chain", "dispatch-tcp-3") < _at(ops, "delete", "map",
                                                              "vip-endpoints-tcp")
    assert _at(ops, "delete", "element", "vip-endpoints-tcp") < _at(ops, "delete", "map",
                                                                    "vip-endpoints-tcp")
    assert _shared_objects(kernel) == (set(), set())
    assert_same_as_full(state, kernel)


def test_a_map_stays_while_another_chooser_picks_from_it() -> None:
    state, kernel = fresh({SKELETON: SKEL, SVC1.name: frag(SVC1, EPS3),
                           TWIN.name: frag(TWIN, [EP1, EP2])})
    assert _shared_objects(kernel) == ({"dispatch-tcp-2", "dispatch-tcp-3"},
                                       {"vip-endpoints-tcp"})
    commands = partial(state, kernel, {SVC1.name: None})
    assert {o[:3] for o in _ops(commands) if o[1] != "element"} == {
        ("flush", "chain", "dispatch-tcp-3"), ("delete", "chain", "dispatch-tcp-3")}
    assert _shared_objects(kernel) == ({"dispatch-tcp-2"}, {"vip-endpoints-tcp"})
    assert_same_as_full(state, kernel)
    commands = partial(state, kernel, {TWIN.name: None})
    assert {o[:3] for o in _ops(commands) if o[1] != "element"} == {
        ("flush", "chain", "dispatch-tcp-2"), ("delete", "chain", "dispatch-tcp-2"),
        ("delete", "map", "vip-endpoints-tcp")}
    assert _shared_objects(kernel) == (set(), set())
    assert_same_as_full(state, kernel)


@pytest.mark.parametrize("twin", [False, True], ids=["its last user", "another user stays"])
def test_a_port_whose_endpoint_count_goes_from_two_to_three_moves_to_dispatch_tcp_3(
    twin: bool,
) -> None:
    """Its service-ips element goes from dispatch-tcp-2 to dispatch-tcp-3,
    which is added before it; dispatch-tcp-2 is flushed and deleted after
    the element that went to it is gone when the port was its last user,
    kept when another port still uses it; the map both pick from stays."""
    desired: dict[Owner, Fragment] = {SKELETON: SKEL, SVC1.name: frag(SVC1, [EP1, EP2])}
    if twin:
        desired[TWIN.name] = frag(TWIN, [EP1, EP2])
    state, kernel = fresh(desired)
    staged = stage_partial(state, {SVC1.name: frag(SVC1, EPS3)})
    ops = _ops(staged.commands)
    assert _at(ops, "add", "chain", "dispatch-tcp-3") < _at(ops, "add", "element", "service-ips")
    assert not [o for o in ops if o[1] in ("set", "map")]
    if twin:
        assert not _has(ops, "flush", "chain", "dispatch-tcp-2")
        assert not _has(ops, "delete", "chain", "dispatch-tcp-2")
    else:
        assert _at(ops, "delete", "element", "service-ips") < _at(ops, "delete", "chain",
                                                                   "dispatch-tcp-2")
    apply(state, kernel, staged, {SVC1.name: frag(SVC1, EPS3)})
    assert _chooser(state, ("service-ips", ("172.30.0.41", "tcp", 80))) == "dispatch-tcp-3"
    chains, sets = _shared_objects(kernel)
    assert chains == ({"dispatch-tcp-2", "dispatch-tcp-3"} if twin else {"dispatch-tcp-3"})
    assert sets == {"vip-endpoints-tcp"}
    assert_same_as_full(state, kernel)


def test_the_etp_local_chains_and_their_choosers_maps_come_and_go_with_their_users() -> None:
    """nodeport-local and its two choosers maps (and the choosers of the
    port's counts) come with the first eTP=Local node port and go with the last."""
    state, kernel = fresh({SKELETON: SKEL})
    local = (endpoint("10.180.0.1", local=True), EP2)
    commands = partial(state, kernel, {SVC1.name: frag(NODEPORT, local)})
    ops = _ops(commands)
    for name in ("nodeport-cluster-choosers", "nodeport-local-choosers"):
        assert _at(ops, "add", "map", name) < _at(ops, "add", "rule", "nodeport-local")
    assert _at(ops, "add", "chain", "nodeport-local") < _at(ops, "add", "element",
                                                            "service-nodeports")
    assert _shared_objects(kernel) == (
        {"nodeport-local", "dispatch-tcp-2", "dispatch-nodeport-tcp-2",
         "dispatch-nodeport-local-tcp-1"},
        {"nodeport-cluster-choosers", "nodeport-local-choosers", "vip-endpoints-tcp",
         "nodeport-endpoints-tcp", "nodeport-local-endpoints-tcp"})
    assert_same_as_full(state, kernel)
    commands = partial(state, kernel, {SVC1.name: None})
    assert _at(_ops(commands), "delete", "element", "service-nodeports") < _at(
        _ops(commands), "delete", "chain", "nodeport-local")
    assert _shared_objects(kernel) == (set(), set())
    assert_same_as_full(state, kernel)


@pytest.mark.parametrize("version", [
    pytest.param("1.0.6", id="libnftables 1.0.6"),
    pytest.param("1.1", id="1.1.x"),
])
@pytest.mark.parametrize(("port", "stale"), [
    pytest.param(SVC1, {"vip-endpoints-tcp": True}, id="a chooser's map"),
    pytest.param(AFFINITY, {AFFINITY_SET: False}, id="the affinity set"),
])
def test_a_shared_set_left_for_gc_is_used_again_by_a_new_user(
    version: str, port: ServicePort, stale: dict[str, bool]
) -> None:
    """With deferred deletes, a shared set whose last user left is flushed
    or left for gc; a user that comes before gc gets it back, as it is."""
    state, kernel = fresh({SKELETON: SKEL, SVC1.name: frag(port, [EP1])}, version=version)
    partial(state, kernel, {SVC1.name: None}, defer=True)
    assert state.stale_sets == stale
    partial(state, kernel, {SVC1.name: frag(port, [EP1, EP2])}, defer=True)
    assert state.stale_sets == {}
    apply(state, kernel, stage_gc(state))
    assert_same_as_full(state, kernel)


def test_the_last_etp_local_port_leaves_its_choosers_maps_for_gc() -> None:
    """With deferred deletes, the last eTP=Local port's elements go and the
    shared chains and maps it was the last user of are left for gc."""
    lb = replace(SVC1, load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),),
                 external_traffic_policy=TrafficPolicy.LOCAL)
    state, kernel = table(0, svc1=frag(lb, [EP1]))
    partial(state, kernel, {SVC1.name: None}, defer=True)
    assert {"external-cluster-choosers", "external-local-choosers"} <= set(state.stale_sets)
    assert "external-local" in state.stale_chains
    apply(state, kernel, stage_gc(state))
    assert _shared_objects(kernel) == (set(), set())
    assert_same_as_full(state, kernel)


# --- element claims -------------------------------------------------------------------

SAME_IP = "172.30.0.41"
A = service_port("a", ns="ns1", cluster_ip=SAME_IP)
B = service_port("b", ns="ns2", cluster_ip=SAME_IP)


def test_deleting_one_claimant_and_adding_another_hands_the_element_over_once() -> None:
    state, kernel = fresh({SKELETON: SKEL, A.name: frag(A, [EP1])})
    commands = partial(state, kernel, {A.name: None, B.name: frag(B, [EP2])})
    ops = _ops(commands)
    adds = [o[3]["elem"] for o in ops if o[:3] == ("add", "element", "service-ips")]
    dels = [o[3]["elem"] for o in ops if o[:3] == ("delete", "element", "service-ips")]
    assert len(adds) == 1 and len(adds[0]) == 1
    # B's element: to the shared chooser of its one endpoint, B's KUBE-SVC-<h> in its comment
    assert adds[0][0][1] == {"goto": {"target": "dispatch-tcp-1"}}
    assert adds[0][0][0]["elem"]["comment"].endswith(names.service_chain(B.name))
    assert dels == [[{"concat": [SAME_IP, "tcp", 80]}]]
    # cluster-ips keeps its element: same key, same (no) verdict
    assert not [o for o in ops if o[1] == "element" and o[2] == "cluster-ips"]
    assert_same_as_full(state, kernel)


@pytest.mark.parametrize("order", ["a then b", "b then a", "together"])
def test_two_claimants_resolve_to_the_same_winner_whatever_the_order(order: str) -> None:
    state, kernel = fresh({SKELETON: SKEL})
    fa: dict[Owner, Fragment | None] = {A.name: frag(A, [EP1])}
    fb: dict[Owner, Fragment | None] = {B.name: frag(B, [EP2])}
    steps = {"a then b": [fa, fb], "b then a": [fb, fa], "together": [{**fa, **fb}]}[order]
    for step in steps:
        commands = partial(state, kernel, step)
        adds = [e for o in _ops(commands) if o[:3] == ("add", "element", "service-ips")
                for e in o[3]["elem"]]
        assert len(adds) <= 1
    key = ("service-ips", (SAME_IP, "tcp", 80))
    winner = state.effective(key)
    assert winner is not None
    assert winner.value is not None
    assert _claimant(state, key) == names.service_chain(A.name)  # ns1/a sorts before ns2/b
    # ... and so is the endpoint its shared chooser picks for the address
    assert _target(state, (SAME_IP, 80, 0)) == EP1.ip
    assert_same_as_full(state, kernel)
    # the loser takes over when the winner leaves
    partial(state, kernel, {A.name: None})
    assert _claimant(state, key) == names.service_chain(B.name)
    assert _target(state, (SAME_IP, 80, 0)) == EP2.ip
    assert_same_as_full(state, kernel)


@pytest.mark.parametrize("order", ["a then b", "b then a", "together"])
@pytest.mark.parametrize(("a_endpoints", "b_endpoints"), [
    pytest.param([EP1], [EP2, EP3], id="the winner with fewer"),
    pytest.param([EP1, EP2], [EP3], id="the winner with more"),
])
def test_two_claimants_with_different_counts_send_the_destination_to_the_winners_chooser(
    order: str, a_endpoints: list[Endpoint], b_endpoints: list[Endpoint]
) -> None:
    """Two ports claim one destination with different endpoint counts: its
    service-ips element goes to the chooser of the winner's count, which
    picks the winner's endpoints; when the winner leaves, to the loser's.
    Both choosers exist while both ports do (each has a user), as a full
    sync writes them."""
    state, kernel = fresh({SKELETON: SKEL})
    fa: dict[Owner, Fragment | None] = {A.name: frag(A, a_endpoints)}
    fb: dict[Owner, Fragment | None] = {B.name: frag(B, b_endpoints)}
    for step in {"a then b": [fa, fb], "b then a": [fb, fa], "together": [{**fa, **fb}]}[order]:
        partial(state, kernel, step)
    key = ("service-ips", (SAME_IP, "tcp", 80))
    assert _claimant(state, key) == names.service_chain(A.name)  # ns1/a sorts before ns2/b
    assert _chooser(state, key) == f"dispatch-tcp-{len(a_endpoints)}"
    assert [_target(state, (SAME_IP, 80, i)) for i in range(len(a_endpoints))] == [
        e.ip for e in a_endpoints]
    assert {f"dispatch-tcp-{len(a_endpoints)}", f"dispatch-tcp-{len(b_endpoints)}"} <= set(
        content(kernel).chains)
    assert_same_as_full(state, kernel)
    partial(state, kernel, {A.name: None})
    assert _claimant(state, key) == names.service_chain(B.name)
    assert _chooser(state, key) == f"dispatch-tcp-{len(b_endpoints)}"
    assert [_target(state, (SAME_IP, 80, i)) for i in range(len(b_endpoints))] == [
        e.ip for e in b_endpoints]
    assert f"dispatch-tcp-{len(a_endpoints)}" not in content(kernel).chains
    assert_same_as_full(state, kernel)


def _claimant(state: Synced, key: tuple[str, Any]) -> str:
    """The KUBE-SVC-<h> of the service-ips element the kernel holds for `key`."""
    winner = state.effective(key)
    assert winner is not None and winner.comment is not None
    return winner.comment.rsplit(" ", 1)[-1]


def _chooser(state: Synced, key: tuple[str, Any]) -> str:
    """The shared chooser the service-ips element for `key` goes to."""
    winner = state.effective(key)
    assert winner is not None and isinstance(winner.value, Verdict)
    assert winner.value.kind == "goto"
    return winner.value.target


def _target(state: Synced, key: tuple[str, int, int]) -> str:
    """The endpoint address of the vip-endpoints element for `key`."""
    winner = state.effective(("vip-endpoints-tcp", key))
    assert winner is not None and isinstance(winner.value, Target)
    return winner.value.ip


# --- full sync against a listing ------------------------------------------------------


def test_full_sync_removes_what_is_not_desired_and_recreates_a_rehooked_base_chain() -> None:
    state, kernel = table(2, svc1=frag(AFFINITY, [EP1]))
    kernel.commit([
        AddChain(HERE, "KUBE-SVC-LEFTOVER"),
        AddSet(HERE, "leftover", SetDecl.keyed("leftover", ("ip daddr",))),
        FlushChain(HERE, "nat-output"),
        DeleteChain(HERE, "nat-output"),
        AddChain(HERE, "nat-output", BaseHook("nat", "output", -99, "accept")),
    ])
    commands = full_sync(state, kernel, dict(state.rendered))
    assert "KUBE-SVC-LEFTOVER" in commands_of(commands, "delete", "chain")
    assert "leftover" in commands_of(commands, "delete", "set")
    assert content(kernel).hooks["nat-output"] == BaseHook("nat", "output", -100)
    assert_same_as_full(state, kernel)


def test_full_sync_with_deferred_deletes_leaves_leftovers_for_gc() -> None:
    state, kernel = table(1, svc1=frag(CHAINED, [EP1]))
    desired = {o: f for o, f in state.rendered.items() if o != SVC1.name}
    full_sync(state, kernel, desired, defer=True)
    assert state.stale_chains == {affinity_table_name(names.service_chain(SVC1.name)),
                                  affinity_table_name(names.external_chain(SVC1.name))}
    apply(state, kernel, stage_gc(state))
    assert_same_as_full(state, kernel)


def test_a_skeleton_change_rewrites_only_the_skeleton() -> None:
    primary = replace(CONFIG, nodeport_addresses=("primary",))
    before = render_skeleton(V4, primary, NODE, ("172.30.0.0/16",))
    state, kernel = fresh({SKELETON: before, SVC1.name: frag(SVC1, [EP1])})
    moved = replace(NODE, ipv4=("192.168.0.3",))
    commands = partial(state, kernel, {SKELETON: render_skeleton(V4, primary, moved)})
    assert {(v, k, n) for v, k, n, _ in _ops(commands)} == {
        ("flush", "set", "nodeport-ips"), ("add", "element", "nodeport-ips"),
        ("flush", "set", "service-cidrs")}
    assert content(kernel).sets["nodeport-ips"].elems == {'"192.168.0.3"': None}
    commands = partial(state, kernel, {SKELETON: SKEL})  # back to every local address
    assert set(commands_of(commands, "add", "chain")) == {"KUBE-SERVICES",
                                                          "KUBE-EXTERNAL-SERVICES"}
    assert_same_as_full(state, kernel)


# --- property: partial syncs end where a full sync ends --------------------------------

_OWNER_POOL = [
    service_port(name, ns=ns, protocol=protocol).name
    for ns, name in [("ns1", "a"), ("ns1", "b"), ("ns2", "a")]
    for protocol in (L4Protocol.TCP, L4Protocol.UDP)
]
_LBS = [(), ("1.2.3.4",), ("1.2.3.4", "5.6.7.8")]
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    # few cluster IPs and node ports, so that services collide
    "cluster_ip": st.sampled_from(["172.30.0.1", "172.30.0.2", "172.30.0.3"]),
    "port": st.sampled_from([80, 443]),
    "node_port": st.sampled_from([0, 30001, 30002]),
    "external_ips": st.sampled_from([(), ("192.168.99.22",)]),
    "load_balancer_ingress": st.sampled_from(
        [tuple(LoadBalancerIngress(ip) for ip in lbs) for lbs in _LBS]),
    "load_balancer_source_ranges": st.sampled_from(
        [(), ("203.0.113.0/25",), ("192.168.0.0/16", "203.0.113.0/24")]),
    "external_traffic_policy": st.sampled_from(list(TrafficPolicy)),
    "internal_traffic_policy": st.sampled_from(list(TrafficPolicy)),
    "session_affinity": st.sampled_from(list(SessionAffinity)),
    "affinity_timeout": st.sampled_from([60, 10800]),
}


@st.composite
def _endpoints(draw: st.DrawFn) -> tuple[Endpoint, ...]:
    eps = []
    for ip in draw(st.lists(st.sampled_from([f"10.180.0.{i}" for i in range(1, 6)]),
                            unique=True, max_size=4)):
        ready = draw(st.booleans())
        eps.append(endpoint(ip, local=draw(st.booleans()), ready=ready,
                            terminating=not ready, serving=draw(st.booleans())))
    return tuple(eps)


Spec = tuple[ServicePort, tuple[Endpoint, ...]]


@st.composite
def _new_spec(draw: st.DrawFn, owner: ServicePortName) -> Spec:
    """A random service port named `owner` with random endpoints and policies."""
    fields = {k: draw(v) for k, v in _FIELDS.items()}
    port = service_port(owner.name, ns=owner.namespace, protocol=owner.protocol, **fields)
    return port, draw(_endpoints())


@st.composite
def _tweaked_spec(draw: st.DrawFn, spec: Spec) -> Spec:
    """`spec` with one thing changed: its endpoints or one field."""
    port, eps = spec
    what = draw(st.sampled_from(["endpoints", *_FIELDS]))
    if what == "endpoints":
        return port, draw(_endpoints())
    return replace(port, **{what: draw(_FIELDS[what])}), eps


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), gc_every=st.integers(1, 3))
def test_successive_partial_syncs_equal_one_full_sync(
    data: st.DataObject, gc_every: int
) -> None:
    """Random syncs (each adds, tweaks or deletes a few service ports; mostly
    partial, some full against the kernel's listing), then one last gc: the
    planner's state and the kernel equal a full sync of the final fragments
    into a fresh table."""
    _successive_syncs(data, gc_every, defer=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), gc_every=st.integers(1, 3))
def test_successive_syncs_with_deferred_deletes_equal_one_full_sync(
    data: st.DataObject, gc_every: int
) -> None:
    """As above, with the deletes deferred to gc (kernels < 6.2)."""
    _successive_syncs(data, gc_every, defer=True)


def _successive_syncs(data: st.DataObject, gc_every: int, *, defer: bool) -> None:
    state, kernel = fresh({SKELETON: SKEL})
    specs: dict[ServicePortName, Spec] = {}
    gone: dict[ServicePortName, Spec] = {}
    for n in range(1, data.draw(st.integers(1, 8), label="syncs") + 1):
        step: dict[Owner, Fragment | None] = {}
        owners = data.draw(st.lists(st.sampled_from(_OWNER_POOL), unique=True, min_size=1,
                                    max_size=3), label="owners")
        for owner in owners:
            current = specs.get(owner)
            if current is not None:
                action = data.draw(st.sampled_from(["new", "tweak", "delete"]))
            else:  # a deleted port may come back, changed, while its chains are stale
                action = data.draw(st.sampled_from(["new", "revive"] if owner in gone else ["new"]))
            if action == "delete":
                gone[owner] = specs.pop(owner)
                step[owner] = None
                continue
            previous = current if action == "tweak" else gone.get(owner)
            specs[owner] = data.draw(
                _new_spec(owner) if action == "new" or previous is None
                else _tweaked_spec(previous))
            step[owner] = frag(*specs[owner])
        if data.draw(st.integers(0, 4), label="full sync?") == 0:
            desired = {o: f for o, f in {**state.rendered, **step}.items() if f is not None}
            full_sync(state, kernel, desired, defer=defer)
        else:
            partial(state, kernel, step, defer=defer)
        if n % gc_every == 0:
            apply(state, kernel, stage_gc(state))
    apply(state, kernel, stage_gc(state))
    assert set(state.fragments) == {SKELETON, *specs}
    assert_same_as_full(state, kernel)


# --- property, seeded: the shared objects after partial syncs --------------------------

_POOL = [service_port(name, ns=ns, protocol=protocol)
         for ns, name in [("ns1", "a"), ("ns1", "b"), ("ns2", "a")]
         for protocol in (L4Protocol.TCP, L4Protocol.UDP)]


def _random_port(rng: random.Random, port: ServicePort) -> tuple[ServicePort, list[Endpoint]]:
    """`port` with random destinations and policies, and 0..5 endpoints:
    every count of the choosers, eTP=Local ones, some ClientIP affinity."""
    changed = replace(
        port,
        cluster_ip=rng.choice(["172.30.0.1", "172.30.0.2", "172.30.0.3"]),
        node_port=rng.choice([0, 30001, 30002]),
        load_balancer_ingress=rng.choice([(), (LoadBalancerIngress("1.2.3.4"),)]),
        external_traffic_policy=rng.choice(list(TrafficPolicy)),
        internal_traffic_policy=rng.choice(list(TrafficPolicy)),
        session_affinity=rng.choice([SessionAffinity.NONE] * 3 + [SessionAffinity.CLIENT_IP]),
    )
    ips = rng.sample([f"10.180.0.{i}" for i in range(1, 7)], rng.randint(0, 5))
    return changed, [endpoint(ip, local=rng.random() < 0.5) for ip in ips]


@pytest.mark.parametrize("seed", range(5))
def test_after_any_partial_syncs_the_chains_and_sets_are_a_full_syncs(seed: int) -> None:
    """A few random sequences of partial syncs (deterministic seeds), each
    adding, changing or deleting up to three ports, so that choosers, the
    maps they pick from, the eTP=Local chains and the affinity set gain
    and lose users: after every sync the state's chains, sets and users,
    and what the kernel holds, are those of a full sync of the same ports."""
    rng = random.Random(seed)
    state, kernel = fresh({SKELETON: SKEL})
    live: set[Owner] = set()
    seen: set[str] = set()
    for _ in range(15):
        step: dict[Owner, Fragment | None] = {}
        for port in rng.sample(_POOL, rng.randint(1, 3)):
            if port.name in live and rng.random() < 0.3:
                step[port.name] = None
                live.discard(port.name)
            else:
                step[port.name] = frag(*_random_port(rng, port))
                live.add(port.name)
        partial(state, kernel, step)
        assert set(state.fragments) == {SKELETON, *live}
        assert_same_as_full(state, kernel)
        seen |= {c for c in state.chains if is_shared_chain(c)}
    assert len(seen) > 5, "the sequence used few shared chains"
