"""Ruleset v7/v8/v10's shared choosers at the cluster IP (nftproxy.core.rules.dispatch,
service.py, skeleton.py).

A service port without ClientIP affinity, whose internal chooser (KUBE-SVC
for iTP=Cluster, KUBE-SVL for iTP=Local) has 1..64 endpoints (and so do
its external destinations), has no chain of its own (`PortPlan.shared`):
its cluster IP reaches the skeleton's `dispatch-<proto>-<g>-<N>`, which
masquerades as kube-proxy's chooser does (per local-traffic detector) and
DNATs by (VIP, port, i), i uniform over 0..N-1, in
`vip-endpoints-<proto>-<g>`, whose N elements the port owns. A full sync
renders the port's service-ips element as a goto to that chooser; since
v10 a partial sync renders it `continue` (comment tagged
KUBE-SVC-<h>/KUBE-SVL-<h>; adding a goto element makes the kernel
re-validate the whole table): the key is an element of the plain set
`shared-vips` and of `shared-vips-a-bit<j>` for each bit j of N - 1, and the
skeleton's rule after the service-ips vmap sends such a destination through
the root map `shared-vips-root` down the generation's pick tree
(`pick-vip-<g>...`, one bit per level) to the chooser of N. Tests read
"where does it go" through builders.resolved (the `continue` and its
plain elements as the goto they amount to); the walk of the pick tree
itself is pinned here too.
Aspects (cluster IP side; the external destinations, node port choosers and
masquerade sets are test_rules_dispatch_external.py's, eTP=Local's
test_rules_dispatch_local.py's):
- which cluster-IP-only ports are dispatched (`PortPlan.shared_chooser`),
  which keep chains;
- the port's elements: service-ips (a full sync's goto, a partial sync's
  `continue`, comment tagged KUBE-SVC-<h>/KUBE-SVL-<h>), shared-vips and its count bits
  (shared-nodeports for a node port), vip-endpoints (endpoint order,
  KUBE-SEP-<h> comments), per generation and protocol, and what picking
  from them amounts to; a changed endpoint count changes plain elements only;
- the skeleton's 3 x 64 VIP choosers per generation and their masquerade
  rule per detector; the maps' declarations (text only on 1.0.6);
- the skeleton's pick trees: every count, protocol and kind reaches its chooser;
- skeleton.generation_of / chain_generation over the new names;
- a 10,000-port cluster-IP-only cluster renders no per-service chain.
Names are spelled out literally ("dispatch-tcp-a-3"), so a change of
spelling shows up here.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest
from builders import (
    AFFINITY,
    CIP,
    CONFIG,
    EIP,
    EP1,
    EP2,
    EP3,
    ETP_LOCAL_NODEPORT,
    EXT,
    ITP_LOCAL,
    LB,
    LOCAL,
    LOCAL_AND_REMOTE,
    MASQ,
    NODE,
    NODEPORT,
    REMOTE,
    SVC,
    SVC1,
    SVL,
    chain_of,
    context,
    endpoint,
    many,
    render,
    resolved,
    rules_of,
    sep,
    service_port,
    shared_dnat,
    text,
)

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    L4Protocol,
    LoadBalancerIngress,
    NodeInfo,
    ServicePort,
    SessionAffinity,
)
from nftproxy.core.nft.ops import OpError, Table
from nftproxy.core.nft.plan import SKELETON
from nftproxy.core.render import render_full
from nftproxy.core.rules import names
from nftproxy.core.rules import picks as pick_trees
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.fragment import (
    NUMGEN_KEY,
    Element,
    Fragment,
    Rule,
    Target,
    Verdict,
    in_affinity_table,
    kernel_name,
)
from nftproxy.core.rules.service import plan_port, render_service_port
from nftproxy.core.rules.skeleton import render_skeleton
from nftproxy.core.tracker import StateSnapshot

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
PROTOCOLS = ("tcp", "udp", "sctp")
GENERATIONS = ("a", "b", "c")
CIP6 = "fd00:172:30::41"


def elements_in(fragment: Fragment, set_name: str) -> list[Element]:
    return [e for e in fragment.elements if e.set_name == set_name]


def is_cluster_vip_chooser(chain: str) -> bool:
    """dispatch-tcp-a-3, not dispatch-nodeport-... nor dispatch-local-..."""
    return chain.startswith("dispatch-") and not chain.startswith(
        ("dispatch-nodeport-", "dispatch-local-"))


def service_ips_target(fragment: Fragment) -> str:
    """Where the port's one service-ips element (its cluster IP's) goes: a
    shared port's `continue` read through its pick-tree elements as the
    goto it amounts to (builders.resolved), an own chain's goto as it is."""
    (element,) = [e for e in resolved(fragment) if e.set_name == "service-ips"]
    assert isinstance(element.value, Verdict) and element.value.kind == "goto"
    return element.value.target


# --- which ports are dispatched ----------------------------------------------------

