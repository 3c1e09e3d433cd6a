"""Planning transactions (nftproxy.core.nft.plan) with fragments from the real renderers.

Aspects:
- order inside one transaction: a chain exists before anything targets it,
  flushes come before deletes, a verdict change is delete + add;
- removed chains are flushed and deleted, or left flushed for stage_gc;
- affinity sets keep their clients across full syncs and are re-created
  (after their users are flushed) when their timeout changes;
- an unchanged service costs nothing, a failed commit records nothing;
- transaction sizes of partial syncs are pinned and do not grow with the
  number of other services (upstream's TestSyncProxyRulesRepeated, §2);
- two service ports claiming one element resolve to one deterministic winner;
- property: successive partial syncs end where one full sync of the final
  state ends, in the planner's state and in what the kernel lists.

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
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from builders import CONFIG, NODE, endpoint, render, service_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel import picked_chooser

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
from nftproxy.core.nft.errors import NftBusy, NftExists, NftNotFound, NftRejected
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
from nftproxy.core.rules.fragment import (
    AFFINITY_TABLE,
    BaseHook,
    Fragment,
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


def new_kernel() -> FakeBackend:
    kernel = FakeBackend()
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


def _ops(commands: Sequence[Json]) -> list[tuple[str, str, str, Any]]:
    """(verb, kind, name, spec) per command."""
    out = []
    for c in commands:
        (verb, body), = c.items()
        (kind, spec), = body.items()
        out.append((verb, kind, spec.get("name") or spec.get("chain", ""), spec))
    return out


def check_order(commands: Sequence[Json]) -> None:
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


def apply(state: Synced, kernel: FakeBackend, staged: Staged,
          planned_from: Mapping[Owner, Fragment | None] | None = None, *,
          full: bool = False) -> list[Json]:
    """Commit a planned transaction to the (fake) kernel, then record it
    (with the fragments it was planned from: all of them if `full`)."""
    check_order(staged.commands)
    kernel.declare(staged.declarations)
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


def fresh(desired: Mapping[Owner, Fragment]) -> tuple[Synced, FakeBackend]:
    state, kernel = Synced(V4, TABLE), new_kernel()
    apply(state, kernel, stage_full(state, None, desired), desired, full=True)
    return state, kernel


def full_sync(state: Synced, kernel: FakeBackend, desired: Mapping[Owner, Fragment], *,
              defer: bool = False) -> list[Json]:
    """A full sync of `desired` against what the kernel lists."""
    staged = stage_full(state, listing(kernel), desired, defer_deletes=defer)
    return apply(state, kernel, staged, desired, full=True)


def assert_same_as_full(state: Synced, kernel: FakeBackend) -> None:
    """The state and the kernel equal a full sync of state's fragments into a fresh table."""
    assert set(state.rendered) == set(state.fragments)
    ref_state, ref_kernel = fresh(dict(state.rendered))
    assert state.chains == ref_state.chains
    assert state.sets == ref_state.sets
    assert effective(state) == effective(ref_state)
    assert content(kernel) == content(ref_kernel)


# --- the kernel refuses, and keeps nothing of a refused transaction ------------------


def _chain(name: str, verb: str = "add") -> Json:
    return {verb: {"chain": {"family": "ip", "table": "nftproxy", "name": name}}}


def _rule(chain: str, *expr: Json) -> Json:
    return {"add": {"rule": {"family": "ip", "table": "nftproxy", "chain": chain,
                             "expr": list(expr)}}}


def _aff(verb: str = "add", **extra: Any) -> Json:
    return {verb: {"set": {"family": "ip", "table": "nftproxy", "name": "aff", **extra}}}


