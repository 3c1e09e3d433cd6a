"""The fixed part of each table (nftproxy.core.rules.skeleton) -- golden.

This is the one place exact output is pinned (style guideline 16): the base
chains with their hooks and integer priorities (upstream-nftables-notes §1.2,
v1.34+ layout), the KUBE-* chains and their rules, the dispatch maps and
shared sets with their types, and the shared objects the ports use on
demand (skeleton.choosers). The JSON (tests/skeleton_golden.py) is written
out literally, not built with nftproxy.core.rules.expr, so a change of
spelling shows up here.

Ruleset v2: loadBalancerSourceRanges are one KUBE-FIREWALL-CHECK rule over
the firewall-vips / firewall-allow sets, and hairpin is the first
KUBE-POSTROUTING rule over the hairpin-endpoints set. Every set a rule looks
up is matched by the very selectors it is declared by (`SetDecl.key`), which
libnftables 1.1.x declares as typeof.

The skeleton holds no chooser: the first rule of KUBE-SERVICES and of
KUBE-NODEPORTS marks the shared ports' external destinations for
masquerade (masquerade-vips, masquerade-nodeports) before the verdict maps,
whose elements go to the shared choosers dispatch-<proto>-<N> (DNAT by
(VIP, port, index) in vip-endpoints-<proto>) and dispatch-nodeport-<proto>-<N>
(by (node port, index) in nodeport-endpoints-<proto>), which
skeleton.choosers makes with their maps as a port needs them
(test_rules_dispatch*.py test them per detector and the ports that use them).

Variants: the masquerade bit, tcp_be_liberal, IPv6; nodePortAddresses in
test_rules_skeleton_nodeports.py.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import pytest
from skeleton_golden import (
    AFFINITY_CHAINS,
    AFFINITY_SET_TEXT_V4,
    BASE_CHAINS,
    FIB_DADDR_LOCAL,
    GOLDEN_CHOOSERS_MAPS_V4,
    GOLDEN_SETS_V4,
    GOLDEN_V4,
    KUBE_CHAINS,
    L4PROTO,
    MARK,
    NOT_LOOPBACK_V4,
    NOT_LOOPBACK_V6,
    PROTO_PORT,
    PROTOCOLS,
    SKELETON_CHAINS,
    SKELETON_SETS,
    TH_DPORT,
    Rules,
    addr_proto_port,
    daddr,
    endpoints_map_text,
    external_local,
    goto,
    hairpin_rule,
    in_set,
    mark_and,
    mark_or,
    nodeport_chooser,
    saddr,
    shared_chooser,
)

from nftproxy.core.config import ConntrackConfig, ProxyConfig
from nftproxy.core.model import IPFamily, L4Protocol, NodeInfo
from nftproxy.core.nft.jsontext import command_json
from nftproxy.core.nft.nfttext import command_text
from nftproxy.core.nft.ops import Table, typeof_key
from nftproxy.core.rules import skeleton as skeleton_mod
from nftproxy.core.rules.fragment import Fragment, Shared
from nftproxy.core.rules.skeleton import AFFINITY, choosers, render_skeleton

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
PROTO_PORT_KEY = {"concat": [L4PROTO, TH_DPORT]}
NODE = NodeInfo("node-a", ipv4=("192.168.0.2", "10.1.2.3"), ipv6=("fd00:192::2",))
DEFAULT = ProxyConfig()
TABLE = {V4: Table("ip", "nftproxy"), V6: Table("ip6", "nftproxy")}


def every_shared(family: IPFamily, config: ProxyConfig = DEFAULT) -> Fragment:
    """A fragment of the shared objects of every kind (choosers of 1 and 3
    endpoints per protocol, of cluster and of local endpoints, for VIPs and
    node ports; the two eTP=Local chains), as skeleton.choosers makes them
    for the ports that use them."""
    made = choosers(family, config, NODE)
    bundles: list[Shared] = [
        made.external_local(nodeport=False), made.external_local(nodeport=True)]
    for p in L4Protocol:
        for n in (1, 3):
            for local in (False, True):
                bundles += [made.vip(p, n, local=local), made.nodeport(p, n, local=local)]
    return Fragment(family, tuple(c for b in bundles for c in b.chains),
                    tuple({d.name: d for b in bundles for d in b.sets}.values()))


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
        command = command_json(TABLE[V4].add_chain(base[name]))
        table, _, bare = name.rpartition(":")
        assert command == {"add": {"chain": {
            "family": "ip", "table": "nftproxy-affinity" if table else "nftproxy", "name": bare,
            "type": type_, "hook": hook, "prio": prio, "policy": "accept"}}}
        # libnftables 1.0.6 JSON turns a string priority into a plain chain
        assert type(command["add"]["chain"]["prio"]) is int


def test_kube_chains_are_regular_chains() -> None:
    fragment = render_skeleton(V4, DEFAULT, NODE)
    regular = {c.name for c in fragment.chains if c.hook is None}
    assert regular == KUBE_CHAINS | AFFINITY_CHAINS
    assert [c.name for c in fragment.chains] == SKELETON_CHAINS
    assert len(SKELETON_CHAINS) == len(BASE_CHAINS) + len(regular) == 21


def test_ipv4_skeleton_rules_are_golden() -> None:
    assert rules(render_skeleton(V4, DEFAULT, NODE)) == GOLDEN_V4


def test_ipv4_maps_and_sets_are_golden() -> None:
    fragment = render_skeleton(V4, DEFAULT, NODE)
    assert [s.name for s in fragment.sets] == SKELETON_SETS
    assert [command_text(TABLE[V4].add_set(s)) for s in fragment.sets] == GOLDEN_SETS_V4
    # no integer key anywhere: the choosers' maps and the affinity set are shared objects
    assert not any("integer" in s.type for s in fragment.sets)
    # static elements only where the config or the cluster gives them
    assert [s.name for s in fragment.sets if s.elements or s.dynamic] == []


def test_ipv4_shared_objects_are_golden() -> None:
    """What skeleton.choosers makes for the ports that use them: each chooser
    is one chain without a hook and its map, each eTP=Local chain with its
    two choosers maps, the affinity set alone; the choosers' maps and the
    affinity set are declared in nft text only on libnftables 1.0.6 (an
    integer key part), the choosers maps in JSON."""
    made = choosers(V4, DEFAULT, NODE)
    affinity = made.affinity()
    assert (affinity.chains, [d.name for d in affinity.sets]) == ((), ["affinity:affinity"])
    assert [command_text(TABLE[V4].add_set(d)) for d in affinity.sets] == [AFFINITY_SET_TEXT_V4]
    assert [d.dynamic for d in affinity.sets] == [True]
    key = {False: addr_proto_port("ip"), True: PROTO_PORT}
    for nodeport, where in ((False, "external"), (True, "nodeport")):
        bundle = made.external_local(nodeport=nodeport)
        assert rules(Fragment(V4, bundle.chains)) == {
            f"{where}-local": external_local(key[nodeport], where)}
        assert [command_text(TABLE[V4].add_set(d)) for d in bundle.sets] == GOLDEN_CHOOSERS_MAPS_V4[
            2 * nodeport:2 * nodeport + 2]
    for p in L4Protocol:
        for n in (1, 3, 200):
            for local in ("", "local-"):
                vip = made.vip(p, n, local=bool(local))
                nodeport = made.nodeport(p, n, local=bool(local))
                assert rules(Fragment(V4, vip.chains)) == {
                    f"dispatch-{local}{p.nft}-{n}": [shared_chooser("ip", p.nft, n, local)]}
                assert rules(Fragment(V4, nodeport.chains)) == {
                    f"dispatch-nodeport-{local}{p.nft}-{n}": [
                        nodeport_chooser("ip", p.nft, n, local)]}
                assert all(c.hook is None for c in (*vip.chains, *nodeport.chains))
                declared = [command_text(TABLE[V4].add_set(d)) for d in (*vip.sets, *nodeport.sets)]
                assert declared == [
                    endpoints_map_text("vip", p.nft, local),
                    endpoints_map_text("nodeport", p.nft, local)]


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
    assert chain_rules(fragment, "KUBE-SERVICES")[-1][0] == [
        FIB_DADDR_LOCAL, NOT_LOOPBACK_V6, goto("KUBE-NODEPORTS")]
    assert chain_rules(fragment, "KUBE-POSTROUTING")[0] == hairpin_rule("ip6", 16384)
    assert {s.name: s.type[0] for s in fragment.sets} == {
        "affinity:service-ips": "ipv6_addr",
        "affinity:service-nodeports": "inet_proto",
        "affinity:nodeport-ips": "ipv6_addr",
        "service-ips": "ipv6_addr",
        "service-nodeports": "inet_proto",
        "no-endpoint-services": "ipv6_addr",
        "no-endpoint-nodeports": "inet_proto",
        "masquerade-vips": "ipv6_addr",
        "masquerade-nodeports": "inet_proto",
        "firewall-vips": "ipv6_addr",
        "firewall-allow": "ipv6_addr",
        "hairpin-endpoints": "ipv6_addr",
        "cluster-ips": "ipv6_addr",
        "nodeport-ips": "ipv6_addr",
        "service-cidrs": "ipv6_addr",
    }
    shared = every_shared(V6)
    assert rules(shared) == v6(rules(every_shared(V4)))
    assert {s.name: s.type[0] for s in shared.sets} == {
        **{f"vip-{local}endpoints-{p}": "ipv6_addr" for p in PROTOCOLS for local in ("", "local-")},
        **{f"nodeport-{local}endpoints-{p}": "inet_service"
           for p in PROTOCOLS for local in ("", "local-")},
        **{f"external-{which}-choosers": "ipv6_addr" for which in ("cluster", "local")},
        **{f"nodeport-{which}-choosers": "inet_proto" for which in ("cluster", "local")},
    }
    assert {s.name: s.data for s in shared.sets if s.data} == {
        f"{kind}-{local}endpoints-{p}": ("ip6 daddr", f"{p} dport")
        for kind in ("vip", "nodeport") for local in ("", "local-") for p in PROTOCOLS}
    assert (sets(fragment)["firewall-allow"].type, sets(fragment)["hairpin-endpoints"].type) == (
        ("ipv6_addr", "inet_proto", "inet_service", "ipv6_addr"), ("ipv6_addr", "ipv6_addr"))


def _lookups(fragment: Fragment) -> list[tuple[str, Any]]:
    """(set name, the expression looked up in it) for every `@set` a rule
    uses: matches, verdict maps, a DNAT's data map; a rule of the affinity
    table names a set of that table ("affinity:<name>" to the planner)."""
    found: list[tuple[str, Any]] = []
    for c in fragment.chains:
        table = c.name.rpartition(":")[0]
        prefix = f"{table}:" if table else ""
        for r in c.rules:
            for s in r.expr:
                if "match" in s and str(s["match"]["right"]).startswith("@"):
                    found.append((prefix + s["match"]["right"][1:], s["match"]["left"]))
                if "vmap" in s:
                    found.append((prefix + s["vmap"]["data"][1:], s["vmap"]["key"]))
                if "dnat" in s and isinstance(s["dnat"]["addr"], dict):
                    lookup = s["dnat"]["addr"]["map"]
                    found.append((prefix + lookup["data"][1:], lookup["key"]))
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
    config = replace(DEFAULT, nodeport_addresses=("primary",))
    fragment = render_skeleton(family, config, NODE)
    lookups = _lookups(fragment)
    declared = sets(fragment)
    # every set is used
    assert {name for name, _ in lookups} == set(declared)
    for name, looked_up in lookups:
        assert _integers(looked_up) == _integers(typeof_key(declared[name].key)), name
    # so are the shared objects' maps, each by the chain of its bundle (and
    # cluster-ips by the VIP choosers' masquerade rule, here of masqueradeAll)
    shared = every_shared(family, replace(config, masquerade_all=True))
    own = sets(shared)
    assert {name for name, _ in _lookups(shared)} == set(own) | {"cluster-ips"}
    for name, looked_up in _lookups(shared):
        decl = own.get(name) or declared[name]
        assert _integers(looked_up) == _integers(typeof_key(decl.key)), name


def test_concatenated_keys_are_declared_by_typeof_in_json_too() -> None:
    """No datatype userdata that would crash 1.0.6's listing (docs/userspaces.md)."""
    table = Table("ip", "nftproxy")
    declared = sets(render_skeleton(V4, DEFAULT, NODE))
    three = [daddr("ip"), L4PROTO, TH_DPORT]

    def json(name: str) -> Any:
        return command_json(table.add_set(declared[name]))["add"]["set"]

    assert [json(n)["type"] for n in (
        "firewall-vips", "firewall-allow", "hairpin-endpoints")] == [
        {"typeof": {"concat": three}},
        {"typeof": {"concat": [*three, saddr("ip")]}},
        {"typeof": {"concat": [saddr("ip"), daddr("ip")]}},
    ]
    assert json("firewall-allow")["flags"] == ["interval"]


