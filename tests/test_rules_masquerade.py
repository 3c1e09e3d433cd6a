"""One service port -> its fragment (nftproxy.core.rules.service): masquerade.

kube-proxy's masquerade decisions for traffic to a cluster IP, per
local-traffic detector (ClusterCIDR, NodeCIDR, BridgeInterface,
InterfaceNamePrefix, none), with masqueradeAll, per protocol, and where the
rule lives: the KUBE-SVC/SVL chain of a port that keeps its own chains (one
with ClientIP affinity), and the shared choosers (rules/dispatch.py) every
other port's fragment uses.
test_rules_service.py has the module map of the renderer's tests.

Rules are read through builders.text() (nft syntax; fails on unknown shapes).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import (
    AFFINITY,
    CIP,
    CONFIG,
    EP1,
    ITP_LOCAL,
    LOCAL,
    LOCAL_AND_REMOTE,
    MASQ,
    NODE,
    REMOTE,
    SVC,
    SVC1,
    SVL,
    context,
    dispatch,
    labels,
    nodeport_dnat,
    render,
    rules_of,
    service_port,
    shared_dnat,
    shared_rules,
    to,
)

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import (
    Endpoint,
    L4Protocol,
    NodeInfo,
    ServicePort,
    SessionAffinity,
)
from nftproxy.core.rules import names
from nftproxy.core.rules.fragment import Verdict

# --- masquerade ------------------------------------------------------------------
# In two places: the KUBE-SVC/SVL of a port with its own chooser (ClientIP
# affinity), and the shared chooser a shared port's cluster IP goes to.

CIP_MATCH = f"ip daddr {CIP} tcp dport 80 "
"""What the own chooser's rule matches before the source."""
CLUSTER_IPS = "ip daddr @cluster-ips "
"""What the shared chooser's matches instead: a cluster IP (an eTP=Local
external destination's pod traffic reaches the chooser too, unmarked, as
kube-proxy's KUBE-SVC rule leaves it)."""


def shared_chooser_rules(
    port: ServicePort,
    endpoints: tuple[Endpoint, ...] = REMOTE,
    config: ProxyConfig = CONFIG,
    node: NodeInfo = NODE,
    set_name: str = "service-ips",
) -> list[str]:
    """The rules of the shared chooser (same config and node) that the
    shared `port`'s cluster IP's service-ips element (or with `set_name`
    service-nodeports, its node port's) goes to, a chain the port's
    fragment lists in its `shared`; the port has no chain."""
    fragment = render(port, endpoints, config=config, node=node).fragment
    assert fragment.chains == ()
    (goto,) = [e.value for e in fragment.elements if e.set_name == set_name]
    assert isinstance(goto, Verdict) and goto.kind == "goto"
    return shared_rules(fragment, goto.target)


def own_chooser_rules(
    port: ServicePort = AFFINITY,
    endpoints: tuple[Endpoint, ...] = REMOTE,
    config: ProxyConfig = CONFIG,
    node: NodeInfo = NODE,
    chain: str = SVC,
) -> list[str]:
    """The rules of `chain` (KUBE-SVC) of a port with ClientIP affinity:
    the masquerade rule, if any, then per endpoint an affinity lookup and
    the cascade, each ending in the DNAT to it."""
    return rules_of(render(port, endpoints, config=config, node=node).fragment, chain)


@pytest.mark.parametrize(
    ("config", "masq_rule"),
    [
        pytest.param(
            CONFIG, f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.0.0/8 {MASQ}",
            id="ClusterCIDR detector masquerades sources outside the cluster CIDR",
        ),
        pytest.param(
            replace(CONFIG, cluster_cidrs=("10.0.0.0/8", "100.64.0.0/10", "fd00:10::/48")),
            f"ip daddr {CIP} tcp dport 80 ip saddr != {{ 10.0.0.0/8, 100.64.0.0/10 }} {MASQ}",
            id="several cluster CIDRs of the family form one anonymous set",
        ),
        pytest.param(
            replace(CONFIG, masquerade_all=True), f"ip daddr {CIP} tcp dport 80 {MASQ}",
            id="masqueradeAll masquerades every source",
        ),
        pytest.param(
            replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR),
            f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.1.0/24 {MASQ}",
            id="NodeCIDR detector uses the node's pod CIDR",
        ),
        pytest.param(
            replace(CONFIG, detect_local_mode=DetectLocalMode.BRIDGE_INTERFACE,
                    bridge_interface="cbr0"),
            f"ip daddr {CIP} tcp dport 80 iifname != cbr0 {MASQ}",
            id="BridgeInterface detector matches the bridge",
        ),
        pytest.param(
            replace(CONFIG, detect_local_mode=DetectLocalMode.INTERFACE_NAME_PREFIX,
                    interface_name_prefix="veth"),
            f"ip daddr {CIP} tcp dport 80 iifname != veth* {MASQ}",
            id="InterfaceNamePrefix detector matches the prefix wildcard",
        ),
    ],
)
def test_cluster_ip_masquerade_rule_comes_first_in_kube_svc(
    config: ProxyConfig, masq_rule: str
) -> None:
    rules = own_chooser_rules(config=config)
    assert rules[0] == masq_rule and len(rules) == 3
    assert all(r.endswith(to(EP1)) for r in rules[1:])
    assert shared_chooser_rules(SVC1, config=config) == [
        CLUSTER_IPS + masq_rule.removeprefix(CIP_MATCH), shared_dnat(1)]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(replace(CONFIG, cluster_cidrs=()), id="ClusterCIDR without a cluster CIDR"),
        pytest.param(replace(CONFIG, cluster_cidrs=("fd00:10::/48",)),
                     id="ClusterCIDR with a cluster CIDR of the other family only"),
        pytest.param(replace(CONFIG, detect_local_mode=DetectLocalMode.BRIDGE_INTERFACE),
                     id="BridgeInterface without a bridge name"),
    ],
)
def test_without_a_detector_cluster_ip_traffic_is_never_masqueraded(config: ProxyConfig) -> None:
    assert context(config=config).detector is None
    rules = own_chooser_rules(config=config)
    assert len(rules) == 2 and all(r.endswith(to(EP1)) for r in rules)
    assert shared_chooser_rules(SVC1, config=config) == [shared_dnat(1)]