DISPATCHED = [
    pytest.param(SVC1, REMOTE, (EP1,), id="cluster IP only, no affinity, one endpoint"),
    pytest.param(SVC1, (endpoint(EP3), endpoint(EP1)), (EP1, EP3),
                 id="the endpoints in endpoint order"),
    pytest.param(SVC1, many(64), tuple(e.ip for e in sorted(many(64))), id="64 endpoints"),
    pytest.param(ITP_LOCAL, LOCAL_AND_REMOTE, (EP1,), id="iTP=Local picks the local endpoints"),
    pytest.param(ITP_LOCAL, (*many(64, local=True), *many(10, base="10.181")),
                 tuple(e.ip for e in sorted(many(64, local=True))),
                 id="iTP=Local counts its 64 local endpoints, not the remote ones"),
    pytest.param(service_port(external_traffic_policy=LOCAL), LOCAL_AND_REMOTE, (EP1, EP2),
                 id="eTP=Local without external access uses every endpoint"),
    pytest.param(SVC1, (endpoint(EP2, ready=False, terminating=True, serving=True),), (EP2,),
                 id="serving terminating endpoints when none is ready"),
    pytest.param(SVC1, (endpoint(EP1), endpoint(EP2, ready=False, terminating=True,
                                                 serving=True)), (EP1,),
                 id="a ready endpoint leaves the terminating ones out"),
    pytest.param(service_port(protocol=L4Protocol.SCTP), REMOTE, (EP1,), id="SCTP"),
    pytest.param(service_port(family=V6), (endpoint("fd00:10:180::1"),), ("fd00:10:180::1",),
                 id="IPv6"),
]


@pytest.mark.parametrize(("port", "endpoints", "chosen"), DISPATCHED)
def test_a_cluster_ip_only_port_without_affinity_uses_a_shared_chooser(
    port: ServicePort, endpoints: tuple[Endpoint, ...], chosen: tuple[str, ...]
) -> None:
    shared = plan_port(port, endpoints, context(port.family)).shared_chooser
    assert shared is not None and tuple(e.ip for e in shared) == chosen
    fragment = render(port, endpoints).fragment
    assert fragment.chains == ()
    n, proto = len(chosen), port.protocol.nft
    assert service_ips_target(fragment) == f"dispatch-{proto}-a-{n}"
    picked = elements_in(fragment, f"vip-endpoints-{proto}-a")
    assert [(e.key, e.value.ip if isinstance(e.value, Target) else None) for e in picked] == [
        ((port.cluster_ip, port.port, i), ip) for i, ip in enumerate(chosen)]


OWN_CHAINS = [
    pytest.param(SVC1, (), set(), id="no endpoints: rejected, no chooser at all"),
    pytest.param(ITP_LOCAL, REMOTE, set(), id="iTP=Local without a local endpoint: dropped"),
    pytest.param(ETP_LOCAL_NODEPORT, many(65), {"SVC", "EXT"},
                 id="eTP=Local node port with 65 endpoints"),
    pytest.param(service_port(load_balancer_ingress=(LoadBalancerIngress(LB),),
                              external_traffic_policy=LOCAL), many(65, local=True),
                 {"SVC", "SVL", "EXT"}, id="eTP=Local LB VIP with 65 local endpoints"),
    pytest.param(replace(ETP_LOCAL_NODEPORT, session_affinity=SessionAffinity.CLIENT_IP),
                 LOCAL_AND_REMOTE, {"SVC", "SVL", "EXT"}, id="eTP=Local with ClientIP affinity"),
    pytest.param(AFFINITY, REMOTE, {"SVC"}, id="ClientIP affinity"),
    pytest.param(replace(ITP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP),
                 LOCAL_AND_REMOTE, {"SVL"}, id="iTP=Local with ClientIP affinity"),
    pytest.param(SVC1, many(65), {"SVC"}, id="65 endpoints"),
    pytest.param(ITP_LOCAL, many(65, local=True), {"SVL"}, id="iTP=Local with 65 local endpoints"),
]


@pytest.mark.parametrize(("port", "endpoints", "chains"), OWN_CHAINS)
def test_other_ports_keep_their_own_chains(
    port: ServicePort, endpoints: tuple[Endpoint, ...], chains: set[str]
) -> None:
    plan = plan_port(port, endpoints, context())
    assert plan.shared_chooser is None
    assert plan.shared is not bool(chains)  # vacuously shared: no destination has a chooser
    fragment = render(port, endpoints).fragment
    label = {SVC: "SVC", SVL: "SVL", names.external_chain(port.name): "EXT"}
    assert {label[kernel_name(c.name)] for c in fragment.chains} == chains
    # ClientIP affinity: in the affinity table; past 64 endpoints: in the main one
    assert {in_affinity_table(c.name) for c in fragment.chains} <= {port.affinity}
    assert not any(e.set_name.startswith(("vip-endpoints-", "nodeport-endpoints-", "masquerade-"))
                   for e in fragment.elements)
    targets = {str(e.value) for e in fragment.elements if isinstance(e.value, Verdict)}
    assert not any("dispatch-" in t for t in targets)


def test_65_endpoints_keep_the_map_pick_of_their_own_chooser() -> None:
    """Past DISPATCH_MAX the port's KUBE-SVC picks from the sharded
    endpoints map, as every chooser did before v7."""
    fragment = render(SVC1, many(65)).fragment
    assert service_ips_target(fragment) == SVC
    rules = rules_of(fragment, SVC)
    assert len(rules) == 2 and rules[0].endswith(MASQ)
    assert rules[1].startswith("meta l4proto tcp dnat to one of ")
    assert sum(sk.is_endpoints_map(e.set_name) for e in fragment.elements) == 65


