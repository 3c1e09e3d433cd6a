"""One service port -> its fragment (nftproxy.core.rules.service), feature by feature.

Aspects, each in kube-proxy's words (docs/kube-proxy-semantics.md,
upstream-nftables-notes.md §1.5-§1.15), in ruleset v2's shapes:
- dispatch: which element lands in which map or set with which verdict
  (service-ips and friends, hairpin-endpoints, firewall-vips/-allow), and
  which chains exist (one table of sentence-named cases);
- masquerade decisions per local-traffic detector;
- the numgen cascade DNATs inline, uniform over the endpoints, in endpoint
  order; each rule names its endpoint by kube-proxy's KUBE-SEP-<h>;
- hairpin: an (endpoint . endpoint) element per reachable endpoint;
- session affinity (lookup, refresh, DNAT per endpoint before the cascade),
  source ranges (KUBE-FW-<h> in the firewall-vips comment), external and
  internal traffic policy Local, terminating endpoints;
- every private renderer has a test (meta-test at the end).

Rules are read through builders.text() (nft syntax; fails on unknown shapes).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import pytest
from builders import (
    CONFIG,
    NODE,
    chain_of,
    context,
    elements_of,
    endpoint,
    render,
    rules_of,
    service_port,
    text,
)

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    IPMode,
    L4Protocol,
    LoadBalancerIngress,
    NodeInfo,
    ServicePort,
    SessionAffinity,
    TrafficPolicy,
)
from nftproxy.core.nft.ops import Table
from nftproxy.core.rules import names
from nftproxy.core.rules import service as service_mod
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.fragment import Element, Fragment, Rule, Verdict
from nftproxy.core.rules.service import RenderContext, render_service_port

LOCAL = TrafficPolicy.LOCAL
EP1, EP2, EP3 = "10.180.0.1", "10.180.0.2", "10.180.0.3"
CIP = "172.30.0.41"
EIP = "192.168.99.22"
LB = "1.2.3.4"
MASQ = "jump KUBE-MARK-MASQ"


def to(ip: str, port: int = 80, protocol: str = "tcp") -> str:
    """What a cascade rule ends with when it sends to ip:port."""
    return f"meta l4proto {protocol} dnat to {ip}:{port}"


# --- labels: real chain names <-> the names cases are written in -------------


def labels(port: ServicePort) -> dict[str, str]:
    """Chain name -> short label: SVC, SVL, EXT (no KUBE-SEP/KUBE-FW chains in v2)."""
    spn = port.name
    return {
        names.service_chain(spn): "SVC",
        names.local_chain(spn): "SVL",
        names.external_chain(spn): "EXT",
        "KUBE-REJECT": "KUBE-REJECT",
    }


def verdict_label(v: Verdict | None, lab: Mapping[str, str]) -> str | None:
    if v is None:
        return None
    return f"{v.kind} {lab[v.target]}" if v.target else v.kind


def dispatch(fragment: Fragment, lab: Mapping[str, str]) -> dict[str, dict[tuple[Any, ...], Any]]:
    """set name -> {key: verdict label (None in plain sets)}, for every element."""
    out: dict[str, dict[tuple[Any, ...], Any]] = {}
    for e in fragment.elements:
        out.setdefault(e.set_name, {})[e.key] = verdict_label(e.verdict, lab)
    return out


# --- dispatch: one table of cases ---------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    port: ServicePort
    endpoints: tuple[Endpoint, ...]
    elements: Elements
    chains: frozenset[str]
    internal_dropped: bool = False
    external_dropped: bool = False
    config: ProxyConfig = field(default=CONFIG)


NODEPORT = service_port(node_port=3001)
EXTERNAL_IP = service_port(external_ips=(EIP,))
LB_PORT = service_port(
    node_port=3001,
    load_balancer_ingress=(LoadBalancerIngress(LB), LoadBalancerIngress("5.6.7.8", IPMode.PROXY)),
)
LB_RANGES = service_port(
    load_balancer_ingress=(LoadBalancerIngress(LB),),
    load_balancer_source_ranges=("203.0.113.0/25",),
)
ETP_LOCAL = service_port(
    node_port=3001,
    external_ips=(EIP,),
    load_balancer_ingress=(LoadBalancerIngress(LB),),
    external_traffic_policy=LOCAL,
)
ITP_LOCAL = service_port(internal_traffic_policy=LOCAL)
REMOTE = (endpoint(EP1),)
LOCAL_AND_REMOTE = (endpoint(EP1, local=True), endpoint(EP2))
Elements = dict[str, dict[tuple[Any, ...], Any]]
CLUSTER_IPS: Elements = {"cluster-ips": {(CIP,): None}}
SVC_CIP: Elements = {**CLUSTER_IPS, "service-ips": {(CIP, "tcp", 80): "goto SVC"}}
FIREWALLED: Elements = {
    "firewall-vips": {(LB, "tcp", 80): None},
    "firewall-allow": {(LB, "tcp", 80, "203.0.113.0/25"): None},
}


def hairpin(*ips: str) -> Elements:
    """The hairpin-endpoints elements of endpoints `ips` (each paired with itself)."""
    return {"hairpin-endpoints": {(ip, ip): None for ip in ips}}


DISPATCH_CASES = [
    Case(
        "cluster IP with endpoints goes to KUBE-SVC, is an active cluster IP, "
        "and its endpoint is a hairpin pair",
        service_port(), REMOTE, {**SVC_CIP, **hairpin(EP1)}, frozenset({"SVC"}),
    ),
    Case(
        "cluster IP without endpoints is rejected and gets no chains at all",
        service_port(), (),
        {**CLUSTER_IPS, "no-endpoint-services": {(CIP, "tcp", 80): "goto KUBE-REJECT"}},
        frozenset(),
    ),
    Case(
        "node port with eTP=Cluster goes to KUBE-EXT",
        NODEPORT, REMOTE,
        {**SVC_CIP, "service-nodeports": {("tcp", 3001): "goto EXT"}, **hairpin(EP1)},
        frozenset({"SVC", "EXT"}),
    ),
    Case(
        "node port without endpoints is rejected through no-endpoint-nodeports",
        NODEPORT, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {(CIP, "tcp", 80): "goto KUBE-REJECT"},
            "no-endpoint-nodeports": {("tcp", 3001): "goto KUBE-REJECT"},
        },
        frozenset(),
    ),
    Case(
        "external IP goes to KUBE-EXT",
        EXTERNAL_IP, REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {(CIP, "tcp", 80): "goto SVC", (EIP, "tcp", 80): "goto EXT"},
            **hairpin(EP1),
        },
        frozenset({"SVC", "EXT"}),
    ),
    Case(
        "external IP without endpoints is rejected like the cluster IP",
        EXTERNAL_IP, (),
        {**CLUSTER_IPS, "no-endpoint-services": {
            (CIP, "tcp", 80): "goto KUBE-REJECT", (EIP, "tcp", 80): "goto KUBE-REJECT"}},
        frozenset(),
    ),
    Case(
        "LB VIP goes to KUBE-EXT and an ipMode Proxy ingress is not captured",
        LB_PORT, REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {(CIP, "tcp", 80): "goto SVC", (LB, "tcp", 80): "goto EXT"},
            "service-nodeports": {("tcp", 3001): "goto EXT"},
            **hairpin(EP1),
        },
        frozenset({"SVC", "EXT"}),
    ),
    Case(
        "LB VIP and node port without endpoints are rejected, Proxy ingress still ignored",
        LB_PORT, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {
                (CIP, "tcp", 80): "goto KUBE-REJECT", (LB, "tcp", 80): "goto KUBE-REJECT"},
            "no-endpoint-nodeports": {("tcp", 3001): "goto KUBE-REJECT"},
        },
        frozenset(),
    ),
    Case(
        "LB VIP with source ranges is a firewall-vips element with its allowed ranges",
        LB_RANGES, REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {(CIP, "tcp", 80): "goto SVC", (LB, "tcp", 80): "goto EXT"},
            **FIREWALLED,
            **hairpin(EP1),
        },
        frozenset({"SVC", "EXT"}),
    ),
    Case(
        "LB VIP with source ranges and no endpoints is still firewalled, then rejected",
        LB_RANGES, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {
                (CIP, "tcp", 80): "goto KUBE-REJECT", (LB, "tcp", 80): "goto KUBE-REJECT"},
            **FIREWALLED,
        },
        frozenset(),
    ),
    Case(
        "eTP=Local with a local endpoint sends every external destination to KUBE-EXT",
        ETP_LOCAL, LOCAL_AND_REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {
                (CIP, "tcp", 80): "goto SVC", (EIP, "tcp", 80): "goto EXT",
                (LB, "tcp", 80): "goto EXT"},
            "service-nodeports": {("tcp", 3001): "goto EXT"},
            **hairpin(EP1, EP2),
        },
        frozenset({"SVC", "SVL", "EXT"}),
    ),
    Case(
        "eTP=Local without a local endpoint drops external destinations but keeps KUBE-EXT",
        ETP_LOCAL, REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {
                (CIP, "tcp", 80): "goto SVC", (EIP, "tcp", 80): "goto EXT",
                (LB, "tcp", 80): "goto EXT"},
            "service-nodeports": {("tcp", 3001): "goto EXT"},
            "no-endpoint-services": {(EIP, "tcp", 80): "drop", (LB, "tcp", 80): "drop"},
            "no-endpoint-nodeports": {("tcp", 3001): "drop"},
            **hairpin(EP1),
        },
        frozenset({"SVC", "EXT"}),
        external_dropped=True,
    ),
    Case(
        "eTP=Local with no endpoints anywhere rejects rather than drops",
        ETP_LOCAL, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {
                (CIP, "tcp", 80): "goto KUBE-REJECT", (EIP, "tcp", 80): "goto KUBE-REJECT",
                (LB, "tcp", 80): "goto KUBE-REJECT"},
            "no-endpoint-nodeports": {("tcp", 3001): "goto KUBE-REJECT"},
        },
        frozenset(),
    ),
    Case(
        "iTP=Local with a local endpoint sends the cluster IP to KUBE-SVL",
        ITP_LOCAL, LOCAL_AND_REMOTE,
        {**CLUSTER_IPS, "service-ips": {(CIP, "tcp", 80): "goto SVL"}, **hairpin(EP1)},
        frozenset({"SVL"}),
    ),
    Case(
        "iTP=Local without a local endpoint drops cluster IP traffic",
        ITP_LOCAL, REMOTE,
        {**CLUSTER_IPS, "no-endpoint-services": {(CIP, "tcp", 80): "drop"}},
        frozenset(),
        internal_dropped=True,
    ),
    Case(
        "iTP=Local with no endpoints anywhere rejects",
        ITP_LOCAL, (),
        {**CLUSTER_IPS, "no-endpoint-services": {(CIP, "tcp", 80): "goto KUBE-REJECT"}},
        frozenset(),
    ),
    Case(
        "iTP=Local does not affect node port traffic, which uses all endpoints",
        replace(ITP_LOCAL, node_port=3001), REMOTE,
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {(CIP, "tcp", 80): "drop"},
            "service-nodeports": {("tcp", 3001): "goto EXT"},
            **hairpin(EP1),
        },
        frozenset({"SVC", "EXT"}),
        internal_dropped=True,
    ),
    Case(
        "terminating endpoints serve when none is ready",
        service_port(), (endpoint(EP2, ready=False, terminating=True, serving=True),),
        {**SVC_CIP, **hairpin(EP2)}, frozenset({"SVC"}),
    ),
    Case(
        "terminating endpoints are ignored while one is ready",
        service_port(),
        (endpoint(EP1), endpoint(EP2, ready=False, terminating=True, serving=True)),
        {**SVC_CIP, **hairpin(EP1)}, frozenset({"SVC"}),
    ),
    Case(
        "non-serving terminating endpoints count as no endpoints",
        service_port(), (endpoint(EP2, ready=False, terminating=True, serving=False),),
        {**CLUSTER_IPS, "no-endpoint-services": {(CIP, "tcp", 80): "goto KUBE-REJECT"}},
        frozenset(),
    ),
    Case(
        "eTP=Local falls back to a local terminating endpoint for external traffic",
        replace(NODEPORT, external_traffic_policy=LOCAL),
        (endpoint(EP1), endpoint(EP2, local=True, ready=False, terminating=True, serving=True)),
        {**SVC_CIP, "service-nodeports": {("tcp", 3001): "goto EXT"}, **hairpin(EP1, EP2)},
        frozenset({"SVC", "SVL", "EXT"}),
    ),
]


@pytest.mark.parametrize("case", DISPATCH_CASES, ids=lambda c: c.id)
def test_dispatch(case: Case) -> None:
    rendered = render(case.port, case.endpoints, config=case.config)
    lab = labels(case.port)
    assert dispatch(rendered.fragment, lab) == case.elements
    assert {lab[c.name] for c in rendered.fragment.chains} == case.chains
    assert (rendered.internal_dropped, rendered.external_dropped) == (
        case.internal_dropped, case.external_dropped)


def test_only_session_affinity_declares_per_service_sets() -> None:
    """Source ranges, node ports and external IPs are elements of shared sets;
    only ClientIP affinity has sets of its own (one per endpoint)."""
    port = replace(LB_RANGES, node_port=3001, external_ips=(EIP,))
    assert render(port, REMOTE).fragment.sets == ()
    affinity = replace(port, session_affinity=SessionAffinity.CLIENT_IP)
    assert [s.name for s in render(affinity, REMOTE).fragment.sets] == [
        names.affinity_set(port.name, endpoint(EP1))]


# --- masquerade ------------------------------------------------------------------

SVC1 = service_port()
SVC = names.service_chain(SVC1.name)
SVL = names.local_chain(SVC1.name)
EXT = names.external_chain(SVC1.name)
FW = names.firewall_chain(SVC1.name)


def sep(ip: str, port: ServicePort = SVC1, number: int = 80) -> str:
    """kube-proxy's KUBE-SEP-<h> of endpoint ip:number of `port`."""
    return names.endpoint_chain(port.name, endpoint(ip, number))


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
    fragment = render(SVC1, REMOTE, config=config).fragment
    assert rules_of(fragment, SVC) == [masq_rule, to(EP1)]


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
    fragment = render(SVC1, REMOTE, config=config).fragment
    assert rules_of(fragment, SVC) == [to(EP1)]


