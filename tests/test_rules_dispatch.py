"""The shared choosers at the cluster IP (nftproxy.core.rules.dispatch,
service.py, skeleton.py).

A service port without ClientIP affinity, whatever its endpoint count, has
no chain of its own (`PortPlan.shared`): its cluster IP's service-ips
element is a goto to the shared chooser of the count N of its internal
endpoints (KUBE-SVC's for iTP=Cluster, KUBE-SVL's for iTP=Local; the
comment is tagged with that identity), `dispatch-<proto>-<N>`, which
masquerades as kube-proxy's chooser does (per local-traffic detector) and
DNATs by (VIP, port, i), i uniform over 0..N-1, in `vip-endpoints-<proto>`,
whose N elements the port owns. There is never a `continue` element: a
partial sync writes what a full sync writes.
The chooser and its map are not the skeleton's: the render's
`dispatch.Choosers` (skeleton.choosers) makes each once, and the port
lists the bundles it uses in its fragment's `shared` (fragment.Shared), so
the planner adds a chooser with its first user and deletes it with its
last (test_plan.py); the skeleton holds the fixed list of chains and sets
only (tests/skeleton_golden.py).
Aspects (cluster IP side; the external destinations, node port choosers and
masquerade sets are test_rules_dispatch_external.py's, eTP=Local's
test_rules_dispatch_local.py's):
- which ports are dispatched (`PortPlan.shared_chooser`; 65 or 200
  endpoints too), which keep chains (ClientIP affinity only), and what
  each fragment's `shared` lists;
- the port's elements: service-ips (a goto, comment tagged
  KUBE-SVC-<h>/KUBE-SVL-<h>), vip-endpoints (endpoint order, KUBE-SEP-<h>
  comments) per protocol, and what picking from them amounts to; a changed
  endpoint count moves the goto to the other count's chooser;
- the shared VIP choosers and their masquerade rule per detector; their
  maps' declarations (text only on 1.0.6);
- the skeleton of each family holds none of them;
- the name predicates of rules/dispatch.py;
- a 10,000-port cluster-IP-only cluster renders no per-service chain.
Names are spelled out literally ("dispatch-tcp-3"), so a change of
spelling shows up here.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

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
    LOCAL,
    LOCAL_AND_REMOTE,
    MASQ,
    NODE,
    NODEPORT,
    REMOTE,
    SVC,
    SVC1,
    SVL,
    context,
    endpoint,
    many,
    render,
    rules_of,
    sep,
    service_port,
    shared_chains,
    shared_dnat,
    shared_sets,
    text,
)
from skeleton_golden import SKELETON_CHAINS, SKELETON_SETS

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    L4Protocol,
    NodeInfo,
    ServicePort,
    SessionAffinity,
)
from nftproxy.core.nft import jsontext, nfttext
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.plan import SKELETON
from nftproxy.core.render import render_full
from nftproxy.core.rules import dispatch as shared_dispatch
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.fragment import (
    NUMGEN_KEY,
    Element,
    Fragment,
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
CIP6 = "fd00:172:30::41"


def elements_in(fragment: Fragment, set_name: str) -> list[Element]:
    return [e for e in fragment.elements if e.set_name == set_name]


def service_ips_target(fragment: Fragment) -> str:
    """Where the port's one service-ips element (its cluster IP's) goes: a
    goto, to a shared chooser or to the port's own chain."""
    (element,) = elements_in(fragment, "service-ips")
    assert isinstance(element.value, Verdict) and element.value.kind == "goto"
    return element.value.target


def uses(fragment: Fragment) -> tuple[set[str], set[str]]:
    """(the chains, the sets) of the shared bundles the fragment lists."""
    return set(shared_chains(fragment)), set(shared_sets(fragment))


def verdict_kinds(fragment: Fragment) -> set[str]:
    return {e.value.kind for e in fragment.elements if isinstance(e.value, Verdict)}


# --- the skeleton holds no shared object ------------------------------------------