# --- the port's elements -----------------------------------------------------------


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize(("n", "bits"), [
    pytest.param(1, set(), id="1"),
    pytest.param(3, {"shared-vips-{g}-bit1"}, id="3"),
    pytest.param(64, {"shared-vips-{g}-bit0", "shared-vips-{g}-bit1", "shared-vips-{g}-bit2",
                      "shared-vips-{g}-bit3", "shared-vips-{g}-bit4", "shared-vips-{g}-bit5"},
                 id="64"),
])
def test_the_service_ips_element_goes_to_the_shared_chooser_of_its_count_and_generation(
    generation: str, n: int, bits: set[str]
) -> None:
    """A full sync's element is the goto to the chooser of its count in the
    render's generation; a partial sync's is `continue` whatever the
    generation (the root map's elements pick the generation's tree), and
    read through the pick tree's elements it is the same goto."""
    ctx = replace(context(), generation=generation)
    full = render_service_port(SVC1, many(n, local=True), ctx).fragment
    partial = render_service_port(
        SVC1, many(n, local=True), replace(ctx, pick_trees=True)).fragment
    key, comment = (CIP, "tcp", 80), f"ns1/svc1:p80 {SVC}"
    goto = Element("service-ips", key, Verdict("goto", f"dispatch-tcp-{generation}-{n}"), comment)
    assert elements_in(full, "service-ips") == [goto]
    assert elements_in(partial, "service-ips") == [
        Element("service-ips", key, Verdict("continue"), comment)]
    assert [e for e in resolved(partial) if e.set_name == "service-ips"] == [goto]
    hairpin = "hairpin-endpoints" + ("" if generation == "a" else f"-{generation}")
    common = {"cluster-ips", "service-ips", f"vip-endpoints-tcp-{generation}", hairpin}
    assert {e.set_name for e in full.elements} == common
    assert {e.set_name for e in partial.elements} == {
        *common, f"shared-vips-{generation}", *(b.format(g=generation) for b in bits)}
    assert len(elements_in(full, f"vip-endpoints-tcp-{generation}")) == n
    assert set(partial.elements) - set(full.elements) - {*elements_in(partial, "service-ips")} == {
        e for e in partial.elements if e.set_name.startswith("shared-vips-")}


RAW_COUNTS = [
    pytest.param(1, (), id="1 endpoint: no bit"),
    pytest.param(2, (0,), id="2 endpoints: bit 0"),
    pytest.param(10, (0, 3), id="10 endpoints: bits 0 and 3"),
    pytest.param(64, (0, 1, 2, 3, 4, 5), id="64 endpoints: every bit"),
]
DESTINATIONS = [
    pytest.param("service-ips", "shared-vips", (CIP, "tcp", 80), SVC, id="cluster IP"),
    pytest.param("service-nodeports", "shared-nodeports", ("tcp", 3001), EXT, id="node port"),
]


def _chooser(table: str, n: int) -> str:
    return f"dispatch-nodeport-tcp-a-{n}" if table == "service-nodeports" else f"dispatch-tcp-a-{n}"


@pytest.mark.parametrize(("table", "shared", "key", "identity"), DESTINATIONS)
@pytest.mark.parametrize(("n", "bits"), RAW_COUNTS)
def test_a_shared_destination_is_a_continue_element_and_plain_elements_spelling_its_count(
    n: int, bits: tuple[int, ...], table: str, shared: str, key: tuple[object, ...],
    identity: str,
) -> None:
    """v10's raw shape, as a partial sync renders it: the dispatch map's
    element is `continue` with the kube-proxy identity in its comment; the
    same key is one element of the membership set and of exactly the bit
    sets of N - 1's set bits, none with a comment (the dispatch map's
    element names the port). A full sync renders the goto and no element
    of the tree's sets."""
    full = render(NODEPORT, many(n)).fragment
    assert [e for e in full.elements if e.set_name == table or e.set_name.startswith(shared)] == [
        Element(table, key, Verdict("goto", _chooser(table, n)), f"ns1/svc1:p80 {identity}")]
    fragment = render(NODEPORT, many(n), pick_trees=True).fragment
    mine = [e for e in fragment.elements if e.set_name == table or e.set_name.startswith(shared)]
    expected = [
        Element(table, key, Verdict("continue"), f"ns1/svc1:p80 {identity}"),
        Element(f"{shared}-a", key),
        *(Element(f"{shared}-a-bit{b}", key) for b in bits),
    ]
    assert sorted(mine, key=repr) == sorted(expected, key=repr)
    assert len(mine) == len(expected)


def test_a_chooser_is_reached_by_continue_in_dispatch_maps_and_by_goto_in_choosers_maps() -> None:
    """service._to_chooser in a partial sync's render: a destination in
    service-ips / service-nodeports reaches its chooser by a `continue`
    element and the pick tree's plain elements; one in an eTP=Local choosers
    map (verdict maps the pick tree does not serve) by a goto element, and
    has no pick-tree element. Here the cluster IP (3 endpoints) is of the
    first kind, the eTP=Local external IP's and node port's cluster (3) and
    local (2) choosers of the second."""
    port = service_port(node_port=3001, external_ips=(EIP,), external_traffic_policy=LOCAL)
    eps = (endpoint(EP1, local=True), endpoint(EP2), endpoint(EP3, local=True))
    fragment = render(port, eps, pick_trees=True).fragment
    svc, svl, ext = (f"ns1/svc1:p80 {c}" for c in (SVC, SVL, EXT))
    eip, node_port = (EIP, "tcp", 80), ("tcp", 3001)
    ways = [e for e in fragment.elements
            if e.set_name.startswith(("service-", "shared-")) or "-choosers-" in e.set_name]
    expected = [
        Element("service-ips", (CIP, "tcp", 80), Verdict("continue"), svc),
        Element("shared-vips-a", (CIP, "tcp", 80)),
        Element("shared-vips-a-bit1", (CIP, "tcp", 80)),
        Element("service-ips", eip, Verdict("goto", "external-local-a"), ext),
        Element("external-cluster-choosers-a", eip, Verdict("goto", "dispatch-tcp-a-3"), svc),
        Element("external-local-choosers-a", eip, Verdict("goto", "dispatch-local-tcp-a-2"), svl),
        Element("service-nodeports", node_port, Verdict("goto", "nodeport-local-a"), ext),
        Element("nodeport-cluster-choosers-a", node_port,
                Verdict("goto", "dispatch-nodeport-tcp-a-3"), svc),
        Element("nodeport-local-choosers-a", node_port,
                Verdict("goto", "dispatch-nodeport-local-tcp-a-2"), svl),
    ]
    assert sorted(ways, key=repr) == sorted(expected, key=repr)
    assert len(ways) == len(expected)


