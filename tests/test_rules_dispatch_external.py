"""The shared choosers at external destinations (rules/dispatch.py,
service.py, skeleton.py).

A port with a node port, external IPs or LB VIPs shares choosers too when
it has no ClientIP affinity, whatever its endpoint count (`PortPlan.shared`).
With eTP=Cluster:
- each external IP / LB VIP: a service-ips element, a goto to the same
  `dispatch-<proto>-<N>` as its cluster IP (N = its cluster endpoints),
  comment "ns/svc:port KUBE-EXT-<h>"; N `vip-endpoints-<proto>` elements
  keyed (VIP, port, i), and a `masquerade-vips` element;
- the node port: a service-nodeports element, a goto to
  `dispatch-nodeport-<proto>-<N>`; N `nodeport-endpoints-<proto>` elements
  keyed (node port, i), and a `masquerade-nodeports` element;
- the skeleton marks both for masquerade (kube-proxy's KUBE-EXT rule) by a
  rule placed before the verdict map of KUBE-SERVICES / KUBE-NODEPORTS, and
  the node port choosers DNAT without a masquerade rule of their own.
The choosers and their maps are the port's shared objects (its fragment's
`shared`), not the skeleton's.
Also: which external ports keep chains (ClientIP affinity only), ports of
more than 64 endpoints, ports without endpoints, loadBalancerSourceRanges
unchanged (checked before DNAT), and the bench's 10,000-service mix.
test_rules_dispatch.py holds the cluster IP side.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from builders import (
    CIP,
    CONFIG,
    EIP,
    EP1,
    EP2,
    EP3,
    LB,
    LB_RANGES,
    LOCAL,
    MASQ,
    NODE,
    chain_of,
    context,
    elements_of,
    endpoint,
    many,
    nodeport_dnat,
    render,
    sep,
    service_port,
    shared_chains,
    shared_sets,
    text,
)
from feed import update_service, update_slice
from skeleton_golden import SKELETON_CHAINS
from test_rules_dispatch import V4, V6, uses

from nftproxy.core import convert
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    L4Protocol,
    LoadBalancerIngress,
    ServicePort,
    ServicePortName,
    SessionAffinity,
)
from nftproxy.core.nft.plan import SKELETON
from nftproxy.core.render import render_full
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.dispatch import is_chooser_chain
from nftproxy.core.rules.fragment import (
    Element,
    Fragment,
    Target,
    Verdict,
    in_affinity_table,
    kernel_name,
)
from nftproxy.core.rules.service import plan_port
from nftproxy.core.rules.skeleton import render_skeleton
from nftproxy.core.tracker import ProxyState

ALL_EXTERNAL = service_port(
    node_port=3001, external_ips=(EIP,), load_balancer_ingress=(LoadBalancerIngress(LB),))
"""A node port, an external IP and an LB VIP, eTP=Cluster."""
SHARED_SETS = ("vip-endpoints-", "nodeport-endpoints-", "masquerade-")


def in_set(fragment: Fragment, set_name: str) -> dict[Any, Any]:
    return {e.key: e.value for e in fragment.elements if e.set_name == set_name}


def gotos(fragment: Fragment, set_name: str) -> dict[Any, str]:
    """Key -> the goto target of each element of a verdict map (each is a goto)."""
    out = {}
    for key, value in elements_of(fragment, set_name).items():
        assert isinstance(value, Verdict) and value.kind == "goto", (key, value)
        out[key] = value.target
    return out


def picks(fragment: Fragment, set_name: str, *fixed: Any) -> list[str]:
    """The endpoints (ip:port) of the elements (*fixed, 0..), in index order."""
    mine = in_set(fragment, set_name)
    out = [str(mine[(*fixed, i)]) for i in range(len(mine)) if (*fixed, i) in mine]
    assert all(isinstance(mine[(*fixed, i)], Target) for i in range(len(out)))
    return out


# --- which external ports share --------------------------------------------------

SHARED = [
    pytest.param(service_port(node_port=3001), id="NodePort"),
    pytest.param(service_port(load_balancer_ingress=(LoadBalancerIngress(LB),)),
                 id="LoadBalancer VIP"),
    pytest.param(service_port(node_port=3001, load_balancer_ingress=(LoadBalancerIngress(LB),)),
                 id="LoadBalancer with node port"),
    pytest.param(service_port(external_ips=(EIP, "192.168.99.23")), id="external IPs"),
    pytest.param(ALL_EXTERNAL, id="all of them"),
    pytest.param(service_port(node_port=3001, protocol=L4Protocol.UDP), id="UDP node port"),
]


@pytest.mark.parametrize("port", SHARED)
def test_an_etp_cluster_external_port_is_shared_and_has_no_chain(port: ServicePort) -> None:
    eps = (endpoint(EP2), endpoint(EP1, local=True))
    plan = plan_port(port, eps, context())
    assert plan.shared and plan.shared_chooser == (eps[1], eps[0])
    fragment = render(port, eps).fragment
    assert fragment.chains == ()
    proto = port.protocol.nft
    vips = (*port.external_ips, *port.load_balancer_vips)
    assert gotos(fragment, "service-ips") == {
        (ip, proto, 80): f"dispatch-{proto}-2" for ip in (CIP, *vips)}
    assert in_set(fragment, "masquerade-vips") == {(ip, proto, 80): None for ip in vips}
    node_ports = {(proto, port.node_port)} if port.node_port else set()
    assert gotos(fragment, "service-nodeports") == {
        key: f"dispatch-nodeport-{proto}-2" for key in node_ports}
    assert in_set(fragment, "masquerade-nodeports") == dict.fromkeys(node_ports)
    chains = {f"dispatch-{proto}-2", *(f"dispatch-nodeport-{proto}-2" for _ in node_ports)}
    sets = {f"vip-endpoints-{proto}", *(f"nodeport-endpoints-{proto}" for _ in node_ports)}
    assert uses(fragment) == (chains, sets)


KEEPS_CHAINS = [
    pytest.param(service_port(node_port=3001, external_traffic_policy=LOCAL,
                              session_affinity=SessionAffinity.CLIENT_IP),
                 (endpoint(EP1, local=True),), {"SVC", "SVL", "EXT"},
                 id="eTP=Local node port with ClientIP affinity"),
    pytest.param(replace(ALL_EXTERNAL, session_affinity=SessionAffinity.CLIENT_IP),
                 (endpoint(EP1),), {"SVC", "EXT"}, id="ClientIP affinity"),
    pytest.param(replace(ALL_EXTERNAL, session_affinity=SessionAffinity.CLIENT_IP),
                 many(65), {"SVC", "EXT"}, id="ClientIP affinity, 65 endpoints"),
]


@pytest.mark.parametrize(("port", "endpoints", "chains"), KEEPS_CHAINS)
def test_external_ports_keep_chains_only_with_client_ip_affinity(
    port: ServicePort, endpoints: tuple[Endpoint, ...], chains: set[str]
) -> None:
    plan = plan_port(port, endpoints, context())
    assert not plan.shared and plan.shared_chooser is None
    fragment = render(port, endpoints).fragment
    label = {names.service_chain(port.name): "SVC", names.local_chain(port.name): "SVL",
             names.external_chain(port.name): "EXT"}
    assert {label[kernel_name(c.name)] for c in fragment.chains} == chains
    assert {in_affinity_table(c.name) for c in fragment.chains} == {True}
    assert not any(e.set_name.startswith(SHARED_SETS) for e in fragment.elements)
    assert uses(fragment)[0] == set()
    ext = names.external_chain(port.name)
    assert gotos(fragment, "affinity:service-nodeports") == {("tcp", 3001): ext}
    assert set(gotos(fragment, "affinity:service-ips").values()) <= set(label)


OVER_64 = [
    pytest.param(ALL_EXTERNAL, many(65), {CIP: 65, EIP: 65, LB: 65}, 65, id="65 endpoints"),
    pytest.param(ALL_EXTERNAL, many(200), {CIP: 200, EIP: 200, LB: 200}, 200,
                 id="200 endpoints"),
    pytest.param(replace(ALL_EXTERNAL, internal_traffic_policy=LOCAL),
                 (endpoint(EP1, local=True), *many(64, base="10.181")),
                 {CIP: 1, EIP: 65, LB: 65}, 65,
                 id="iTP=Local: 1 local endpoint, 65 cluster ones at the external destinations"),
]


@pytest.mark.parametrize(("port", "endpoints", "vips", "node_port"), OVER_64)
def test_external_ports_of_more_than_64_endpoints_use_the_shared_choosers_of_their_count(
    port: ServicePort, endpoints: tuple[Endpoint, ...], vips: dict[str, int], node_port: int
) -> None:
    plan = plan_port(port, endpoints, context())
    assert plan.shared
    fragment = render(port, endpoints).fragment
    assert fragment.chains == ()
    assert gotos(fragment, "service-ips") == {
        (ip, "tcp", 80): f"dispatch-tcp-{n}" for ip, n in vips.items()}
    assert gotos(fragment, "service-nodeports") == {
        ("tcp", 3001): f"dispatch-nodeport-tcp-{node_port}"}
    for ip, n in vips.items():
        assert len(picks(fragment, "vip-endpoints-tcp", ip, 80)) == n
    assert len(picks(fragment, "nodeport-endpoints-tcp", 3001)) == node_port
    assert uses(fragment) == (
        {*(f"dispatch-tcp-{n}" for n in vips.values()), f"dispatch-nodeport-tcp-{node_port}"},
        {"vip-endpoints-tcp", "nodeport-endpoints-tcp"})


def test_itp_local_etp_cluster_cluster_ip_picks_local_and_externals_pick_cluster_ones() -> None:
    """kube-proxy: the cluster IP goes to KUBE-SVL (local endpoints), the
    external destinations to KUBE-EXT -> KUBE-SVC (every endpoint)."""
    port = replace(ALL_EXTERNAL, internal_traffic_policy=LOCAL)
    eps = (endpoint(EP3), endpoint(EP2, local=True), endpoint(EP1))
    plan = plan_port(port, eps, context())
    assert plan.shared and plan.shared_chooser == (eps[1],)
    fragment = render(port, eps).fragment
    assert fragment.chains == ()
    assert gotos(fragment, "service-ips") == {
        (CIP, "tcp", 80): "dispatch-tcp-1",
        (EIP, "tcp", 80): "dispatch-tcp-3",
        (LB, "tcp", 80): "dispatch-tcp-3",
    }
    every = [f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"]
    assert picks(fragment, "vip-endpoints-tcp", CIP, 80) == [f"{EP2}:80"]
    assert picks(fragment, "vip-endpoints-tcp", EIP, 80) == every
    assert picks(fragment, "vip-endpoints-tcp", LB, 80) == every
    assert gotos(fragment, "service-nodeports") == {("tcp", 3001): "dispatch-nodeport-tcp-3"}
    assert picks(fragment, "nodeport-endpoints-tcp", 3001) == every
    comments = {e.key: e.comment for e in fragment.elements if e.set_name == "service-ips"}
    assert comments[(CIP, "tcp", 80)] == f"ns1/svc1:p80 {names.local_chain(port.name)}"
    assert comments[(EIP, "tcp", 80)] == f"ns1/svc1:p80 {names.external_chain(port.name)}"


def test_itp_local_without_local_endpoint_drops_the_cluster_ip_and_shares_the_rest() -> None:
    port = replace(ALL_EXTERNAL, internal_traffic_policy=LOCAL)
    rendered = render(port, (endpoint(EP1),))
    fragment = rendered.fragment
    assert rendered.internal_dropped and fragment.chains == ()
    assert plan_port(port, (endpoint(EP1),), context()).shared_chooser is None
    assert in_set(fragment, "no-endpoint-services") == {(CIP, "tcp", 80): Verdict("drop")}
    assert gotos(fragment, "service-ips") == {
        (EIP, "tcp", 80): "dispatch-tcp-1", (LB, "tcp", 80): "dispatch-tcp-1"}
    assert gotos(fragment, "service-nodeports") == {("tcp", 3001): "dispatch-nodeport-tcp-1"}
    assert (CIP, 80, 0) not in in_set(fragment, "vip-endpoints-tcp")


@pytest.mark.parametrize("etp", [pytest.param(None, id="eTP=Cluster"),
                                 pytest.param(LOCAL, id="eTP=Local")])
def test_no_endpoints_rejects_every_destination_without_any_chooser(etp: Any) -> None:
    port = ALL_EXTERNAL if etp is None else replace(ALL_EXTERNAL, external_traffic_policy=etp)
    plan = plan_port(port, (), context())
    assert plan.shared_chooser is None and not plan.uses_ext_chain
    fragment = render(port, ()).fragment
    assert fragment.chains == ()
    reject = Verdict("goto", "KUBE-REJECT")
    assert in_set(fragment, "no-endpoint-services") == {
        (ip, "tcp", 80): reject for ip in (CIP, EIP, LB)}
    assert in_set(fragment, "no-endpoint-nodeports") == {("tcp", 3001): reject}
    assert not any(e.set_name.startswith(SHARED_SETS) for e in fragment.elements)
    assert in_set(fragment, "service-ips") == in_set(fragment, "service-nodeports") == {}
    assert fragment.shared == ()


# --- the elements of each external destination -------------------------------------


def test_each_external_vip_goes_to_the_shared_chooser_with_its_own_elements() -> None:
    """Every element of a shared port with an external IP, an LB VIP and a
    node port, with its comment: kube-proxy's identities (KUBE-SVC on the
    cluster IP, KUBE-EXT on the external destinations, KUBE-SEP on endpoints)."""
    eps = (endpoint(EP2), endpoint(EP1, 8080, local=True))  # EP2 on node-b: no hairpin pair
    fragment = render(ALL_EXTERNAL, eps).fragment
    svc, ext = names.service_chain(ALL_EXTERNAL.name), names.external_chain(ALL_EXTERNAL.name)
    ep1 = (Target(EP1, 8080), f"ns1/svc1:p80 -> {EP1}:8080 {sep(EP1, number=8080)}")
    ep2 = (Target(EP2, 80), f"ns1/svc1:p80 -> {EP2}:80 {sep(EP2)}")

    def vip(ip: str, identity: str) -> list[Element]:
        return [
            Element("service-ips", (ip, "tcp", 80), Verdict("goto", "dispatch-tcp-2"),
                    f"ns1/svc1:p80 {identity}"),
            Element("vip-endpoints-tcp", (ip, 80, 0), *ep1),
            Element("vip-endpoints-tcp", (ip, 80, 1), *ep2),
        ]

    expected = [
        Element("cluster-ips", (CIP,)),
        *vip(CIP, svc),
        *vip(EIP, ext),
        Element("masquerade-vips", (EIP, "tcp", 80), None, f"ns1/svc1:p80 {ext}"),
        *vip(LB, ext),
        Element("masquerade-vips", (LB, "tcp", 80), None, f"ns1/svc1:p80 {ext}"),
        Element("service-nodeports", ("tcp", 3001), Verdict("goto", "dispatch-nodeport-tcp-2"),
                f"ns1/svc1:p80 {ext}"),
        Element("nodeport-endpoints-tcp", (3001, 0), *ep1),
        Element("nodeport-endpoints-tcp", (3001, 1), *ep2),
        Element("masquerade-nodeports", ("tcp", 3001), None, f"ns1/svc1:p80 {ext}"),
        Element("hairpin-endpoints", (EP1, EP1)),
    ]
    assert sorted(map(repr, fragment.elements)) == sorted(map(repr, expected))
    assert len(fragment.elements) == len(expected)
    # the two choosers and their maps, one bundle each
    assert [([c.name for c in b.chains], [d.name for d in b.sets]) for b in fragment.shared] == [
        (["dispatch-tcp-2"], ["vip-endpoints-tcp"]),
        (["dispatch-nodeport-tcp-2"], ["nodeport-endpoints-tcp"])]


def test_the_node_port_goes_to_the_shared_node_port_chooser() -> None:
    port = service_port("dns", port_name="dns", port=53, protocol=L4Protocol.UDP, node_port=30053)
    fragment = render(port, many(3)).fragment
    assert gotos(fragment, "service-nodeports") == {("udp", 30053): "dispatch-nodeport-udp-3"}
    assert picks(fragment, "nodeport-endpoints-udp", 30053) == [
        f"10.180.0.{i}:80" for i in (1, 2, 3)]
    assert in_set(fragment, "masquerade-nodeports") == {("udp", 30053): None}
    assert in_set(fragment, "masquerade-vips") == {}


def _chances(fragment: Fragment, set_name: str, key: tuple[Any, ...]) -> dict[str, Fraction]:
    """Chance of a packet matching `key` in `set_name` (service-ips or
    service-nodeports) being DNATed to each endpoint: follow its goto into
    the shared chooser the fragment uses, read its DNAT's key (the packet's
    destination and/or port, then numgen random mod N) and look each index up."""
    target = gotos(fragment, set_name)[key]
    chooser = shared_chains(fragment)[target]
    (dnat,) = [s["dnat"] for s in chooser.rules[-1].expr if "dnat" in s]
    *fields, index = dnat["addr"]["map"]["key"]["concat"]
    packet = {"daddr": key[0], "dport": key[-1]}
    fixed = tuple(packet[f["payload"]["field"]] for f in fields)
    n = index["numgen"]["mod"]
    mine = in_set(fragment, dnat["addr"]["map"]["data"].lstrip("@"))
    out: dict[str, Fraction] = {}
    for i in range(n):
        out[str(mine[(*fixed, i)])] = out.get(str(mine[(*fixed, i)]), Fraction(0)) + Fraction(1, n)
    return out


@pytest.mark.parametrize("n", [1, 3, 64, 65, 200])
def test_every_external_destination_picks_each_endpoint_with_probability_one_over_n(
    n: int,
) -> None:
    eps = many(n)
    fragment = render(ALL_EXTERNAL, eps).fragment
    uniform = {ep.address: Fraction(1, n) for ep in eps}
    for ip in (CIP, EIP, LB):
        assert _chances(fragment, "service-ips", (ip, "tcp", 80)) == uniform, ip
    assert _chances(fragment, "service-nodeports", ("tcp", 3001)) == uniform


@pytest.mark.parametrize("family", [V4, V6], ids=["IPv4", "IPv6"])
def test_every_shared_external_port_names_only_what_the_skeleton_or_its_shared_objects_declare(
    family: IPFamily,
) -> None:
    skeleton = render_skeleton(family, CONFIG, NODE)
    vips = {V4: (EIP, LB), V6: ("fd00:99::22", "fd00:1:2::3")}[family]
    port = service_port(family=family, node_port=3001, external_ips=vips[:1],
                        load_balancer_ingress=(LoadBalancerIngress(vips[1]),))
    base = "10.180" if family is V4 else "fd00:10:180::"
    for n in (1, 2, 64, 65):
        eps = many(n) if family is V4 else tuple(
            endpoint(f"{base}{i + 1:x}") for i in range(n))
        fragment = render(port, eps).fragment
        targets = {*gotos(fragment, "service-ips").values(),
                   *gotos(fragment, "service-nodeports").values()}
        assert targets == {f"dispatch-tcp-{n}", f"dispatch-nodeport-tcp-{n}"}
        assert targets == set(shared_chains(fragment))
        sets = {s.name for s in skeleton.sets} | set(shared_sets(fragment))
        assert {e.set_name for e in fragment.elements} <= sets


# --- loadBalancerSourceRanges ------------------------------------------------------


def test_a_shared_lb_port_keeps_its_firewall_elements_checked_before_dnat() -> None:
    """The source ranges are checked in KUBE-FIREWALL-CHECK (filter
    prerouting/output, priority -110, before the DNAT at -100): sharing the
    chooser changes neither the firewall elements nor where they are read."""
    shared = render(LB_RANGES, (endpoint(EP1),)).fragment
    own = render(replace(LB_RANGES, session_affinity=SessionAffinity.CLIENT_IP),
                 (endpoint(EP1),)).fragment
    assert shared.chains == () and own.chains != ()

    def firewall(fragment: Fragment) -> list[Element]:
        return [e for e in fragment.elements if e.set_name.startswith("firewall-")]

    assert firewall(shared) == firewall(own) == [
        Element("firewall-vips", (LB, "tcp", 80), None,
                f"{names.firewall_chain(LB_RANGES.name)} ns1/svc1:p80"),
        Element("firewall-allow", (LB, "tcp", 80, "203.0.113.0/25")),
    ]
    skeleton = render_skeleton(V4, CONFIG, NODE)
    readers = {c.name for c in skeleton.chains for r in c.rules if "@firewall-vips" in text(r)}
    assert readers == {sk.FIREWALL_CHECK}
    hooked = {c.name: c.hook for c in skeleton.chains if c.hook is not None}
    jumps = {c for c in hooked if any(f"jump {sk.FIREWALL_CHECK}" in text(r)
                                      for r in chain_of(skeleton, c).rules)}
    dnat_prio = {hooked[c].prio for c in ("nat-prerouting", "nat-output") if hooked[c]}
    assert jumps and all(hooked[c] and hooked[c].prio < min(dnat_prio) for c in jumps)


# --- the skeleton: node port choosers, maps, marking rules -------------------------


@pytest.mark.parametrize(("family", "ip"), [(V4, "ip"), (V6, "ip6")], ids=["IPv4", "IPv6"])
@pytest.mark.parametrize("config", [
    pytest.param(CONFIG, id="ClusterCIDR detector"),
    pytest.param(replace(CONFIG, masquerade_all=True), id="masqueradeAll"),
])
def test_a_node_port_chooser_is_one_dnat_rule_and_its_map(
    family: IPFamily, ip: str, config: ProxyConfig
) -> None:
    """No masquerade rule, whatever the detector: KUBE-NODEPORTS marked the
    packet from masquerade-nodeports before the goto."""
    made = sk.choosers(family, config, NODE)
    for p in L4Protocol:
        for n in (1, 2, 64, 65, 200):
            bundle = made.nodeport(p, n)
            (chain,) = bundle.chains
            assert chain.name == f"dispatch-nodeport-{p.nft}-{n}" and chain.hook is None
            assert [(text(r), r.comment) for r in chain.rules] == [
                (nodeport_dnat(n, p.nft, ip), f"node port -> {n} endpoints")]
            assert [d.name for d in bundle.sets] == [f"nodeport-endpoints-{p.nft}"]
            assert made.nodeport(p, n) is bundle


@pytest.mark.parametrize(("family", "ip"), [(V4, "ip"), (V6, "ip6")], ids=["IPv4", "IPv6"])
def test_external_destinations_are_marked_before_the_verdict_maps(
    family: IPFamily, ip: str
) -> None:
    """kube-proxy's KUBE-EXT marks eTP=Cluster external traffic for
    masquerade before choosing; here the first rule of KUBE-SERVICES and of
    KUBE-NODEPORTS does it for the shared ports, ahead of the vmap (whose
    gotos to the choosers do not come back)."""
    skeleton = render_skeleton(family, CONFIG, NODE)
    services = [text(r) for r in chain_of(skeleton, "KUBE-SERVICES").rules]
    nodeports = [text(r) for r in chain_of(skeleton, "KUBE-NODEPORTS").rules]
    assert services[:2] == [
        f"{ip} daddr . meta l4proto . th dport @masquerade-vips {MASQ}",
        f"{ip} daddr . meta l4proto . th dport vmap @service-ips",
    ]
    assert len(services) == 3 and services[2].endswith("goto KUBE-NODEPORTS")
    assert nodeports == [
        f"meta l4proto . th dport @masquerade-nodeports {MASQ}",
        "meta l4proto . th dport vmap @service-nodeports",
    ]
    decls = {s.name: s for s in skeleton.sets}
    assert decls["masquerade-vips"].key == (f"{ip} daddr", "meta l4proto", "th dport")
    assert decls["masquerade-nodeports"].key == ("meta l4proto", "th dport")
    assert not any(decls[n].map or decls[n].flags or "integer" in decls[n].type
                   for n in ("masquerade-vips", "masquerade-nodeports"))


# --- at scale: the bench's mix ------------------------------------------------------


def _bench_state() -> tuple[ProxyState, Any, ProxyConfig]:
    """bench/benchlib.py's 10,000 x 10 mix, converted as the agent does."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import benchlib

    services, slices = benchlib.make_cluster(benchlib.ClusterShape(10_000, 10))
    state = ProxyState(V4)
    for svc, slc in zip(services, slices, strict=True):
        update_service(state.service_tracker, None, svc)
        update_slice(state.endpoint_tracker, None, slc, benchlib.NODE)
    state.apply()
    node, problems = convert.node_info(benchlib.node_obj())
    assert node is not None and not problems
    config = ProxyConfig(node_name=benchlib.NODE, cluster_cidrs=(benchlib.POD_CIDR,))
    return state, node, config


