"""FakeBackend's reader of nft's syntax (kernel/fake_text.py).

Aspects: every command of planned syncs (the example cluster; a richer
dual-stack sample with affinity, source ranges, eTP=Local, UDP; a partial
sync's flushes and deletes), printed by core/nft/nfttext.py, reads back as
the JSON object core/nft/jsontext.py prints for it; set and map
declarations read in the shapes each libnftables lists (fake_txn.py);
hand-written edge lines read as nft means them; anything else is refused,
not guessed; and the fake ends with the same tables whichever printer it
is given.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from feed import intake
from k8s import endpoint_slice, node, service

from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.nft import jsontext, nfttext
from nftproxy.core.nft.commands import (
    AddChain,
    AddElements,
    AddRule,
    AddSet,
    AddTable,
    Command,
    DeleteChain,
    DeleteElements,
    DeleteSet,
    DeleteTable,
    FlushChain,
    FlushSet,
)
from nftproxy.core.nft.marker import create_commands
from nftproxy.core.nft.ops import Table, typeof_key
from nftproxy.core.rules import expr
from nftproxy.core.rules.fragment import (
    BaseHook,
    Chain,
    Element,
    Rule,
    SetDecl,
    Target,
    Verdict,
    datatypes,
)
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.fake_text import parse_transaction
from nftproxy.tools.dry_run import proxier_from_files

NODE = "node-a"
CONFIG = ProxyConfig(
    node_name=NODE, cluster_cidrs=("10.244.0.0/16", "fd00:244::/48"), table_name="nftproxy"
)
T4, T6 = Table("ip", "nftproxy"), Table("ip6", "nftproxy")
V4, V6 = IPFamily.IPV4, IPFamily.IPV6
TCP, UDP = L4Protocol.TCP, L4Protocol.UDP
_log = logging.getLogger(__name__)


class Recording(FakeBackend):
    """A FakeBackend that keeps every transaction committed to it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sent: list[list[Command]] = []

    def commit(self, commands: Sequence[Command], *, fresh: bool = False) -> None:
        self.sent.append(list(commands))
        super().commit(commands, fresh=fresh)


def sample() -> dict[str, dict[str, Any]]:
    """As tests/test_proxier_kernel.py's, with a UDP port that has endpoints."""
    return {
        "svc/web": service(
            "web", ["10.96.0.10", "fd00:96::10"], type="NodePort", node_ports=[30080]
        ),
        "eps/web4": endpoint_slice("web", [("10.244.0.11", NODE), ("10.244.1.12", "node-b")]),
        "eps/web6": endpoint_slice("web", [("fd00:244::11", NODE)]),
        "svc/lb": service(
            "lb",
            "10.96.0.20",
            type="LoadBalancer",
            node_ports=[30081],
            lb_ips=["192.168.60.10"],
            source_ranges=["192.168.50.0/24", "192.168.51.7/32"],
            etp="Local",
            health_check_node_port=30500,
        ),
        "eps/lb": endpoint_slice("lb", [("10.244.0.11", NODE), ("10.244.1.12", "node-b")]),
        "svc/sticky": service("sticky", ["10.96.0.30", "fd00:96::30"], affinity_timeout=60),
        "eps/sticky": endpoint_slice("sticky", ["10.244.0.11", "10.244.0.12"]),
        "eps/sticky6": endpoint_slice("sticky", ["fd00:244::12"]),
        "svc/dns": service("dns", "10.96.0.53", ports=[("dns", 53, "UDP")]),
        "eps/dns": endpoint_slice("dns", ["10.244.0.53"], ports=[("dns", 53, "UDP")]),
        "svc/empty": service("empty", "10.96.0.99", ports=[("dns", 53, "UDP")]),
    }


