"""The fixed part of each table (nftproxy.core.rules.skeleton) -- golden.

This is the one place exact output is pinned (style guideline 16): the base
chains with their hooks and integer priorities (upstream-nftables-notes §1.2,
v1.34+ layout), the KUBE-* chains and their rules, the dispatch maps and
shared sets with their types. The JSON below is written out literally, not
built with nftproxy.core.rules.expr, so a change of spelling shows up here.

Ruleset v2: loadBalancerSourceRanges are one KUBE-FIREWALL-CHECK rule over
the firewall-vips / firewall-allow sets, and hairpin is the first
KUBE-POSTROUTING rule over the hairpin-endpoints set. Every set a rule looks
up is matched by the very selectors it is declared by (`SetDecl.key`), which
libnftables 1.1.x declares as typeof.

Ruleset v7: the shared choosers dispatch-<proto>-<generation>-<N> (N =
1..64) of the cluster IPs, each DNATing by (cluster IP, port, index) in its
protocol's clusterip-endpoints map (test_rules_dispatch.py tests their
masquerade rule per detector, the generations and the ports that use them).

Variants: nodePortAddresses (all local addresses, "primary", CIDR lists,
loopback never served; selecting from the host's interface addresses when
they were read, else from the Node's), the masquerade bit, tcp_be_liberal,
IPv6.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import pytest

from nftproxy.core.config import ConntrackConfig, ProxyConfig
from nftproxy.core.model import HostAddresses, IPFamily, NodeInfo
from nftproxy.core.nft.ops import Table, typeof_key
from nftproxy.core.rules import skeleton as skeleton_mod
from nftproxy.core.rules.fragment import Fragment
from nftproxy.core.rules.skeleton import (
    AFFINITY,
    is_endpoints_map,
    nodeport_ips,
    render_skeleton,
)

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
NODE = NodeInfo("node-a", ipv4=("192.168.0.2", "10.1.2.3"), ipv6=("fd00:192::2",))
DEFAULT = ProxyConfig()
TABLE = {V4: Table("ip", "nftproxy"), V6: Table("ip6", "nftproxy")}

# --- literal JSON pieces ---------------------------------------------------------

NEW = {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["new"]}}
L4PROTO = {"meta": {"key": "l4proto"}}
TH_DPORT = {"payload": {"protocol": "th", "field": "dport"}}
MARK = {"meta": {"key": "mark"}}


def jump(target: str) -> dict[str, Any]:
    return {"jump": {"target": target}}


def goto(target: str) -> dict[str, Any]:
    return {"goto": {"target": target}}


def daddr(ip: str) -> dict[str, Any]:
    return {"payload": {"protocol": ip, "field": "daddr"}}


def saddr(ip: str) -> dict[str, Any]:
    return {"payload": {"protocol": ip, "field": "saddr"}}


def vmap(key: Any, name: str) -> dict[str, Any]:
    return {"vmap": {"key": key, "data": "@" + name}}


def addr_proto_port(ip: str) -> dict[str, Any]:
    return {"concat": [daddr(ip), L4PROTO, TH_DPORT]}


PROTO_PORT = {"concat": [L4PROTO, TH_DPORT]}
FIB_DADDR_LOCAL = {
    "match": {"op": "==", "left": {"fib": {"result": "type", "flags": ["daddr"]}}, "right": "local"}
}
NOT_LOOPBACK_V4 = {
    "match": {"op": "!=", "left": daddr("ip"), "right": {"prefix": {"addr": "127.0.0.0", "len": 8}}}
}
NOT_LOOPBACK_V6 = {"match": {"op": "!=", "left": daddr("ip6"), "right": "::1"}}


def in_set(ip: str, name: str) -> dict[str, Any]:
    return {"match": {"op": "==", "left": daddr(ip), "right": "@" + name}}


def mark_and(bit: int, value: int) -> dict[str, Any]:
    return {"match": {"op": "==", "left": {"&": [MARK, bit]}, "right": value}}


def mark_or(bit: int) -> dict[str, Any]:
    return {"mangle": {"key": MARK, "value": {"|": [MARK, bit]}}}


HAIRPIN_SETS = ("hairpin-endpoints", "hairpin-endpoints-b", "hairpin-endpoints-c")
"""One per generation (the resync fills a new one in steps); a is v2-v5's name."""


