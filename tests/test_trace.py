"""The ruleset interpreter behind `nftproxy trace` (nftproxy/core/trace).

Aspects:
- coverage: every statement shape core/rules/expr.py can build is read, and
  every rule and set element of tables rendered from the sample cluster
  under every local-traffic detector, masqueradeAll, restricted node-port
  addresses and tcp_be_liberal is understood (a new expression shape in the
  renderers fails here until the tracer learns it);
- nftables semantics on small hand-written tables: jump returns, goto does
  not, return, accept ends only its base chain, drop ends the packet, a
  drop policy, NAT chains run once per direction, `reject with tcp reset`
  implies TCP (the listing leaves the dependency out);
- numgen: a cascade and an anonymous numgen vmap give every endpoint its
  probability (exact fractions, summing to 1);
- sets and maps: named and anonymous, intervals (prefixes, ranges) and
  concatenations, negation; marks (or, and, xor); `ct status dnat`;
- affinity: an element for the source in a dynamic set pins the path;
- honesty: an expression it does not interpret stops the trace with its
  chain and rule (only when the packet reaches it); a field it was not told
  (input interface) is asked for, never guessed;
- the kernel's own listing (canonical JSON) traces exactly as the planned
  one (kernel test).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.nft.listing import list_family
from nftproxy.core.rules import expr
from nftproxy.core.trace import Host, Origin, Packet, Ruleset, Unsupported, trace
from nftproxy.core.trace.evaluate import NeedsInput
from nftproxy.core.trace.syntax import parse_statement
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.dry_run import proxier_from_files
from nftproxy.tools.trace import Tables, make_packet, planned_tables, run

SAMPLE = str(Path(__file__).resolve().parent.parent / "nftproxy" / "examples" / "cluster.yaml")
PODS = ("10.244.0.0/16", "fd00:244::/48")
CONFIG = ProxyConfig(table_name="nftproxy", cluster_cidrs=PODS)
V4, V6 = IPFamily.IPV4, IPFamily.IPV6


# --- coverage ---------------------------------------------------------------------------

_BUILDERS: dict[str, Callable[[IPFamily], list[Any]]] = {
    "accept": lambda f: [expr.accept()],
    "affinity_lookup": lambda f: [expr.affinity_lookup(f, (1139835961, 7), "affinity")],
    "affinity_update": lambda f: [expr.affinity_update(f, (1139835961, 7), "affinity", 600)],
    "addr_match": lambda f: [
        expr.addr_match(f, "saddr", (PODS[0] if f is V4 else PODS[1],)),
        expr.addr_match(f, "daddr", ("10.0.0.1",) if f is V4 else ("fd00::1",), negate=True),
        expr.addr_match(f, "saddr", ("10.0.0.0/8", "10.1.0.0/16") if f is V4 else ("fd00::/8",)),
    ],
    "concat_daddr_proto_dport": lambda f: [expr.vmap(expr.concat_daddr_proto_dport(f), "m")],
    "concat_proto_dport": lambda f: [expr.vmap(expr.concat_proto_dport(), "m")],
    "ct_state": lambda f: [expr.ct_state("new"), expr.ct_state("established", "related")],
    "dnat": lambda f: [expr.dnat("10.0.0.1" if f is V4 else "fd00::1", 8080)],
    "dnat_by_destination": lambda f: [
        expr.dnat_by_destination(f, p, 3, f"vip-endpoints-{p.nft}") for p in L4Protocol
    ],
    "dnat_by_port": lambda f: [
        expr.dnat_by_port(f, p, 3, f"nodeport-endpoints-{p.nft}") for p in L4Protocol
    ],
    "drop": lambda f: [expr.drop()],
    "fib_local": lambda f: [expr.fib_local("saddr"), expr.fib_local("daddr")],
    "goto": lambda f: [expr.goto("C")],
    "iifname": lambda f: [expr.iifname("cbr0"), expr.iifname("veth*", negate=True)],
    "jump": lambda f: [expr.jump("C")],
    "l4proto": lambda f: [expr.l4proto(p) for p in L4Protocol],
    "mark_clear": lambda f: [expr.mark_clear(0x4000)],
    "mark_is_clear": lambda f: [expr.mark_is_clear(0x4000)],
    "mark_is_set": lambda f: [expr.mark_is_set(0x4000)],
    "mark_set": lambda f: [expr.mark_set(0x4000)],
    "masquerade": lambda f: [expr.masquerade()],
    "match": lambda f: [
        expr.match({"ct": {"key": "status"}}, "dnat", "in"),
        expr.match({"concat": [expr.payload(f, "saddr"), expr.payload(f, "daddr")]}, "@s"),
        expr.match({"concat": [*expr.concat_daddr_proto_dport(f)["concat"],
                               expr.payload(f, "saddr")]}, "@s", "!="),
    ],
    "numgen_zero": lambda f: [expr.numgen_zero(3)],
    "payload": lambda f: [],  # an expression, exercised through match
    "port_match": lambda f: [expr.port_match(p, 80) for p in L4Protocol],
    "prefix": lambda f: [],  # a literal, exercised through addr_match
    "reject_icmp": lambda f: [expr.reject_icmp(f)],
    "reject_tcp_reset": lambda f: [expr.reject_tcp_reset()],
    "ret": lambda f: [expr.ret()],
    "set_lookup": lambda f: [expr.set_lookup(f, "saddr", "s"),
                             expr.set_lookup(f, "daddr", "s", negate=True)],
    "vmap": lambda f: [expr.vmap(expr.concat_proto_dport(), "m")],
}


def test_every_statement_the_renderers_can_build_is_understood() -> None:
    assert set(_BUILDERS) == set(expr.__all__), "a new expr builder: teach the tracer, list it"
    for family in IPFamily:
        for build in _BUILDERS.values():
            for statement in build(family):
                parse_statement(json.loads(json.dumps(statement)))  # raises if not understood


def _configs() -> list[ProxyConfig]:
    return [
        CONFIG,
        ProxyConfig(table_name="nftproxy"),  # no detector: no masquerade rules
        replace(CONFIG, masquerade_all=True),
        replace(CONFIG, detect_local_mode=DetectLocalMode.BRIDGE_INTERFACE,
                bridge_interface="cbr0"),
        replace(CONFIG, detect_local_mode=DetectLocalMode.INTERFACE_NAME_PREFIX,
                interface_name_prefix="veth"),
        replace(CONFIG, detect_local_mode=DetectLocalMode.NODE_CIDR),
        replace(CONFIG, nodeport_addresses=("192.168.50.0/24", "fd00:50::/64")),
    ]


@pytest.mark.parametrize("config", _configs(), ids=lambda c: "config")
def test_every_rule_of_the_rendered_sample_is_understood(config: ProxyConfig) -> None:
    tables = planned_tables([SAMPLE], config)
    for family in ("ip", "ip6"):
        rs = Ruleset.from_listing(tables.listings[family], family, "nftproxy")
        assert sum(len(c.rules) for c in rs.chains.values()) > 30
        assert rs.problems() == []


# --- hand-written tables ------------------------------------------------------------------


def _chain(name: str, *rules: list[Any], hook: str | None = None, kind: str = "filter",
           prio: int = 0, policy: str = "accept") -> list[dict[str, Any]]:
    head: dict[str, Any] = {"family": "ip", "table": "t", "name": name}
    if hook:
        head |= {"type": kind, "hook": hook, "prio": prio, "policy": policy}
    body = [{"rule": {"family": "ip", "table": "t", "chain": name, "expr": r}} for r in rules]
    return [{"chain": head}, *body]


def _table(*chains: list[dict[str, Any]], sets: tuple[dict[str, Any], ...] = ()) -> Ruleset:
    objects = [{"set" if "map" not in s else "map": {"family": "ip", "table": "t", **s}}
               for s in sets]
    return Ruleset("ip", "t", [*objects, *(o for c in chains for o in c)])


def _daddr(ip: str) -> dict[str, Any]:
    return {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}},
                      "right": ip}}


MARK = {"meta": {"key": "mark"}}


def _set_mark(value: int) -> dict[str, Any]:
    return {"mangle": {"key": MARK, "value": value}}


def _mark_is(value: int) -> dict[str, Any]:
    return {"match": {"op": "==", "left": MARK, "right": value}}


PKT = Packet("192.168.1.2", "10.0.0.1", 80)
HOST = Host.of(["192.168.1.1"])


def _marks(rs: Ruleset, packet: Packet = PKT) -> list[tuple[str, int]]:
    """(verdict, last constant mark set) of every path, in order."""
    return [(p.verdict, _last_mark(p.steps)) for p in trace(rs, packet, HOST).paths]


def _last_mark(steps: Any) -> int:
    marks = [int(s.text.split("meta mark set ")[1].split()[0], 0)
             for s in steps if "meta mark set " in s.text]
    return marks[-1] if marks else 0


def test_jump_returns_and_goto_does_not() -> None:
    rs = _table(
        _chain("base", [{"jump": {"target": "A"}}], [_set_mark(3)],
               hook="prerouting", prio=-100),
        _chain("A", [{"goto": {"target": "B"}}], [_set_mark(1)]),
        _chain("B", [_set_mark(2)]),
    )
    # base jumps to A; A goes to B (no way back into A); B ends; base resumes
    assert _marks(rs) == [("accept", 3)]
    path = trace(rs, PKT, HOST).paths[0]
    assert [s.text for s in path.steps if s.rule] == [
        "jump A", "goto B", "meta mark set 2", "meta mark set 3"]


def test_return_accept_drop_and_policy() -> None:
    rs = _table(
        _chain("first", [{"jump": {"target": "R"}}], [{"accept": None}], [_set_mark(9)],
               hook="prerouting", prio=-200),
        _chain("R", [{"return": None}], [_set_mark(7)]),
        _chain("second", [_daddr("10.0.0.2"), {"drop": None}], [_set_mark(5)],
               hook="prerouting", prio=0),
    )
    # return skips R's mark; accept ends "first" but "second" still runs
    assert _marks(rs) == [("accept", 5)]
    assert trace(rs, replace(PKT, dst="10.0.0.2"), HOST).paths[0].verdict == "drop"
    closed = _table(_chain("only", hook="input", policy="drop"))
    path = trace(closed, replace(PKT, dst="192.168.1.1"), HOST).paths[0]
    assert (path.verdict, path.steps[-1].text) == ("drop", "policy drop")


def test_nat_runs_once_per_direction_and_dnat_ends_its_chain() -> None:
    rs = _table(
        _chain("out", [{"dnat": {"addr": "192.168.1.1", "port": 8080}}], [_set_mark(1)],
               hook="output", kind="nat", prio=-100),
        _chain("pre", [_set_mark(2)], hook="prerouting", kind="nat", prio=-100),
        _chain("in", [{"match": {"op": "in", "left": {"ct": {"key": "status"}},
                                 "right": "dnat"}}, _set_mark(4)], hook="input"),
    )
    path = trace(rs, replace(PKT, origin=Origin.NODE, iifname=""), HOST).paths[0]
    # DNAT to the node's own address: back in through loopback, prerouting NAT
    # not run again, input sees ct status dnat
    assert path.destination == "192.168.1.1:8080"
    assert path.delivery == "delivered to the node (loopback)"
    assert _last_mark(path.steps) == 4
    assert [s.chain for s in path.steps if "meta mark" in s.text] == ["in"]


def test_tcp_reset_reject_implies_tcp() -> None:
    rs = _table(_chain("fwd", [{"reject": {"type": "tcp reset"}}],
                       [{"reject": {"type": "icmp", "expr": "port-unreachable"}}],
                       hook="forward"))
    assert trace(rs, PKT, HOST).paths[0].reject_with == "TCP reset"
    udp = trace(rs, replace(PKT, proto="udp"), HOST).paths[0]
    assert (udp.verdict, udp.reject_with) == ("reject", "ICMP port-unreachable")


def _dnat_rule(n: int) -> list[Any]:
    return [{"dnat": {"addr": f"10.1.0.{n}", "port": 80}}]


def test_numgen_cascade_gives_every_endpoint_its_share() -> None:
    def numgen(mod: int) -> dict[str, Any]:
        return {"match": {"op": "==", "left": {"numgen": {"mode": "random", "mod": mod,
                                                          "offset": 0}}, "right": 0}}

    rs = _table(
        _chain("nat", [numgen(3), {"goto": {"target": "E1"}}],
               [numgen(2), {"goto": {"target": "E2"}}], [{"goto": {"target": "E3"}}],
               hook="prerouting", kind="nat", prio=-100),
        *(_chain(f"E{n}", _dnat_rule(n)) for n in (1, 2, 3)),
    )
    result = trace(rs, PKT, HOST)
    assert result.endpoints() == {f"10.1.0.{n}:80": Fraction(1, 3) for n in (1, 2, 3)}
    assert sum(p.probability for p in result.paths) == 1


def test_numgen_vmap_branches_and_unmapped_values_fall_through() -> None:
    numgen = {"numgen": {"mode": "random", "mod": 4, "offset": 0}}
    vmap = {"vmap": {"key": numgen, "data": {"set": [[0, {"goto": {"target": "E1"}}],
                                                      [1, {"goto": {"target": "E2"}}],
                                                      [2, {"goto": {"target": "E3"}}]]}}}
    rs = _table(
        _chain("nat", [vmap], hook="prerouting", kind="nat", prio=-100),
        *(_chain(f"E{n}", _dnat_rule(n)) for n in (1, 2, 3)),
    )
    result = trace(rs, PKT, HOST)
    assert result.endpoints() == {f"10.1.0.{n}:80": Fraction(1, 4) for n in (1, 2, 3)}
    untranslated = [p for p in result.paths if p.endpoint is None]
    assert [p.probability for p in untranslated] == [Fraction(1, 4)]


def test_sets_with_intervals_concatenations_and_negation() -> None:
    key = {"concat": [{"payload": {"protocol": "ip", "field": "saddr"}},
                      {"payload": {"protocol": "th", "field": "dport"}}]}
    allowed = {"name": "allowed", "type": ["ipv4_addr", "inet_service"], "flags": ["interval"],
               "elem": [{"concat": [{"prefix": {"addr": "192.168.0.0", "len": 16}},
                                    {"range": [70, 90]}]},
                        {"concat": ["172.16.0.1", 443]}]}
    rs = _table(
        _chain("fw", [{"match": {"op": "!=", "left": key, "right": "@allowed"}}, {"drop": None}],
               [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                           "right": {"set": [{"prefix": {"addr": "192.168.9.0", "len": 24}},
                                             {"range": ["192.168.1.2", "192.168.1.3"]}]}}},
                _set_mark(6)],
               hook="prerouting", prio=-150),
        sets=(allowed,),
    )
    assert _marks(rs) == [("accept", 6)]  # 192.168.1.2 . 80: allowed, and in the range
    assert _marks(rs, replace(PKT, dport=91)) == [("drop", 0)]
    assert _marks(rs, replace(PKT, src="172.16.0.1", dport=443)) == [("accept", 0)]
    assert _marks(rs, replace(PKT, src="192.168.9.7", dport=70)) == [("accept", 6)]


def test_mark_operations() -> None:
    def mangle(op: str, bit: int) -> dict[str, Any]:
        return {"mangle": {"key": MARK, "value": {op: [MARK, bit]}}}

    rs = _table(_chain(
        "p", [mangle("|", 0x4000)], [mangle("|", 0x1)], [mangle("^", 0x4000)],
        [{"match": {"op": "==", "left": {"&": [MARK, 0x4000]}, "right": 0}}, mangle("&", 0x1)],
        [_mark_is(1), {"drop": None}],
        hook="prerouting", prio=-150))
    assert trace(rs, PKT, HOST).paths[0].verdict == "drop"


def test_source_in_a_dynamic_set_pins_the_endpoint() -> None:
    saddr = {"payload": {"protocol": "ip", "field": "saddr"}}
    sticky = {"name": "aff", "type": "ipv4_addr", "flags": ["timeout"], "timeout": 600,
              "elem": [{"elem": {"val": "192.168.1.2", "timeout": 600, "expires": 512}}]}
    rs = _table(
        _chain("nat", [{"match": {"op": "==", "left": saddr, "right": "@aff"}},
                       {"goto": {"target": "E2"}}],
               [{"goto": {"target": "E1"}}], hook="prerouting", kind="nat", prio=-100),
        _chain("E1", [{"set": {"op": "update", "elem": saddr, "set": "@aff"}}], _dnat_rule(1)),
        _chain("E2", [{"set": {"op": "update", "elem": saddr, "set": "@aff"}}], _dnat_rule(2)),
        sets=(sticky,),
    )
    pinned = trace(rs, PKT, HOST).paths
    assert [(p.endpoint.address if p.endpoint else "", p.probability) for p in pinned] == [
        ("10.1.0.2", Fraction(1))]
    assert pinned[0].affinity == "affinity pins 192.168.1.2 to this endpoint (@aff, 512s left)"
    other = trace(rs, replace(PKT, src="192.168.1.9"), HOST).paths[0]
    assert other.affinity == "affinity would pin 192.168.1.9 to this endpoint for 600s (@aff)"


def test_an_expression_it_does_not_interpret_stops_the_trace() -> None:
    rs = _table(_chain("p", [_daddr("10.0.0.9"), {"log": {"prefix": "x"}}], [_set_mark(1)],
                       hook="prerouting", prio=-150))
    assert rs.problems() == ["unsupported expression at p/rule 1: "
                             "unsupported statement 'log': {'log': {'prefix': 'x'}}"]
    assert _marks(rs) == [("accept", 1)]  # its match fails first: `log` is never reached
    with pytest.raises(Unsupported, match=r"at p/rule 1.*'log'"):
        trace(rs, replace(PKT, dst="10.0.0.9"), HOST)
    nothing_like_it = _table(_chain("p", [{"match": {"op": "==", "left": {
        "meta": {"key": "skuid"}}, "right": 0}}, {"accept": None}], hook="input"))
    assert "meta" in nothing_like_it.problems()[0]


def test_the_input_interface_is_asked_for_not_guessed() -> None:
    iif = {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "veth*"}}
    rs = _table(_chain("p", [iif, _set_mark(1)], hook="prerouting", prio=-150))
    with pytest.raises(NeedsInput, match="--iif"):
        trace(rs, PKT, HOST)
    assert _marks(rs, replace(PKT, iifname="veth12ab")) == [("accept", 1)]
    assert _marks(rs, replace(PKT, iifname="eth0")) == [("accept", 0)]


# --- the sample, in kube-proxy's words ---------------------------------------------------------


@pytest.fixture(scope="module")
def sample() -> Tables:
    return planned_tables([SAMPLE], CONFIG)


def test_sample_trace_reads_like_kube_proxy(sample: Tables) -> None:
    web = run(sample, make_packet("192.168.50.2", "10.96.0.10:80", Origin.EXTERNAL, CONFIG))
    assert web.endpoints() == {"10.244.0.11:8080": Fraction(1, 2),
                               "10.244.1.13:8080": Fraction(1, 2)}
    assert {p.service for p in web.paths} == {"demo/web:http"}
    assert all(p.masquerade and "off-cluster" in p.reasons[0] for p in web.paths)
    # a cluster-IP-only port: the shared chooser stands in for its KUBE-SVC,
    # which the service-ips element's comment names
    assert web.paths[0].chains == ("KUBE-SVC-XRY76EGRC3BSCIIJ",)
    assert web.paths[0].chooser == "dispatch-tcp-2"
    assert web.paths[0].endpoint is not None
    # the shared chooser DNATs; kube-proxy's KUBE-SEP name is in the element's comment
    assert web.paths[0].endpoint.chain == "dispatch-tcp-2"
    assert web.paths[0].endpoint.identity == "KUBE-SEP-QRUEL26JRDPVFLID"

    hairpin = run(sample, make_packet("10.244.0.11", "10.96.0.10:80", Origin.POD, CONFIG))
    assert [(p.endpoint.address if p.endpoint else "", p.masquerade, p.reasons[0][:7])
            for p in hairpin.paths] == [("10.244.0.11", True, "hairpin"),
                                        ("10.244.1.13", False, "not mar")]

    denied = run(sample, make_packet("192.168.50.3", "192.168.60.10:80", Origin.EXTERNAL, CONFIG))
    assert [(p.verdict, p.reasons, p.service, p.firewall) for p in denied.paths] == [
        ("drop", ("source 192.168.50.3 is outside the service's loadBalancerSourceRanges",),
         "demo/web-local:http", "KUBE-FW-EPQ2GAXAICHDUGFX")]

    empty = run(sample, make_packet("192.168.50.2", "10.96.0.99:80/udp", Origin.EXTERNAL, CONFIG))
    assert [(p.verdict, p.reject_with) for p in empty.paths] == [
        ("reject", "ICMP port-unreachable")]

    unallocated = run(sample, make_packet("fd00:50::2", "[fd00:96::77]:80", Origin.EXTERNAL,
                                          CONFIG))
    assert "unallocated" in unallocated.paths[0].reasons[0]

    node = run(sample, make_packet("192.168.50.1", "192.168.50.1:30081", Origin.NODE, CONFIG))
    assert {p.reasons[0] for p in node.paths} == {
        "the node's own traffic to an externalTrafficPolicy=Local destination (Local policy)"}
    assert len(node.paths) == 2 and all(p.delivery == "sent out of the node" for p in node.paths)


def test_masquerade_all_is_named() -> None:
    config = replace(CONFIG, masquerade_all=True)
    tables = planned_tables([SAMPLE], config)
    pod = run(tables, make_packet("10.244.0.12", "10.96.0.53:53/udp", Origin.POD, config))
    assert {p.reasons for p in pod.paths} == {
        ("masqueradeAll: all traffic to the cluster IP is masqueraded",)}


def test_json_form(sample: Tables) -> None:
    doc = run(sample, make_packet("192.168.50.2", "10.96.0.40:80", Origin.EXTERNAL, CONFIG))
    out = json.loads(json.dumps(doc.to_json()))
    assert out["packet"]["dst"] == "10.96.0.40" and out["table"] == "ip nftproxy"
    assert [p["probability_fraction"] for p in out["paths"]] == ["1/3"] * 3
    assert all("would pin" in p["affinity"] for p in out["paths"])


def test_kernel_listing_traces_as_the_planned_one(netns: str, sample: Tables) -> None:
    """The kernel lists rules in canonical form (e.g. `ct state` as a
    string, the tcp-reset dependency left out): same answers."""
    with NftBackend(netns=netns) as backend:
        proxier_from_files([SAMPLE], CONFIG, backend).sync()
        listings = {f: list_family(backend.list_table, f, "nftproxy") for f in ("ip", "ip6")}
    live = Tables("nftproxy", {f: d for f, d in listings.items() if d}, sample.host)
    for family in ("ip", "ip6"):
        assert Ruleset.from_listing(live.listings[family], family, "nftproxy").problems() == []
    packets = [
        ("192.168.50.2", "10.96.0.10:80", Origin.EXTERNAL),
        ("10.244.0.11", "10.96.0.10:80", Origin.POD),
        ("192.168.50.3", "192.168.60.10:80", Origin.EXTERNAL),
        ("192.168.50.2", "192.168.50.1:30081", Origin.EXTERNAL),
        ("192.168.50.1", "192.168.50.1:30080", Origin.NODE),
        ("192.168.50.2", "10.96.0.99:80/udp", Origin.EXTERNAL),
        ("192.168.50.1", "10.96.0.99:80/tcp", Origin.NODE),
        ("192.168.50.2", "10.96.0.10:81", Origin.EXTERNAL),
        ("fd00:50::2", "[fd00:96::10]:80", Origin.EXTERNAL),
        ("fd00:50::2", "[fd00:50::1]:30080/tcp", Origin.EXTERNAL),
        ("fd00:50::2", "[fd00:96::99]:80", Origin.EXTERNAL),
    ]
    for src, dst, origin in packets:
        packet = make_packet(src, dst, origin, CONFIG)
        assert _answer(run(live, packet)) == _answer(run(sample, packet)), (src, dst)


def _answer(result: Any) -> list[tuple[Any, ...]]:
    return [(p.probability, p.verdict, p.reject_with, p.endpoint, p.masquerade, p.reasons,
             p.service, p.delivery, [(s.hook, s.chain, s.rule) for s in p.steps])
            for p in result.paths]