@pytest.mark.parametrize("family", [V4, V6], ids=["IPv4", "IPv6"])
@pytest.mark.parametrize("config", [
    pytest.param(CONFIG, id="ClusterCIDR detector"),
    pytest.param(replace(CONFIG, masquerade_all=True, nodeport_addresses=("primary",)),
                 id="masqueradeAll, primary node ports"),
])
def test_the_skeleton_holds_no_chooser_no_endpoints_map_and_no_etp_local_chain(
    family: IPFamily, config: ProxyConfig
) -> None:
    """An empty node's table is the fixed list: no dispatch-* chain, no
    external-local / nodeport-local chain, no vip- / nodeport-[local-]endpoints
    map and no *-choosers map; they come with the ports that use them."""
    skeleton = render_skeleton(family, config, NODE, ("172.30.0.0/16",))
    chains, sets = [c.name for c in skeleton.chains], [s.name for s in skeleton.sets]
    assert chains == SKELETON_CHAINS and len(chains) == 21
    assert sets == SKELETON_SETS and len(sets) == 15
    assert not any(c.startswith("dispatch-") or shared_dispatch.is_shared_chain(c)
                   for c in map(kernel_name, chains))
    assert not any(shared_dispatch.is_indexed_map(s) or shared_dispatch.is_choosers_map(s)
                   or s.endswith("-choosers") or "endpoints-" in s for s in map(kernel_name, sets))
    assert skeleton.shared == ()


# --- which ports are dispatched ----------------------------------------------------