def _references(fragment: Fragment) -> tuple[set[str], set[str]]:
    """(the chains its rules jump or go to, the sets they name)."""
    targets = {s[verb]["target"] for c in fragment.chains for r in c.rules for s in r.expr
               for verb in ("jump", "goto") if verb in s}
    text = repr(rules(fragment))
    referenced = {w.strip("'\"@,]}") for w in text.split() if w.startswith(("'@", '"@'))}
    return targets, referenced


def test_every_jump_and_set_reference_resolves_inside_the_skeleton() -> None:
    """And a shared object's inside the skeleton and its own bundle."""
    for family in (V4, V6):
        fragment = render_skeleton(family, DEFAULT, NODE)
        targets, referenced = _references(fragment)
        assert targets <= fragment.chain_names()
        assert referenced <= {s.name for s in fragment.sets}
        assert referenced
        made = choosers(family, replace(DEFAULT, masquerade_all=True), NODE)
        for bundle in (made.vip(L4Protocol.TCP, 2), made.nodeport(L4Protocol.UDP, 2, local=True),
                       made.external_local(nodeport=False), made.external_local(nodeport=True)):
            targets, referenced = _references(Fragment(family, bundle.chains))
            assert targets <= fragment.chain_names()
            assert referenced <= {s.name for s in (*fragment.sets, *bundle.sets)}


