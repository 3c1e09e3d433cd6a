"""Ruleset v8: eTP=Local external destinations through shared chains
(rules/dispatch.py, service.py, skeleton.py).

kube-proxy's KUBE-EXT of an eTP=Local port sends pod traffic and the node's
own traffic (marked for masquerade) to KUBE-SVC, everything else to KUBE-SVL
(none local: nowhere, the no-endpoint map drops it). Here one skeleton chain
per generation does that for every such port: `external-local-<g>` for
external IPs and LB VIPs, `nodeport-local-<g>` for node ports, each picking
the destination's chooser from two verdict maps the port fills
(`*-cluster-choosers-<g>`: the chooser of its cluster endpoints, comment
KUBE-SVC-<h>; `*-local-choosers-<g>`: of its local endpoints, comment
KUBE-SVL-<h>, only with local endpoints). The local choosers
(`dispatch-local-...`, `dispatch-nodeport-local-...`) pick from their own
maps and have no masquerade rule: external traffic keeps its source.
The eTP=Local destinations' elements are gotos still (ruleset v10's pick
tree serves only service-ips / service-nodeports elements of shared
destinations, test_rules_dispatch.py): such a port's cluster IP (iTP=Cluster)
is one, a `continue` element and the pick tree's plain elements, read here
through builders.resolved (`gotos`) as the goto to its chooser.
Aspects: the port's elements (VIP, node port, none local, terminating
fallback, UDP), no masquerade-vips / masquerade-nodeports elements, the
skeleton's chains per detector, the local choosers, generation names.
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
    chain_of,
    context,
    endpoint,
    render,
    service_port,
    text,
)
from test_rules_dispatch import GENERATIONS, PROTOCOLS, V4, V6
from test_rules_dispatch_external import gotos, in_set, picks

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import IPFamily, L4Protocol, LoadBalancerIngress, SessionAffinity
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.fragment import Element, Fragment, Verdict, affinity_table_name
from nftproxy.core.rules.service import render_service_port
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


def test_an_etp_local_vip_goes_to_external_local_and_its_two_choosers() -> None:
    fragment = render(ETP_LOCAL, EPS, pick_trees=True).fragment
    assert fragment.chains == ()
    for vip in (EIP, LB):
        key = (vip, "tcp", 80)
        assert element(fragment, "service-ips", key) == Element(
            "service-ips", key, Verdict("goto", "external-local-a"),
            f"{TAG} {names.external_chain(SPN)}")
        assert element(fragment, "external-cluster-choosers-a", key) == Element(
            "external-cluster-choosers-a", key, Verdict("goto", "dispatch-tcp-a-3"),
            f"{TAG} {names.service_chain(SPN)}")
        assert element(fragment, "external-local-choosers-a", key) == Element(
            "external-local-choosers-a", key, Verdict("goto", "dispatch-local-tcp-a-2"),
            f"{TAG} {names.local_chain(SPN)}")
        assert picks(fragment, "vip-endpoints-tcp-a", vip, 80) == [
            f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"]
        assert picks(fragment, "vip-local-endpoints-tcp-a", vip, 80) == [f"{EP1}:80", f"{EP3}:80"]
    # the cluster IP: a shared port's, of every endpoint (iTP=Cluster), by
    # the pick tree (a partial sync's render); the eTP=Local destinations
    # have no pick-tree element
    assert gotos(fragment, "service-ips")[(CIP, "tcp", 80)] == "dispatch-tcp-a-3"
    assert element(fragment, "service-ips", (CIP, "tcp", 80)).value == Verdict("continue")
    assert {e.key for e in fragment.elements if e.set_name.startswith("shared-")} == {
        (CIP, "tcp", 80)}
    # kube-proxy's KUBE-EXT of an eTP=Local port marks only LOCAL traffic:
    # external-local-a does, no masquerade-vips element
    assert in_set(fragment, "masquerade-vips") == {} == in_set(fragment, "masquerade-nodeports")
    local_comments = [e.comment or "" for e in fragment.elements
                      if e.set_name == "vip-local-endpoints-tcp-a"]
    assert all("KUBE-SEP-" in c for c in local_comments)


def test_an_etp_local_node_port_goes_to_nodeport_local_and_its_two_choosers() -> None:
    fragment = render(ETP_LOCAL, EPS).fragment
    key = ("tcp", 3001)
    assert element(fragment, "service-nodeports", key) == Element(
        "service-nodeports", key, Verdict("goto", "nodeport-local-a"),
        f"{TAG} {names.external_chain(SPN)}")
    assert gotos(fragment, "nodeport-cluster-choosers-a") == {key: "dispatch-nodeport-tcp-a-3"}
    assert gotos(fragment, "nodeport-local-choosers-a") == {
        key: "dispatch-nodeport-local-tcp-a-2"}
    assert picks(fragment, "nodeport-endpoints-tcp-a", 3001) == [
        f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"]
    assert picks(fragment, "nodeport-local-endpoints-tcp-a", 3001) == [f"{EP1}:80", f"{EP3}:80"]
    assert not any(e.set_name.startswith("shared-nodeports") for e in fragment.elements)


def test_without_a_local_endpoint_there_is_no_local_chooser_and_the_destination_drops() -> None:
    rendered = render(ETP_LOCAL, (endpoint(EP2),))
    fragment = rendered.fragment
    assert rendered.external_dropped
    assert fragment.chains == ()
    assert in_set(fragment, "external-local-choosers-a") == {}
    assert in_set(fragment, "nodeport-local-choosers-a") == {}
    assert not any("local-endpoints" in e.set_name for e in fragment.elements)
    # pod and node traffic still reach the cluster chooser; the rest falls
    # through external-local-a undNATed and the no-endpoint map drops it
    assert gotos(fragment, "external-cluster-choosers-a") == {
        (EIP, "tcp", 80): "dispatch-tcp-a-1", (LB, "tcp", 80): "dispatch-tcp-a-1"}
    assert in_set(fragment, "no-endpoint-services") == {
        (EIP, "tcp", 80): Verdict("drop"), (LB, "tcp", 80): Verdict("drop")}
    assert in_set(fragment, "no-endpoint-nodeports") == {("tcp", 3001): Verdict("drop")}


def test_a_local_terminating_endpoint_serves_the_local_chooser_when_none_is_ready() -> None:
    eps = (endpoint(EP1), endpoint(EP2, local=True, ready=False, terminating=True, serving=True))
    fragment = render(ETP_LOCAL, eps).fragment
    assert picks(fragment, "vip-local-endpoints-tcp-a", EIP, 80) == [f"{EP2}:80"]
    assert picks(fragment, "vip-endpoints-tcp-a", EIP, 80) == [f"{EP1}:80"]


def test_the_choosers_follow_the_protocol_and_the_generation() -> None:
    port = replace(ETP_LOCAL, name=replace(SPN, protocol=L4Protocol.UDP), protocol=L4Protocol.UDP)
    fragment = render_service_port(port, EPS, replace(context(), generation="c")).fragment
    assert gotos(fragment, "service-ips")[(EIP, "udp", 80)] == "external-local-c"
    assert gotos(fragment, "external-local-choosers-c") == {
        (EIP, "udp", 80): "dispatch-local-udp-c-2", (LB, "udp", 80): "dispatch-local-udp-c-2"}
    assert gotos(fragment, "service-nodeports") == {("udp", 3001): "nodeport-local-c"}
    assert len(in_set(fragment, "vip-local-endpoints-udp-c")) == 4


def test_affinity_keeps_the_ports_own_chains() -> None:
    port = replace(ETP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, EPS).fragment
    assert {c.name for c in fragment.chains} == {affinity_table_name(c) for c in (
        names.service_chain(SPN), names.local_chain(SPN), names.external_chain(SPN))}
    assert not any("choosers" in e.set_name for e in fragment.elements)


# --- the skeleton -------------------------------------------------------------------

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
    skeleton = render_skeleton(V4, config, NODE, generation="b")
    key = "ip daddr . meta l4proto . th dport"
    pod_rule = [] if pods is None else [
        (f"{pods}{key} vmap @external-cluster-choosers-b", "pod traffic: Cluster policy")]
    assert [(text(r), r.comment) for r in chain_of(skeleton, "external-local-b").rules] == [
        *pod_rule,
        (f"fib saddr type local {MASQ}", "masquerade LOCAL traffic"),
        (f"fib saddr type local {key} vmap @external-cluster-choosers-b",
         "LOCAL traffic: Cluster policy"),
        (f"{key} vmap @external-local-choosers-b", "other traffic: local endpoints"),
    ]
    rules = [text(r) for r in chain_of(skeleton, "nodeport-local-b").rules]
    assert rules[-1] == "meta l4proto . th dport vmap @nodeport-local-choosers-b"
    assert len(rules) == 3 + (pods is not None)


@pytest.mark.parametrize(("family", "ip"), [(V4, "ip"), (V6, "ip6")], ids=["IPv4", "IPv6"])
@pytest.mark.parametrize("masquerade_all", [False, True])
def test_the_local_choosers_dnat_without_a_masquerade_rule(
    family: IPFamily, ip: str, masquerade_all: bool
) -> None:
    config = replace(CONFIG, masquerade_all=masquerade_all)
    skeleton = render_skeleton(family, config, NODE)
    for p in PROTOCOLS:
        for n in (1, 64):
            (vip,) = chain_of(skeleton, f"dispatch-local-{p}-a-{n}").rules
            assert (text(vip), vip.comment) == (
                f"meta l4proto {p} dnat {ip} to {ip} daddr . {p} dport . numgen random mod {n} "
                f"map @vip-local-endpoints-{p}-a", f"VIP -> {n} local endpoints")
            (node_port,) = chain_of(skeleton, f"dispatch-nodeport-local-{p}-a-{n}").rules
            assert text(node_port) == (
                f"meta l4proto {p} dnat {ip} to {p} dport . numgen random mod {n} "
                f"map @nodeport-local-endpoints-{p}-a")


def test_the_choosers_maps_are_verdict_maps_keyed_as_service_ips_and_service_nodeports() -> None:
    skeleton = render_skeleton(V4, CONFIG, NODE)
    decls = {s.name: s for s in skeleton.sets}
    for which in ("cluster", "local"):
        external = decls[f"external-{which}-choosers-a"]
        nodeport = decls[f"nodeport-{which}-choosers-a"]
        assert (external.key, external.map) == (decls["service-ips"].key, "verdict")
        assert (nodeport.key, nodeport.map) == (decls["service-nodeports"].key, "verdict")
        assert not external.text_only and not nodeport.text_only


@pytest.mark.parametrize("g", GENERATIONS)
def test_generation_of_and_chain_generation_know_the_v8_names(g: str) -> None:
    for chain in (f"external-local-{g}", f"nodeport-local-{g}", f"dispatch-local-tcp-{g}-1",
                  f"dispatch-nodeport-local-sctp-{g}-64"):
        assert sk.chain_generation(chain) == g and sk.generation_of(chain) is None, chain
    for name in (f"external-cluster-choosers-{g}", f"external-local-choosers-{g}",
                 f"nodeport-cluster-choosers-{g}", f"nodeport-local-choosers-{g}",
                 f"vip-local-endpoints-udp-{g}", f"nodeport-local-endpoints-tcp-{g}"):
        assert sk.generation_of(name) == g and sk.chain_generation(name) is None, name
    assert sk.chain_generation(f"dispatch-local-tcp-{g}-65") is None