DISPATCHED = [
    pytest.param(SVC1, REMOTE, (EP1,), id="cluster IP only, no affinity, one endpoint"),
    pytest.param(SVC1, (endpoint(EP3), endpoint(EP1)), (EP1, EP3),
                 id="the endpoints in endpoint order"),
    pytest.param(SVC1, many(64), tuple(e.ip for e in sorted(many(64))), id="64 endpoints"),
    pytest.param(SVC1, many(65), tuple(e.ip for e in sorted(many(65))), id="65 endpoints"),
    pytest.param(SVC1, many(200), tuple(e.ip for e in sorted(many(200))), id="200 endpoints"),
    pytest.param(ITP_LOCAL, LOCAL_AND_REMOTE, (EP1,), id="iTP=Local picks the local endpoints"),
    pytest.param(ITP_LOCAL, (*many(64, local=True), *many(10, base="10.181")),
                 tuple(e.ip for e in sorted(many(64, local=True))),
                 id="iTP=Local counts its 64 local endpoints, not the remote ones"),
    pytest.param(ITP_LOCAL, (*many(65, local=True), *many(10, base="10.181")),
                 tuple(e.ip for e in sorted(many(65, local=True))),
                 id="iTP=Local with 65 local endpoints"),
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
    assert service_ips_target(fragment) == f"dispatch-{proto}-{n}"
    picked = elements_in(fragment, f"vip-endpoints-{proto}")
    assert [(e.key, e.value.ip if isinstance(e.value, Target) else None) for e in picked] == [
        ((port.cluster_ip, port.port, i), ip) for i, ip in enumerate(chosen)]
    assert uses(fragment) == ({f"dispatch-{proto}-{n}"}, {f"vip-endpoints-{proto}"})


@pytest.mark.parametrize("n", [65, 200])
def test_a_port_of_more_than_64_endpoints_uses_the_shared_chooser_of_its_count(n: int) -> None:
    """No endpoint count gives a port without affinity chains of its own:
    its cluster IP goes to dispatch-tcp-<n>, every endpoint is an element of
    vip-endpoints-tcp, and its fragment's `shared` is exactly that chooser
    and that map, one bundle."""
    eps = many(n)
    fragment = render(SVC1, eps).fragment
    assert fragment.chains == () and fragment.sets == ()
    assert elements_in(fragment, "service-ips") == [Element(
        "service-ips", (CIP, "tcp", 80), Verdict("goto", f"dispatch-tcp-{n}"),
        f"ns1/svc1:p80 {SVC}")]
    picked = elements_in(fragment, "vip-endpoints-tcp")
    assert [e.key for e in picked] == [(CIP, 80, i) for i in range(n)]
    assert [str(e.value) for e in picked] == [ep.address for ep in sorted(eps)]
    (bundle,) = fragment.shared
    assert [c.name for c in bundle.chains] == [f"dispatch-tcp-{n}"]
    assert [c.name for c in bundle.records] == [f"dispatch-tcp-{n}"]
    assert [d.name for d in bundle.sets] == ["vip-endpoints-tcp"]
    (chooser,) = bundle.chains
    assert text(chooser.rules[-1]) == shared_dnat(n)


OWN_CHAINS = [
    pytest.param(replace(ETP_LOCAL_NODEPORT, session_affinity=SessionAffinity.CLIENT_IP),
                 LOCAL_AND_REMOTE, {"SVC", "SVL", "EXT"}, id="eTP=Local with ClientIP affinity"),
    pytest.param(AFFINITY, REMOTE, {"SVC"}, id="ClientIP affinity"),
    pytest.param(AFFINITY, many(65), {"SVC"}, id="ClientIP affinity, 65 endpoints"),
    pytest.param(replace(ITP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP),
                 LOCAL_AND_REMOTE, {"SVL"}, id="iTP=Local with ClientIP affinity"),
]


@pytest.mark.parametrize(("port", "endpoints", "chains"), OWN_CHAINS)
def test_only_ports_with_client_ip_affinity_keep_their_own_chains(
    port: ServicePort, endpoints: tuple[Endpoint, ...], chains: set[str]
) -> None:
    """In the affinity table, with the numgen cascade; they use no chooser,
    no endpoints map and no masquerade set: their fragment's `shared` is the
    affinity set alone (Choosers.affinity)."""
    plan = plan_port(port, endpoints, context())
    assert plan.shared_chooser is None and not plan.shared
    fragment = render(port, endpoints).fragment
    label = {SVC: "SVC", SVL: "SVL", names.external_chain(port.name): "EXT"}
    assert {label[kernel_name(c.name)] for c in fragment.chains} == chains
    assert {in_affinity_table(c.name) for c in fragment.chains} == {True}
    assert not any(shared_dispatch.is_indexed_map(e.set_name)
                   or e.set_name.startswith("masquerade-") for e in fragment.elements)
    targets = {str(e.value) for e in fragment.elements if isinstance(e.value, Verdict)}
    assert not any("dispatch-" in t for t in targets)
    assert uses(fragment) == (set(), {"affinity:affinity"})
    assert [(b.chains, b.records) for b in fragment.shared] == [((), ())]


@pytest.mark.parametrize(("port", "endpoints"), [
    pytest.param(SVC1, (), id="no endpoints: rejected"),
    pytest.param(ITP_LOCAL, REMOTE, id="iTP=Local without a local endpoint: dropped"),
])
def test_a_port_whose_cluster_ip_has_no_endpoint_uses_no_chooser(
    port: ServicePort, endpoints: tuple[Endpoint, ...]
) -> None:
    plan = plan_port(port, endpoints, context())
    assert plan.shared and plan.shared_chooser is None
    fragment = render(port, endpoints).fragment
    assert fragment.chains == () and fragment.shared == ()
    assert elements_in(fragment, "service-ips") == []
    assert [e.set_name for e in fragment.elements] == ["cluster-ips", "no-endpoint-services"]


# --- the port's elements -----------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 64, 65, 200])
def test_the_service_ips_element_goes_to_the_shared_chooser_of_its_count(n: int) -> None:
    """One goto element, commented with the kube-proxy identity; the port's
    other elements: its cluster IP, its n endpoints and their hairpin pairs
    (here all local)."""
    fragment = render(SVC1, many(n, local=True)).fragment
    key, comment = (CIP, "tcp", 80), f"ns1/svc1:p80 {SVC}"
    assert elements_in(fragment, "service-ips") == [
        Element("service-ips", key, Verdict("goto", f"dispatch-tcp-{n}"), comment)]
    assert {e.set_name for e in fragment.elements} == {
        "cluster-ips", "service-ips", "vip-endpoints-tcp", "hairpin-endpoints"}
    assert len(elements_in(fragment, "vip-endpoints-tcp")) == n
    assert len(elements_in(fragment, "hairpin-endpoints")) == n


COUNTS = [1, 2, 10, 64, 65, 200]
DESTINATIONS = [
    pytest.param("service-ips", (CIP, "tcp", 80), SVC, "dispatch-tcp-{n}", id="cluster IP"),
    pytest.param("service-nodeports", ("tcp", 3001), EXT, "dispatch-nodeport-tcp-{n}",
                 id="node port"),
]


@pytest.mark.parametrize(("table", "key", "identity", "chooser"), DESTINATIONS)
@pytest.mark.parametrize("n", COUNTS)
def test_a_shared_destination_is_one_goto_element_and_never_a_continue(
    n: int, table: str, key: tuple[object, ...], identity: str, chooser: str
) -> None:
    """The dispatch map's element is the goto to the chooser of its count,
    with the kube-proxy identity in its comment; no element of the port is
    a `continue` (what a partial sync writes is what a full sync writes:
    there is one render)."""
    fragment = render(NODEPORT, many(n)).fragment
    assert elements_in(fragment, table) == [
        Element(table, key, Verdict("goto", chooser.format(n=n)), f"ns1/svc1:p80 {identity}")]
    assert verdict_kinds(fragment) == {"goto"}
    assert render(NODEPORT, many(n)).fragment == fragment


def test_every_destination_reaches_its_chooser_by_a_goto_element() -> None:
    """In service-ips / service-nodeports as in an eTP=Local destination's
    choosers maps. Here the cluster IP (3 endpoints), and the eTP=Local
    external IP's and node port's cluster (3) and local (2) choosers; the
    fragment's `shared` lists every chooser and chain they go to, with the
    maps they pick from."""
    port = service_port(node_port=3001, external_ips=(EIP,), external_traffic_policy=LOCAL)
    eps = (endpoint(EP1, local=True), endpoint(EP2), endpoint(EP3, local=True))
    fragment = render(port, eps).fragment
    svc, svl, ext = (f"ns1/svc1:p80 {c}" for c in (SVC, SVL, EXT))
    eip, node_port = (EIP, "tcp", 80), ("tcp", 3001)
    ways = [e for e in fragment.elements if isinstance(e.value, Verdict)]
    expected = [
        Element("service-ips", (CIP, "tcp", 80), Verdict("goto", "dispatch-tcp-3"), svc),
        Element("service-ips", eip, Verdict("goto", "external-local"), ext),
        Element("external-cluster-choosers", eip, Verdict("goto", "dispatch-tcp-3"), svc),
        Element("external-local-choosers", eip, Verdict("goto", "dispatch-local-tcp-2"), svl),
        Element("service-nodeports", node_port, Verdict("goto", "nodeport-local"), ext),
        Element("nodeport-cluster-choosers", node_port,
                Verdict("goto", "dispatch-nodeport-tcp-3"), svc),
        Element("nodeport-local-choosers", node_port,
                Verdict("goto", "dispatch-nodeport-local-tcp-2"), svl),
    ]
    assert sorted(ways, key=repr) == sorted(expected, key=repr)
    assert len(ways) == len(expected)
    targets = {e.value.target for e in ways if isinstance(e.value, Verdict)}
    assert uses(fragment)[0] == targets


@pytest.mark.parametrize(("before", "after"), [
    pytest.param(3, 4, id="3 -> 4 endpoints"),
    pytest.param(4, 3, id="4 -> 3 endpoints"),
    pytest.param(64, 65, id="64 -> 65 endpoints"),
])
def test_a_changed_endpoint_count_moves_the_destinations_to_the_other_counts_chooser(
    before: int, after: int
) -> None:
    """Each destination's dispatch element keeps its key and comment and
    goes to the new count's chooser; the endpoints maps' keys past the
    smaller count come or go (the others stay, valued by the endpoint of
    their index in the new order); the fragment's `shared` swaps the
    choosers and keeps the maps."""
    port = replace(NODEPORT, external_ips=(EIP,))
    old, cur = (render(port, many(n)).fragment for n in (before, after))

    def dispatch_maps(fragment: Fragment) -> dict[tuple[str, object], tuple[object, object]]:
        return {(e.set_name, e.key): (e.value, e.comment) for e in fragment.elements
                if e.set_name in ("service-ips", "service-nodeports")}

    assert dispatch_maps(old).keys() == dispatch_maps(cur).keys()
    assert [c for _, c in dispatch_maps(old).values()] == [
        c for _, c in dispatch_maps(cur).values()]
    for fragment, n in ((old, before), (cur, after)):
        assert {v for v, _ in dispatch_maps(fragment).values()} == {
            Verdict("goto", f"dispatch-tcp-{n}"), Verdict("goto", f"dispatch-nodeport-tcp-{n}")}
        assert uses(fragment) == (
            {f"dispatch-tcp-{n}", f"dispatch-nodeport-tcp-{n}"},
            {"vip-endpoints-tcp", "nodeport-endpoints-tcp"})

    def endpoints(indices: range) -> set[tuple[str, tuple[object, ...]]]:
        return {*(("vip-endpoints-tcp", (ip, 80, i)) for i in indices for ip in (CIP, EIP)),
                *(("nodeport-endpoints-tcp", (3001, i)) for i in indices)}

    def picked(fragment: Fragment) -> set[tuple[str, tuple[object, ...]]]:
        return {(e.set_name, e.key) for e in fragment.elements
                if shared_dispatch.is_indexed_map(e.set_name)}

    assert picked(old) - picked(cur) == endpoints(range(after, before))
    assert picked(cur) - picked(old) == endpoints(range(before, after))
    assert picked(cur) == endpoints(range(after))
    changed = {e.set_name for e in set(old.elements) ^ set(cur.elements)}
    assert changed - {"vip-endpoints-tcp", "nodeport-endpoints-tcp"} == {
        "service-ips", "service-nodeports"}


def test_the_service_ips_comment_of_itp_local_names_kube_svl() -> None:
    fragment = render(ITP_LOCAL, LOCAL_AND_REMOTE).fragment
    (element,) = elements_in(fragment, "service-ips")
    assert element.comment == f"ns1/svc1:p80 {SVL}"
    assert service_ips_target(fragment) == "dispatch-tcp-1"
    assert SVL.startswith("KUBE-SVL-") and SVC.startswith("KUBE-SVC-")


def test_shared_elements_are_the_endpoints_in_order_keyed_by_cluster_ip() -> None:
    """(cluster IP, port, i) -> endpoint i, in endpoint order whatever the
    arrival order, each named by its KUBE-SEP-<h>; keyed by the service's
    port, valued by the endpoint's."""
    eps = (endpoint(EP3), endpoint(EP1, 8080), endpoint(EP2))
    fragment = render(SVC1, eps).fragment
    assert elements_in(fragment, "vip-endpoints-tcp") == [
        Element("vip-endpoints-tcp", (CIP, 80, 0), Target(EP1, 8080),
                f"ns1/svc1:p80 -> {EP1}:8080 {sep(EP1, number=8080)}"),
        Element("vip-endpoints-tcp", (CIP, 80, 1), Target(EP2, 80),
                f"ns1/svc1:p80 -> {EP2}:80 {sep(EP2)}"),
        Element("vip-endpoints-tcp", (CIP, 80, 2), Target(EP3, 80),
                f"ns1/svc1:p80 -> {EP3}:80 {sep(EP3)}"),
    ]
    dns = service_port("dns", port_name="dns", port=53, protocol=L4Protocol.UDP)
    fragment = render(dns, (endpoint(EP1, 5353),)).fragment
    assert elements_in(fragment, "vip-endpoints-udp") == [
        Element("vip-endpoints-udp", (CIP, 53, 0), Target(EP1, 5353),
                f"ns1/dns:dns -> {EP1}:5353 {sep(EP1, dns, 5353)}")]
    assert service_ips_target(fragment) == "dispatch-udp-1"


def _chances(port: ServicePort, endpoints: tuple[Endpoint, ...]) -> dict[str, Fraction]:
    """Chance of a packet to the port's cluster IP being DNATed to each
    endpoint: the service-ips element goes to a shared chooser the fragment
    uses (its `shared`), whose DNAT looks up (its destination, its port,
    numgen random mod N), the destination and port being the element's key
    (cluster IP, port); each index 0..N-1 with probability 1/N, and there
    is an element for each."""
    fragment = render(port, endpoints).fragment
    (element,) = elements_in(fragment, "service-ips")
    chooser = shared_chains(fragment)[service_ips_target(fragment)]
    (dnat,) = [s["dnat"] for s in chooser.rules[-1].expr if "dnat" in s]
    daddr, dport, index = dnat["addr"]["map"]["key"]["concat"]
    assert daddr == {"payload": {"protocol": "ip", "field": "daddr"}}
    assert dport == {"payload": {"protocol": port.protocol.nft, "field": "dport"}}
    n = index["numgen"]["mod"]
    assert index == {"numgen": {"mode": "random", "mod": n}}
    map_name = dnat["addr"]["map"]["data"].lstrip("@")
    assert map_name in shared_sets(fragment)
    mine = {e.key: e for e in elements_in(fragment, map_name)}
    assert len(mine) == n
    cluster_ip, _, number = element.key
    out: dict[str, Fraction] = {}
    for i in range(n):
        target = str(mine[(cluster_ip, number, i)].value)
        out[target] = out.get(target, Fraction(0)) + Fraction(1, n)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 200])