def _goto_free(fragment: Fragment) -> bool:
    return not any(isinstance(e.value, Verdict) and e.value.kind == "goto"
                   for e in fragment.elements)


@pytest.mark.parametrize(("before", "after", "gone", "new"), [
    pytest.param(3, 4, (), (0,), id="3 -> 4 endpoints: bit 0 joins"),
    pytest.param(4, 3, (0,), (), id="4 -> 3 endpoints: bit 0 leaves"),
    pytest.param(2, 3, (0,), (1,), id="2 -> 3 endpoints: bit 0 for bit 1"),
])
def test_a_changed_endpoint_count_changes_plain_elements_only(
    before: int, after: int, gone: tuple[int, ...], new: tuple[int, ...]
) -> None:
    """Why v10: a shared port whose count a partial sync changes keeps its dispatch maps'
    elements (key, `continue`, comment) as they are, and no element of it
    is a goto (a goto element makes the kernel re-validate the table);
    what changes is bit-set elements and the endpoints maps' elements past
    the smaller count. Read through the tree, it reaches the new count's chooser."""
    port = replace(NODEPORT, external_ips=(EIP,))
    old, cur = (render(port, many(n), pick_trees=True).fragment for n in (before, after))
    assert _goto_free(old) and _goto_free(cur)

    def dispatch_maps(fragment: Fragment) -> list[Element]:
        return [e for e in fragment.elements
                if e.set_name in ("service-ips", "service-nodeports")]

    assert dispatch_maps(old) == dispatch_maps(cur)
    assert {e.value for e in dispatch_maps(cur)} == {Verdict("continue")}
    vips, node_ports = [(CIP, "tcp", 80), (EIP, "tcp", 80)], [("tcp", 3001)]

    def bit_elements(bits: tuple[int, ...]) -> set[Element]:
        return {*(Element(f"shared-vips-a-bit{b}", k) for b in bits for k in vips),
                *(Element(f"shared-nodeports-a-bit{b}", k) for b in bits for k in node_ports)}

    def endpoints(indices: range) -> set[tuple[str, tuple[object, ...]]]:
        return {*(("vip-endpoints-tcp-a", (ip, 80, i)) for i in indices for ip in (CIP, EIP)),
                *(("nodeport-endpoints-tcp-a", (3001, i)) for i in indices)}

    removed, added = set(old.elements) - set(cur.elements), set(cur.elements) - set(old.elements)
    for diff, bits, indices in ((removed, gone, range(after, before)),
                                (added, new, range(before, after))):
        picked = {e for e in diff if e.set_name.endswith("-endpoints-tcp-a")}
        assert diff - picked == bit_elements(bits)
        assert {(e.set_name, e.key) for e in picked} == endpoints(indices)
        assert all(isinstance(e.value, Target) for e in picked)
    assert {e.value for e in resolved(cur) if e.set_name == "service-ips"} == {
        Verdict("goto", f"dispatch-tcp-a-{after}")}
    assert {e.value for e in resolved(cur) if e.set_name == "service-nodeports"} == {
        Verdict("goto", f"dispatch-nodeport-tcp-a-{after}")}


def test_the_service_ips_comment_of_itp_local_names_kube_svl() -> None:
    fragment = render(ITP_LOCAL, LOCAL_AND_REMOTE).fragment
    (element,) = elements_in(fragment, "service-ips")
    assert element.comment == f"ns1/svc1:p80 {SVL}"
    assert service_ips_target(fragment) == "dispatch-tcp-a-1"
    assert SVL.startswith("KUBE-SVL-") and SVC.startswith("KUBE-SVC-")


def test_shared_elements_are_the_endpoints_in_order_keyed_by_cluster_ip() -> None:
    """(cluster IP, port, i) -> endpoint i, in endpoint order whatever the
    arrival order, each named by its KUBE-SEP-<h> as the endpoints map's
    elements are; keyed by the service's port, valued by the endpoint's."""
    eps = (endpoint(EP3), endpoint(EP1, 8080), endpoint(EP2))
    fragment = render(SVC1, eps).fragment
    assert elements_in(fragment, "vip-endpoints-tcp-a") == [
        Element("vip-endpoints-tcp-a", (CIP, 80, 0), Target(EP1, 8080),
                f"ns1/svc1:p80 -> {EP1}:8080 {sep(EP1, number=8080)}"),
        Element("vip-endpoints-tcp-a", (CIP, 80, 1), Target(EP2, 80),
                f"ns1/svc1:p80 -> {EP2}:80 {sep(EP2)}"),
        Element("vip-endpoints-tcp-a", (CIP, 80, 2), Target(EP3, 80),
                f"ns1/svc1:p80 -> {EP3}:80 {sep(EP3)}"),
    ]
    dns = service_port("dns", port_name="dns", port=53, protocol=L4Protocol.UDP)
    fragment = render(dns, (endpoint(EP1, 5353),)).fragment
    assert elements_in(fragment, "vip-endpoints-udp-a") == [
        Element("vip-endpoints-udp-a", (CIP, 53, 0), Target(EP1, 5353),
                f"ns1/dns:dns -> {EP1}:5353 {sep(EP1, dns, 5353)}")]
    assert service_ips_target(fragment) == "dispatch-udp-a-1"