@pytest.mark.parametrize(
    ("commands", "error"),
    [
        pytest.param([_chain("A"), _rule("A", {"goto": {"target": "B"}})], NftNotFound,
                     id="goto to a missing chain"),
        pytest.param([_chain("A"), _chain("B"), _rule("A", {"jump": {"target": "B"}}),
                      _chain("B", "flush"), _chain("B", "delete")], NftBusy,
                     id="deleting a chain a rule jumps to"),
        pytest.param([_chain("A"), {"add": {"map": {"family": "ip", "table": "nftproxy",
                                                    "name": "m", "type": "ipv4_addr",
                                                    "map": "verdict"}}},
                      {"add": {"element": {"family": "ip", "table": "nftproxy", "name": "m",
                                           "elem": [["1.1.1.1", {"goto": {"target": "A"}}]]}}},
                      _chain("A", "delete")], NftBusy,
                     id="deleting a chain a map element targets"),
        pytest.param([_aff(type="ipv4_addr", flags=["timeout"], timeout=60), _chain("A"),
                      _rule("A", {"set": {"op": "update", "set": "@aff",
                                          "elem": {"payload": {"protocol": "ip",
                                                               "field": "saddr"}}}}),
                      _aff(type="ipv4_addr", flags=["timeout"], timeout=60)], NftExists,
                     id="re-adding a set an update rule made dynamic"),
        pytest.param([_aff(type="ipv4_addr"), _chain("A"),
                      _rule("A", {"match": {"op": "==", "left": "x", "right": "@aff"}}),
                      _aff("delete")], NftBusy,
                     id="deleting a set a rule uses"),
        pytest.param([_aff(type="ipv4_addr"),
                      {"delete": {"element": {"family": "ip", "table": "nftproxy", "name": "aff",
                                              "elem": ["1.1.1.1"]}}}], NftNotFound,
                     id="deleting a missing element"),
        pytest.param([_chain("A"), _chain("B"),
                      {"add": {"map": {"family": "ip", "table": "nftproxy", "name": "m",
                                       "type": "ipv4_addr", "map": "verdict"}}},
                      {"add": {"element": {"family": "ip", "table": "nftproxy", "name": "m",
                                           "elem": [["1.1.1.1", {"goto": {"target": "A"}}]]}}},
                      {"add": {"element": {"family": "ip", "table": "nftproxy", "name": "m",
                                           "elem": [["1.1.1.1", {"goto": {"target": "B"}}]]}}}],
                     NftExists, id="adding an element that exists with another verdict"),
    ],
)
def test_the_kernel_refuses_and_stays_unchanged(
    commands: list[Json], error: type[NftRejected]
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
"""SVC1 with an eTP=Local node port: since ruleset v8 it goes through the
shared nodeport-local chain and choosers, as SVC1 (cluster IP only) and a
node port of eTP=Cluster go through shared choosers (rules/dispatch.py)."""
CHAINED = replace(NODEPORT, session_affinity=SessionAffinity.CLIENT_IP)
"""NODEPORT with ClientIP affinity: it keeps its KUBE-SVC and KUBE-EXT chains."""


SHARED_NODEPORT = replace(SVC1, node_port=30001)


def frag(port: ServicePort, endpoints: Iterable[Endpoint] = ()) -> Fragment:
    """The port's fragment as a full sync renders it (a shared destination's
    service-ips element a goto to its chooser)."""
    return render(port, tuple(endpoints)).fragment


def pfrag(port: ServicePort, endpoints: Iterable[Endpoint] = ()) -> Fragment:
    """The port's fragment as a partial sync renders it (a shared
    destination's service-ips element `continue`, and its pick tree's)."""
    return render(port, tuple(endpoints), pick_trees=True).fragment


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
            *, defer: bool = False) -> list[Json]:
    return apply(state, kernel, stage_partial(state, changes, defer_deletes=defer), changes)


def commands_of(commands: Sequence[Json], verb: str, kind: str) -> list[str]:
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
    """A 65th endpoint moves a cluster-IP-only port from the shared
    choosers (its service-ips element `continue`, rules/dispatch.py) to a
    KUBE-SVC of its own: its service-ips element is deleted and added again
    as a goto to the new chain, in one transaction that adds the chain
    first and leaves the pick tree's elements."""
    eps64 = [endpoint(f"10.180.1.{i}") for i in range(1, 65)]
    state, kernel = table(0, svc1=pfrag(SVC1, eps64))
    commands = partial(state, kernel, {SVC1.name: pfrag(SVC1, [*eps64, EP1])})
    ops = _ops(commands)
    elems = [(v, name, spec["elem"]) for v, k, name, spec in ops if k == "element"]
    key = {"concat": ["172.30.0.41", "tcp", 80]}
    mine = [e for e in elems if e[1] == "service-ips"]
    assert [(v, n) for v, n, _ in mine] == [("delete", "service-ips"), ("add", "service-ips")]
    assert mine[0][2] == [key]
    assert mine[1][2][0][0]["elem"]["val"] == key
    svc = names.service_chain(SVC1.name)
    assert mine[1][2][0][1] == {"goto": {"target": svc}}
    left = {n for v, n, _ in elems if v == "delete"} - {"service-ips"}
    assert {"shared-vips-a", "shared-vips-a-bit0", "shared-vips-a-bit5"} <= left
    add_chain = ops.index(next(o for o in ops if o[:3] == ("add", "chain", svc)))
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
    # a port with ClientIP affinity: its chains are the affinity table's
    assert state.stale_chains == {affinity_table_name(c) for c in gone}
    assert all(content(kernel).chains[affinity_table_name(c)] == [] for c in gone)
    gc = apply(state, kernel, stage_gc(state))
    assert set(commands_of(gc, "delete", "chain")) == gone
    assert state.stale_chains == set()
    assert_same_as_full(state, kernel)