def test_the_shared_chooser_picks_each_endpoint_with_probability_one_over_n(n: int) -> None:
    eps = many(n)
    assert _chances(SVC1, eps) == {ep.address: Fraction(1, n) for ep in eps}


def test_shared_element_comments_of_a_maximal_service_keep_their_kube_tags() -> None:
    port = service_port("s" * 63, ns="n" * 63, port_name="p" * 15, family=V6)
    eps = (endpoint("fd00:10:180::ffff:ffff", 65535), endpoint("fd00:10:180::2"))
    fragment = render(port, eps).fragment
    (ip_element,) = elements_in(fragment, "service-ips")
    picked = elements_in(fragment, "vip-endpoints-tcp")
    tags = [names.endpoint_chain(port.name, ep) for ep in sorted(eps)]
    comments = [str(e.comment) for e in (*picked, ip_element)]
    assert [c.rsplit(" ", 1)[1] for c in comments] == [*tags, names.service_chain(port.name)]
    assert all(len(c.encode()) <= names.COMMENT_MAX_BYTES for c in comments)
    assert all(c.startswith(str(port.name)[:60]) for c in comments)


def test_every_dispatched_port_names_only_what_the_skeleton_or_its_shared_objects_declare(
) -> None:
    skeleton = render_skeleton(V4, CONFIG, NODE)
    for n in (*range(1, 66), 200):
        fragment = render(SVC1, many(n)).fragment
        chains, sets = uses(fragment)
        assert service_ips_target(fragment) in chains
        assert {e.set_name for e in fragment.elements} <= {s.name for s in skeleton.sets} | sets
        assert not chains & skeleton.chain_names() and not sets & {s.name for s in skeleton.sets}