def _chances(port: ServicePort, endpoints: tuple[Endpoint, ...]) -> dict[str, Fraction]:
    """Chance of a packet to the port's cluster IP being DNATed to each
    endpoint: the service-ips element (`continue`) and its pick-tree
    elements send it to a shared chooser (service_ips_target; the tree's
    walk: test_every_count_walks_the_pick_tree_to_its_chooser), whose
    DNAT looks up (its destination, its port, numgen random mod N), the
    destination and port being the element's key (cluster IP, port); each
    index 0..N-1 with probability 1/N, and there is an element for each."""
    fragment = render(port, endpoints).fragment
    (element,) = elements_in(fragment, "service-ips")
    chooser = chain_of(render_skeleton(port.family, CONFIG, NODE), service_ips_target(fragment))
    (dnat,) = [s["dnat"] for s in chooser.rules[-1].expr if "dnat" in s]
    daddr, dport, index = dnat["addr"]["map"]["key"]["concat"]
    assert daddr == {"payload": {"protocol": "ip", "field": "daddr"}}
    assert dport == {"payload": {"protocol": port.protocol.nft, "field": "dport"}}
    n = index["numgen"]["mod"]
    assert index == {"numgen": {"mode": "random", "mod": n}}
    mine = {e.key: e for e in elements_in(fragment, dnat["addr"]["map"]["data"].lstrip("@"))}
    assert len(mine) == n
    cluster_ip, _, number = element.key
    out: dict[str, Fraction] = {}
    for i in range(n):
        target = str(mine[(cluster_ip, number, i)].value)
        out[target] = out.get(target, Fraction(0)) + Fraction(1, n)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64])
def test_the_shared_chooser_picks_each_endpoint_with_probability_one_over_n(n: int) -> None:
    eps = many(n)
    assert _chances(SVC1, eps) == {ep.address: Fraction(1, n) for ep in eps}


def test_shared_element_comments_of_a_maximal_service_keep_their_kube_tags() -> None:
    port = service_port("s" * 63, ns="n" * 63, port_name="p" * 15, family=V6)
    eps = (endpoint("fd00:10:180::ffff:ffff", 65535), endpoint("fd00:10:180::2"))
    fragment = render(port, eps).fragment
    (ip_element,) = elements_in(fragment, "service-ips")
    picked = elements_in(fragment, "vip-endpoints-tcp-a")
    tags = [names.endpoint_chain(port.name, ep) for ep in sorted(eps)]
    comments = [str(e.comment) for e in (*picked, ip_element)]
    assert [c.rsplit(" ", 1)[1] for c in comments] == [*tags, names.service_chain(port.name)]
    assert all(len(c.encode()) <= names.COMMENT_MAX_BYTES for c in comments)
    assert all(c.startswith(str(port.name)[:60]) for c in comments)


def test_every_dispatched_port_names_only_what_the_skeleton_declares() -> None:
    skeleton = render_skeleton(V4, CONFIG, NODE)
    chains, sets = skeleton.chain_names(), {s.name for s in skeleton.sets}
    for n in range(1, 65):
        fragment = render(SVC1, many(n)).fragment
        assert service_ips_target(fragment) in chains
        assert {e.set_name for e in fragment.elements} <= sets


# --- the skeleton's shared choosers ------------------------------------------------


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize(("family", "ip"), [(V4, "ip"), (V6, "ip6")], ids=["IPv4", "IPv6"])
def test_the_skeleton_holds_3_protocols_x_64_shared_choosers_of_its_generation(
    generation: str, family: IPFamily, ip: str
) -> None:
    skeleton = render_skeleton(family, CONFIG, NODE, generation=generation)
    dispatch = [c for c in skeleton.chains if is_cluster_vip_chooser(c.name)]
    assert [c.name for c in dispatch] == [
        f"dispatch-{p}-{generation}-{n}" for p in PROTOCOLS for n in range(1, 65)]
    assert all(c.hook is None for c in dispatch)
    for chain in dispatch:
        _, p, _, n = chain.name.split("-")
        last = chain.rules[-1]
        assert (text(last), last.comment) == (
            shared_dnat(int(n), p, generation, ip), f"VIP -> {n} endpoints")
    maps = {s.name for s in skeleton.sets if s.name.startswith("vip-endpoints-")}
    assert maps == {f"vip-endpoints-{p}-{generation}" for p in PROTOCOLS}


def _masquerade_rules(
    family: IPFamily, config: ProxyConfig, node: NodeInfo
) -> set[tuple[str, ...]]:
    """What every shared VIP chooser of the skeleton does before its DNAT
    (one set member: they all do the same), with each rule's comment; the
    node port choosers do nothing before it (KUBE-NODEPORTS marks)."""
    skeleton = render_skeleton(family, config, node)
    assert {len(c.rules) for c in skeleton.chains
            if c.name.startswith("dispatch-nodeport-")} == {1}
    return {
        tuple(f"{text(r)} # {r.comment}" for r in c.rules[:-1])
        for c in skeleton.chains
        if is_cluster_vip_chooser(c.name)
    }


