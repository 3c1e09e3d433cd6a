"""One service port -> its fragment (nftproxy.core.rules.service): external access.

Aspects, each in kube-proxy's words (docs/kube-proxy-semantics.md,
upstream-nftables-notes.md §1.5-§1.15):
- KUBE-EXT (a port with ClientIP affinity's own chain; every other port's
  external destinations go to the shared choosers, and for eTP=Local to
  the shared external-local / nodeport-local chains,
  test_rules_dispatch_local.py): masquerade then KUBE-SVC for eTP=Cluster;
  for eTP=Local the pod and host short-circuits (per local-traffic
  detector) and KUBE-SVL with local endpoints only (as the shared local
  choosers' maps);
- loadBalancerSourceRanges: firewall-vips elements (KUBE-FW-<h> in their
  comment) and firewall-allow elements, read by the skeleton's one check;
- whole-fragment properties: determinism, every comment names the service
  port, the render context's family;
- the text() printer reads every shape the renderers emit, fails on others.
Dispatch, masquerade and the renderer meta-test are in test_rules_service.py.

Rules are read through builders.text() (nft syntax; fails on unknown shapes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from builders import (
    CONFIG,
    EP1,
    EP2,
    EP3,
    ETP_LOCAL,
    EXT,
    FW,
    LB,
    LB_RANGES,
    LOCAL,
    LOCAL_AND_REMOTE,
    MASQ,
    NODE,
    NODEPORT,
    REMOTE,
    SVC,
    SVL,
    dispatch,
    dnat_to,
    elements_of,
    endpoint,
    labels,
    render,
    rules_of,
    service_port,
    shared_chains,
    shared_rules,
    text,
)

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import (
    IPFamily,
    LoadBalancerIngress,
    NodeInfo,
    SessionAffinity,
    TrafficPolicy,
)
from nftproxy.core.nft.jsontext import command_json
from nftproxy.core.nft.ops import Table
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.fragment import Element, Fragment, Rule, Verdict, affinity_table_name
from nftproxy.core.rules.service import RenderContext, render_service_port

# --- KUBE-EXT --------------------------------------------------------------------


def test_etp_cluster_external_chain_masquerades_then_goes_to_kube_svc() -> None:
    sticky = replace(NODEPORT, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(sticky, REMOTE).fragment
    assert rules_of(fragment, EXT) == [MASQ, f"goto {SVC}"]
    # shared (no affinity): no KUBE-EXT; its node port is marked for
    # masquerade by the skeleton's KUBE-NODEPORTS, from masquerade-nodeports
    fragment = render(NODEPORT, REMOTE).fragment
    assert fragment.chains == ()
    assert elements_of(fragment, "masquerade-nodeports") == {("tcp", 3001): None}


POD_SHORT_CIRCUIT = f"ip saddr 10.0.0.0/8 goto {SVC}"
"""eTP=Local's KUBE-EXT sends pods (ClusterCIDR detector) to KUBE-SVC first..."""
HOST_SHORT_CIRCUIT = [f"fib saddr type local {MASQ}", f"fib saddr type local goto {SVC}"]
"""...then masquerades the host's own traffic and sends it to KUBE-SVC too."""


STICKY_ETP_LOCAL = replace(ETP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP)
"""eTP=Local with ClientIP affinity: a port that keeps KUBE-SVC/SVL/EXT."""


def dnat_targets(fragment: Fragment, chain: str) -> set[str]:
    """The endpoints (ip:port) the chain's rules DNAT to."""
    rules = [r for c in fragment.chains if c.name.endswith(chain) for r in c.rules]
    return {dnat_to(r) for r in rules if any("dnat" in s for s in r.expr)}


def test_etp_local_external_chain_short_circuits_pods_and_host() -> None:
    fragment = render(STICKY_ETP_LOCAL, LOCAL_AND_REMOTE).fragment
    assert rules_of(fragment, EXT) == [POD_SHORT_CIRCUIT, *HOST_SHORT_CIRCUIT, f"goto {SVL}"]