# --- the shared VIP choosers -------------------------------------------------------


@pytest.mark.parametrize(("family", "ip"), [(V4, "ip"), (V6, "ip6")], ids=["IPv4", "IPv6"])
def test_a_vip_chooser_is_one_chain_and_its_map_made_once_per_render(
    family: IPFamily, ip: str
) -> None:
    """Choosers.vip(p, N): dispatch-<p>-<N>, no hook, DNATing last by (VIP,
    port, numgen random mod N) in vip-endpoints-<p>, bundled with that map;
    asked again in the same render, the same bundle (its users share it);
    in another render, an equal one."""
    made = sk.choosers(family, CONFIG, NODE)
    for p in L4Protocol:
        for n in (1, 2, 64, 65, 200):
            bundle = made.vip(p, n)
            (chain,) = bundle.chains
            assert chain.name == f"dispatch-{p.nft}-{n}" and chain.hook is None
            last = chain.rules[-1]
            assert (text(last), last.comment) == (
                shared_dnat(n, p.nft, ip), f"VIP -> {n} endpoints")
            assert [d.name for d in bundle.sets] == [f"vip-endpoints-{p.nft}"]
            assert made.vip(p, n) is bundle
            assert sk.choosers(family, CONFIG, NODE).vip(p, n) == bundle
    assert made.vip(L4Protocol.TCP, 2) != made.vip(L4Protocol.TCP, 3)
    assert made.vip(L4Protocol.TCP, 2).sets == made.vip(L4Protocol.TCP, 3).sets