def hairpin_rule(ip: str, bit: int, name: str = "hairpin-endpoints") -> tuple[list[Any], str]:
    """After DNAT, source == destination == an endpoint: mark for masquerade."""
    dnated = {"match": {"op": "in", "left": {"ct": {"key": "status"}}, "right": "dnat"}}
    pair = {"match": {"op": "==", "left": {"concat": [saddr(ip), daddr(ip)]},
                      "right": "@" + name}}
    return [dnated, pair, mark_or(bit)], "hairpin: the client is the endpoint it was sent to"


def hairpin_rules(ip: str, bit: int) -> list[tuple[list[Any], str]]:
    return [hairpin_rule(ip, bit, name) for name in HAIRPIN_SETS]


PROTOCOLS = ("tcp", "udp", "sctp")
COUNTS = range(1, 65)
"""The shared choosers: one per protocol and endpoint count 1..64."""
DISPATCH_CHAINS = {f"dispatch-{p}-a-{n}" for p in PROTOCOLS for n in COUNTS}


def shared_chooser(ip: str, protocol: str, n: int) -> tuple[list[Any], str]:
    """dispatch-<protocol>-a-<n>'s DNAT: ip daddr . P dport . numgen random
    mod n in the protocol's clusterip-endpoints map (no masquerade rule
    before it: the default config has no local-traffic detector)."""
    key = {"concat": [daddr(ip), {"payload": {"protocol": protocol, "field": "dport"}},
                      {"numgen": {"mode": "random", "mod": n}}]}
    lookup = {"map": {"key": key, "data": f"@clusterip-endpoints-{protocol}-a"}}
    return ([{"match": {"op": "==", "left": L4PROTO, "right": protocol}},
             {"dnat": {"family": ip, "addr": lookup}}], f"cluster IP -> {n} endpoints")


# --- the golden IPv4 skeleton (default config) --------------------------------

BASE_CHAINS = {
    "filter-prerouting-pre-dnat": ("filter", "prerouting", -110),
    "filter-output-pre-dnat": ("filter", "output", -110),
    "nat-prerouting": ("nat", "prerouting", -100),
    "nat-output": ("nat", "output", -100),
    "filter-input": ("filter", "input", 0),
    "filter-forward": ("filter", "forward", 0),
    "filter-output": ("filter", "output", 0),
    "nat-postrouting": ("nat", "postrouting", 100),
}

KUBE_CHAINS = {
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-FIREWALL-CHECK",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-CLUSTER-IPS-CHECK",
    "KUBE-REJECT",
    "KUBE-MARK-MASQ",
    "KUBE-POSTROUTING",
    "KUBE-FORWARD",
}

Rules = list[tuple[list[Any], str | None]]