def test_etp_local_local_chain_contains_only_local_endpoints() -> None:
    eps = (endpoint(EP1, local=True), endpoint(EP2), endpoint(EP3, local=True))
    fragment = render(STICKY_ETP_LOCAL, eps).fragment
    assert dnat_targets(fragment, SVL) == {f"{EP1}:80", f"{EP3}:80"}
    # KUBE-SVC (pods, host) still balances over every endpoint
    assert dnat_targets(fragment, SVC) == {f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"}
    # without affinity, the same split between the shared choosers' maps
    shared = render(ETP_LOCAL, eps).fragment
    local = [str(v) for k, v in elements_of(shared, "vip-local-endpoints-tcp").items()
             if k[0] == LB]
    cluster = [str(v) for k, v in elements_of(shared, "vip-endpoints-tcp").items() if k[0] == LB]
    assert (local, cluster) == ([f"{EP1}:80", f"{EP3}:80"], [f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"])


def test_etp_local_local_chain_has_no_cluster_ip_masquerade_rule() -> None:
    fragment = render(STICKY_ETP_LOCAL, LOCAL_AND_REMOTE).fragment
    assert not any(r.endswith(MASQ) for r in rules_of(fragment, SVL))
    shared = render(ETP_LOCAL, LOCAL_AND_REMOTE).fragment
    local_choosers = [c for c in shared_chains(shared) if c.startswith("dispatch-local-")]
    assert local_choosers == ["dispatch-local-tcp-1"]
    assert not any(r.endswith(MASQ) for r in shared_rules(shared, "dispatch-local-tcp-1"))


def test_etp_local_without_local_endpoints_has_no_goto_kube_svl() -> None:
    fragment = render(STICKY_ETP_LOCAL, REMOTE).fragment
    assert rules_of(fragment, EXT) == [POD_SHORT_CIRCUIT, *HOST_SHORT_CIRCUIT]


def test_etp_local_without_a_detector_loses_the_pod_short_circuit() -> None:
    config = replace(CONFIG, cluster_cidrs=())
    fragment = render(STICKY_ETP_LOCAL, LOCAL_AND_REMOTE, config=config).fragment
    assert rules_of(fragment, EXT) == [*HOST_SHORT_CIRCUIT, f"goto {SVL}"]


@pytest.mark.parametrize(
    ("config", "short_circuit"),
    [
        pytest.param(replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR),
                     f"ip saddr 10.0.1.0/24 goto {SVC}", id="NodeCIDR"),
        pytest.param(replace(CONFIG, detect_local_mode=DetectLocalMode.BRIDGE_INTERFACE,
                             bridge_interface="cbr0"),
                     f"iifname cbr0 goto {SVC}", id="BridgeInterface"),
        pytest.param(replace(CONFIG, detect_local_mode=DetectLocalMode.INTERFACE_NAME_PREFIX,
                             interface_name_prefix="veth"),
                     f"iifname veth* goto {SVC}", id="InterfaceNamePrefix"),
    ],
)
def test_etp_local_pod_short_circuit_uses_the_detector(
    config: ProxyConfig, short_circuit: str
) -> None:
    fragment = render(STICKY_ETP_LOCAL, LOCAL_AND_REMOTE, config=config).fragment
    assert rules_of(fragment, EXT)[0] == short_circuit


def test_etp_local_without_external_access_is_plain_cluster_ip() -> None:
    """No KUBE-SVL nor KUBE-EXT: the cluster-IP-only port renders as one
    without the policy, with its shared chooser or, with affinity, its own
    KUBE-SVC."""
    port = service_port(external_traffic_policy=LOCAL)
    fragment = render(port, REMOTE).fragment
    assert fragment == render(service_port(), REMOTE).fragment
    assert {c.name for c in fragment.chains} == set()
    assert set(dispatch(fragment, labels(port))) == {
        "cluster-ips", "service-ips", "vip-endpoints-tcp"}  # REMOTE: no hairpin pair
    sticky = replace(port, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(sticky, REMOTE).fragment
    cluster = replace(sticky, external_traffic_policy=TrafficPolicy.CLUSTER)
    assert fragment == render(cluster, REMOTE).fragment
    assert {c.name for c in fragment.chains} == {affinity_table_name(SVC)}
    assert set(dispatch(fragment, labels(port))) == {
        "cluster-ips", "service-ips", "affinity:service-ips"}


# --- loadBalancerSourceRanges: firewall-vips / firewall-allow ----------------------


def _firewall(fragment: Fragment) -> tuple[dict[Any, str | None], list[Any]]:
    """(firewall-vips key -> comment, firewall-allow keys in fragment order)."""
    vips = {e.key: e.comment for e in fragment.elements if e.set_name == "firewall-vips"}
    allow = [e.key for e in fragment.elements if e.set_name == "firewall-allow"]
    for e in fragment.elements:
        if e.set_name in ("firewall-vips", "firewall-allow"):
            assert e.value is None  # plain sets: the check is the skeleton's one rule
    return vips, allow


def test_source_ranges_are_firewall_vips_and_firewall_allow_elements() -> None:
    fragment = render(LB_RANGES, REMOTE).fragment
    vips, allow = _firewall(fragment)
    assert vips == {(LB, "tcp", 80): f"{FW} ns1/svc1:p80"}
    assert allow == [(LB, "tcp", 80, "203.0.113.0/25")]
    assert FW not in fragment.chain_names()
    # as JSON: the allowed range is a prefix in the concatenation
    table = Table("ip", "nftproxy")
    ((add_vips,), (add_allow,)) = (
        table.add_elements(name, (e for e in fragment.elements if e.set_name == name))
        for name in ("firewall-vips", "firewall-allow"))
    assert command_json(add_vips)["add"]["element"]["elem"] == [
        {"elem": {"val": {"concat": [LB, "tcp", 80]}, "comment": f"{FW} ns1/svc1:p80"}}]
    assert command_json(add_allow)["add"]["element"]["elem"] == [
        {"concat": [LB, "tcp", 80, {"prefix": {"addr": "203.0.113.0", "len": 25}}]}]
    # the skeleton's rule that reads them, pre-DNAT
    skeleton = sk.render_skeleton(IPFamily.IPV4, CONFIG, NODE)
    assert rules_of(skeleton, "KUBE-FIREWALL-CHECK") == [
        "ip daddr . meta l4proto . th dport @firewall-vips "
        "ip daddr . meta l4proto . th dport . ip saddr != @firewall-allow drop"]


def test_firewall_allows_the_lb_ips_when_a_range_contains_the_node() -> None:
    """VIP-style load balancers loop a node's own request back with the VIP as
    source: every VIP of the port is allowed to every VIP of the port."""
    port = replace(
        LB_RANGES,
        load_balancer_ingress=(LoadBalancerIngress(LB), LoadBalancerIngress("1.2.3.9")),
        load_balancer_source_ranges=("203.0.113.0/25", "192.168.0.0/24"),
    )
    vips, allow = _firewall(render(port, REMOTE).fragment)
    assert set(vips) == {(LB, "tcp", 80), ("1.2.3.9", "tcp", 80)}
    ranges = ["1.2.3.4/32", "1.2.3.9/32", "192.168.0.0/24", "203.0.113.0/25"]
    assert allow == [(vip, "tcp", 80, r) for vip in (LB, "1.2.3.9") for r in ranges]
    node_ip = Table("ip", "nftproxy").add_elements(
        "firewall-allow", [Element("firewall-allow", allow[0])])
    assert command_json(node_ip[0])["add"]["element"]["elem"] == [{"concat": [LB, "tcp", 80, LB]}]


def test_firewall_ranges_not_containing_the_node_do_not_allow_the_lb_ips() -> None:
    fragment = render(LB_RANGES, REMOTE, node=replace(NODE, ipv4=("192.168.7.7",))).fragment
    _, allow = _firewall(fragment)
    assert allow == [(LB, "tcp", 80, "203.0.113.0/25")]


def test_firewall_collapses_overlapping_and_adjacent_ranges() -> None:
    port = replace(LB_RANGES, load_balancer_source_ranges=(
        "203.0.113.0/25", "203.0.113.64/26", "203.0.113.128/25", "198.51.100.7/32"))
    _, allow = _firewall(render(port, REMOTE).fragment)
    assert allow == [(LB, "tcp", 80, "198.51.100.7/32"), (LB, "tcp", 80, "203.0.113.0/24")]


def test_source_ranges_without_lb_ips_need_no_firewall() -> None:
    port = service_port(node_port=3001, load_balancer_source_ranges=("203.0.113.0/25",))
    fragment = render(port, REMOTE).fragment
    assert _firewall(fragment) == ({}, [])
    assert fragment.sets == ()


def test_node_port_bypasses_source_ranges() -> None:
    port = replace(LB_RANGES, node_port=3001)
    fragment = render(port, REMOTE).fragment
    vips, allow = _firewall(fragment)
    assert set(vips) == {(LB, "tcp", 80)}
    assert {key[:3] for key in allow} == {(LB, "tcp", 80)}
    assert elements_of(fragment, "service-nodeports") == {
        ("tcp", 3001): Verdict("goto", "dispatch-nodeport-tcp-1")}
    own = render(replace(port, session_affinity=SessionAffinity.CLIENT_IP), REMOTE).fragment
    assert _firewall(own) == (vips, allow)
    assert elements_of(own, "service-nodeports") == {("tcp", 3001): Verdict("accept")}
    assert elements_of(own, "affinity:service-nodeports") == {("tcp", 3001): Verdict("goto", EXT)}


def test_ipv6_firewall_elements_and_lb_host_prefix() -> None:
    lb6 = "fd00:1:2::3"
    port = service_port(
        family=IPFamily.IPV6,
        load_balancer_ingress=(LoadBalancerIngress(lb6),),
        load_balancer_source_ranges=("fd00:192::/64",),  # contains the node's IPv6
    )
    fragment = render(port, REMOTE).fragment
    vips, allow = _firewall(fragment)
    assert vips == {(lb6, "tcp", 80): f"{names.firewall_chain(port.name)} ns1/svc1:p80"}
    assert allow == [(lb6, "tcp", 80, f"{lb6}/128"), (lb6, "tcp", 80, "fd00:192::/64")]
    assert fragment.sets == ()
    (add,) = Table("ip6", "nftproxy").add_elements(
        "firewall-allow", (e for e in fragment.elements if e.set_name == "firewall-allow"))
    assert command_json(add)["add"]["element"]["elem"] == [
        {"concat": [lb6, "tcp", 80, lb6]},
        {"concat": [lb6, "tcp", 80, {"prefix": {"addr": "fd00:192::", "len": 64}}]}]


# --- misc ------------------------------------------------------------------------


def test_rendering_is_deterministic_and_independent_of_endpoint_order() -> None:
    eps = (endpoint(EP2), endpoint(EP1, local=True), endpoint(EP3))
    a = render(ETP_LOCAL, eps).fragment
    b = render(ETP_LOCAL, tuple(reversed(eps))).fragment
    assert a == b


def test_every_rule_comment_names_the_service_port() -> None:
    port = replace(ETP_LOCAL, load_balancer_source_ranges=("203.0.113.0/25",),
                   session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, LOCAL_AND_REMOTE).fragment
    commented = [r.comment for c in fragment.chains for r in c.rules if r.comment]
    assert commented
    assert all(str(port.name) in c for c in commented)
    assert all(e.comment == str(port.name) for e in fragment.elements if e.value is not None)
    assert [e.comment for e in fragment.elements if e.set_name == "firewall-vips"] == [
        f"{names.firewall_chain(port.name)} {port.name}"]


def test_render_context_is_honoured_for_the_family() -> None:
    node = NodeInfo("node-a")
    ctx = RenderContext(IPFamily.IPV6, CONFIG, node, None, sk.choosers(IPFamily.IPV6, CONFIG, node))
    port = service_port(family=IPFamily.IPV6)
    fragment = render_service_port(port, (endpoint("fd00:10:180::1"),), ctx).fragment
    assert fragment.family is IPFamily.IPV6


# --- the printer ----------------------------------------------------------------


@pytest.mark.parametrize("family", [IPFamily.IPV4, IPFamily.IPV6], ids=lambda f: f.value)
def test_text_reads_every_rule_the_renderers_emit(family: IPFamily) -> None:
    """The printer knows every shape of the skeleton and of a port using every
    feature, so the assertions above can rely on it."""
    ip = {IPFamily.IPV4: (LB, "10.180.0.", "203.0.113.0/25"),
          IPFamily.IPV6: ("fd00:1:2::3", "fd00:10:180::", "fd00:203::/64")}[family]
    port = replace(service_port(family=family, node_port=3001, external_traffic_policy=LOCAL,
                                session_affinity=SessionAffinity.CLIENT_IP),
                   load_balancer_ingress=(LoadBalancerIngress(ip[0]),),
                   load_balancer_source_ranges=(ip[2],))
    eps = (endpoint(ip[1] + "1", local=True), endpoint(ip[1] + "2"))
    shared = render(replace(port, session_affinity=SessionAffinity.NONE), eps).fragment
    for fragment in (render(port, eps).fragment, sk.render_skeleton(family, CONFIG, NODE)):
        assert all(text(r) for c in fragment.chains for r in c.rules)
    assert len(shared_chains(shared)) == 6  # the choosers and the eTP=Local chains
    assert all(text(r) for c in shared_chains(shared).values() for r in c.rules)


@pytest.mark.parametrize(
    "statement",
    [
        pytest.param({"counter": None}, id="an unknown statement"),
        pytest.param({"match": {"op": "==", "left": {"osf": {"key": "name"}}, "right": "Linux"}},
                     id="an unknown expression"),
        pytest.param({"match": {"op": "==", "left": {"meta": {"key": "mark"}}, "right": True}},
                     id="a boolean literal"),
    ],
)
def test_text_fails_loudly_on_an_unknown_shape(statement: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match="text\\(\\) does not know"):
        text(Rule((statement,)))
