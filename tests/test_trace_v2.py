"""The interpreter on ruleset v2's shapes, hand-written (issue 12).

Aspects, each on a small table written in the JSON shapes core/rules
builds for ruleset v2 (so they hold whatever the sample cluster contains):
- the numgen cascade DNATs inline in KUBE-SVC, with an `update` of the
  shared affinity set in the cascade rule (ClientIP affinity, ruleset v4:
  `ip saddr . K1 . K2`, K the endpoint's key, with the element's timeout):
  each endpoint gets its share, the path names the endpoint's KUBE-SEP-<h>
  from the rule's comment and the chain that DNATed; an affinity rule
  (lookup, update, DNAT) pins a known client;
- hairpin in KUBE-POSTROUTING (`ct status dnat`, `saddr . daddr` in
  `hairpin-endpoints`): only the client that is its own endpoint is
  masqueraded, and the reason says hairpin;
- loadBalancerSourceRanges: `daddr . l4proto . dport` in `firewall-vips`
  and `daddr . l4proto . dport . saddr` not in the interval set
  `firewall-allow` (prefixes in a concatenation) drops; the path names the
  port's KUBE-FW-<h> from the element's comment, allowed or dropped, and the
  service port even when nothing after the check ran;
- a KUBE-* name is read from a comment `names.tagged` cut to the budget.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

from nftproxy.core.model import Endpoint, IPFamily, L4Protocol, ServicePortName
from nftproxy.core.rules import expr, names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.trace import Host, Origin, Packet, Ruleset, trace
from nftproxy.core.trace.identity import ENDPOINT, FIREWALL, identity, split

SVC = "KUBE-SVC-WWWWWWWWWWWWWWWW"
LB = "KUBE-SVC-LLLLLLLLLLLLLLLL"
SEP1, SEP2, SEP3 = (f"KUBE-SEP-{c * 16}" for c in "AB2")
FW = "KUBE-FW-LLLLLLLLLLLLLLLL"
MARK = {"meta": {"key": "mark"}}
HOST = Host.of(["192.168.1.1"])
KEY1, KEY2 = names.endpoints_key(SEP1), names.endpoints_key(SEP2)
"""The endpoints' keys in the shared affinity set (names.affinity_key)."""


def _p(field: str, protocol: str = "ip") -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": field}}