def test_a_stale_chain_that_comes_back_before_gc_is_rewritten_and_kept() -> None:
    state, kernel = table(0, svc1=frag(CHAINED, [EP1, EP2]))
    back = names.external_chain(SVC1.name)
    partial(state, kernel, {SVC1.name: frag(SVC1, [EP1])}, defer=True)
    commands = partial(state, kernel, {SVC1.name: frag(CHAINED, [EP1, EP2])}, defer=True)
    assert back in commands_of(commands, "add", "chain")
    assert state.stale_chains == set()
    assert stage_gc(state).commands == []
    assert_same_as_full(state, kernel)


def test_a_deleted_service_with_deferred_deletes_is_gone_after_gc() -> None:
    port = replace(SVC1, session_affinity=SessionAffinity.CLIENT_IP,
                   load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),),
                   load_balancer_source_ranges=("203.0.113.0/25",))
    state, kernel = table(0, svc1=frag(port, [EP1]))
    partial(state, kernel, {SVC1.name: None}, defer=True)
    assert state.stale_chains and not state.stale_sets, "a port declares no set"
    apply(state, kernel, stage_gc(state))
    assert set(content(kernel).chains) == SKEL.chain_names()
    assert set(content(kernel).sets) == {s.name for s in SKEL.sets}


def test_a_service_that_comes_back_with_other_source_ranges_keeps_no_old_range() -> None:
    lb = replace(SVC1, load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),),
                 load_balancer_source_ranges=("203.0.113.0/25",))
    state, kernel = table(0, svc1=frag(lb, [EP1]))
    partial(state, kernel, {SVC1.name: None}, defer=True)
    narrowed = replace(lb, load_balancer_source_ranges=("198.51.100.0/24",))
    partial(state, kernel, {SVC1.name: frag(narrowed, [EP1])}, defer=True)
    ranges = content(kernel).sets["firewall-allow"].elems
    allowed = {"concat": ["1.2.3.4", "tcp", 80, {"prefix": {"addr": "198.51.100.0", "len": 24}}]}
    assert [json.loads(e) for e in ranges] == [allowed]
    assert_same_as_full(state, kernel)


# --- the shared affinity set -------------------------------------------------------

AFFINITY = replace(SVC1, session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=600)
CLIENT = {"concat": ["192.0.2.7", 1234, 5678]}
"""An entry the datapath recorded: a client . an endpoint's key."""


def _record_client(kernel: FakeBackend) -> None:
    kernel.commit(TABLE.add_set_elements(AFFINITY_SET, [{"elem": {"val": CLIENT, "timeout": 600}}]))


def _clients(kernel: FakeBackend) -> list[Any]:
    return [json.loads(e) for e in content(kernel).sets[AFFINITY_SET].elems]


def _forget_client(kernel: FakeBackend) -> None:
    """Expire the recorded entry (so the table equals a fresh one)."""
    kernel.commit([{"delete": {"element": {
        "family": "ip", "table": TABLE.affinity_table, "name": "affinity", "elem": [CLIENT]}}}])


AFFINITY_SET = "affinity:affinity"
"""The shared affinity set, in the affinity table (fragment.AFFINITY_TABLE)."""