def test_ports_of_one_render_share_the_same_chooser_bundle() -> None:
    ctx = context()
    one, two = (render_service_port(service_port(name, cluster_ip=cip), many(2), ctx).fragment
                for name, cip in (("a", "172.30.0.1"), ("b", "172.30.0.2")))
    (a,), (b,) = one.shared, two.shared
    assert a is b and [c.name for c in a.chains] == ["dispatch-tcp-2"]


def _masquerade_rules(
    family: IPFamily, config: ProxyConfig, node: NodeInfo
) -> set[tuple[str, ...]]:
    """What every shared VIP chooser does before its DNAT (one set member:
    they all do the same), with each rule's comment; the node port choosers
    do nothing before it (KUBE-NODEPORTS marks)."""
    made = sk.choosers(family, config, node)
    counts = (1, 2, 64, 65, 200)
    assert {len(made.nodeport(p, n).chains[0].rules) for p in L4Protocol for n in counts} == {1}
    return {
        tuple(f"{text(r)} # {r.comment}" for r in made.vip(p, n).chains[0].rules[:-1])
        for p in L4Protocol for n in counts
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
    (nodeport-endpoints); data: endpoint . port; declared by typeof in both
    printers (libnftables 1.0.6 can declare the integer index only so)."""
    made = sk.choosers(family, CONFIG, NODE)
    table = Table(ip, "nftproxy")
    for p in PROTOCOLS:
        bundle = (made.vip if kind == "vip" else made.nodeport)(L4Protocol(p.upper()), 3)
        (d,) = bundle.sets
        assert d.name == f"{kind}-endpoints-{p}"
        vip = (f"{ip} daddr",) if kind == "vip" else ()
        types = (addr,) if kind == "vip" else ()
        assert (d.key, d.data) == ((*vip, f"{p} dport", NUMGEN_KEY), (f"{ip} daddr", f"{p} dport"))
        assert (d.type, d.map) == ((*types, "inet_service", "integer"), f"{addr} . inet_service")
        assert (d.flags, d.elements, d.dynamic) == ((), (), False)
        key = " . ".join((*vip, f"{p} dport", "numgen random mod 1"))
        assert f"typeof {key} : {ip} daddr . {p} dport;" in nfttext.command_text(table.add_set(d))
        declared = jsontext.command_json(table.add_set(d))["add"]["map"]
        assert declared["map"] == {"typeof": {"concat": [
            {"payload": {"protocol": ip, "field": "daddr"}},
            {"payload": {"protocol": p, "field": "dport"}}]}}


# --- the names of the shared objects ------------------------------------------------


def test_the_shared_objects_names_and_the_predicates_that_know_them() -> None:
    tcp, udp = L4Protocol.TCP, L4Protocol.UDP
    assert shared_dispatch.dispatch_chain(tcp, 3) == "dispatch-tcp-3"
    assert shared_dispatch.dispatch_chain(tcp, 1, local=True) == "dispatch-local-tcp-1"
    assert shared_dispatch.nodeport_dispatch_chain(udp, 2) == "dispatch-nodeport-udp-2"
    assert (shared_dispatch.nodeport_dispatch_chain(tcp, 1, local=True)
            == "dispatch-nodeport-local-tcp-1")
    assert shared_dispatch.vip_endpoints_map(tcp) == "vip-endpoints-tcp"
    assert shared_dispatch.vip_endpoints_map(tcp, local=True) == "vip-local-endpoints-tcp"
    assert shared_dispatch.nodeport_endpoints_map(tcp) == "nodeport-endpoints-tcp"
    assert (shared_dispatch.nodeport_endpoints_map(tcp, local=True)
            == "nodeport-local-endpoints-tcp")
    assert [shared_dispatch.choosers_map(nodeport=n, local=lo)
            for n in (False, True) for lo in (False, True)] == [
        "external-cluster-choosers", "external-local-choosers",
        "nodeport-cluster-choosers", "nodeport-local-choosers"]
    assert (shared_dispatch.EXTERNAL_LOCAL, shared_dispatch.NODEPORT_LOCAL) == (
        "external-local", "nodeport-local")

    choosers = ("dispatch-tcp-1", "dispatch-udp-64", "dispatch-sctp-65", "dispatch-tcp-200",
                "dispatch-local-tcp-1", "dispatch-nodeport-udp-3", "dispatch-nodeport-local-sctp-9")
    not_choosers = ("dispatch-tcp-0", "dispatch-tcp-01", "dispatch-tcp-a-1", "dispatch-icmp-1",
                    "dispatch-local-nodeport-tcp-1", "external-local", "KUBE-SVC-ABC",
                    "vip-endpoints-tcp", "dispatch-tcp-1-x")
    for name in choosers:
        assert shared_dispatch.is_chooser_chain(name), name
        assert shared_dispatch.is_shared_chain(name), name
        assert not shared_dispatch.is_external_local_chain(name), name
    for name in not_choosers:
        assert not shared_dispatch.is_chooser_chain(name), name
    for name in ("external-local", "nodeport-local"):
        assert shared_dispatch.is_external_local_chain(name)
        assert shared_dispatch.is_shared_chain(name) and not shared_dispatch.is_chooser_chain(name)
    for name in ("external-local-a", "KUBE-EXT-ABC", "KUBE-SERVICES", "service-ips"):
        assert not shared_dispatch.is_shared_chain(name), name

    choosers_maps = {f"{w}-{k}-choosers" for w in ("external", "nodeport")
                     for k in ("cluster", "local")}
    indexed = {f"{kind}-{local}endpoints-{p}" for kind in ("vip", "nodeport")
               for local in ("", "local-") for p in PROTOCOLS}
    for name in choosers_maps:
        assert shared_dispatch.is_choosers_map(name) and not shared_dispatch.is_indexed_map(name)
    for name in indexed:
        assert shared_dispatch.is_indexed_map(name) and not shared_dispatch.is_choosers_map(name)
    for name in ("service-ips", "hairpin-endpoints", "vip-endpoints-tcp-a",
                 "endpoints-tcp-a-00", "external-cluster-choosers-a", "affinity:affinity",
                 *SKELETON_SETS):
        assert not shared_dispatch.is_indexed_map(name), name
        assert not shared_dispatch.is_choosers_map(name), name


# --- at scale ----------------------------------------------------------------------


def test_a_10000_port_cluster_ip_only_cluster_renders_no_per_service_chain() -> None:
    """The whole table's chains are the skeleton's and the shared choosers
    the ports use: every port is elements only (1..5 endpoints each, the
    three protocols), each service-ips element a goto to one of the 15
    choosers, all the ports' `shared` together."""
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
    assert [c.name for c in skeleton.chains] == SKELETON_CHAINS
    assert len(fragments) == 10_000
    assert all(f.chains == () for f in fragments.values())
    verdicts = {e.value for f in fragments.values() for e in f.elements
                if isinstance(e.value, Verdict)}
    assert {v.kind for v in verdicts} == {"goto"}
    targets = {service_ips_target(f) for f in fragments.values()}
    assert targets == {v.target for v in verdicts}
    assert targets == {f"dispatch-{p}-{n}" for p in PROTOCOLS for n in range(1, 6)}
    bundles = {id(b): b for f in fragments.values() for b in f.shared}
    assert len(bundles) == 15
    assert {c.name for b in bundles.values() for c in b.chains} == targets
    assert {d.name for b in bundles.values() for d in b.sets} == {
        f"vip-endpoints-{p}" for p in PROTOCOLS}
    picked = sum(e.set_name.startswith("vip-endpoints-")
                 for f in fragments.values() for e in f.elements)
    assert picked == sum(map(len, endpoints.values())) == 30_000