def test_without_a_detector_masquerade_all_still_masquerades() -> None:
    config = replace(CONFIG, cluster_cidrs=(), masquerade_all=True)
    assert own_chooser_rules(config=config)[0] == f"ip daddr {CIP} tcp dport 80 {MASQ}"
    assert shared_chooser_rules(SVC1, config=config) == [CLUSTER_IPS + MASQ, shared_dnat(1)]


def test_node_cidr_detector_without_pod_cidr_is_no_detector() -> None:
    config = replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR)
    node = replace(NODE, pod_cidrs=())
    rules = own_chooser_rules(config=config, node=node)
    assert len(rules) == 2 and not any(r.endswith(MASQ) for r in rules)
    assert shared_chooser_rules(SVC1, config=config, node=node) == [shared_dnat(1)]
    with_pod_cidr = shared_chooser_rules(SVC1, config=config)
    assert with_pod_cidr == [f"{CLUSTER_IPS}ip saddr != 10.0.1.0/24 {MASQ}", shared_dnat(1)]


def test_itp_local_masquerade_rule_lives_in_kube_svl() -> None:
    port = replace(ITP_LOCAL, node_port=3001, external_traffic_policy=LOCAL,
                   session_affinity=SessionAffinity.CLIENT_IP)
    rules = own_chooser_rules(port, LOCAL_AND_REMOTE, chain=SVL)
    assert rules[0] == f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.0.0/8 {MASQ}"
    assert len(rules) == 3 and all(r.endswith(to(EP1)) for r in rules[1:])
    # cluster IP only: KUBE-SVL's shared chooser, of the one local endpoint
    assert shared_chooser_rules(ITP_LOCAL, LOCAL_AND_REMOTE) == [
        f"{CLUSTER_IPS}ip saddr != 10.0.0.0/8 {MASQ}", shared_dnat(1)]


def test_itp_local_with_external_access_keeps_kube_svc_free_of_the_cluster_ip_rule() -> None:
    port = replace(ITP_LOCAL, node_port=3001, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, LOCAL_AND_REMOTE).fragment
    assert all("ip daddr" not in r for r in rules_of(fragment, SVC))
    assert rules_of(fragment, SVL)[0].endswith(MASQ)
    # shared (no affinity): the node port's chooser has no masquerade rule
    # (KUBE-NODEPORTS marks it), the cluster IP's has the cluster IP's
    shared_port = replace(ITP_LOCAL, node_port=3001)
    assert shared_chooser_rules(shared_port, LOCAL_AND_REMOTE, set_name="service-nodeports") == [
        nodeport_dnat(2)]
    assert shared_chooser_rules(shared_port, LOCAL_AND_REMOTE) == [
        f"{CLUSTER_IPS}ip saddr != 10.0.0.0/8 {MASQ}", shared_dnat(1)]


@pytest.mark.parametrize("protocol", [L4Protocol.UDP, L4Protocol.SCTP], ids=lambda p: p.value)
def test_masquerade_rule_matches_the_service_protocol(protocol: L4Protocol) -> None:
    port = service_port(protocol=protocol, node_port=3001, external_traffic_policy=LOCAL,
                        session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, REMOTE).fragment
    rules = rules_of(fragment, names.service_chain(port.name))
    assert rules[0] == f"ip daddr {CIP} {protocol.nft} dport 80 ip saddr != 10.0.0.0/8 {MASQ}"
    assert dispatch(fragment, labels(port))["affinity:service-ips"] == {
        (CIP, protocol.nft, 80): "goto SVC"}
    cluster_ip_only = replace(port, node_port=0, session_affinity=SessionAffinity.NONE)
    fragment = render(cluster_ip_only, REMOTE).fragment
    assert dispatch(fragment, labels(port))["service-ips"] == {
        (CIP, protocol.nft, 80): f"goto dispatch-{protocol.nft}-1"}
    assert shared_chooser_rules(cluster_ip_only) == [
        f"{CLUSTER_IPS}ip saddr != 10.0.0.0/8 {MASQ}", shared_dnat(1, protocol.nft)]