def _m(left: Any, right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


VIP = {"concat": [_p("daddr"), {"meta": {"key": "l4proto"}}, _p("dport", "th")]}
VIP_SRC = {"concat": [*VIP["concat"], _p("saddr")]}


def _update(key: tuple[int, int]) -> dict[str, Any]:
    return expr.affinity_update(IPFamily.IPV4, key, sk.AFFINITY, 600)


def _pinned(key: tuple[int, int]) -> dict[str, Any]:
    return expr.affinity_lookup(IPFamily.IPV4, key, sk.AFFINITY)


def _dnat(ip: str) -> list[dict[str, Any]]:
    return [_m({"meta": {"key": "l4proto"}}, "tcp"), {"dnat": {"family": "ip", "addr": ip,
                                                             "port": 8080}}]


def _numgen(mod: int) -> dict[str, Any]:
    return _m({"numgen": {"mode": "random", "mod": mod, "offset": 0}}, 0)


def _chains() -> dict[str, tuple[dict[str, Any] | None, list[tuple[list[Any], str | None]]]]:
    """name -> (base chain head or None, [(expr, comment)])."""
    def web(n: int, sep: str, what: str = "") -> str:
        return f"ns/web:http -> 10.1.0.{n}{what} {sep}"

    return {
        "pre-dnat": ({"type": "filter", "hook": "prerouting", "prio": -110, "policy": "accept"},
                     [([_m({"ct": {"key": "state"}}, "new"),
                        {"jump": {"target": "KUBE-FIREWALL-CHECK"}}], None)]),
        "KUBE-FIREWALL-CHECK": (None, [([_m(VIP, "@firewall-vips"),
                                         _m(VIP_SRC, "@firewall-allow", "!="), {"drop": None}],
                                        "loadBalancerSourceRanges")]),
        "nat-pre": ({"type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"},
                    [([{"vmap": {"key": VIP, "data": "@service-ips"}}], None)]),
        SVC: (None, [
            ([_pinned(KEY1), _update(KEY1), *_dnat("10.1.0.1")],
             web(1, SEP1, " affinity")),
            ([_pinned(KEY2), _update(KEY2), *_dnat("10.1.0.2")],
             web(2, SEP2, " affinity")),
            ([_numgen(2), _update(KEY1), *_dnat("10.1.0.1")], web(1, SEP1)),
            ([_update(KEY2), *_dnat("10.1.0.2")], web(2, SEP2)),
        ]),
        LB: (None, [(_dnat("10.1.0.3"), f"ns/lb:http -> 10.1.0.3:8080 {SEP3}")]),
        "nat-post": ({"type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"},
                     [([{"jump": {"target": "KUBE-POSTROUTING"}}], None)]),
        "KUBE-POSTROUTING": (None, [
            ([_m({"ct": {"key": "status"}}, "dnat", "in"),
              _m({"concat": [_p("saddr"), _p("daddr")]}, "@hairpin-endpoints"),
              {"mangle": {"key": MARK, "value": {"|": [MARK, 0x4000]}}}],
             "hairpin: the client is the endpoint it was sent to"),
            ([_m({"&": [MARK, 0x4000]}, 0), {"return": None}], None),
            ([{"mangle": {"key": MARK, "value": {"^": [MARK, 0x4000]}}}], None),
            ([{"masquerade": {"flags": ["fully-random"]}}], None),
        ]),
    }


def _elem(val: Any, comment: str) -> dict[str, Any]:
    return {"elem": {"val": val, "comment": comment}}


def _sets() -> list[dict[str, Any]]:
    def goto(target: str) -> dict[str, Any]:
        return {"goto": {"target": target}}

    return [
        {"map": {"name": "service-ips", "map": "verdict", "elem": [
            [_elem({"concat": ["10.96.0.10", "tcp", 80]}, "ns/web:http"), goto(SVC)],
            [_elem({"concat": ["192.168.60.10", "tcp", 80]}, "ns/lb:http"), goto(LB)]]}},
        {"set": {"name": "firewall-vips", "elem": [
            _elem({"concat": ["192.168.60.10", "tcp", 80]}, f"{FW} ns/lb:http")]}},
        {"set": {"name": "firewall-allow", "flags": ["interval"], "elem": [
            {"concat": ["192.168.60.10", "tcp", 80,
                        {"prefix": {"addr": "192.168.50.0", "len": 24}}]},
            {"concat": ["192.168.60.10", "tcp", 80, "172.16.0.9"]}]}},
        {"set": {"name": "hairpin-endpoints", "elem": [
            {"concat": [f"10.1.0.{n}", f"10.1.0.{n}"]} for n in (1, 2, 3)]}},
        {"set": {"name": sk.AFFINITY, "flags": ["timeout"], "elem": [
            {"elem": {"val": {"concat": ["192.168.1.2", *KEY2]}, "timeout": 600,
                      "expires": 300}}]}},
    ]


def _table() -> Ruleset:
    objects: list[dict[str, Any]] = []
    for s in _sets():
        ((kind, body),) = s.items()
        objects.append({kind: {"family": "ip", "table": "t", **body}})
    for name, (base, rules) in _chains().items():
        objects.append({"chain": {"family": "ip", "table": "t", "name": name, **(base or {})}})
        for exprs, comment in rules:
            rule: dict[str, Any] = {"family": "ip", "table": "t", "chain": name, "expr": exprs}
            objects.append({"rule": rule | ({"comment": comment} if comment else {})})
    return Ruleset("ip", "t", objects)


WEB = Packet("192.168.1.9", "10.96.0.10", 80)


def test_the_table_is_understood_whole() -> None:
    assert _table().problems() == []


def test_inline_cascade_names_each_endpoints_kube_sep() -> None:
    result = trace(_table(), WEB, HOST)
    got = [(p.endpoint.text() if p.endpoint else "", p.endpoint.chain if p.endpoint else "",
            p.endpoint.identity if p.endpoint else "", p.probability, p.affinity)
           for p in result.paths]
    assert got == [
        ("10.1.0.1:8080", SVC, SEP1, Fraction(1, 2),
         "affinity would pin 192.168.1.9 to this endpoint for 600s (@affinity)"),
        ("10.1.0.2:8080", SVC, SEP2, Fraction(1, 2),
         "affinity would pin 192.168.1.9 to this endpoint for 600s (@affinity)"),
    ]
    assert {p.service for p in result.paths} == {"ns/web:http"}
    assert all(not p.masquerade and p.firewall == "" for p in result.paths)
    assert result.to_json()["paths"][0]["endpoint"]["identity"] == SEP1


def test_an_affinity_rule_pins_a_known_client() -> None:
    (path,) = trace(_table(), replace(WEB, src="192.168.1.2"), HOST).paths
    assert path.endpoint is not None
    assert (path.endpoint.address, path.endpoint.identity, path.probability) == (
        "10.1.0.2", SEP2, Fraction(1))
    assert path.endpoint.comment == f"ns/web:http -> 10.1.0.2 affinity {SEP2}"
    assert path.affinity == "affinity pins 192.168.1.2 to this endpoint (@affinity, 300s left)"


def test_hairpin_masquerades_only_the_client_that_is_the_endpoint() -> None:
    pod = replace(WEB, src="10.1.0.1", origin=Origin.POD)
    paths = trace(_table(), pod, HOST).paths
    assert [(p.endpoint.address if p.endpoint else "", p.masquerade, p.reasons) for p in paths] == [
        ("10.1.0.1", True, ("hairpin: the endpoint itself is the source",)),
        ("10.1.0.2", False, ("not marked for masquerade",)),
    ]
    masq = [s.text for s in paths[0].steps if s.chain == "KUBE-POSTROUTING"]
    assert masq[0].startswith("ct status dnat ip saddr . ip daddr @hairpin-endpoints")


def test_source_ranges_allow_and_drop_naming_kube_fw() -> None:
    rs = _table()
    lb = Packet("192.168.50.7", "192.168.60.10", 80)
    for src in ("192.168.50.7", "172.16.0.9"):  # a prefix, and a host range
        (allowed,) = trace(rs, replace(lb, src=src), HOST).paths
        assert allowed.verdict == "accept" and allowed.firewall == FW
        assert allowed.endpoint is not None and allowed.endpoint.identity == SEP3
        assert allowed.reasons[-1] == f"source {src} is inside loadBalancerSourceRanges"
        assert any(s.text == "@firewall-vips: 192.168.60.10 . tcp . 80" for s in allowed.steps)
    (denied,) = trace(rs, replace(lb, src="192.168.51.7"), HOST).paths
    assert (denied.verdict, denied.service, denied.firewall, denied.reasons) == (
        "drop", "ns/lb:http", FW,
        ("source 192.168.51.7 is outside the service's loadBalancerSourceRanges",))
    assert denied.to_json()["firewall"] == FW
    (other_port,) = trace(rs, replace(lb, src="192.168.51.7", dport=81), HOST).paths
    assert (other_port.verdict, other_port.firewall) == ("accept", "")


def test_identity_survives_a_comment_cut_to_the_budget() -> None:
    spn = ServicePortName("n" * 63, "s" * 63, "p" * 15, L4Protocol.TCP)
    sep = names.endpoint_chain(spn, Endpoint("10.1.0.1", 8080))
    comment = names.tagged(f"{spn} -> 10.1.0.1:8080", sep)
    assert len(comment.encode()) <= names.COMMENT_MAX_BYTES
    assert identity(comment, ENDPOINT) == sep and identity(comment, FIREWALL) == ""
    fw = names.firewall_chain(spn)
    assert split(f"{fw} ns/lb:http") == (fw, "ns/lb:http")
    assert split("ns/web:http cluster IP") == ("", "ns/web:http cluster IP")