def fed(backend: FakeBackend, objects: dict[str, dict[str, Any]]) -> Proxier:
    proxier = Proxier(CONFIG, backend)
    events = intake(proxier)
    events.on_node(node(NODE, ["192.168.50.1", "fd00:50::1"], pod_cidrs=["10.244.0.0/24"]))
    for key, obj in objects.items():
        if key.startswith("svc/"):
            events.on_service(None, obj)
        else:
            events.on_endpoint_slice(None, obj)
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)
    return proxier


def example_cluster() -> list[Command]:
    proxier = proxier_from_files(
        ["nftproxy/examples/cluster.yaml"], ProxyConfig(), FakeBackend(), log=_log
    )
    return list(proxier.plan_full().commands)


def full_and_partial(**backend_args: Any) -> tuple[Recording, list[Command], list[Command]]:
    """The sample's full sync, then a partial one that removes services and
    changes endpoints: (the backend, the full sync's commands, the partial's)."""
    backend = Recording(**backend_args)
    backend.start()
    objects = sample()
    proxier = fed(backend, objects)
    assert proxier.sync().full
    events = intake(proxier)
    events.on_service(objects["svc/sticky"], None)
    events.on_endpoint_slice(objects["eps/sticky"], None)
    events.on_endpoint_slice(objects["eps/sticky6"], None)
    events.on_service(objects["svc/lb"], None)
    events.on_endpoint_slice(objects["eps/web4"], endpoint_slice("web", [("10.244.0.13", NODE)]))
    events.on_endpoint_slice(objects["eps/dns"], None)
    assert not proxier.sync().full
    full, *partial = backend.sent
    return backend, full, [c for commands in partial for c in commands]


HANDWRITTEN: list[Command] = [
    *create_commands("ip6"),  # the kube-proxy marker: `create table`, a chain's comment
    T4.add_rule(
        "KUBE-SVC-X",
        Rule((expr.accept(),), comment="ns/web:http -> 10.0.0.1:80, {x}; y=1 (z) @a #b"),
    ),
    T6.add_chain(Chain("nat-prerouting", hook=BaseHook("nat", "prerouting", -100))),
    T4.add_chain(Chain("filter-forward", hook=BaseHook("filter", "forward", 0, "drop"))),
    *T6.add_elements(
        "firewall-allow",
        [
            Element("firewall-allow", ("fd00:60::10", "tcp", 80, "fd00:50::/64")),
            Element("firewall-allow", ("fd00:60::10", "tcp", 80, "fd00:50::7/128")),
        ],
    ),
    *T6.delete_elements(
        "firewall-allow", [Element("firewall-allow", ("fd00:60::10", "udp", 53, "2001:db8::/32"))]
    ),
    *T6.add_elements(
        "vip-endpoints-tcp",
        [
            Element(
                "vip-endpoints-tcp",
                ("fd00:96::10", 80, 0),
                Target("fd00:244::11", 8080),
                'ns/web:http -> [fd00:244::11]:8080, "quoted" \\ too',
            ),
        ],
    ),
    *T4.add_elements(
        "service-ips",
        [
            Element("service-ips", ("10.96.0.10", "tcp", 80), Verdict("goto", "dispatch-tcp-2")),
            Element("service-ips", ("10.96.0.11", "udp", 53), Verdict("jump", "K-X"), "a, b : c"),
            Element("service-ips", ("10.96.0.12", "sctp", 9), Verdict("drop")),
            Element("service-ips", ("10.96.0.13", "tcp", 1), Verdict("accept")),
        ],
    ),
    *T4.add_elements("cluster-ips", [Element("cluster-ips", ("10.96.0.10",))]),
    *T4.delete_tables(),
    T4.flush_chain("c"),
    T4.delete_chain("c"),
    T4.flush_set("s"),
    T4.flush_set("m", is_map=True),
    T4.delete_set("s"),
    T4.delete_set("m", is_map=True),
]
"""Edge lines: a comment with spaces and punctuation, IPv6 CIDR keys and
host prefixes, base chains (negative priority, drop policy), every verdict,
and the flushes and deletes of objects."""