def _own_masquerade_rule(family: IPFamily, config: ProxyConfig, node: NodeInfo) -> list[str]:
    """The masquerade rule a port's own KUBE-SVC (ClientIP affinity) starts
    with, minus its cluster IP match (the shared chooser has none)."""
    port = service_port(family=family, session_affinity=SessionAffinity.CLIENT_IP)
    ctx = context(family, config, node)
    ep = endpoint("10.180.0.1" if family is V4 else "fd00:10:180::1")
    fragment = render_service_port(port, (ep,), ctx).fragment
    cip = CIP if family is V4 else CIP6
    match = f"{family.nft_family} daddr {cip} tcp dport 80 "
    first = rules_of(fragment, SVC)[0]
    return [first.removeprefix(match)] if first.endswith(MASQ) else []


NO_CIDR = replace(CONFIG, cluster_cidrs=())


@pytest.mark.parametrize(
    ("family", "config", "node", "masq"),
    [
        pytest.param(V4, CONFIG, NODE, f"ip saddr != 10.0.0.0/8 {MASQ}", id="ClusterCIDR"),
        pytest.param(V6, CONFIG, NODE, f"ip6 saddr != fd00:10::/48 {MASQ}", id="ClusterCIDR IPv6"),
        pytest.param(V4, replace(CONFIG, masquerade_all=True), NODE, MASQ, id="masqueradeAll"),
        pytest.param(V4, replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR), NODE,
                     f"ip saddr != 10.0.1.0/24 {MASQ}", id="NodeCIDR"),
        pytest.param(V4, replace(CONFIG, detect_local_mode=DetectLocalMode.BRIDGE_INTERFACE,
                                 bridge_interface="cbr0"), NODE,
                     f"iifname != cbr0 {MASQ}", id="BridgeInterface"),
        pytest.param(V4, replace(CONFIG, detect_local_mode=DetectLocalMode.INTERFACE_NAME_PREFIX,
                                 interface_name_prefix="veth"), NODE,
                     f"iifname != veth* {MASQ}", id="InterfaceNamePrefix"),
        pytest.param(V4, NO_CIDR, NODE, None, id="no detector: no rule"),
        pytest.param(V6, replace(CONFIG, cluster_cidrs=("10.0.0.0/8",)), NODE, None,
                     id="no cluster CIDR of the family: no rule"),
        pytest.param(V4, replace(NO_CIDR, masquerade_all=True), NODE, MASQ,
                     id="no detector but masqueradeAll"),
        pytest.param(V4, replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR),
                     replace(NODE, pod_cidrs=()), None, id="NodeCIDR without a pod CIDR: no rule"),
    ],
)
def test_every_shared_chooser_masquerades_as_the_detector_says(
    family: IPFamily, config: ProxyConfig, node: NodeInfo, masq: str | None
) -> None:
    """The same kube-proxy rule as a port's own chooser has, for any cluster IP."""
    cluster_ips = f"{family.nft_family} daddr @cluster-ips"
    expected = () if masq is None else (f"{cluster_ips} {masq} # cluster IP",)
    assert _masquerade_rules(family, config, node) == {expected}
    assert _own_masquerade_rule(family, config, node) == ([] if masq is None else [masq])


@pytest.mark.parametrize("kind", ["vip", "nodeport"])
@pytest.mark.parametrize(("family", "ip", "addr"), [(V4, "ip", "ipv4_addr"),
                                                    (V6, "ip6", "ipv6_addr")])
def test_shared_choosers_maps_are_declared_by_key_and_data_selectors(
    family: IPFamily, ip: str, addr: str, kind: str
) -> None:
    """Key: VIP . port . index (vip-endpoints) or node port . index
    (nodeport-endpoints); data: endpoint . port; the integer index makes
    libnftables 1.0.6 declare them in nft text only, 1.1.x by typeof in JSON."""
    skeleton = render_skeleton(family, CONFIG, NODE, generation="b")
    decls = {s.name: s for s in skeleton.sets}
    old, new = Table(ip, "nftproxy"), Table(ip, "nftproxy", typeof=True)
    for p in PROTOCOLS:
        d = decls[f"{kind}-endpoints-{p}-b"]
        vip = (f"{ip} daddr",) if kind == "vip" else ()
        types = (addr,) if kind == "vip" else ()
        assert (d.key, d.data) == ((*vip, f"{p} dport", NUMGEN_KEY), (f"{ip} daddr", f"{p} dport"))
        assert (d.type, d.map) == ((*types, "inet_service", "integer"), f"{addr} . inet_service")
        assert (d.flags, d.elements, d.dynamic) == ((), (), False)
        assert d.text_only and old.declares_in_text(d) and not new.declares_in_text(d)
        with pytest.raises(OpError):
            old.add_set(d)
        key = " . ".join((*vip, f"{p} dport", "numgen random mod 1"))
        assert f"typeof {key} : {ip} daddr . {p} dport;" in old.declare_text(d)
        declared = new.add_set(d)["add"]["map"]
        assert declared["map"] == {"typeof": {"concat": [
            {"payload": {"protocol": ip, "field": "daddr"}},
            {"payload": {"protocol": p, "field": "dport"}}]}}


# --- the skeleton's pick trees (v10) ----------------------------------------------

L4PROTO = {"meta": {"key": "l4proto"}}


def _tree_key(ip: str, *, nodeport: bool) -> dict[str, Any]:
    """The destination's key as the tree's set lookups spell it."""
    dport = {"payload": {"protocol": "th", "field": "dport"}}
    daddr = [] if nodeport else [{"payload": {"protocol": ip, "field": "daddr"}}]
    return {"concat": [*daddr, L4PROTO, dport]}


