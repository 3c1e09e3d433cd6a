"""One service port -> its fragment (nftproxy.core.rules.service), feature by feature.

Aspects, each in kube-proxy's words (docs/kube-proxy-semantics.md,
upstream-nftables-notes.md §1.5-§1.15):
- dispatch: which element lands in which map with which verdict, and which
  chains exist (one table of sentence-named cases);
- masquerade decisions per local-traffic detector;
- the numgen cascade is uniform over the endpoints, in endpoint order;
- KUBE-SEP: hairpin, affinity update, DNAT per protocol and family;
- session affinity, source ranges, external/internal traffic policy Local,
  terminating endpoints;
- every private renderer has a test (meta-test at the end).

Rules are read through `text()`, a small nft-syntax printer that knows only
the statement shapes the renderers emit and fails loudly on anything else,
so the assertions say what a rule does rather than how its JSON is spelled.
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
    service_port,
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
from nftproxy.core.rules import names
from nftproxy.core.rules import service as service_mod
from nftproxy.core.rules.fragment import Fragment, Rule, Verdict
from nftproxy.core.rules.service import RenderContext, render_service_port

LOCAL = TrafficPolicy.LOCAL
EP1, EP2, EP3 = "10.180.0.1", "10.180.0.2", "10.180.0.3"
CIP = "172.30.0.41"
EIP = "192.168.99.22"
LB = "1.2.3.4"
MASQ = "jump KUBE-MARK-MASQ"


# --- reading rules -----------------------------------------------------------


def _value(v: Any) -> str:
    if isinstance(v, dict):
        if "payload" in v:
            return f"{v['payload']['protocol']} {v['payload']['field']}"
        if "meta" in v:
            key = v["meta"]["key"]
            return key if key == "iifname" else f"meta {key}"
        if "fib" in v:
            return f"fib {' . '.join(v['fib']['flags'])} {v['fib']['result']}"
        if "numgen" in v:
            return f"numgen {v['numgen']['mode']} mod {v['numgen']['mod']}"
        if "prefix" in v:
            return f"{v['prefix']['addr']}/{v['prefix']['len']}"
        if "set" in v:
            return "{ " + ", ".join(_value(x) for x in v["set"]) + " }"
    if isinstance(v, str | int):
        return str(v)
    raise AssertionError(f"text() does not know the expression {v!r}")


def _statement(s: Mapping[str, Any]) -> str:
    (kind, body), = s.items()
    if kind == "match":
        op = "" if body["op"] == "==" else body["op"] + " "
        return f"{_value(body['left'])} {op}{_value(body['right'])}"
    if kind in ("jump", "goto"):
        return f"{kind} {body['target']}"
    if kind in ("drop", "accept", "return"):
        return kind
    if kind == "dnat":
        addr = body["addr"]
        return f"dnat to {f'[{addr}]' if ':' in addr else addr}:{body['port']}"
    if kind == "set":
        return f"{body['op']} {body['set']} {{ {_value(body['elem'])} }}"
    raise AssertionError(f"text() does not know the statement {s!r}")


def text(rule: Rule) -> str:
    """A rule in nft syntax, e.g. `ip saddr != 10.0.0.0/8 jump KUBE-MARK-MASQ`."""
    return " ".join(_statement(s) for s in rule.expr)


def rules_of(fragment: Fragment, chain: str) -> list[str]:
    return [text(r) for r in chain_of(fragment, chain).rules]


# --- labels: real chain names <-> the names cases are written in -------------


def labels(port: ServicePort, endpoints: tuple[Endpoint, ...]) -> dict[str, str]:
    """Chain name -> short label: SVC, SVL, EXT, FW, and "SEP <ip:port>"."""
    spn = port.name
    out = {
        names.service_chain(spn): "SVC",
        names.local_chain(spn): "SVL",
        names.external_chain(spn): "EXT",
        names.firewall_chain(spn): "FW",
        "KUBE-REJECT": "KUBE-REJECT",
    }
    out.update({names.endpoint_chain(spn, ep): f"SEP {ep.address}" for ep in endpoints})
    return out


def verdict_label(v: Verdict | None, lab: Mapping[str, str]) -> str | None:
    if v is None:
        return None
    return f"{v.kind} {lab[v.target]}" if v.target else v.kind


def dispatch(fragment: Fragment, lab: Mapping[str, str]) -> dict[str, dict[tuple[Any, ...], Any]]:
    """set name -> {key: verdict label}, for every element of the fragment."""
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

DISPATCH_CASES = [
    Case(
        "cluster IP with endpoints goes to KUBE-SVC and is an active cluster IP",
        service_port(), REMOTE, SVC_CIP, frozenset({"SVC", f"SEP {EP1}:80"}),
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
        {**SVC_CIP, "service-nodeports": {("tcp", 3001): "goto EXT"}},
        frozenset({"SVC", "EXT", f"SEP {EP1}:80"}),
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
        },
        frozenset({"SVC", "EXT", f"SEP {EP1}:80"}),
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
        },
        frozenset({"SVC", "EXT", f"SEP {EP1}:80"}),
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
        "LB VIP with source ranges is checked by KUBE-FW before DNAT",
        LB_RANGES, REMOTE,
        {
            **CLUSTER_IPS,
            "service-ips": {(CIP, "tcp", 80): "goto SVC", (LB, "tcp", 80): "goto EXT"},
            "firewall-ips": {(LB, "tcp", 80): "goto FW"},
        },
        frozenset({"SVC", "EXT", "FW", f"SEP {EP1}:80"}),
    ),
    Case(
        "LB VIP with source ranges and no endpoints is still firewalled, then rejected",
        LB_RANGES, (),
        {
            **CLUSTER_IPS,
            "no-endpoint-services": {
                (CIP, "tcp", 80): "goto KUBE-REJECT", (LB, "tcp", 80): "goto KUBE-REJECT"},
            "firewall-ips": {(LB, "tcp", 80): "goto FW"},
        },
        frozenset({"FW"}),
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
        },
        frozenset({"SVC", "SVL", "EXT", f"SEP {EP1}:80", f"SEP {EP2}:80"}),
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
        },
        frozenset({"SVC", "EXT", f"SEP {EP1}:80"}),
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
        {**CLUSTER_IPS, "service-ips": {(CIP, "tcp", 80): "goto SVL"}},
        frozenset({"SVL", f"SEP {EP1}:80"}),
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
        },
        frozenset({"SVC", "EXT", f"SEP {EP1}:80"}),
        internal_dropped=True,
    ),
    Case(
        "terminating endpoints serve when none is ready",
        service_port(), (endpoint(EP2, ready=False, terminating=True, serving=True),),
        SVC_CIP, frozenset({"SVC", f"SEP {EP2}:80"}),
    ),
    Case(
        "terminating endpoints are ignored while one is ready",
        service_port(),
        (endpoint(EP1), endpoint(EP2, ready=False, terminating=True, serving=True)),
        SVC_CIP, frozenset({"SVC", f"SEP {EP1}:80"}),
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
        {**SVC_CIP, "service-nodeports": {("tcp", 3001): "goto EXT"}},
        frozenset({"SVC", "SVL", "EXT", f"SEP {EP1}:80", f"SEP {EP2}:80"}),
    ),
]


@pytest.mark.parametrize("case", DISPATCH_CASES, ids=lambda c: c.id)
def test_dispatch(case: Case) -> None:
    rendered = render(case.port, case.endpoints, config=case.config)
    lab = labels(case.port, case.endpoints)
    assert dispatch(rendered.fragment, lab) == case.elements
    assert {lab[c.name] for c in rendered.fragment.chains} == case.chains
    assert (rendered.internal_dropped, rendered.external_dropped) == (
        case.internal_dropped, case.external_dropped)


def test_fragment_has_no_sets_without_affinity_or_source_ranges() -> None:
    rendered = render(service_port(node_port=3001, external_ips=(EIP,)), REMOTE)
    assert rendered.fragment.sets == ()


# --- masquerade ------------------------------------------------------------------

SVC1 = service_port()
SVC = names.service_chain(SVC1.name)
SVL = names.local_chain(SVC1.name)
EXT = names.external_chain(SVC1.name)
FW = names.firewall_chain(SVC1.name)


def sep(ip: str, port: ServicePort = SVC1) -> str:
    return names.endpoint_chain(port.name, endpoint(ip))


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
    assert rules_of(fragment, SVC) == [masq_rule, f"goto {sep(EP1)}"]


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
    assert rules_of(fragment, SVC) == [f"goto {sep(EP1)}"]


def test_without_a_detector_masquerade_all_still_masquerades() -> None:
    config = replace(CONFIG, cluster_cidrs=(), masquerade_all=True)
    fragment = render(SVC1, REMOTE, config=config).fragment
    assert rules_of(fragment, SVC)[0] == f"ip daddr {CIP} tcp dport 80 {MASQ}"


def test_node_cidr_detector_without_pod_cidr_is_no_detector() -> None:
    config = replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR)
    node = replace(NODE, pod_cidrs=())
    fragment = render(SVC1, REMOTE, config=config, node=node).fragment
    assert rules_of(fragment, SVC) == [f"goto {sep(EP1)}"]


def test_itp_local_masquerade_rule_lives_in_kube_svl() -> None:
    fragment = render(ITP_LOCAL, LOCAL_AND_REMOTE).fragment
    assert rules_of(fragment, SVL) == [
        f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.0.0/8 {MASQ}",
        f"goto {sep(EP1)}",
    ]


def test_itp_local_with_external_access_keeps_kube_svc_free_of_the_cluster_ip_rule() -> None:
    port = replace(ITP_LOCAL, node_port=3001)
    fragment = render(port, LOCAL_AND_REMOTE).fragment
    assert all("ip daddr" not in r for r in rules_of(fragment, SVC))
    assert rules_of(fragment, SVL)[0].endswith(MASQ)


# --- the cascade ---------------------------------------------------------------


def _probabilities(rules: list[Rule]) -> dict[str, Fraction]:
    """Chance of reaching each goto target, reading each rule's numgen match:
    `numgen random mod m == 0` matches with probability 1/m, no match means 1."""
    reach, out = Fraction(1), dict[str, Fraction]()
    for rule in rules:
        p = Fraction(1)
        for s in rule.expr:
            if "match" in s and "numgen" in s["match"]["left"]:
                assert s["match"]["right"] == 0 and s["match"]["op"] == "=="
                p = Fraction(1, s["match"]["left"]["numgen"]["mod"])
        target = next(s["goto"]["target"] for s in rule.expr if "goto" in s)
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
        *(f"numgen random mod {n - i} 0 goto {sep(ep.ip)}" for i, ep in enumerate(eps[:-1])),
        f"goto {sep(eps[-1].ip)}",
    ]
    assert _probabilities(cascade) == {sep(ep.ip): Fraction(1, n) for ep in eps}


def test_cascade_follows_endpoint_order_not_arrival_order() -> None:
    eps = (endpoint(EP3), endpoint(EP1), endpoint(EP2))
    fragment = render(SVC1, eps).fragment
    targets = [text(r).split()[-1] for r in chain_of(fragment, SVC).rules[1:]]
    assert targets == [sep(EP1), sep(EP2), sep(EP3)]


# --- KUBE-SEP ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("protocol", "dnat_rule"),
    [
        pytest.param(L4Protocol.TCP, f"meta l4proto tcp dnat to {EP1}:8080", id="TCP"),
        pytest.param(L4Protocol.UDP, f"meta l4proto udp dnat to {EP1}:8080", id="UDP"),
        pytest.param(L4Protocol.SCTP, f"meta l4proto sctp dnat to {EP1}:8080", id="SCTP"),
    ],
)
def test_endpoint_chain_marks_hairpin_then_dnats(protocol: L4Protocol, dnat_rule: str) -> None:
    port = service_port(protocol=protocol)
    ep = endpoint(EP1, 8080)
    fragment = render(port, (ep,)).fragment
    assert rules_of(fragment, names.endpoint_chain(port.name, ep)) == [
        f"ip saddr {EP1} {MASQ}",
        dnat_rule,
    ]


@pytest.mark.parametrize("protocol", [L4Protocol.UDP, L4Protocol.SCTP], ids=lambda p: p.value)
def test_masquerade_rule_matches_the_service_protocol(protocol: L4Protocol) -> None:
    port = service_port(protocol=protocol)
    fragment = render(port, REMOTE).fragment
    rules = rules_of(fragment, names.service_chain(port.name))
    assert rules[0] == f"ip daddr {CIP} {protocol.nft} dport 80 ip saddr != 10.0.0.0/8 {MASQ}"
    assert dispatch(fragment, labels(port, REMOTE))["service-ips"] == {
        (CIP, protocol.nft, 80): "goto SVC"}


def test_endpoint_chain_records_the_client_for_affinity_before_dnat() -> None:
    port = service_port(session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, REMOTE).fragment
    aff = names.affinity_set(port.name, endpoint(EP1))
    assert rules_of(fragment, sep(EP1)) == [
        f"ip saddr {EP1} {MASQ}",
        f"update @{aff} {{ ip saddr }}",
        f"meta l4proto tcp dnat to {EP1}:80",
    ]


# --- IPv6 ------------------------------------------------------------------------


def test_ipv6_port_renders_ip6_matches_and_ipv6_addresses() -> None:
    port = service_port(family=IPFamily.IPV6, node_port=3001)
    ep = endpoint("fd00:10:180::1")
    fragment = render(port, (ep,)).fragment
    cip = "fd00:172:30::41"
    assert dispatch(fragment, labels(port, (ep,))) == {
        "cluster-ips": {(cip,): None},
        "service-ips": {(cip, "tcp", 80): "goto SVC"},
        "service-nodeports": {("tcp", 3001): "goto EXT"},
    }
    assert rules_of(fragment, names.service_chain(port.name)) == [
        f"ip6 daddr {cip} tcp dport 80 ip6 saddr != fd00:10::/48 {MASQ}",
        f"goto {names.endpoint_chain(port.name, ep)}",
    ]
    assert rules_of(fragment, names.endpoint_chain(port.name, ep)) == [
        f"ip6 saddr fd00:10:180::1 {MASQ}",
        "meta l4proto tcp dnat to [fd00:10:180::1]:80",
    ]
    assert fragment.family is IPFamily.IPV6


def test_ipv6_affinity_sets_hold_ipv6_addresses() -> None:
    port = service_port(family=IPFamily.IPV6, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, (endpoint("fd00:10:180::1"),)).fragment
    (decl,) = fragment.sets
    assert decl.type == ("ipv6_addr",)
    assert "ip6 saddr" in rules_of(fragment, names.service_chain(port.name))[1]


# --- session affinity ------------------------------------------------------------

AFFINITY = service_port(session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=600)


def test_affinity_declares_one_dynamic_timeout_set_per_endpoint() -> None:
    eps = (endpoint(EP1), endpoint(EP2))
    fragment = render(AFFINITY, eps).fragment
    assert {s.name for s in fragment.sets} == {
        names.affinity_set(AFFINITY.name, ep) for ep in eps}
    for decl in fragment.sets:
        assert decl.type == ("ipv4_addr",)
        assert decl.map is None
        assert "timeout" in decl.flags
        assert decl.timeout == 600
        assert decl.dynamic
        assert decl.elements == ()


def test_affinity_default_timeout_is_three_hours() -> None:
    port = service_port(session_affinity=SessionAffinity.CLIENT_IP)
    (decl,) = render(port, REMOTE).fragment.sets
    assert decl.timeout == 10800


def test_affinity_lookups_come_after_masquerade_and_before_the_cascade() -> None:
    eps = (endpoint(EP1), endpoint(EP2))
    fragment = render(AFFINITY, eps).fragment
    aff1, aff2 = (names.affinity_set(AFFINITY.name, ep) for ep in eps)
    assert rules_of(fragment, SVC) == [
        f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.0.0/8 {MASQ}",
        f"ip saddr @{aff1} goto {sep(EP1)}",
        f"ip saddr @{aff2} goto {sep(EP2)}",
        f"numgen random mod 2 0 goto {sep(EP1)}",
        f"goto {sep(EP2)}",
    ]


def test_affinity_in_kube_svl_looks_up_local_endpoints_only() -> None:
    port = replace(ITP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, LOCAL_AND_REMOTE).fragment
    aff1 = names.affinity_set(port.name, endpoint(EP1))
    assert rules_of(fragment, SVL)[1:] == [f"ip saddr @{aff1} goto {sep(EP1)}", f"goto {sep(EP1)}"]
    assert {s.name for s in fragment.sets} == {aff1}


def test_without_affinity_there_are_no_lookups_nor_updates() -> None:
    fragment = render(SVC1, (endpoint(EP1), endpoint(EP2))).fragment
    assert not any("@" in r for c in fragment.chains for r in (text(x) for x in c.rules))


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
    assert rules_of(fragment, SVL) == [f"numgen random mod 2 0 goto {sep(EP1)}", f"goto {sep(EP3)}"]
    # KUBE-SVC (pods, host) still balances over every endpoint
    assert [r.split()[-1] for r in rules_of(fragment, SVC)[1:]] == [sep(EP1), sep(EP2), sep(EP3)]


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
    assert {c.name for c in fragment.chains} == {SVC, sep(EP1)}


# --- KUBE-FW ---------------------------------------------------------------------


def _ranges(fragment: Fragment) -> tuple[Any, ...]:
    (decl,) = [s for s in fragment.sets if s.name == names.firewall_set(SVC1.name)]
    assert decl.type == ("ipv4_addr",)
    assert decl.flags == ("interval",)
    assert not decl.dynamic
    return decl.elements


def test_firewall_chain_drops_sources_outside_the_ranges_set() -> None:
    fragment = render(LB_RANGES, REMOTE).fragment
    assert rules_of(fragment, FW) == [f"ip saddr != @{names.firewall_set(SVC1.name)} drop"]
    assert _ranges(fragment) == ({"prefix": {"addr": "203.0.113.0", "len": 25}},)


def test_firewall_allows_the_lb_ips_when_a_range_contains_the_node() -> None:
    port = replace(LB_RANGES, load_balancer_source_ranges=("203.0.113.0/25", "192.168.0.0/24"))
    fragment = render(port, REMOTE).fragment
    assert _ranges(fragment) == (
        LB,
        {"prefix": {"addr": "192.168.0.0", "len": 24}},
        {"prefix": {"addr": "203.0.113.0", "len": 25}},
    )


def test_firewall_ranges_not_containing_the_node_do_not_allow_the_lb_ips() -> None:
    fragment = render(LB_RANGES, REMOTE, node=replace(NODE, ipv4=("192.168.7.7",))).fragment
    assert LB not in _ranges(fragment)


def test_firewall_collapses_overlapping_and_adjacent_ranges() -> None:
    port = replace(LB_RANGES, load_balancer_source_ranges=(
        "203.0.113.0/25", "203.0.113.64/26", "203.0.113.128/25", "198.51.100.7/32"))
    fragment = render(port, REMOTE).fragment
    assert _ranges(fragment) == (
        "198.51.100.7", {"prefix": {"addr": "203.0.113.0", "len": 24}})


def test_source_ranges_without_lb_ips_need_no_firewall() -> None:
    port = service_port(node_port=3001, load_balancer_source_ranges=("203.0.113.0/25",))
    fragment = render(port, REMOTE).fragment
    assert FW not in {c.name for c in fragment.chains}
    assert fragment.sets == ()
    assert "firewall-ips" not in dispatch(fragment, labels(port, REMOTE))


def test_node_port_bypasses_source_ranges() -> None:
    port = replace(LB_RANGES, node_port=3001)
    fragment = render(port, REMOTE).fragment
    assert elements_of(fragment, "firewall-ips") == {(LB, "tcp", 80): Verdict("goto", FW)}
    assert elements_of(fragment, "service-nodeports") == {("tcp", 3001): Verdict("goto", EXT)}


def test_ipv6_firewall_set_and_lb_host_prefix() -> None:
    lb6 = "fd00:1:2::3"
    port = service_port(
        family=IPFamily.IPV6,
        load_balancer_ingress=(LoadBalancerIngress(lb6),),
        load_balancer_source_ranges=("fd00:192::/64",),  # contains the node's IPv6
    )
    fragment = render(port, REMOTE).fragment
    (decl,) = fragment.sets
    assert decl.type == ("ipv6_addr",)
    assert decl.elements == (lb6, {"prefix": {"addr": "fd00:192::", "len": 64}})
    assert rules_of(fragment, names.firewall_chain(port.name)) == [
        f"ip6 saddr != @{decl.name} drop"]


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


def test_render_context_is_honoured_for_the_family() -> None:
    ctx = RenderContext(IPFamily.IPV6, CONFIG, NodeInfo("node-a"), None)
    port = service_port(family=IPFamily.IPV6)
    fragment = render_service_port(port, (endpoint("fd00:10:180::1"),), ctx).fragment
    assert fragment.family is IPFamily.IPV6


# --- meta-test: every renderer has a test ------------------------------------

RENDERER_TESTS = {
    "_cluster_ip_elements": "test_dispatch",
    "_external_elements": "test_dispatch",
    "_nodeport_elements": "test_dispatch",
    "_masquerade_rule": "test_cluster_ip_masquerade_rule_comes_first_in_kube_svc",
    "_chooser_rules": "test_cascade_picks_each_endpoint_with_probability_one_over_n",
    "_policy_chains": "test_etp_local_local_chain_contains_only_local_endpoints",
    "_external_chain": "test_etp_local_external_chain_short_circuits_pods_and_host",
    "_firewall": "test_firewall_chain_drops_sources_outside_the_ranges_set",
    "_endpoint_chains": "test_endpoint_chain_marks_hairpin_then_dnats",
}
HELPERS = {"_key", "_contains_any", "_merge", "_net"}


def test_every_private_renderer_has_a_test() -> None:
    """A new renderer in rules/service.py must be added here with its test."""
    private = {
        name for name, fn in inspect.getmembers(service_mod, inspect.isfunction)
        if name.startswith("_") and fn.__module__ == service_mod.__name__
    }
    renderers = {
        name for name in private
        if any(t in str(inspect.signature(getattr(service_mod, name)).return_annotation)
               for t in ("Chain", "Element", "Rule", "SetDecl"))
    }
    assert renderers == set(RENDERER_TESTS)
    assert private == set(RENDERER_TESTS) | HELPERS
    for test_name in RENDERER_TESTS.values():
        assert callable(globals().get(test_name)), test_name