def test_service_cidrs_fill_the_interval_set() -> None:
    fragment = render_skeleton(V4, DEFAULT, NODE, ("172.30.0.0/16", "172.31.0.1/32"))
    assert sets(fragment)["service-cidrs"].elements == ("172.30.0.0/16", "172.31.0.1")


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
    assert chain_rules(fragment, "KUBE-POSTROUTING")[:2] == [
        hairpin_rule("ip", mark), ([mark_and(mark, 0), {"return": None}], None)]


def test_tcp_be_liberal_removes_the_conntrack_invalid_drop() -> None:
    config = replace(DEFAULT, conntrack=ConntrackConfig(tcp_be_liberal=True))
    fragment = render_skeleton(V4, config, NODE)
    assert chain_rules(fragment, "KUBE-FORWARD") == GOLDEN_V4["KUBE-FORWARD"][1:]
    assert "['invalid']" not in repr(rules(fragment))


def test_the_affinity_table_dispatches_after_the_main_table_with_its_own_objects() -> None:
    """The ports with ClientIP affinity keep their chains in the affinity
    table: its nat chains run after the main table's (-99 after -100), its
    KUBE-SERVICES looks their destinations up in its own dispatch maps with
    the main table's node-port address match (its own nodeport-ips, the
    same addresses), its KUBE-MARK-MASQ sets the configured bit, and the
    shared affinity set (a shared object the ClientIP affinity ports use,
    not the skeleton's) is there only."""
    config = replace(DEFAULT, nodeport_addresses=("primary",), masquerade_bit=5)
    fragment = render_skeleton(V4, config, NODE)
    chains = {c.name: c for c in fragment.chains}
    main_prio = chains["nat-prerouting"].hook
    aside_prio = chains["affinity:nat-prerouting"].hook
    assert main_prio is not None and aside_prio is not None
    assert (main_prio.prio, aside_prio.prio) == (-100, skeleton_mod.AFFINITY_NAT_PRIORITY) == (
        -100, -99)
    main_nodeports = chain_rules(fragment, "KUBE-SERVICES")[-1][0]
    aside_nodeports = chain_rules(fragment, "affinity:KUBE-SERVICES")[-1][0]
    assert main_nodeports[:-1] == aside_nodeports[:-1] == [in_set("ip", "nodeport-ips")]
    assert aside_nodeports[-1] == {"vmap": {"key": PROTO_PORT_KEY, "data": "@service-nodeports"}}
    declared = sets(fragment)
    assert declared["affinity:nodeport-ips"].elements == declared["nodeport-ips"].elements != ()
    assert chain_rules(fragment, "affinity:KUBE-MARK-MASQ") == [([mark_or(1 << 5)], None)]
    assert not any(n.endswith(AFFINITY) for n in declared)
    affinity = choosers(V4, config, NODE).affinity()
    assert [d.name for d in affinity.sets] == [f"affinity:{AFFINITY}"]