def _goto_target(statement: Any, verb: str = "goto") -> str:
    """A `goto <chain>` statement's chain (fails on any other statement)."""
    assert isinstance(statement, dict) and list(statement) == [verb], statement
    assert list(statement[verb]) == ["target"], statement
    target = statement[verb]["target"]
    assert isinstance(target, str) and target, statement
    return target


def _taken(
    rule: Rule, key: dict[str, Any], shared: str, protocol: str, bits: set[int], generation: str
) -> str | None:
    """Where `rule` sends the packet (None: it does not match it). A tree
    rule is matches (on `meta l4proto`, or on the destination's key in a bit
    set of `shared`), then a goto; or the root's return of what is not in
    the generation's `shared` set (the walked destination is); anything
    else fails the walk."""
    *matches, last = rule.expr
    if last == {"return": None}:
        assert matches == [{"match": {"op": "!=", "left": key,
                                      "right": f"@{shared}-{generation}"}}], rule
        return None
    target = _goto_target(last)
    hits = []
    for statement in matches:
        assert list(statement) == ["match"], statement
        match = statement["match"]
        assert set(match) == {"op", "left", "right"} and match["op"] == "==", statement
        if match["left"] == L4PROTO:
            assert match["right"] in PROTOCOLS, statement
            hits.append(match["right"] == protocol)
        elif match["left"] == key:
            bit = str(match["right"]).removeprefix(f"@{shared}-{generation}-bit")
            assert bit in {str(b) for b in range(6)}, statement
            hits.append(int(bit) in bits)
        else:
            raise AssertionError(f"the walk does not know the match {statement!r}")
    return target if all(hits) else None


def _walk(
    skeleton: Fragment, shared: str, key: dict[str, Any], protocol: str, bits: set[int]
) -> tuple[str, list[str], str | None]:
    """Where a `protocol` packet to a destination of the `shared` set, in
    `<shared>-<g>-bit<j>` exactly for j in `bits`, goes: the root map's element
    for its protocol, then through each pick chain its first rule that
    matches, until a chain that is not a pick chain. Returns that chain,
    the pick chains passed and the comment of the rule that left the tree."""
    root = {d.name: d for d in skeleton.sets}[f"{shared}-root"]
    assert (root.key, root.map, root.flags) == (("meta l4proto",), "verdict", ())
    (verdict,) = [v for k, v in root.elements if k == protocol]
    target, chains = _goto_target(verdict, "jump"), {c.name: c for c in skeleton.chains}
    generation = target.rpartition("-")[2]  # pick-vip-b: the tree of generation b
    path: list[str] = []
    comment = None
    while target.startswith("pick-"):
        assert target not in path and len(path) < 6, (target, path)
        chain = chains[target]
        assert chain.hook is None and chain.rules, target
        path.append(target)
        for rule in chain.rules:
            taken = _taken(rule, key, shared, protocol, bits, generation)
            if taken is not None:
                target, comment = taken, rule.comment
                break
        else:
            raise AssertionError(f"the packet falls off the end of {target}")
    return target, path, comment


TREES = [
    pytest.param("shared-vips", "pick-vip", "dispatch-{p}-{g}-{n}", id="VIP"),
    pytest.param("shared-nodeports", "pick-nodeport", "dispatch-nodeport-{p}-{g}-{n}",
                 id="node port"),
]


@pytest.mark.parametrize("generation", ["b", "c"])
@pytest.mark.parametrize(("shared", "tree", "leaf"), TREES)
@pytest.mark.parametrize(("family", "ip"), [(V4, "ip"), (V6, "ip6")], ids=["IPv4", "IPv6"])
def test_every_count_walks_the_pick_tree_to_its_chooser(
    family: IPFamily, ip: str, shared: str, tree: str, leaf: str, generation: str
) -> None:
    """The specification of the pick tree: a destination in `shared-vips`
    (`shared-nodeports`) enters it after the dispatch map by the root map's
    element for its protocol, and, its count N - 1 spelled by its
    membership in the bit sets (pick_trees.count_bits), passes exactly 6 pick
    chains of the generation, one per bit, to `dispatch-<p>-<g>-N`
    (`dispatch-nodeport-<p>-<g>-N`), by a rule commented "N endpoints".
    Every chain of the tree is on some count's path."""
    skeleton = render_skeleton(family, CONFIG, NODE, generation=generation)
    nodeport = shared == "shared-nodeports"
    entry = ("meta l4proto . th dport" if nodeport
             else f"{ip} daddr . meta l4proto . th dport")
    lookup = "KUBE-NODEPORTS" if nodeport else "KUBE-SERVICES"
    rules = [text(r) for r in chain_of(skeleton, lookup).rules]
    dispatch_map = "service-nodeports" if nodeport else "service-ips"
    at = rules.index(f"{entry} vmap @{dispatch_map}")
    assert rules[at + 1] == f"meta l4proto vmap @{shared}-root"
    key, passed = _tree_key(ip, nodeport=nodeport), set[str]()
    for n in range(1, 65):
        bits = set(pick_trees.count_bits(n))
        assert pick_trees.count_of(sorted(bits)) == n
        for p in PROTOCOLS:
            target, path, comment = _walk(skeleton, shared, key, p, bits)
            assert target == leaf.format(p=p, g=generation, n=n), (n, p, path)
            assert comment == f"{n} endpoints"
            assert target in skeleton.chain_names()
            assert len(path) == 6 and path[0] == f"{tree}-{generation}"
            passed.update(path)
    in_tree = {c.name for c in skeleton.chains if c.name.startswith(f"{tree}-{generation}")}
    assert passed == in_tree and len(in_tree) == 63


