"""eTP=Local external destinations through shared chains (rules/dispatch.py,
service.py, skeleton.py).

kube-proxy's KUBE-EXT of an eTP=Local port sends pod traffic and the node's
own traffic (marked for masquerade) to KUBE-SVC, everything else to KUBE-SVL
(none local: nowhere, the no-endpoint map drops it). Here one shared chain
does that for every such port: `external-local` for external IPs and LB
VIPs, `nodeport-local` for node ports, each picking the destination's
chooser from two verdict maps the port fills (`*-cluster-choosers`: a goto
to the chooser of its cluster endpoints, comment KUBE-SVC-<h>;
`*-local-choosers`: of its local endpoints, comment KUBE-SVL-<h>, only with
local endpoints). The local choosers (`dispatch-local-...`,
`dispatch-nodeport-local-...`) pick from their own maps and have no
masquerade rule: external traffic keeps its source. Such a port's cluster
IP (iTP=Cluster) is a shared port's: a goto to its chooser.
The chain, its two maps and the choosers are shared objects
(dispatch.Choosers.external_local, .vip, .nodeport) the port lists in its
fragment's `shared`; the skeleton holds none of them.
Aspects: the port's elements (VIP, node port, none local, terminating
fallback, UDP, more than 64 endpoints), its `shared`, no masquerade-vips /
masquerade-nodeports elements, the chains per detector, the local
choosers, the choosers maps' declarations.
"""

from __future__ import annotations

from dataclasses import replace
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
    LOCAL,
    MASQ,
    NODE,
    endpoint,
    many,
    render,
    service_port,
    text,
)
from skeleton_golden import SKELETON_CHAINS
from test_rules_dispatch import V4, V6, uses, verdict_kinds
from test_rules_dispatch_external import gotos, in_set, picks

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import IPFamily, L4Protocol, LoadBalancerIngress, SessionAffinity
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.fragment import Chain, Element, Fragment, Verdict, affinity_table_name
from nftproxy.core.rules.skeleton import render_skeleton

ETP_LOCAL = service_port(
    node_port=3001,
    external_ips=(EIP,),
    load_balancer_ingress=(LoadBalancerIngress(LB),),
    external_traffic_policy=LOCAL,
)
"""A node port, an external IP and an LB VIP, eTP=Local."""
EPS = (endpoint(EP1, local=True), endpoint(EP2), endpoint(EP3, local=True))
"""Three endpoints, two of them on this node."""
SPN = ETP_LOCAL.name
TAG = "ns1/svc1:p80"


def element(fragment: Fragment, set_name: str, key: Any) -> Element:
    (found,) = [e for e in fragment.elements if e.set_name == set_name and e.key == key]
    return found


def external_local_chain(config: ProxyConfig, *, nodeport: bool, family: IPFamily = V4) -> Chain:
    (chain,) = sk.choosers(family, config, NODE).external_local(nodeport=nodeport).chains
    return chain