STATEMENTS: list[Any] = [
    expr.addr_match(V4, "saddr", ["10.0.0.0/8"]),
    expr.addr_match(V4, "daddr", ["192.0.2.7/32"]),
    expr.addr_match(V6, "daddr", ["fd00::1", "fd00::/64"], negate=True),
    expr.set_lookup(V4, "daddr", "cluster-ips"),
    expr.set_lookup(V6, "saddr", "x", negate=True),
    expr.l4proto(TCP),
    expr.port_match(UDP, 53),
    expr.iifname("cbr0"),
    expr.iifname("veth*", negate=True),
    expr.fib_local("daddr"),
    expr.ct_state("new"),
    expr.ct_state("established", "related"),
    expr.match({"ct": {"key": "status"}}, "dnat", "in"),
    expr.mark_set(0x4000),
    expr.mark_clear(0x4000),
    expr.mark_is_clear(0x4000),
    expr.mark_is_set(0x4000),
    expr.match(expr.concat_daddr_proto_dport(V4), "@firewall-vips"),
    expr.match(expr.concat_daddr_proto_dport(V6), "@firewall-vips", "!="),
    expr.vmap(expr.concat_proto_dport(), "service-nodeports"),
    expr.numgen_zero(3),
    expr.affinity_lookup(V4, (7, 9), "affinity"),
    expr.affinity_update(V6, (7, 9), "affinity", 10800),
    {"set": {"op": "add", "set": "@s", "elem": {"payload": {"protocol": "ip", "field": "saddr"}}}},
    expr.dnat("10.128.0.5", 8080),
    expr.dnat("fd00::5", 8080),
    {"dnat": {"family": "ip", "addr": "10.128.0.5"}},
    expr.dnat_by_destination(V6, TCP, 2, "vip-local-endpoints-tcp"),
    expr.dnat_by_port(V4, UDP, 1, "nodeport-endpoints-udp"),
    expr.masquerade(),
    {"masquerade": None},
    expr.reject_tcp_reset(),
    expr.reject_icmp(V4),
    expr.reject_icmp(V6),
    {"reject": None},
    expr.jump("KUBE-MARK-MASQ"),
    expr.goto("dispatch-tcp-2"),
    expr.drop(),
    expr.accept(),
    expr.ret(),
    {"continue": None},
]
"""Each statement core/rules/expr.py builds (and the option-less forms)."""


def _line(command: Command) -> str:
    return nfttext.command_text(command) + "\n"


def _declared(command: AddSet, *, v11: bool) -> dict[str, Any]:
    """A declaration as the fake takes it from text (fake_txn.py `_add_set`):
    typeof expressions on 1.1.x, datatypes on 1.0.6; verdict data "verdict"."""
    decl = command.decl
    spec = jsontext.command_json(command)["add"][command.kind]
    spec = {k: v for k, v in spec.items() if k not in ("type", "map")}
    spec["type"] = {"typeof": typeof_key(decl.key)} if v11 else list(datatypes(decl.key))
    if decl.map:
        if not decl.data:
            spec["map"] = "verdict"
        else:
            spec["map"] = (
                {"typeof": typeof_key(decl.data)} if v11 else " . ".join(datatypes(decl.data))
            )
    return {"add": {command.kind: spec}}


def _expected(command: Command, *, v11: bool) -> dict[str, Any]:
    if isinstance(command, AddSet):
        return _declared(command, v11=v11)
    return dict(jsontext.command_json(command))


def assert_round_trip(commands: Sequence[Command]) -> None:
    """Each command's line reads as its JSON (declarations as the fake takes
    them), and the whole transaction reads as its lines, on both userspaces."""
    for command in commands:
        for v11 in (True, False):
            assert parse_transaction(_line(command), v11=v11) == [_expected(command, v11=v11)], (
                nfttext.command_text(command)
            )
    text = nfttext.transaction_text(commands)
    assert parse_transaction(text, v11=True) == [_expected(c, v11=True) for c in commands]