# --- meta-test: every private renderer has a test ---------------------------------

RENDERER_TESTS = {
    "_base_chains": "test_base_chains_hook_types_and_integer_priorities",
    "_affinity_set": "test_ipv4_maps_and_sets_are_golden",
    "_nodeport_address_match": "test_cidr_lists_select_node_ips",
    "_lookup_chains": "test_ipv4_skeleton_rules_are_golden",
    "_source_range_rule": "test_every_set_lookup_matches_the_key_its_set_is_declared_by",
    "_hairpin_rule": "test_masquerade_bit_sets_the_mark_everywhere",
    "_helper_chains": "test_tcp_be_liberal_removes_the_conntrack_invalid_drop",
    "_maps_and_sets": "test_ipv4_maps_and_sets_are_golden",
    "_by_destination": "test_ipv4_skeleton_rules_are_golden",
    "_affinity_table": (
        "test_the_affinity_table_dispatches_after_the_main_table_with_its_own_objects"
    ),
}
HELPERS = {"_rule", "_network"}
"""Build a Rule from its statements, write a CIDR canonically; decide nothing."""


def test_every_private_renderer_has_a_test() -> None:
    """A new renderer in rules/skeleton.py must be added here with its test
    (besides the golden, which covers the IPv4 default)."""
    private = {
        name for name, fn in inspect.getmembers(skeleton_mod, inspect.isfunction)
        if name.startswith("_") and fn.__module__ == skeleton_mod.__name__
    }
    assert private == set(RENDERER_TESTS) | HELPERS
    import test_rules_skeleton_nodeports as nodeports  # it imports this module's helpers

    tests = {**globals(), **vars(nodeports)}
    for test_name in RENDERER_TESTS.values():
        assert callable(tests.get(test_name)), test_name