def test_an_etp_local_vip_goes_to_external_local_and_its_two_choosers() -> None:
    fragment = render(ETP_LOCAL, EPS).fragment
    assert fragment.chains == ()
    for vip in (EIP, LB):
        key = (vip, "tcp", 80)
        assert element(fragment, "service-ips", key) == Element(
            "service-ips", key, Verdict("goto", "external-local"),
            f"{TAG} {names.external_chain(SPN)}")
        assert element(fragment, "external-cluster-choosers", key) == Element(
            "external-cluster-choosers", key, Verdict("goto", "dispatch-tcp-3"),
            f"{TAG} {names.service_chain(SPN)}")
        assert element(fragment, "external-local-choosers", key) == Element(
            "external-local-choosers", key, Verdict("goto", "dispatch-local-tcp-2"),
            f"{TAG} {names.local_chain(SPN)}")
        assert picks(fragment, "vip-endpoints-tcp", vip, 80) == [
            f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"]
        assert picks(fragment, "vip-local-endpoints-tcp", vip, 80) == [f"{EP1}:80", f"{EP3}:80"]
    # the cluster IP: a shared port's, of every endpoint (iTP=Cluster)
    assert gotos(fragment, "service-ips")[(CIP, "tcp", 80)] == "dispatch-tcp-3"
    assert element(fragment, "service-ips", (CIP, "tcp", 80)).comment == (
        f"{TAG} {names.service_chain(SPN)}")
    assert verdict_kinds(fragment) == {"goto"}
    # kube-proxy's KUBE-EXT of an eTP=Local port marks only LOCAL traffic:
    # external-local does, no masquerade-vips element
    assert in_set(fragment, "masquerade-vips") == {} == in_set(fragment, "masquerade-nodeports")
    local_comments = [e.comment or "" for e in fragment.elements
                      if e.set_name == "vip-local-endpoints-tcp"]
    assert all("KUBE-SEP-" in c for c in local_comments)


def test_an_etp_local_node_port_goes_to_nodeport_local_and_its_two_choosers() -> None:
    fragment = render(ETP_LOCAL, EPS).fragment
    key = ("tcp", 3001)
    assert element(fragment, "service-nodeports", key) == Element(
        "service-nodeports", key, Verdict("goto", "nodeport-local"),
        f"{TAG} {names.external_chain(SPN)}")
    assert gotos(fragment, "nodeport-cluster-choosers") == {key: "dispatch-nodeport-tcp-3"}
    assert gotos(fragment, "nodeport-local-choosers") == {
        key: "dispatch-nodeport-local-tcp-2"}
    assert picks(fragment, "nodeport-endpoints-tcp", 3001) == [
        f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"]
    assert picks(fragment, "nodeport-local-endpoints-tcp", 3001) == [f"{EP1}:80", f"{EP3}:80"]
    assert in_set(fragment, "masquerade-nodeports") == {}


def test_an_etp_local_ports_shared_holds_the_etp_local_chains_their_maps_and_its_choosers() -> None:
    """external-local and nodeport-local with their choosers maps (one
    bundle each), and the choosers the port's elements go to with the maps
    they pick from: of its cluster IP and its destinations' cluster
    endpoints (3: dispatch-tcp-3, dispatch-nodeport-tcp-3) and local ones
    (2: the local choosers); nothing else."""
    fragment = render(ETP_LOCAL, EPS).fragment
    assert uses(fragment) == (
        {"external-local", "nodeport-local", "dispatch-tcp-3", "dispatch-local-tcp-2",
         "dispatch-nodeport-tcp-3", "dispatch-nodeport-local-tcp-2"},
        {"external-cluster-choosers", "external-local-choosers",
         "nodeport-cluster-choosers", "nodeport-local-choosers",
         "vip-endpoints-tcp", "vip-local-endpoints-tcp",
         "nodeport-endpoints-tcp", "nodeport-local-endpoints-tcp"})
    bundles = {tuple(c.name for c in b.chains): [d.name for d in b.sets] for b in fragment.shared}
    assert bundles[("external-local",)] == ["external-cluster-choosers", "external-local-choosers"]
    assert bundles[("nodeport-local",)] == ["nodeport-cluster-choosers", "nodeport-local-choosers"]
    assert len(bundles) == len(fragment.shared) == 6
    # every goto of the port's elements reaches a chain of its `shared`
    targets = {e.value.target for e in fragment.elements if isinstance(e.value, Verdict)}
    assert targets == uses(fragment)[0]
    # without a local endpoint: no local chooser, the eTP=Local chains still
    remote = render(ETP_LOCAL, (endpoint(EP2),)).fragment
    assert uses(remote)[0] == {
        "external-local", "nodeport-local", "dispatch-tcp-1", "dispatch-nodeport-tcp-1"}
    # eTP=Local without external destinations: no eTP=Local chain at all
    plain = render(service_port(external_traffic_policy=LOCAL), EPS).fragment
    assert uses(plain) == ({"dispatch-tcp-3"}, {"vip-endpoints-tcp"})


def test_an_etp_local_port_of_more_than_64_endpoints_uses_the_choosers_of_its_counts() -> None:
    """65 endpoints, 65 of them local at the LB VIP; 65 remote ones at the
    node port: external-local / nodeport-local and the choosers of 65, as
    for any count (no chain of its own)."""
    lb = service_port(load_balancer_ingress=(LoadBalancerIngress(LB),),
                      external_traffic_policy=LOCAL)
    fragment = render(lb, many(65, local=True)).fragment
    assert fragment.chains == ()
    assert gotos(fragment, "service-ips") == {
        (CIP, "tcp", 80): "dispatch-tcp-65", (LB, "tcp", 80): "external-local"}
    assert gotos(fragment, "external-cluster-choosers") == {(LB, "tcp", 80): "dispatch-tcp-65"}
    assert gotos(fragment, "external-local-choosers") == {
        (LB, "tcp", 80): "dispatch-local-tcp-65"}
    assert len(picks(fragment, "vip-local-endpoints-tcp", LB, 80)) == 65
    node_port = render(service_port(node_port=3001, external_traffic_policy=LOCAL),
                       many(65)).fragment
    assert node_port.chains == ()
    assert gotos(node_port, "service-nodeports") == {("tcp", 3001): "nodeport-local"}
    assert gotos(node_port, "nodeport-cluster-choosers") == {
        ("tcp", 3001): "dispatch-nodeport-tcp-65"}
    assert in_set(node_port, "nodeport-local-choosers") == {}
    assert in_set(node_port, "no-endpoint-nodeports") == {("tcp", 3001): Verdict("drop")}


def test_without_a_local_endpoint_there_is_no_local_chooser_and_the_destination_drops() -> None:
    rendered = render(ETP_LOCAL, (endpoint(EP2),))
    fragment = rendered.fragment
    assert rendered.external_dropped
    assert fragment.chains == ()
    assert in_set(fragment, "external-local-choosers") == {}
    assert in_set(fragment, "nodeport-local-choosers") == {}
    assert not any("local-endpoints" in e.set_name for e in fragment.elements)
    # pod and node traffic still reach the cluster chooser; the rest falls
    # through external-local undNATed and the no-endpoint map drops it
    assert gotos(fragment, "external-cluster-choosers") == {
        (EIP, "tcp", 80): "dispatch-tcp-1", (LB, "tcp", 80): "dispatch-tcp-1"}
    assert in_set(fragment, "no-endpoint-services") == {
        (EIP, "tcp", 80): Verdict("drop"), (LB, "tcp", 80): Verdict("drop")}
    assert in_set(fragment, "no-endpoint-nodeports") == {("tcp", 3001): Verdict("drop")}


def test_a_local_terminating_endpoint_serves_the_local_chooser_when_none_is_ready() -> None:
    eps = (endpoint(EP1), endpoint(EP2, local=True, ready=False, terminating=True, serving=True))
    fragment = render(ETP_LOCAL, eps).fragment
    assert picks(fragment, "vip-local-endpoints-tcp", EIP, 80) == [f"{EP2}:80"]
    assert picks(fragment, "vip-endpoints-tcp", EIP, 80) == [f"{EP1}:80"]


def test_the_choosers_follow_the_protocol() -> None:
    port = replace(ETP_LOCAL, name=replace(SPN, protocol=L4Protocol.UDP), protocol=L4Protocol.UDP)
    fragment = render(port, EPS).fragment
    assert gotos(fragment, "service-ips")[(EIP, "udp", 80)] == "external-local"
    assert gotos(fragment, "external-local-choosers") == {
        (EIP, "udp", 80): "dispatch-local-udp-2", (LB, "udp", 80): "dispatch-local-udp-2"}
    assert gotos(fragment, "service-nodeports") == {("udp", 3001): "nodeport-local"}
    assert gotos(fragment, "nodeport-local-choosers") == {
        ("udp", 3001): "dispatch-nodeport-local-udp-2"}
    assert len(in_set(fragment, "vip-local-endpoints-udp")) == 4


def test_affinity_keeps_the_ports_own_chains() -> None:
    port = replace(ETP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, EPS).fragment
    assert {c.name for c in fragment.chains} == {affinity_table_name(c) for c in (
        names.service_chain(SPN), names.local_chain(SPN), names.external_chain(SPN))}
    assert not any("choosers" in e.set_name for e in fragment.elements)
    assert uses(fragment) == (set(), {"affinity:affinity"})


# --- the shared chains --------------------------------------------------------------

DETECTORS = [
    pytest.param(CONFIG, "ip saddr 10.0.0.0/8 ", id="ClusterCIDR"),
    pytest.param(replace(CONFIG, detect_local_mode=DetectLocalMode.BRIDGE_INTERFACE,
                         bridge_interface="cbr0"), "iifname cbr0 ", id="BridgeInterface"),
    pytest.param(replace(CONFIG, cluster_cidrs=()), None, id="no detector: no pod rule"),
]


@pytest.mark.parametrize(("config", "pods"), DETECTORS)
def test_external_local_sends_pods_and_the_node_to_the_cluster_chooser(
    config: ProxyConfig, pods: str | None
) -> None:
    external = external_local_chain(config, nodeport=False)
    key = "ip daddr . meta l4proto . th dport"
    pod_rule = [] if pods is None else [
        (f"{pods}{key} vmap @external-cluster-choosers", "pod traffic: Cluster policy")]
    assert external.name == "external-local" and external.hook is None
    assert [(text(r), r.comment) for r in external.rules] == [
        *pod_rule,
        (f"fib saddr type local {MASQ}", "masquerade LOCAL traffic"),
        (f"fib saddr type local {key} vmap @external-cluster-choosers",
         "LOCAL traffic: Cluster policy"),
        (f"{key} vmap @external-local-choosers", "other traffic: local endpoints"),
    ]
    nodeport = external_local_chain(config, nodeport=True)
    assert nodeport.name == "nodeport-local" and nodeport.hook is None
    key = "meta l4proto . th dport"
    pod = [] if pods is None else [f"{pods}{key} vmap @nodeport-cluster-choosers"]
    assert [text(r) for r in nodeport.rules] == [
        *pod,
        f"fib saddr type local {MASQ}",
        f"fib saddr type local {key} vmap @nodeport-cluster-choosers",
        f"{key} vmap @nodeport-local-choosers",
    ]


@pytest.mark.parametrize(("family", "ip"), [(V4, "ip"), (V6, "ip6")], ids=["IPv4", "IPv6"])
@pytest.mark.parametrize("masquerade_all", [False, True])
def test_the_local_choosers_dnat_without_a_masquerade_rule(
    family: IPFamily, ip: str, masquerade_all: bool
) -> None:
    config = replace(CONFIG, masquerade_all=masquerade_all)
    made = sk.choosers(family, config, NODE)
    for protocol in L4Protocol:
        p = protocol.nft
        for n in (1, 64, 65):
            vip_bundle = made.vip(protocol, n, local=True)
            (chain,) = vip_bundle.chains
            assert chain.name == f"dispatch-local-{p}-{n}"
            (vip,) = chain.rules
            assert (text(vip), vip.comment) == (
                f"meta l4proto {p} dnat {ip} to {ip} daddr . {p} dport . numgen random mod {n} "
                f"map @vip-local-endpoints-{p}", f"VIP -> {n} local endpoints")
            assert [d.name for d in vip_bundle.sets] == [f"vip-local-endpoints-{p}"]
            nodeport_bundle = made.nodeport(protocol, n, local=True)
            (chain,) = nodeport_bundle.chains
            assert chain.name == f"dispatch-nodeport-local-{p}-{n}"
            (node_port,) = chain.rules
            assert text(node_port) == (
                f"meta l4proto {p} dnat {ip} to {p} dport . numgen random mod {n} "
                f"map @nodeport-local-endpoints-{p}")
            assert [d.name for d in nodeport_bundle.sets] == [f"nodeport-local-endpoints-{p}"]


def test_the_choosers_maps_are_verdict_maps_keyed_as_service_ips_and_service_nodeports() -> None:
    skeleton = render_skeleton(V4, CONFIG, NODE)
    main = {s.name: s for s in skeleton.sets}
    made = sk.choosers(V4, CONFIG, NODE)
    for nodeport, dispatch_map in ((False, "service-ips"), (True, "service-nodeports")):
        where = "nodeport" if nodeport else "external"
        decls = {s.name: s for s in made.external_local(nodeport=nodeport).sets}
        assert list(decls) == [f"{where}-cluster-choosers", f"{where}-local-choosers"]
        for decl in decls.values():
            assert (decl.key, decl.map) == (main[dispatch_map].key, "verdict")
            assert "integer" not in decl.type and decl.elements == ()
    assert made.external_local(nodeport=False) is made.external_local(nodeport=False)
    assert [c.name for c in skeleton.chains] == SKELETON_CHAINS
