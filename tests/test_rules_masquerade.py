"""One service port -> its fragment (nftproxy.core.rules.service): masquerade.

kube-proxy's masquerade decisions for traffic to a cluster IP, per
local-traffic detector (ClusterCIDR, NodeCIDR, BridgeInterface,
InterfaceNamePrefix, none), with masqueradeAll, per protocol, and where the
rule lives: the KUBE-SVC/SVL chain of a port that keeps its own chains, and
the skeleton's shared choosers (rules/dispatch.py) for every other port.
test_rules_service.py has the module map of the renderer's tests.

Rules are read through builders.text() (nft syntax; fails on unknown shapes).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import (
    CIP,
    CONFIG,
    EP1,
    ETP_LOCAL_NODEPORT,
    ITP_LOCAL,
    LOCAL,
    LOCAL_AND_REMOTE,
    MASQ,
    NODE,
    REMOTE,
    SVC,
    SVC1,
    SVL,
    chain_of,
    context,
    dispatch,
    labels,
    nodeport_dnat,
    picks,
    render,
    render_own,
    resolved,
    rules_of,
    service_port,
    shared_dnat,
    text,
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
from nftproxy.core.rules.skeleton import render_skeleton

# --- masquerade ------------------------------------------------------------------
# In two places (v7): the KUBE-SVC/SVL of a port with its own chooser (an
# eTP=Local node port here, rendered keeping its chains: `render_own`), and
# the skeleton's shared chooser a shared port's cluster IP goes to.

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
    """The rules of the skeleton's shared chooser (same config and node) that
    the shared `port`'s cluster IP's service-ips element (or with `set_name`
    service-nodeports, its node port's) goes to; the port has no chain.
    A full sync's element is the goto; a partial sync's is `continue`
    (ruleset v10), read through its pick-tree elements (builders.resolved)
    as the same goto."""
    full = render(port, endpoints, config=config, node=node).fragment
    partial = render(port, endpoints, config=config, node=node, pick_trees=True).fragment
    assert full.chains == () == partial.chains
    (goto,) = [e.value for e in full.elements if e.set_name == set_name]
    (raw,) = [e.value for e in partial.elements if e.set_name == set_name]
    assert raw == Verdict("continue")
    assert [e.value for e in resolved(partial) if e.set_name == set_name] == [goto]
    assert isinstance(goto, Verdict) and goto.kind == "goto"
    skeleton = render_skeleton(port.family, config, node)
    return [text(r) for r in chain_of(skeleton, goto.target).rules]



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
    fragment = render_own(ETP_LOCAL_NODEPORT, REMOTE, config=config).fragment
    assert rules_of(fragment, SVC) == [masq_rule, picks(EP1)]
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
    fragment = render_own(ETP_LOCAL_NODEPORT, REMOTE, config=config).fragment
    assert rules_of(fragment, SVC) == [picks(EP1)]
    assert shared_chooser_rules(SVC1, config=config) == [shared_dnat(1)]


def test_without_a_detector_masquerade_all_still_masquerades() -> None:
    config = replace(CONFIG, cluster_cidrs=(), masquerade_all=True)
    fragment = render_own(ETP_LOCAL_NODEPORT, REMOTE, config=config).fragment
    assert rules_of(fragment, SVC)[0] == f"ip daddr {CIP} tcp dport 80 {MASQ}"
    assert shared_chooser_rules(SVC1, config=config) == [CLUSTER_IPS + MASQ, shared_dnat(1)]


def test_node_cidr_detector_without_pod_cidr_is_no_detector() -> None:
    config = replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR)
    node = replace(NODE, pod_cidrs=())
    fragment = render_own(ETP_LOCAL_NODEPORT, REMOTE, config=config, node=node).fragment
    assert rules_of(fragment, SVC) == [picks(EP1)]
    assert shared_chooser_rules(SVC1, config=config, node=node) == [shared_dnat(1)]
    with_pod_cidr = shared_chooser_rules(SVC1, config=config)
    assert with_pod_cidr == [f"{CLUSTER_IPS}ip saddr != 10.0.1.0/24 {MASQ}", shared_dnat(1)]


def test_itp_local_masquerade_rule_lives_in_kube_svl() -> None:
    port = replace(ITP_LOCAL, node_port=3001, external_traffic_policy=LOCAL)
    fragment = render_own(port, LOCAL_AND_REMOTE).fragment
    assert rules_of(fragment, SVL) == [
        f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.0.0/8 {MASQ}",
        picks(EP1),
    ]
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
    port = service_port(protocol=protocol, node_port=3001, external_traffic_policy=LOCAL)
    fragment = render_own(port, REMOTE).fragment
    rules = rules_of(fragment, names.service_chain(port.name))
    assert rules[0] == f"ip daddr {CIP} {protocol.nft} dport 80 ip saddr != 10.0.0.0/8 {MASQ}"
    assert dispatch(fragment, labels(port))["service-ips"] == {
        (CIP, protocol.nft, 80): "goto SVC"}
    cluster_ip_only = replace(port, node_port=0)
    fragment = render(cluster_ip_only, REMOTE).fragment
    assert dispatch(fragment, labels(port))["service-ips"] == {
        (CIP, protocol.nft, 80): f"goto dispatch-{protocol.nft}-a-1"}
    assert shared_chooser_rules(cluster_ip_only) == [
        f"{CLUSTER_IPS}ip saddr != 10.0.0.0/8 {MASQ}", shared_dnat(1, protocol.nft)]