# --- round trips --------------------------------------------------------------------------


def test_the_example_clusters_full_sync_reads_as_its_json() -> None:
    commands = example_cluster()
    kinds = {type(c) for c in commands}
    assert {AddTable, AddChain, AddRule, AddSet, AddElements} <= kinds
    assert_round_trip(commands)


def test_a_dual_stack_sample_full_and_partial_syncs_read_as_their_json() -> None:
    _, full, partial = full_and_partial(version="1.1")
    text = nfttext.transaction_text(full)
    for word in (
        "update @",
        "dnat ip6 to",
        "udp dport",
        "192.168.51.7",
        "masquerade",
        "ct status dnat",
        "th dport vmap",
        "192.168.50.0/24",
        "flags ",
    ):
        assert word in text, word  # fmt: skip
    assert_round_trip(full)
    assert {FlushChain, DeleteChain, DeleteSet, DeleteElements, AddElements} <= {
        type(c) for c in partial
    }
    assert_round_trip(partial)


def test_handwritten_edge_lines_read_as_their_json() -> None:
    assert {DeleteTable, FlushSet} <= {type(c) for c in HANDWRITTEN}
    assert "create table ip6 kube-proxy" in nfttext.transaction_text(HANDWRITTEN)
    assert_round_trip(HANDWRITTEN)


@pytest.mark.parametrize("statement", STATEMENTS, ids=[json.dumps(s) for s in STATEMENTS])
def test_each_statement_reads_as_its_json(statement: Any) -> None:
    rule = T4.add_rule("KUBE-SVC-X", Rule((statement, expr.accept()), comment="ns/web:http"))
    assert_round_trip([rule, T4.add_rule("KUBE-SVC-X", Rule((statement,)))])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "add chain ip6 nftproxy nat-output { type nat hook output priority -100; "
            "policy accept; }",
            {"add": {"chain": {"family": "ip6", "table": "nftproxy", "name": "nat-output",
                               "type": "nat", "hook": "output", "prio": -100,
                               "policy": "accept"}}},
        ),
        (
            'add rule ip t c meta l4proto . th dport vmap @m comment "a b; c, {d}: e"',
            {"add": {"rule": {"family": "ip", "table": "t", "chain": "c", "comment":
                              "a b; c, {d}: e", "expr": [{"vmap": {"key": {"concat": [
                                  {"meta": {"key": "l4proto"}},
                                  {"payload": {"protocol": "th", "field": "dport"}}]},
                                  "data": "@m"}}]}}},
        ),
        (
            "delete element ip6 t s { fd00:60::10 . tcp . 80 . fd00:50::/64, fd00::1 }",
            {"delete": {"element": {"family": "ip6", "table": "t", "name": "s", "elem": [
                {"concat": ["fd00:60::10", "tcp", 80,
                            {"prefix": {"addr": "fd00:50::", "len": 64}}]},
                "fd00::1"]}}},
        ),
        (
            'add table ip t { comment "managed by nftproxy"; }',
            {"add": {"table": {"family": "ip", "name": "t", "comment": "managed by nftproxy"}}},
        ),
    ],
)  # fmt: skip
def test_lines_read_as_nft_means_them(line: str, expected: dict[str, Any]) -> None:
    assert parse_transaction(line, v11=False) == [expected]


# --- declarations -------------------------------------------------------------------------