def test_the_bench_mix_of_10000_services_keeps_chains_only_for_affinity() -> None:
    """Per 20 services of the mix: 12 ClusterIP, 2 NodePort and 2
    LoadBalancer (one with source ranges) with eTP=Cluster, the iTP=Local
    ClusterIP and the 2 eTP=Local ones share; the ClientIP affinity one
    keeps chains (1 in 20: 500 ports)."""
    state, node, config = _bench_state()
    rendered = render_full(state.snapshot(), config, node, ("10.96.0.0/12",))
    fragments = rendered.desired()
    skeleton = fragments.pop(SKELETON)
    assert [c.name for c in skeleton.chains] == SKELETON_CHAINS
    assert len(fragments) == 10_000
    own = {owner for owner, f in fragments.items() if f.chains}
    assert len(own) == 500
    services = state.snapshot().services
    for owner in own:
        assert isinstance(owner, ServicePortName)
        assert services[owner].affinity
    shared = [f for f in fragments.values() if not f.chains]
    # every shared destination by a goto, never a `continue`
    assert {e.value.kind for f in shared for e in f.elements
            if isinstance(e.value, Verdict)} <= {"goto", "drop"}
    targets = {e.value.target for f in shared for e in f.elements
               if isinstance(e.value, Verdict) and e.value.kind == "goto"}
    # each goes to a chain some port's `shared` brings, none to the skeleton's
    brought = {c.name for f in shared for b in f.shared for c in b.chains}
    assert targets - {"KUBE-REJECT"} == brought
    assert not brought & skeleton.chain_names()
    assert {t.rsplit("-", 1)[0] if is_chooser_chain(t) else t for t in brought} == {
        "dispatch-tcp", "dispatch-nodeport-tcp", "dispatch-local-tcp",
        "dispatch-nodeport-local-tcp", "external-local", "nodeport-local"}
    marked = sum(e.set_name == "masquerade-nodeports" for f in shared for e in f.elements)
    assert marked == 4 * 500  # 2 NodePort + 2 LoadBalancer per 20
    assert sum(e.set_name == "masquerade-vips" for f in shared for e in f.elements) == 2 * 500