def test_without_a_detector_masquerade_all_still_masquerades() -> None:
    config = replace(CONFIG, cluster_cidrs=(), masquerade_all=True)
    fragment = render(SVC1, REMOTE, config=config).fragment
    assert rules_of(fragment, SVC)[0] == f"ip daddr {CIP} tcp dport 80 {MASQ}"


def test_node_cidr_detector_without_pod_cidr_is_no_detector() -> None:
    config = replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR)
    node = replace(NODE, pod_cidrs=())
    fragment = render(SVC1, REMOTE, config=config, node=node).fragment
    assert rules_of(fragment, SVC) == [to(EP1)]


def test_itp_local_masquerade_rule_lives_in_kube_svl() -> None:
    fragment = render(ITP_LOCAL, LOCAL_AND_REMOTE).fragment
    assert rules_of(fragment, SVL) == [
        f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.0.0/8 {MASQ}",
        to(EP1),
    ]


def test_itp_local_with_external_access_keeps_kube_svc_free_of_the_cluster_ip_rule() -> None:
    port = replace(ITP_LOCAL, node_port=3001)
    fragment = render(port, LOCAL_AND_REMOTE).fragment
    assert all("ip daddr" not in r for r in rules_of(fragment, SVC))
    assert rules_of(fragment, SVL)[0].endswith(MASQ)