def test_declarations_read_as_each_userspace_lists_them() -> None:
    endpoints = T4.add_set(
        SetDecl.data_map(
            "vip-endpoints-tcp",
            ("ip daddr", "th dport", "numgen random mod 1"),
            ("ip daddr", "tcp dport"),
            comment="ns: endpoints; by VIP",
        )
    )
    line = nfttext.command_text(endpoints)
    assert parse_transaction(line, v11=False) == [{"add": {"map": {
        "family": "ip", "table": "nftproxy", "name": "vip-endpoints-tcp",
        "type": ["ipv4_addr", "inet_service", "integer"], "map": "ipv4_addr . inet_service",
        "comment": "ns: endpoints; by VIP"}}}]  # fmt: skip
    affinity = T6.add_set(
        SetDecl.keyed("affinity", ("ip6 saddr",), flags=("dynamic", "timeout"), timeout=60,
                      size=1000)
    )  # fmt: skip
    assert parse_transaction(nfttext.command_text(affinity), v11=True) == [{"add": {"set": {
        "family": "ip6", "table": "nftproxy", "name": "affinity",
        "type": {"typeof": {"payload": {"protocol": "ip6", "field": "saddr"}}},
        "flags": ["dynamic", "timeout"], "timeout": 60, "size": 1000}}}]  # fmt: skip
    verdicts = T4.add_set(SetDecl.keyed("service-ips", ("ip daddr", "meta l4proto", "th dport"),
                                        map="verdict"))  # fmt: skip
    for v11 in (True, False):
        (got,) = parse_transaction(nfttext.command_text(verdicts), v11=v11)
        assert got["add"]["map"]["map"] == "verdict"
    assert_round_trip([endpoints, affinity, verdicts])


# --- what it refuses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "insert rule ip t c accept",
        "add rule bridge t c accept",
        "add rule ip t c",
        "add rule ip t c counter",
        "add rule ip t c accept extra",
        "add rule ip t c ip saddr == @x",
        "add rule ip t c ip saddr == 10.0.0.0/8 log",
        "add rule ip t c meta iifname == cbr0",
        'add rule ip t c accept comment "unterminated',
        'add rule ip t c accept comment "a" drop',
        "add rule ip t c dnat to ip daddr",
        "add rule ip t c reject with tcp",
        "add rule ip t c meta mark set",
        "add table ip t extra",
        "add chain ip t c { type nat hook output priority x; policy accept; }",
        "add chain ip t c { type nat hook output; }",
        "add element ip t s { foo }",
        "add element ip t s { 10.0.0.1 : 10.0.0.2 . }",
        "add element ip t s { 10.0.0.1 : queue }",
        "delete element ip t s { 10.0.0.1 : drop }",
        "add set ip t s { typeof ip saddr; bogus 1; }",
        "add set ip t s { typeof ct mark; }",
        "add set ip t s { flags interval; }",
        "add map ip t m { typeof ip daddr; }",
        "add set ip t s { typeof ip daddr : verdict; }",
        "list table ip t",
        "add chain ip t bad/name",
    ],
)
def test_what_it_does_not_read_it_names(line: str) -> None:
    with pytest.raises(NotImplementedError, match="nft text"):
        parse_transaction(line + "\n", v11=True)


# --- the fake applies what was sent -------------------------------------------------------


def _tables(backend: FakeBackend, *, set_comments: bool = True) -> str:
    """The four tables as listed; without set and map comments if asked
    (libnftables' JSON parser drops them, and so does the fake's JSON)."""
    tables = [
        backend.list_table(family, name)
        for family in ("ip", "ip6")
        for name in ("nftproxy", "nftproxy-affinity")
    ]
    text = json.dumps(tables, sort_keys=True)
    if set_comments:
        return text
    for doc in tables:
        for item in (doc or {}).get("nftables", ()):
            for kind in ("set", "map"):
                item.get(kind, {}).pop("comment", None)
    return json.dumps(tables, sort_keys=True)


def test_the_fake_holds_the_same_tables_from_either_printer() -> None:
    by_text, text_full, text_partial = full_and_partial(version="1.1", syntax="nft")
    by_json, json_full, json_partial = full_and_partial(version="1.1", syntax="json")
    assert (text_full, text_partial) == (json_full, json_partial)
    assert '"dnat"' in _tables(by_text)
    assert _tables(by_text, set_comments=False) == _tables(by_json, set_comments=False)
    assert '"comment": "NodePort traffic"' in _tables(by_text)
    assert '"comment": "NodePort traffic"' not in _tables(by_json)