def test_generation_of_and_chain_generation_know_the_shared_names() -> None:
    for g in GENERATIONS:
        skeleton = render_skeleton(V4, CONFIG, NODE, generation=g)
        in_generations = [c.name for c in skeleton.chains if sk.chain_generation(c.name)]
        # + external-local, nodeport-local, and the two pick trees of 63 chains
        assert len(in_generations) == 4 * 3 * 64 + 2 + 2 * 63
        assert {sk.chain_generation(c) for c in in_generations} == {g}
        trees = {c for c in in_generations if c.startswith("pick-")}
        assert len(trees) == 2 * 63 and all(sk.is_pick_chain(c) for c in trees)
        for tree in (f"pick-vip-{g}", f"pick-nodeport-{g}"):
            for chain in (tree, f"{tree}-0", f"{tree}-1", f"{tree}-10110", f"{tree}-11111"):
                assert chain in trees and sk.generation_of(chain) is None, chain
        for p in PROTOCOLS:
            name = f"vip-endpoints-{p}-{g}"
            assert sk.generation_of(name) == g
            assert not sk.is_endpoints_map(name) and not sk.is_hairpin_set(name)
            assert not sk.is_unsharded_endpoints_map(name)
            assert sk.chain_generation(name) is None
            assert sk.chain_generation(f"dispatch-{p}-{g}-1") == g
            assert sk.chain_generation(f"dispatch-{p}-{g}-64") == g
            assert sk.generation_of(f"dispatch-{p}-{g}-1") is None
            nodeports = f"nodeport-endpoints-{p}-{g}"
            assert sk.generation_of(nodeports) == g and sk.chain_generation(nodeports) is None
            assert not sk.is_endpoints_map(nodeports) and not sk.is_hairpin_set(nodeports)
            assert sk.chain_generation(f"dispatch-nodeport-{p}-{g}-1") == g
            assert sk.chain_generation(f"dispatch-nodeport-{p}-{g}-64") == g
            assert sk.generation_of(f"dispatch-nodeport-{p}-{g}-1") is None
    for other in ("dispatch-tcp-a-0", "dispatch-tcp-a-65", "dispatch-tcp-d-1", "KUBE-SERVICES",
                  "hairpin-endpoints", "endpoints-tcp-a-00", "dispatch-nodeport-tcp-a-65",
                  "clusterip-endpoints-tcp-a", "masquerade-vips", "masquerade-nodeports",
                  "pick-vip-d", "pick-vip-a-2", "pick-vip-a-000000", "pick-nodeport-a-111111",
                  "shared-vips", "shared-vips-a-bit0", "shared-nodeports-root"):
        assert sk.chain_generation(other) is None, other
        assert not sk.is_pick_chain(other), other
    # the pick tree's root maps are not per generation (their elements name
    # the generation's tree); its membership and bit sets are, as the
    # choosers they lead to
    for plain in ("masquerade-vips", "masquerade-nodeports", "clusterip-endpoints-tcp-a",
                  "shared-vips", "shared-vips-root", "shared-nodeports", "shared-nodeports-root",
                  "shared-vips-d", "shared-vips-bit0", "shared-vips-d-bit0", "shared-vips-a-bit6"):
        assert sk.generation_of(plain) is None, plain
    for g in GENERATIONS:
        assert sk.generation_of(f"shared-vips-{g}") == g
        assert sk.generation_of(f"shared-nodeports-{g}") == g
        for b in range(6):
            assert sk.generation_of(f"shared-vips-{g}-bit{b}") == g
            assert sk.generation_of(f"shared-nodeports-{g}-bit{b}") == g


# --- at scale ----------------------------------------------------------------------


def test_a_10000_port_cluster_ip_only_cluster_renders_no_per_service_chain() -> None:
    """The whole table's chains are the skeleton's: every port is elements
    only (1..5 endpoints each, the three protocols), each service-ips
    element a goto to a shared chooser of the skeleton (a full sync's)."""
    protocols = list(L4Protocol)
    ports = [
        service_port(f"s{i}", cluster_ip=f"172.30.{i // 250}.{i % 250 + 1}",
                     protocol=protocols[i % 3])
        for i in range(10_000)
    ]
    endpoints = {p.name: many(1 + i % 5) for i, p in enumerate(ports)}
    state = StateSnapshot(V4, {p.name: p for p in ports}, endpoints)
    rendered = render_full(state, CONFIG, NODE, ("172.30.0.0/16",))
    fragments = rendered.desired()
    skeleton = fragments.pop(SKELETON)
    assert len(fragments) == 10_000
    assert all(f.chains == () for f in fragments.values())
    verdicts = {e.value for f in fragments.values() for e in f.elements
                if isinstance(e.value, Verdict)}
    assert {v.kind for v in verdicts} == {"goto"}
    targets = {service_ips_target(f) for f in fragments.values()}
    assert targets == {v.target for v in verdicts}
    assert targets == {f"dispatch-{p}-a-{n}" for p in PROTOCOLS for n in range(1, 6)}
    assert targets <= skeleton.chain_names()
    picked = sum(e.set_name.startswith("vip-endpoints-")
                 for f in fragments.values() for e in f.elements)
    assert picked == sum(map(len, endpoints.values())) == 30_000