GOLDEN_V4: dict[str, Rules] = {
    "filter-prerouting-pre-dnat": [([NEW, jump("KUBE-FIREWALL-CHECK")], None)],
    "filter-output-pre-dnat": [([NEW, jump("KUBE-FIREWALL-CHECK")], None)],
    "nat-prerouting": [([jump("KUBE-SERVICES")], None)],
    "nat-output": [([jump("KUBE-SERVICES")], None)],
    "filter-input": [([NEW, jump("KUBE-EXTERNAL-SERVICES")], None)],
    "filter-forward": [
        ([NEW, jump("KUBE-EXTERNAL-SERVICES")], None),
        ([NEW, jump("KUBE-CLUSTER-IPS-CHECK")], None),
        ([jump("KUBE-FORWARD")], None),
    ],
    "filter-output": [
        ([NEW, jump("KUBE-EXTERNAL-SERVICES")], None),
        ([NEW, jump("KUBE-CLUSTER-IPS-CHECK")], None),
    ],
    "nat-postrouting": [([jump("KUBE-POSTROUTING")], None)],
    "KUBE-SERVICES": [
        ([vmap(addr_proto_port("ip"), "service-ips")],
         "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        ([FIB_DADDR_LOCAL, NOT_LOOPBACK_V4, goto("KUBE-NODEPORTS")],
         "NodePort traffic (must be last)"),
    ],
    "KUBE-NODEPORTS": [([vmap(PROTO_PORT, "service-nodeports")], None)],
    "KUBE-FIREWALL-CHECK": [
        ([{"match": {"op": "==", "left": addr_proto_port("ip"), "right": "@firewall-vips"}},
          {"match": {"op": "!=",
                     "left": {"concat": [daddr("ip"), L4PROTO, TH_DPORT, saddr("ip")]},
                     "right": "@firewall-allow"}},
          {"drop": None}], "loadBalancerSourceRanges"),
    ],
    "KUBE-EXTERNAL-SERVICES": [
        ([vmap(addr_proto_port("ip"), "no-endpoint-services")],
         "services with no (local) endpoints"),
        ([FIB_DADDR_LOCAL, NOT_LOOPBACK_V4, vmap(PROTO_PORT, "no-endpoint-nodeports")],
         "node ports with no (local) endpoints"),
    ],
    "KUBE-CLUSTER-IPS-CHECK": [
        ([in_set("ip", "cluster-ips"), goto("KUBE-REJECT")],
         "Reject traffic to invalid ports of ClusterIPs"),
        ([in_set("ip", "service-cidrs"), {"drop": None}],
         "Drop traffic to unallocated ClusterIPs"),
    ],
    "KUBE-REJECT": [
        ([{"match": {"op": "==", "left": L4PROTO, "right": "tcp"}},
          {"reject": {"type": "tcp reset"}}], None),
        ([{"reject": {"type": "icmp", "expr": "port-unreachable"}}], None),
    ],
    "KUBE-MARK-MASQ": [([mark_or(16384)], None)],
    "KUBE-POSTROUTING": [
        *hairpin_rules("ip", 16384),
        ([mark_and(16384, 0), {"return": None}], None),
        ([{"mangle": {"key": MARK, "value": {"^": [MARK, 16384]}}}], None),
        ([{"masquerade": {"flags": ["fully-random"]}}], None),
    ],
    "KUBE-FORWARD": [
        ([{"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["invalid"]}},
          {"drop": None}], "drop conntrack INVALID packets"),
        ([mark_and(16384, 16384), {"accept": None}], "forward marked for masquerade"),
        ([{"match": {"op": "in", "left": {"ct": {"key": "state"}},
                     "right": ["established", "related"]}},
          {"accept": None}], "forward established connections"),
    ],
    **{f"dispatch-{p}-a-{n}": [shared_chooser("ip", p, n)] for p in PROTOCOLS for n in COUNTS},
}


def _set(kind: str, name: str, type_: Any, comment: str, **extra: Any) -> dict[str, Any]:
    fields = {"family": "ip", "table": "nftproxy", "name": name, "type": type_, **extra}
    return {"add": {kind: {**fields, "comment": comment}}}


THREE = ["ipv4_addr", "inet_proto", "inet_service"]
TWO = ["inet_proto", "inet_service"]
GOLDEN_SETS_V4 = [
    _set("map", "service-ips", THREE, "ClusterIP, ExternalIP and LoadBalancer IP traffic",
         map="verdict"),
    _set("map", "service-nodeports", TWO, "NodePort traffic", map="verdict"),
    _set("map", "no-endpoint-services", THREE, "drop or reject services with no endpoints",
         map="verdict"),
    _set("map", "no-endpoint-nodeports", TWO, "drop or reject node ports with no endpoints",
         map="verdict"),
    _set("set", "firewall-vips", THREE, "LoadBalancer IPs with loadBalancerSourceRanges"),
    _set("set", "firewall-allow", [*THREE, "ipv4_addr"], "LoadBalancer IP . allowed source range",
         flags=["interval"]),
    *(_set("set", name, ["ipv4_addr", "ipv4_addr"], "endpoint . endpoint: hairpin connections")
      for name in HAIRPIN_SETS),
    _set("set", "cluster-ips", "ipv4_addr", "Active ClusterIPs"),
    _set("set", "nodeport-ips", "ipv4_addr", "IPs that accept NodePort traffic"),
    _set("set", "service-cidrs", "ipv4_addr", "service CIDRs (ServiceCIDR objects)",
         flags=["interval"]),
]


def rules(fragment: Fragment) -> dict[str, Rules]:
    return {c.name: [(list(r.expr), r.comment) for r in c.rules] for c in fragment.chains}


def chain_rules(fragment: Fragment, name: str) -> Rules:
    return rules(fragment)[name]


def sets(fragment: Fragment) -> dict[str, Any]:
    return {s.name: s for s in fragment.sets}


# --- golden ----------------------------------------------------------------------


def test_base_chains_hook_types_and_integer_priorities() -> None:
    fragment = render_skeleton(V4, DEFAULT, NODE)
    base = {c.name: c for c in fragment.chains if c.hook is not None}
    assert {n: (c.hook.type, c.hook.hook, c.hook.prio) for n, c in base.items()
            if c.hook} == BASE_CHAINS
    for name, (type_, hook, prio) in BASE_CHAINS.items():
        command = TABLE[V4].add_chain(base[name])
        assert command == {"add": {"chain": {
            "family": "ip", "table": "nftproxy", "name": name,
            "type": type_, "hook": hook, "prio": prio, "policy": "accept"}}}
        # libnftables 1.0.6 JSON turns a string priority into a plain chain
        assert type(command["add"]["chain"]["prio"]) is int


def test_kube_chains_are_regular_chains() -> None:
    fragment = render_skeleton(V4, DEFAULT, NODE)
    regular = {c.name for c in fragment.chains if c.hook is None}
    assert regular == KUBE_CHAINS | DISPATCH_CHAINS
    assert len(DISPATCH_CHAINS) == 3 * 64


def test_ipv4_skeleton_rules_are_golden() -> None:
    assert rules(render_skeleton(V4, DEFAULT, NODE)) == GOLDEN_V4


def test_ipv4_maps_and_sets_are_golden() -> None:
    fragment = render_skeleton(V4, DEFAULT, NODE)
    in_json = [s for s in fragment.sets if not s.text_only]
    assert [TABLE[V4].add_set(s) for s in in_json] == GOLDEN_SETS_V4
    # the endpoints maps: integer keys, which 1.0.6 declares only in nft text
    assert [TABLE[V4].declare_text(s) for s in fragment.sets if s.text_only] == [
        f"add table ip nftproxy\nadd map ip nftproxy endpoints-{p}-a-{k:02} {{ typeof numgen "
        f"random mod 1 . numgen random mod 1 . numgen random mod 1 : ip daddr . {p} dport; "
        f'comment "{p} endpoints: chooser chain key . index -> endpoint"; }}'
        for p in ("tcp", "udp", "sctp")
        for k in range(32)
    ] + [
        f"add table ip nftproxy\nadd map ip nftproxy clusterip-endpoints-{p}-a {{ typeof ip daddr "
        f". {p} dport . numgen random mod 1 : ip daddr . {p} dport; "
        f'comment "{p} cluster IP . port . index -> endpoint"; }}'
        for p in ("tcp", "udp", "sctp")
    ] + [
        "add table ip nftproxy\nadd set ip nftproxy affinity { typeof ip saddr . numgen random "
        "mod 1 . numgen random mod 1; flags dynamic, timeout; size 1048576; "
        'comment "ClientIP affinity: client . KUBE-SEP key, expiring"; }'
    ]
    assert all(s.elements == () for s in fragment.sets)
    assert [s.name for s in fragment.sets if s.dynamic] == ["affinity"]


def test_ipv6_skeleton_differs_only_in_address_matches_and_icmpv6() -> None:
    fragment = render_skeleton(V6, DEFAULT, NODE)

    def v6(value: Any) -> Any:
        """The IPv4 golden with ip -> ip6 and loopback -> ::1."""
        if value == NOT_LOOPBACK_V4:
            return NOT_LOOPBACK_V6
        if value == {"reject": {"type": "icmp", "expr": "port-unreachable"}}:
            return {"reject": {"type": "icmpv6", "expr": "port-unreachable"}}
        if value in ({"protocol": "ip", "field": "daddr"}, {"protocol": "ip", "field": "saddr"}):
            return {**value, "protocol": "ip6"}
        if isinstance(value, dict) and value.get("dnat", {}).get("family") == "ip":
            return {"dnat": {**v6(value["dnat"]), "family": "ip6"}}
        if isinstance(value, dict):
            return {k: v6(v) for k, v in value.items()}
        if isinstance(value, list):
            return [v6(v) for v in value]
        if isinstance(value, tuple):
            return tuple(v6(v) for v in value)
        return value

    assert rules(fragment) == v6(GOLDEN_V4)
    assert chain_rules(fragment, "KUBE-SERVICES")[1][0] == [
        FIB_DADDR_LOCAL, NOT_LOOPBACK_V6, goto("KUBE-NODEPORTS")]
    assert chain_rules(fragment, "KUBE-POSTROUTING")[:3] == hairpin_rules("ip6", 16384)
    assert {s.name: s.type[0] for s in fragment.sets} == {
        **{f"endpoints-{p}-a-{k:02}": "integer" for p in ("tcp", "udp", "sctp") for k in range(32)},
        **{f"clusterip-endpoints-{p}-a": "ipv6_addr" for p in ("tcp", "udp", "sctp")},
        "affinity": "ipv6_addr",
        "service-ips": "ipv6_addr",
        "service-nodeports": "inet_proto",
        "no-endpoint-services": "ipv6_addr",
        "no-endpoint-nodeports": "inet_proto",
        "firewall-vips": "ipv6_addr",
        "firewall-allow": "ipv6_addr",
        **dict.fromkeys(HAIRPIN_SETS, "ipv6_addr"),
        "cluster-ips": "ipv6_addr",
        "nodeport-ips": "ipv6_addr",
        "service-cidrs": "ipv6_addr",
    }
    assert (sets(fragment)["firewall-allow"].type, sets(fragment)["hairpin-endpoints"].type) == (
        ("ipv6_addr", "inet_proto", "inet_service", "ipv6_addr"), ("ipv6_addr", "ipv6_addr"))


def _lookups(fragment: Fragment) -> list[tuple[str, Any]]:
    """(set name, the expression looked up in it) for every `@set` a rule
    uses: matches, verdict maps, a DNAT's data map."""
    found: list[tuple[str, Any]] = []
    for c in fragment.chains:
        for r in c.rules:
            for s in r.expr:
                if "match" in s and str(s["match"]["right"]).startswith("@"):
                    found.append((s["match"]["right"][1:], s["match"]["left"]))
                if "vmap" in s:
                    found.append((s["vmap"]["data"][1:], s["vmap"]["key"]))
                if "dnat" in s and isinstance(s["dnat"]["addr"], dict):
                    lookup = s["dnat"]["addr"]["map"]
                    found.append((lookup["data"][1:], lookup["key"]))
    return found


def _integers(key: Any) -> Any:
    """A key expression with each `numgen` part as what it is to a set, an
    integer: a rule's `numgen random mod N` looks up the key part declared
    `numgen random mod 1`."""
    if isinstance(key, dict) and "concat" in key:
        return {"concat": [_integers(part) for part in key["concat"]]}
    return "integer" if isinstance(key, dict) and "numgen" in key else key


@pytest.mark.parametrize("family", [V4, V6], ids=lambda f: f.value)
def test_every_set_lookup_matches_the_key_its_set_is_declared_by(family: IPFamily) -> None:
    """A concatenation in a rule and the set's declared key agree part by
    part (ip saddr . ip daddr for hairpin-endpoints, not the other way
    round): libnftables 1.1.x declares the set by exactly this expression."""
    fragment = render_skeleton(family, replace(DEFAULT, nodeport_addresses=("primary",)), NODE)
    lookups = _lookups(fragment)
    declared = sets(fragment)
    # every set is used (the endpoints maps and the affinity set by the
    # service ports' choosers)
    by_ports = {n for n in declared if is_endpoints_map(n) or n == AFFINITY}
    assert {name for name, _ in lookups} == set(declared) - by_ports
    for name, looked_up in lookups:
        assert _integers(looked_up) == _integers(typeof_key(declared[name].key)), name
    assert {name for name, _ in lookups if name.startswith("clusterip-endpoints-")} == {
        f"clusterip-endpoints-{p}-a" for p in PROTOCOLS}


def test_v2_sets_are_declared_by_typeof_on_libnftables_1_1() -> None:
    """The concatenated keys of ruleset v2, in the 1.1.x dialect (no datatype
    userdata that would crash 1.0.6's listing, docs/userspaces.md)."""
    table = Table("ip", "nftproxy", typeof=True)
    declared = sets(render_skeleton(V4, DEFAULT, NODE))
    three = [daddr("ip"), L4PROTO, TH_DPORT]
    assert [table.add_set(declared[n])["add"]["set"]["type"] for n in (
        "firewall-vips", "firewall-allow", "hairpin-endpoints")] == [
        {"typeof": {"concat": three}},
        {"typeof": {"concat": [*three, saddr("ip")]}},
        {"typeof": {"concat": [saddr("ip"), daddr("ip")]}},
    ]
    assert table.add_set(declared["firewall-allow"])["add"]["set"]["flags"] == ["interval"]


def test_every_jump_and_set_reference_resolves_inside_the_skeleton() -> None:
    for family in (V4, V6):
        fragment = render_skeleton(family, DEFAULT, NODE)
        chains = fragment.chain_names()
        declared = {s.name for s in fragment.sets}
        text = repr(rules(fragment))
        for c in fragment.chains:
            for r in c.rules:
                for s in r.expr:
                    for verb in ("jump", "goto"):
                        if verb in s:
                            assert s[verb]["target"] in chains
        referenced = {w.strip("'\"@,]}") for w in text.split() if w.startswith(("'@", '"@'))}
        assert referenced <= declared
        assert referenced


def test_service_cidrs_fill_the_interval_set() -> None:
    fragment = render_skeleton(V4, DEFAULT, NODE, ("172.30.0.0/16", "172.31.0.1/32"))
    assert sets(fragment)["service-cidrs"].elements == (
        {"prefix": {"addr": "172.30.0.0", "len": 16}}, "172.31.0.1")


# --- nodePortAddresses -----------------------------------------------------------


def _nodeport_match(fragment: Fragment) -> list[dict[str, Any]]:
    """The destination matches before `goto KUBE-NODEPORTS` (KUBE-SERVICES) --
    the same ones must guard the no-endpoint-nodeports check."""
    services = chain_rules(fragment, "KUBE-SERVICES")[1][0]
    external = chain_rules(fragment, "KUBE-EXTERNAL-SERVICES")[1][0]
    assert services[-1] == goto("KUBE-NODEPORTS")
    assert external[:-1] == services[:-1]
    return services[:-1]


@pytest.mark.parametrize(
    "addresses",
    [
        pytest.param((), id="empty nodePortAddresses"),
        pytest.param(("0.0.0.0/0",), id="0.0.0.0/0"),
        pytest.param(("10.0.0.0/8", "0.0.0.0/0"), id="a /0 among other CIDRs"),
    ],
)
def test_node_ports_on_every_local_non_loopback_address(addresses: tuple[str, ...]) -> None:
    fragment = render_skeleton(V4, replace(DEFAULT, nodeport_addresses=addresses), NODE)
    assert _nodeport_match(fragment) == [FIB_DADDR_LOCAL, NOT_LOOPBACK_V4]
    assert sets(fragment)["nodeport-ips"].elements == ()


def test_node_ports_on_every_local_ipv6_address_exclude_ipv6_loopback() -> None:
    config = replace(DEFAULT, nodeport_addresses=("::/0",))
    fragment = render_skeleton(V6, config, NODE)
    assert _nodeport_match(fragment) == [FIB_DADDR_LOCAL, NOT_LOOPBACK_V6]


@pytest.mark.parametrize(
    ("family", "ip", "expected"),
    [
        pytest.param(V4, "ip", ("192.168.0.2",), id="IPv4 primary"),
        pytest.param(V6, "ip6", ("fd00:192::2",), id="IPv6 primary"),
    ],
)
def test_primary_serves_node_ports_on_the_primary_ip_only(
    family: IPFamily, ip: str, expected: tuple[str, ...]
) -> None:
    fragment = render_skeleton(family, replace(DEFAULT, nodeport_addresses=("primary",)), NODE)
    assert _nodeport_match(fragment) == [in_set(ip, "nodeport-ips")]
    assert sets(fragment)["nodeport-ips"].elements == expected


NODE_MANY = NodeInfo(
    "node-a",
    ipv4=("192.168.0.2", "10.1.2.3", "172.16.0.1", "127.0.0.1"),
    ipv6=("fd00:192::2", "2001:db8::5", "::1"),
)


@pytest.mark.parametrize(
    ("family", "addresses", "expected"),
    [
        pytest.param(V4, ("10.0.0.0/8",), ("10.1.2.3",), id="one CIDR picks the node IP inside it"),
        pytest.param(V4, ("172.16.0.0/12", "192.168.0.0/16"), ("192.168.0.2", "172.16.0.1"),
                     id="several CIDRs keep the node's address order"),
        pytest.param(V4, ("127.0.0.0/8", "10.0.0.0/8"), ("10.1.2.3",),
                     id="loopback in the list is never served"),
        pytest.param(V4, ("203.0.113.0/24",), (), id="a CIDR matching no node IP serves nothing"),
        pytest.param(V6, ("2001:db8::/32", "::1/128"), ("2001:db8::5",),
                     id="IPv6 CIDRs, loopback never served"),
    ],
)
def test_cidr_lists_select_node_ips(
    family: IPFamily, addresses: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    config = replace(DEFAULT, nodeport_addresses=addresses)
    fragment = render_skeleton(family, config, NODE_MANY)
    assert sets(fragment)["nodeport-ips"].elements == expected
    assert nodeport_ips(family, config, NODE_MANY) == expected
    assert _nodeport_match(fragment) == [in_set(family.nft_family, "nodeport-ips")]


def test_primary_never_serves_a_loopback_primary() -> None:
    node = NodeInfo("node-a", ipv4=("127.0.0.1", "192.168.0.2"))
    config = replace(DEFAULT, nodeport_addresses=("primary",))
    assert nodeport_ips(V4, config, node) == ()


def test_family_without_any_listed_cidr_serves_node_ports_on_every_address() -> None:
    config = replace(DEFAULT, nodeport_addresses=("192.168.0.0/16",))
    fragment = render_skeleton(V6, config, NODE)
    assert _nodeport_match(fragment) == [FIB_DADDR_LOCAL, NOT_LOOPBACK_V6]


# Host interface addresses: a secondary address the Node object does not list,
# a Node address on no interface (192.168.0.2 is the Node's primary), loopback.
HOST = HostAddresses(
    ipv4=("10.1.2.3", "10.9.9.9", "127.0.0.1", "172.16.0.1"),
    ipv6=("::1", "2001:db8::5", "2001:db8::7", "fd00:192::2"),
)
NODE_ON_HOST = replace(NODE_MANY, host_addresses=HOST)


@pytest.mark.parametrize(
    ("family", "addresses", "expected"),
    [
        pytest.param(V4, ("10.0.0.0/8",), ("10.1.2.3", "10.9.9.9"),
                     id="a CIDR selects the host's addresses, secondaries too"),
        pytest.param(V4, ("192.168.0.0/16",), (),
                     id="a Node address on no interface is not served"),
        pytest.param(V4, ("127.0.0.0/8", "172.16.0.0/12"), ("172.16.0.1",),
                     id="a loopback interface address is never served"),
        pytest.param(V6, ("2001:db8::/32",), ("2001:db8::5", "2001:db8::7"),
                     id="IPv6 CIDRs select the host's IPv6 addresses"),
        pytest.param(V6, ("primary",), ("fd00:192::2",),
                     id="primary: the Node's primary IP, found on an interface"),
        pytest.param(V4, ("primary",), (),
                     id="primary: not served when on no interface (as kube-proxy)"),
        pytest.param(V4, ("primary", "172.16.0.0/12"), ("172.16.0.1",),
                     id="primary with CIDRs"),
    ],
)
def test_cidrs_select_the_host_interface_addresses_when_read(
    family: IPFamily, addresses: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    config = replace(DEFAULT, nodeport_addresses=addresses)
    fragment = render_skeleton(family, config, NODE_ON_HOST)
    assert sets(fragment)["nodeport-ips"].elements == expected
    assert _nodeport_match(fragment) == [in_set(family.nft_family, "nodeport-ips")]


@pytest.mark.parametrize("family", [V4, V6])
def test_without_node_port_addresses_host_addresses_change_nothing(family: IPFamily) -> None:
    assert render_skeleton(family, DEFAULT, NODE_ON_HOST) == render_skeleton(
        family, DEFAULT, NODE_MANY
    )


# --- masquerade bit, conntrack -----------------------------------------------------


def _mark_values(fragment: Fragment) -> set[int]:
    """Every integer that is combined with meta mark anywhere in the skeleton."""
    found: set[int] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for op in ("|", "^", "&"):
                if op in value and value[op][0] == MARK:
                    found.add(value[op][1])
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    walk(rules(fragment))
    return found


@pytest.mark.parametrize(
    ("bit", "mark"),
    [pytest.param(14, 0x4000, id="default bit 14 is 0x4000"), pytest.param(5, 0x20, id="bit 5")],
)
def test_masquerade_bit_sets_the_mark_everywhere(bit: int, mark: int) -> None:
    fragment = render_skeleton(V4, replace(DEFAULT, masquerade_bit=bit), NODE)
    assert _mark_values(fragment) == {mark}
    assert chain_rules(fragment, "KUBE-MARK-MASQ") == [([mark_or(mark)], None)]
    assert chain_rules(fragment, "KUBE-POSTROUTING")[:4] == [
        *hairpin_rules("ip", mark), ([mark_and(mark, 0), {"return": None}], None)]


def test_tcp_be_liberal_removes_the_conntrack_invalid_drop() -> None:
    config = replace(DEFAULT, conntrack=ConntrackConfig(tcp_be_liberal=True))
    fragment = render_skeleton(V4, config, NODE)
    assert chain_rules(fragment, "KUBE-FORWARD") == GOLDEN_V4["KUBE-FORWARD"][1:]
    assert "['invalid']" not in repr(rules(fragment))


# --- meta-test: every private renderer has a test ---------------------------------

RENDERER_TESTS = {
    "_base_chains": "test_base_chains_hook_types_and_integer_priorities",
    "_endpoints_maps": "test_ipv4_maps_and_sets_are_golden",
    "_affinity_set": "test_ipv4_maps_and_sets_are_golden",
    "_nodeport_address_match": "test_cidr_lists_select_node_ips",
    "_lookup_chains": "test_ipv4_skeleton_rules_are_golden",
    "_source_range_rule": "test_every_set_lookup_matches_the_key_its_set_is_declared_by",
    "_hairpin_rules": "test_masquerade_bit_sets_the_mark_everywhere",
    "_helper_chains": "test_tcp_be_liberal_removes_the_conntrack_invalid_drop",
    "_maps_and_sets": "test_ipv4_maps_and_sets_are_golden",
}
HELPERS = {"_rule"}
"""Builds a Rule from its statements; decides nothing."""


def test_every_private_renderer_has_a_test() -> None:
    """A new renderer in rules/skeleton.py must be added here with its test
    (besides the golden, which covers the IPv4 default)."""
    private = {
        name for name, fn in inspect.getmembers(skeleton_mod, inspect.isfunction)
        if name.startswith("_") and fn.__module__ == skeleton_mod.__name__
    }
    assert private == set(RENDERER_TESTS) | HELPERS
    for test_name in RENDERER_TESTS.values():
        assert callable(globals().get(test_name)), test_name