def test_full_resync_never_flushes_or_redeclares_the_affinity_set() -> None:
    state, kernel = table(3, svc1=frag(AFFINITY, [EP1, EP2]))
    _record_client(kernel)
    commands = full_sync(state, kernel, dict(state.rendered))
    touched = {name for v, k, name, _ in _ops(commands) if k == "set"}
    assert AFFINITY_SET not in touched
    assert len(_clients(kernel)) == 1
    # every other set that exists is flushed and refilled
    assert set(commands_of(commands, "flush", "set")) == {
        "cluster-ips", "nodeport-ips", "service-cidrs", "hairpin-endpoints",
        "hairpin-endpoints-b", "hairpin-endpoints-c",
        "firewall-vips", "firewall-allow", "masquerade-vips", "masquerade-nodeports",
        *(f"shared-{kind}-a{bit}" for kind in ("vips", "nodeports")
          for bit in ("", *(f"-bit{b}" for b in range(6)))),
    }


def test_adding_or_deleting_a_port_with_affinity_touches_no_set() -> None:
    """Its clients' entries are in the shared set; a deleted port's expire
    by their timeout (listing the set to find them would cost what a
    partial sync must not: docs/architecture.md)."""
    state, kernel = table(0)
    commands = partial(state, kernel, {SVC1.name: frag(AFFINITY, [EP1, EP2])})
    assert not [o for o in _ops(commands) if o[1] == "set"]
    _record_client(kernel)
    commands = partial(state, kernel, {SVC1.name: None})
    assert not [o for o in _ops(commands) if o[1] == "set"]
    assert len(_clients(kernel)) == 1
    _forget_client(kernel)
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
    assert not [o for o in ops if o[2] == AFFINITY_SET]
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
    return pfrag(SVC1, [EP1])


AC, AR, FC, DC = "add chain", "add rule", "flush chain", "delete chain"
AE, DE = "add element", "delete element"