# --- the cascade: inline DNAT ------------------------------------------------------


def _dnat_to(rule: Rule) -> str:
    """The ip:port ([ip6]:port) the rule DNATs to; every chooser rule has one."""
    (dnat,) = [s["dnat"] for s in rule.expr if "dnat" in s]
    addr = dnat["addr"]
    return f"{f'[{addr}]' if ':' in addr else addr}:{dnat['port']}"


def _probabilities(rules: list[Rule]) -> dict[str, Fraction]:
    """Chance of being DNATed to each endpoint, reading each rule's numgen match:
    `numgen random mod m == 0` matches with probability 1/m, no match means 1."""
    reach, out = Fraction(1), dict[str, Fraction]()
    for rule in rules:
        p = Fraction(1)
        for s in rule.expr:
            if "match" in s and "numgen" in s["match"]["left"]:
                assert s["match"]["right"] == 0 and s["match"]["op"] == "=="
                p = Fraction(1, s["match"]["left"]["numgen"]["mod"])
        target = _dnat_to(rule)
        out[target] = out.get(target, Fraction(0)) + reach * p
        reach *= 1 - p
    assert reach == 0, "the last rule of the cascade must always match"
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_cascade_picks_each_endpoint_with_probability_one_over_n(n: int) -> None:
    eps = tuple(endpoint(f"10.180.0.{i + 1}") for i in range(n))
    fragment = render(SVC1, eps).fragment
    cascade = list(chain_of(fragment, SVC).rules[1:])  # after the masquerade rule
    assert [text(r) for r in cascade] == [
        *(f"numgen random mod {n - i} 0 {to(ep.ip)}" for i, ep in enumerate(eps[:-1])),
        to(eps[-1].ip),
    ]
    assert _probabilities(cascade) == {ep.address: Fraction(1, n) for ep in eps}
    assert [r.comment for r in cascade] == [
        f"ns1/svc1:p80 -> {ep.address} {sep(ep.ip)}" for ep in eps]


def test_cascade_follows_endpoint_order_not_arrival_order() -> None:
    eps = (endpoint(EP3), endpoint(EP1), endpoint(EP2))
    fragment = render(SVC1, eps).fragment
    cascade = chain_of(fragment, SVC).rules[1:]
    assert [_dnat_to(r) for r in cascade] == [f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"]
    assert [str(r.comment).split()[-1] for r in cascade] == [sep(EP1), sep(EP2), sep(EP3)]


@pytest.mark.parametrize(
    ("protocol", "dnat_rule"),
    [
        pytest.param(L4Protocol.TCP, f"meta l4proto tcp dnat to {EP1}:8080", id="TCP"),
        pytest.param(L4Protocol.UDP, f"meta l4proto udp dnat to {EP1}:8080", id="UDP"),
        pytest.param(L4Protocol.SCTP, f"meta l4proto sctp dnat to {EP1}:8080", id="SCTP"),
    ],
)
def test_endpoint_rule_dnats_with_the_service_protocol(
    protocol: L4Protocol, dnat_rule: str
) -> None:
    """The DNAT is inline in KUBE-SVC; no rule marks hairpin traffic any more
    (KUBE-POSTROUTING does, from hairpin-endpoints) and no KUBE-SEP chain exists."""
    port = service_port(protocol=protocol)
    ep = endpoint(EP1, 8080)
    fragment = render(port, (ep,)).fragment
    assert rules_of(fragment, names.service_chain(port.name))[1:] == [dnat_rule]
    assert {c.name for c in fragment.chains} == {names.service_chain(port.name)}
    assert elements_of(fragment, "hairpin-endpoints") == {(EP1, EP1): None}


def test_endpoint_comments_name_the_endpoint_by_its_kube_sep_identity() -> None:
    eps = (endpoint(EP1), endpoint(EP2, 8080))
    fragment = render(AFFINITY, eps).fragment
    spn, (sep1, sep2) = AFFINITY.name, (sep(EP1, AFFINITY), sep(EP2, AFFINITY, 8080))
    assert [r.comment for r in chain_of(fragment, SVC).rules[1:]] == [
        f"{spn} -> {EP1}:80 affinity {sep1}",
        f"{spn} -> {EP2}:8080 affinity {sep2}",
        f"{spn} -> {EP1}:80 {sep1}",
        f"{spn} -> {EP2}:8080 {sep2}",
    ]


def test_endpoint_comments_of_a_maximal_service_keep_the_kube_sep_tag_within_128_bytes() -> None:
    port = service_port("s" * 63, ns="n" * 63, port_name="p" * 15, family=IPFamily.IPV6,
                        session_affinity=SessionAffinity.CLIENT_IP)
    eps = (endpoint("fd00:10:180::ffff:ffff", 65535), endpoint("fd00:10:180::2"))
    fragment = render(port, eps).fragment
    rules = chain_of(fragment, names.service_chain(port.name)).rules[1:]
    comments = [str(r.comment) for r in rules]
    tags = [names.endpoint_chain(port.name, Endpoint(*_split(_dnat_to(r)))) for r in rules]
    assert tags[:2] == tags[2:]  # the affinity rules, then the cascade, in one order
    assert set(tags) == {names.endpoint_chain(port.name, ep) for ep in eps}
    assert all(len(c.encode()) <= names.COMMENT_MAX_BYTES for c in comments)
    assert all(c.endswith(" " + tag) for c, tag in zip(comments, tags, strict=True))
    assert all(c.startswith(str(port.name)[:60]) for c in comments)  # still readable
    assert len(set(comments)) == len(comments)  # affinity and cascade rules stay distinct


def _split(address: str) -> tuple[str, int]:
    """"ip:port" / "[ip6]:port" -> (ip, port)."""
    ip, _, port = address.rpartition(":")
    return ip.strip("[]"), int(port)


@pytest.mark.parametrize("protocol", [L4Protocol.UDP, L4Protocol.SCTP], ids=lambda p: p.value)
def test_masquerade_rule_matches_the_service_protocol(protocol: L4Protocol) -> None:
    port = service_port(protocol=protocol)
    fragment = render(port, REMOTE).fragment
    rules = rules_of(fragment, names.service_chain(port.name))
    assert rules[0] == f"ip daddr {CIP} {protocol.nft} dport 80 ip saddr != 10.0.0.0/8 {MASQ}"
    assert dispatch(fragment, labels(port))["service-ips"] == {
        (CIP, protocol.nft, 80): "goto SVC"}


# --- hairpin ---------------------------------------------------------------------


def test_hairpin_elements_pair_each_reachable_endpoint_with_itself() -> None:
    """kube-proxy masquerades a connection whose client is the endpoint it was
    sent to: every endpoint a chooser can DNAT to is an (ep . ep) element,
    which the skeleton's first KUBE-POSTROUTING rule matches after DNAT."""
    eps = (endpoint(EP3, local=True), endpoint(EP1),
           endpoint(EP2, ready=False, terminating=True, serving=True))  # unused: EP1 is ready
    fragment = render(ETP_LOCAL, eps).fragment
    assert elements_of(fragment, "hairpin-endpoints") == {(EP1, EP1): None, (EP3, EP3): None}
    everything = [r for c in fragment.chains for r in (text(x) for x in c.rules)]
    assert not any(ip in r and r.endswith(MASQ) for r in everything for ip in (EP1, EP2, EP3))
    skeleton = sk.render_skeleton(IPFamily.IPV4, CONFIG, NODE)
    (decl,) = [s for s in skeleton.sets if s.name == "hairpin-endpoints"]
    assert decl.key == ("ip saddr", "ip daddr")
    assert rules_of(skeleton, "KUBE-POSTROUTING")[0] == (
        "ct status dnat ip saddr . ip daddr @hairpin-endpoints meta mark set meta mark | 0x4000")


def test_one_element_per_endpoint_ip_however_many_of_its_ports_serve() -> None:
    eps = (endpoint(EP1, 8080), endpoint(EP1, 9090), endpoint(EP2))
    fragment = render(SVC1, eps).fragment
    assert [e.key for e in fragment.elements if e.set_name == "hairpin-endpoints"] == [
        (EP1, EP1), (EP2, EP2)]


# --- IPv6 ------------------------------------------------------------------------


def test_ipv6_port_renders_ip6_matches_and_ipv6_addresses() -> None:
    port = service_port(family=IPFamily.IPV6, node_port=3001)
    ep = endpoint("fd00:10:180::1")
    fragment = render(port, (ep,)).fragment
    cip = "fd00:172:30::41"
    assert dispatch(fragment, labels(port)) == {
        "cluster-ips": {(cip,): None},
        "service-ips": {(cip, "tcp", 80): "goto SVC"},
        "service-nodeports": {("tcp", 3001): "goto EXT"},
        **hairpin("fd00:10:180::1"),
    }
    assert rules_of(fragment, names.service_chain(port.name)) == [
        f"ip6 daddr {cip} tcp dport 80 ip6 saddr != fd00:10::/48 {MASQ}",
        "meta l4proto tcp dnat to [fd00:10:180::1]:80",
    ]
    assert chain_of(fragment, names.service_chain(port.name)).rules[1].comment == (
        f"ns1/svc1:p80 -> [fd00:10:180::1]:80 {names.endpoint_chain(port.name, ep)}")
    assert fragment.family is IPFamily.IPV6


def test_ipv6_affinity_sets_hold_ipv6_addresses() -> None:
    port = service_port(family=IPFamily.IPV6, session_affinity=SessionAffinity.CLIENT_IP)
    ep = endpoint("fd00:10:180::1")
    fragment = render(port, (ep,)).fragment
    (decl,) = fragment.sets
    assert decl.type == ("ipv6_addr",)
    assert rules_of(fragment, names.service_chain(port.name))[1:] == [
        f"ip6 saddr @{decl.name} update @{decl.name} {{ ip6 saddr }} "
        "meta l4proto tcp dnat to [fd00:10:180::1]:80",
        f"update @{decl.name} {{ ip6 saddr }} meta l4proto tcp dnat to [fd00:10:180::1]:80",
    ]


# --- session affinity ------------------------------------------------------------

AFFINITY = service_port(session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=600)


def test_affinity_declares_one_dynamic_timeout_set_per_endpoint() -> None:
    eps = (endpoint(EP1), endpoint(EP2))
    fragment = render(AFFINITY, eps).fragment
    assert {s.name for s in fragment.sets} == {
        names.affinity_set(AFFINITY.name, ep) for ep in eps}
    for decl in fragment.sets:
        assert decl.type == ("ipv4_addr",)
        assert decl.key == ("ip saddr",)
        assert decl.map is None
        assert "timeout" in decl.flags
        assert decl.timeout == 600
        assert decl.dynamic
        assert decl.elements == ()


def test_affinity_default_timeout_is_three_hours() -> None:
    port = service_port(session_affinity=SessionAffinity.CLIENT_IP)
    (decl,) = render(port, REMOTE).fragment.sets
    assert decl.timeout == 10800


def test_every_rule_that_dnats_records_the_client_for_affinity_first() -> None:
    """kube-proxy's KUBE-SEP chain did `update @affinity { ip saddr }` before
    DNAT whichever way it was reached: the affinity hit refreshes the timeout,
    the cascade pick starts it."""
    port = service_port(session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, REMOTE).fragment
    aff = names.affinity_set(port.name, endpoint(EP1))
    assert rules_of(fragment, SVC)[1:] == [
        f"ip saddr @{aff} update @{aff} {{ ip saddr }} {to(EP1)}",
        f"update @{aff} {{ ip saddr }} {to(EP1)}",
    ]


def test_affinity_lookups_come_after_masquerade_and_before_the_cascade() -> None:
    eps = (endpoint(EP1), endpoint(EP2))
    fragment = render(AFFINITY, eps).fragment
    aff1, aff2 = (names.affinity_set(AFFINITY.name, ep) for ep in eps)
    assert rules_of(fragment, SVC) == [
        f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.0.0/8 {MASQ}",
        f"ip saddr @{aff1} update @{aff1} {{ ip saddr }} {to(EP1)}",
        f"ip saddr @{aff2} update @{aff2} {{ ip saddr }} {to(EP2)}",
        f"numgen random mod 2 0 update @{aff1} {{ ip saddr }} {to(EP1)}",
        f"update @{aff2} {{ ip saddr }} {to(EP2)}",
    ]
    cascade = list(chain_of(fragment, SVC).rules[3:])
    assert _probabilities(cascade) == {f"{EP1}:80": Fraction(1, 2), f"{EP2}:80": Fraction(1, 2)}


def test_affinity_in_kube_svl_looks_up_local_endpoints_only() -> None:
    port = replace(ITP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, LOCAL_AND_REMOTE).fragment
    aff1 = names.affinity_set(port.name, endpoint(EP1))
    assert rules_of(fragment, SVL)[1:] == [
        f"ip saddr @{aff1} update @{aff1} {{ ip saddr }} {to(EP1)}",
        f"update @{aff1} {{ ip saddr }} {to(EP1)}",
    ]
    assert {s.name for s in fragment.sets} == {aff1}


def test_without_affinity_there_are_no_lookups_nor_updates() -> None:
    fragment = render(SVC1, (endpoint(EP1), endpoint(EP2))).fragment
    assert not any("@" in r for c in fragment.chains for r in (text(x) for x in c.rules))
    assert fragment.sets == ()


# --- KUBE-EXT --------------------------------------------------------------------


def test_etp_cluster_external_chain_masquerades_then_goes_to_kube_svc() -> None:
    fragment = render(NODEPORT, REMOTE).fragment
    assert rules_of(fragment, EXT) == [MASQ, f"goto {SVC}"]


def test_etp_local_external_chain_short_circuits_pods_and_host() -> None:
    fragment = render(ETP_LOCAL, LOCAL_AND_REMOTE).fragment
    assert rules_of(fragment, EXT) == [
        f"ip saddr 10.0.0.0/8 goto {SVC}",
        f"fib saddr type local {MASQ}",
        f"fib saddr type local goto {SVC}",
        f"goto {SVL}",
    ]


def test_etp_local_local_chain_contains_only_local_endpoints() -> None:
    eps = (endpoint(EP1, local=True), endpoint(EP2), endpoint(EP3, local=True))
    fragment = render(ETP_LOCAL, eps).fragment
    assert rules_of(fragment, SVL) == [f"numgen random mod 2 0 {to(EP1)}", to(EP3)]
    # KUBE-SVC (pods, host) still balances over every endpoint
    assert [_dnat_to(r) for r in chain_of(fragment, SVC).rules[1:]] == [
        f"{EP1}:80", f"{EP2}:80", f"{EP3}:80"]


def test_etp_local_local_chain_has_no_cluster_ip_masquerade_rule() -> None:
    fragment = render(ETP_LOCAL, LOCAL_AND_REMOTE).fragment
    assert not any(r.endswith(MASQ) for r in rules_of(fragment, SVL))


def test_etp_local_without_local_endpoints_has_no_goto_kube_svl() -> None:
    fragment = render(ETP_LOCAL, REMOTE).fragment
    assert rules_of(fragment, EXT) == [
        f"ip saddr 10.0.0.0/8 goto {SVC}",
        f"fib saddr type local {MASQ}",
        f"fib saddr type local goto {SVC}",
    ]


def test_etp_local_without_a_detector_loses_the_pod_short_circuit() -> None:
    config = replace(CONFIG, cluster_cidrs=())
    fragment = render(ETP_LOCAL, LOCAL_AND_REMOTE, config=config).fragment
    assert rules_of(fragment, EXT) == [
        f"fib saddr type local {MASQ}",
        f"fib saddr type local goto {SVC}",
        f"goto {SVL}",
    ]


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
    fragment = render(ETP_LOCAL, LOCAL_AND_REMOTE, config=config).fragment
    assert rules_of(fragment, EXT)[0] == short_circuit


def test_etp_local_without_external_access_is_plain_cluster_ip() -> None:
    port = service_port(external_traffic_policy=LOCAL)
    fragment = render(port, REMOTE).fragment
    assert {c.name for c in fragment.chains} == {SVC}
    assert set(dispatch(fragment, labels(port))) == {
        "cluster-ips", "service-ips", "hairpin-endpoints"}


# --- loadBalancerSourceRanges: firewall-vips / firewall-allow ----------------------


def _firewall(fragment: Fragment) -> tuple[dict[Any, str | None], list[Any]]:
    """(firewall-vips key -> comment, firewall-allow keys in fragment order)."""
    vips = {e.key: e.comment for e in fragment.elements if e.set_name == "firewall-vips"}
    allow = [e.key for e in fragment.elements if e.set_name == "firewall-allow"]
    for e in fragment.elements:
        if e.set_name in ("firewall-vips", "firewall-allow"):
            assert e.verdict is None  # plain sets: the check is the skeleton's one rule
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
    assert add_vips["add"]["element"]["elem"] == [
        {"elem": {"val": {"concat": [LB, "tcp", 80]}, "comment": f"{FW} ns1/svc1:p80"}}]
    assert add_allow["add"]["element"]["elem"] == [
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
    assert node_ip[0]["add"]["element"]["elem"] == [{"concat": [LB, "tcp", 80, LB]}]


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
    assert elements_of(fragment, "service-nodeports") == {("tcp", 3001): Verdict("goto", EXT)}


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
    assert add["add"]["element"]["elem"] == [
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
    assert all(e.comment == str(port.name) for e in fragment.elements if e.verdict is not None)
    assert [e.comment for e in fragment.elements if e.set_name == "firewall-vips"] == [
        f"{names.firewall_chain(port.name)} {port.name}"]


def test_render_context_is_honoured_for_the_family() -> None:
    ctx = RenderContext(IPFamily.IPV6, CONFIG, NodeInfo("node-a"), None)
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
    for fragment in (render(port, eps).fragment, sk.render_skeleton(family, CONFIG, NODE)):
        assert all(text(r) for c in fragment.chains for r in c.rules)


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


# --- meta-test: every renderer has a test ------------------------------------

RENDERER_TESTS = {
    "_cluster_ip_elements": "test_dispatch",
    "_external_elements": "test_dispatch",
    "_nodeport_elements": "test_dispatch",
    "_masquerade_rule": "test_cluster_ip_masquerade_rule_comes_first_in_kube_svc",
    "_endpoint_tail": "test_endpoint_rule_dnats_with_the_service_protocol",
    "_endpoint_comment": "test_endpoint_comments_name_the_endpoint_by_its_kube_sep_identity",
    "_chooser_rules": "test_cascade_picks_each_endpoint_with_probability_one_over_n",
    "_policy_chains": "test_etp_local_local_chain_contains_only_local_endpoints",
    "_external_chain": "test_etp_local_external_chain_short_circuits_pods_and_host",
    "_firewall_elements": "test_source_ranges_are_firewall_vips_and_firewall_allow_elements",
    "_hairpin_elements": "test_hairpin_elements_pair_each_reachable_endpoint_with_itself",
    "_affinity_sets": "test_affinity_declares_one_dynamic_timeout_set_per_endpoint",
}
HELPERS = {"_key", "_contains_any", "_merge", "_net"}
RENDERED = ("Chain", "Element", "Rule", "SetDecl", "Json")
"""What a renderer returns (in its annotation); a helper returns none of these."""


def test_every_private_renderer_has_a_test() -> None:
    """A new renderer in rules/service.py must be added here with its test."""
    private = {
        name for name, fn in inspect.getmembers(service_mod, inspect.isfunction)
        if name.startswith("_") and fn.__module__ == service_mod.__name__
    }
    renderers = {
        name for name in private
        if any(t in str(inspect.signature(getattr(service_mod, name)).return_annotation)
               for t in RENDERED)
    }
    assert renderers <= set(RENDERER_TESTS)
    assert not renderers & HELPERS
    assert private == set(RENDERER_TESTS) | HELPERS
    for test_name in RENDERER_TESTS.values():
        assert callable(globals().get(test_name)), test_name