SIZES = [
    # (starting fragment of ns1/svc1 or None, its new fragment or None, commands by kind)
    # A ClusterIP service goes through the shared choosers (rules/dispatch.py):
    # elements only, one command per set
    pytest.param(None, _one_endpoint(), {AE: 5},
                 id="add a ClusterIP service with one endpoint"),
    # cluster-ips, service-ips (continue), shared-vips (the pick tree: one
    # endpoint sets no count bit), hairpin-endpoints, vip-endpoints-tcp-a
    pytest.param(_one_endpoint(), pfrag(SVC1, [EP2]), {DE: 2, AE: 2},
                 id="change one endpoint's IP"),
    # hairpin EP1 . EP1 -> EP2 . EP2, vip-endpoints (VIP, 80, 0) -> EP2
    pytest.param(_one_endpoint(), pfrag(SVC1, [EP1, EP2]), {AE: 3},
                 id="add a second endpoint"),
    # shared-vips-a-bit0 (count 2); hairpin EP2 . EP2, vip-endpoints (VIP, 80, 1)
    pytest.param(_one_endpoint(), None, {DE: 5}, id="delete the service"),
    # cluster-ips, service-ips, shared-vips, hairpin, vip-endpoints elements deleted
    pytest.param(_one_endpoint(), _one_endpoint(), {}, id="no change"),
    pytest.param(_one_endpoint(), pfrag(SVC1), {DE: 4, AE: 1},
                 id="endpoints become none"),
    # service-ips and shared-vips -> no-endpoint-services (reject), hairpin and
    # endpoints elements gone
    pytest.param(None, pfrag(SVC1), {AE: 2}, id="add a service without endpoints"),
    # cluster-ips and no-endpoint-services elements
    pytest.param(pfrag(SVC1), _one_endpoint(), {DE: 1, AE: 4},
                 id="its first endpoint"),
    # no-endpoint-services -> service-ips + shared-vips + hairpin + endpoints
    # A NodePort service with eTP=Cluster goes through shared choosers too
    pytest.param(None, pfrag(SHARED_NODEPORT, [EP1]), {AE: 9},
                 id="add a NodePort service with one endpoint"),
    # cluster-ips, service-ips, shared-vips, service-nodeports (continue),
    # shared-nodeports, masquerade-nodeports, vip-endpoints, nodeport-endpoints, hairpin
    pytest.param(pfrag(SHARED_NODEPORT, [EP1]), pfrag(SHARED_NODEPORT, [EP2]), {DE: 3, AE: 3},
                 id="change a NodePort service's endpoint"),
    # vip-endpoints, nodeport-endpoints, hairpin
    # An eTP=Local NodePort service goes through the shared nodeport-local
    # chain (ruleset v8): elements only too
    pytest.param(None, pfrag(NODEPORT, [EP1]), {AE: 9},
                 id="add an eTP=Local NodePort service with one endpoint"),
    # cluster-ips, service-ips, shared-vips, vip-endpoints, service-nodeports (goto
    # nodeport-local-a), nodeport-cluster-choosers, nodeport-endpoints,
    # no-endpoint-nodeports (no local endpoint: drop), hairpin
    pytest.param(pfrag(NODEPORT, [EP1]), pfrag(NODEPORT, [EP2]), {DE: 3, AE: 3},
                 id="change an eTP=Local NodePort service's endpoint"),
    # vip-endpoints, nodeport-endpoints, hairpin
    pytest.param(pfrag(NODEPORT, [EP1]), pfrag(NODEPORT, [EP1, EP2]), {DE: 1, AE: 5},
                 id="add a second endpoint to an eTP=Local NodePort service"),
    # the cluster IP's shared-vips-a-bit0 and nodeport-cluster-choosers' goto to the
    # chooser of 2; vip-endpoints, nodeport-endpoints, hairpin
    # A ClientIP affinity NodePort service keeps chains of its own
    pytest.param(pfrag(CHAINED, [EP1]), pfrag(CHAINED, [EP2]), {FC: 1, AC: 1, AR: 3, DE: 1, AE: 1},
                 id="change a ClientIP affinity service's endpoint"),
    # KUBE-SVC rewritten (its affinity lookups and cascade DNAT inline); hairpin
    # The first change of a port a full sync wrote (its goto to the chooser)
    pytest.param(frag(SVC1, [EP1]), pfrag(SVC1, [EP2]), {DE: 3, AE: 4},
                 id="change one endpoint's IP, the first change since the full sync"),
    # service-ips goto -> continue, shared-vips; hairpin, vip-endpoints
    pytest.param(frag(SVC1, [EP1]), pfrag(SVC1, [EP1, EP2]), {DE: 1, AE: 5},
                 id="add a second endpoint, the first change since the full sync"),
    # service-ips goto -> continue, shared-vips and its bit0; hairpin, vip-endpoints
    pytest.param(frag(SVC1, [EP1]), None, {DE: 4},
                 id="delete a service the full sync wrote"),
    # cluster-ips, service-ips (goto), hairpin, vip-endpoints
    pytest.param(frag(SHARED_NODEPORT, [EP1]), pfrag(SHARED_NODEPORT, [EP2]), {DE: 5, AE: 7},
                 id="change a NodePort service's endpoint, the first change since the full sync"),
    # service-ips and service-nodeports goto -> continue, shared-vips,
    # shared-nodeports; vip-endpoints, nodeport-endpoints, hairpin
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


# --- element claims -------------------------------------------------------------------

SAME_IP = "172.30.0.41"
A = service_port("a", ns="ns1", cluster_ip=SAME_IP)
B = service_port("b", ns="ns2", cluster_ip=SAME_IP)


def test_deleting_one_claimant_and_adding_another_hands_the_element_over_once() -> None:
    state, kernel = fresh({SKELETON: SKEL, A.name: frag(A, [EP1])})
    commands = partial(state, kernel, {A.name: None, B.name: pfrag(B, [EP2])})
    ops = _ops(commands)
    adds = [o[3]["elem"] for o in ops if o[:3] == ("add", "element", "service-ips")]
    dels = [o[3]["elem"] for o in ops if o[:3] == ("delete", "element", "service-ips")]
    assert len(adds) == 1 and len(adds[0]) == 1
    # B's element: on to the shared choosers' pick tree, B's KUBE-SVC-<h> in its comment
    assert adds[0][0][1] == {"continue": None}
    assert adds[0][0][0]["elem"]["comment"].endswith(names.service_chain(B.name))
    assert dels == [[{"concat": [SAME_IP, "tcp", 80]}]]
    # cluster-ips keeps its element: same key, same (no) verdict
    assert not [o for o in ops if o[1] == "element" and o[2] == "cluster-ips"]
    assert_same_as_full(state, kernel)


@pytest.mark.parametrize("order", ["a then b", "b then a", "together"])
def test_two_claimants_resolve_to_the_same_winner_whatever_the_order(order: str) -> None:
    state, kernel = fresh({SKELETON: SKEL})
    fa: dict[Owner, Fragment | None] = {A.name: pfrag(A, [EP1])}
    fb: dict[Owner, Fragment | None] = {B.name: pfrag(B, [EP2])}
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


def _tree_count(kernel: FakeBackend, key: tuple[str, str, int]) -> int:
    """The endpoint count the kernel's pick tree spells for the
    destination `key` (its membership and bit sets)."""
    doc = kernel.list_table(TABLE.family, TABLE.name)
    assert doc is not None
    sets = {o["name"]: o.get("elem", []) for item in doc["nftables"]
            for o in [item.get("set") or item.get("map")] if o}
    return int(picked_chooser(sets, list(key)).rsplit("-", 1)[1])


@pytest.mark.parametrize("order", ["a then b", "b then a", "together"])
@pytest.mark.parametrize(("a_endpoints", "b_endpoints"), [
    pytest.param([EP1], [EP2, EP3], id="the winner with fewer"),
    pytest.param([EP1, EP2], [EP3], id="the winner with more"),
])
def test_two_claimants_through_the_pick_tree_spell_the_winners_count(
    order: str, a_endpoints: list[Endpoint], b_endpoints: list[Endpoint]
) -> None:
    """Two ports claim one destination, both through partial syncs (a
    `continue` element and the pick tree's), with different endpoint
    counts: the tree spells the winner's count, no bit of the loser's mixed
    in (each bit element is claimed on its own); when the winner leaves,
    the loser's. A winner by goto (a full sync's) keeps the tree empty."""
    state, kernel = fresh({SKELETON: SKEL})
    fa: dict[Owner, Fragment | None] = {A.name: pfrag(A, a_endpoints)}
    fb: dict[Owner, Fragment | None] = {B.name: pfrag(B, b_endpoints)}
    for step in {"a then b": [fa, fb], "b then a": [fb, fa], "together": [{**fa, **fb}]}[order]:
        partial(state, kernel, step)
    key = (SAME_IP, "tcp", 80)
    assert _tree_count(kernel, key) == len(a_endpoints)  # ns1/a sorts before ns2/b
    assert_same_as_full(state, kernel)
    partial(state, kernel, {A.name: frag(A, a_endpoints)})  # a full sync's goto
    assert not [e for e in effective(state).values()
                if e is not None and e.set_name.startswith("shared-vips-")]
    assert_same_as_full(state, kernel)
    partial(state, kernel, {A.name: None})
    assert _tree_count(kernel, key) == len(b_endpoints)
    assert_same_as_full(state, kernel)


def _claimant(state: Synced, key: tuple[str, Any]) -> str:
    """The KUBE-SVC-<h> of the service-ips element the kernel holds for `key`."""
    winner = state.effective(key)
    assert winner is not None and winner.comment is not None
    assert winner.value == Verdict("continue")
    return winner.comment.rsplit(" ", 1)[-1]


def _target(state: Synced, key: tuple[str, int, int]) -> str:
    """The endpoint address of the vip-endpoints element for `key`."""
    winner = state.effective(("vip-endpoints-tcp-a", key))
    assert winner is not None and isinstance(winner.value, Target)
    return winner.value.ip


# --- full sync against a listing ------------------------------------------------------


def test_full_sync_removes_what_is_not_desired_and_recreates_a_rehooked_base_chain() -> None:
    state, kernel = table(2, svc1=frag(AFFINITY, [EP1]))
    kernel.commit([
        {"add": {"chain": {"family": "ip", "table": "nftproxy", "name": "KUBE-SVC-LEFTOVER"}}},
        {"add": {"set": {"family": "ip", "table": "nftproxy", "name": "leftover",
                         "type": "ipv4_addr"}}},
        {"flush": {"chain": {"family": "ip", "table": "nftproxy", "name": "nat-output"}}},
        {"delete": {"chain": {"family": "ip", "table": "nftproxy", "name": "nat-output"}}},
        {"add": {"chain": {"family": "ip", "table": "nftproxy", "name": "nat-output",
                           "type": "nat", "hook": "output", "prio": -99, "policy": "accept"}}},
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
@given(data=st.data(), defer=st.booleans(), gc_every=st.integers(1, 3))
def test_successive_partial_syncs_equal_one_full_sync(
    data: st.DataObject, defer: bool, gc_every: int
) -> None:
    """Random syncs (each adds, tweaks or deletes a few service ports; mostly
    partial, some full against the kernel's listing), with or without deferred
    deletes, then one last gc: the planner's state and the kernel equal a full
    sync of the final fragments into a fresh table."""
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
