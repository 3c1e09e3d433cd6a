"""`trace` and `dump` on ruleset v3's chooser: the shared endpoints map.

A KUBE-SVC-/KUBE-SVL- chain of a port without ClientIP affinity picks its
endpoint with one rule, `dnat ip to numgen random mod 1 offset H1 . numgen
random mod 1 offset H2 . numgen random mod N map @endpoints-tcp-a-07`: the key
is (H1, H2, i), i uniform over 0..N-1, and the element's data is the
endpoint's address . port, its comment "ns/svc:port -> addr:port
KUBE-SEP-<h>". Aspects, on hand-written listings in the shapes libnftables
1.0.6 and 1.1.3 list (declaration `type` list vs `typeof`, the third numgen
with or without `"offset": 0`, elements with or without an `elem` wrapper):
- trace: 3 endpoints give 3 paths of 1/3 each, DNATed to the element's
  address . port, named by its KUBE-SEP-<h> (path, JSON, `trace` text);
  the chain's other keys (another chain's elements in the same map) are
  never reached; the whole table is understood (`problems()`);
- a missing element: that branch does not match and goes on with the next
  rule (here a reject), saying "no element";
- IPv6 (`dnat ip6`, `fd00::1 . 8080` data);
- the live trace's question, the other way round: which element (key and
  KUBE-SEP-<h>) sent a packet seen going to addr:port (`dnat_element`);
- dump: per service port, the elements of its chain's key (not another
  chain's), 1/3 each, named by KUBE-SEP-<h>, in text and JSON; a missing
  element's share is not shown.
"""

from __future__ import annotations

from fractions import Fraction
from ipaddress import ip_address
from typing import Any

import pytest

from nftproxy.core.model import Endpoint, L4Protocol, ServicePortName
from nftproxy.core.rules import names
from nftproxy.core.trace import Host, Packet, Ruleset, trace
from nftproxy.core.trace import syntax as sx
from nftproxy.core.trace.evaluate import dnat_element
from nftproxy.tools.dump import parse_table, render_text
from nftproxy.tools.trace import render_text as trace_text

WEB = ServicePortName("ns", "web", "http", L4Protocol.TCP)
API = ServicePortName("ns", "api", "http", L4Protocol.TCP)
H1, H2 = 1139835961, 2047483647
OTHER = (5, 6)
"""API's chain key: its elements share the map with WEB's."""
MAP = "endpoints-tcp-a-07"
SHAPES = ("1.0.6", "1.1.3", "as-written")
HOST = Host.of(["192.168.1.1"])
CHOOSER = f"{WEB} -> 3 endpoints"


def _ips(family: str) -> list[str]:
    return [f"10.1.0.{n}" if family == "ip" else f"fd00::{n}" for n in (1, 2, 3)]


def _seps(family: str) -> list[str]:
    return [names.endpoint_chain(WEB, Endpoint(ip, 8080)) for ip in _ips(family)]


def _numgen(mod: int, offset: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"mode": "random", "mod": mod}
    return {"numgen": body | ({} if offset is None else {"offset": offset})}


def _chooser(family: str, key: tuple[int, int], n: int, shape: str) -> dict[str, Any]:
    """The map-form rule: `meta l4proto tcp dnat ip to ... map @endpoints-tcp-a-07`."""
    third = None if shape == "as-written" else 0
    parts = [_numgen(1, key[0]), _numgen(1, key[1]), _numgen(n, third)]
    return {"expr": [
        {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
        {"dnat": {"family": family, "addr": {"map": {
            "key": {"concat": parts}, "data": "@" + MAP}}}}]}


def _map(family: str, shape: str, elements: list[Any]) -> dict[str, Any]:
    addr = "ipv4_addr" if family == "ip" else "ipv6_addr"
    if shape == "1.1.3":
        typeof = {"concat": [_numgen(1, 0)] * 3}
        decl: dict[str, Any] = {"type": {"typeof": typeof}, "map": [addr, "inet_service"]}
    else:
        decl = {"type": ["integer"] * 3, "map": f"{addr} . inet_service"}
    return {"map": {"name": MAP, "handle": 5, **decl, "elem": elements}}


def _element(key: tuple[int, int], i: int, ip: str, comment: str | None) -> list[Any]:
    val: dict[str, Any] = {"concat": [*key, i]}
    return [{"elem": {"val": val, "comment": comment}} if comment else val,
            {"concat": [ip, 8080]}]


def _listing(family: str = "ip", shape: str = "1.0.6", *, missing: int | None = None,
             then_reject: bool = False) -> dict[str, Any]:
    """WEB (3 endpoints, one VIP) and API (2 endpoints) choosing from one
    map; `missing`: WEB's element of that index is not in it;
    `then_reject`: WEB's chain has a reject rule after its chooser."""
    vip = "10.96.0.10" if family == "ip" else "fd00:96::10"
    svc, api = names.service_chain(WEB), names.service_chain(API)
    ips, seps = _ips(family), _seps(family)
    elems = [_element((H1, H2), i, ips[i], f"{WEB} -> {ips[i]}:8080 {seps[i]}")
             for i in range(3) if i != missing]
    elems += [_element(OTHER, i, f"{ips[0][:-1]}9", None) for i in range(2)]
    mark = {"expr": [{"match": {"op": "!=", "left": {"payload": {
        "protocol": family, "field": "saddr"}}, "right": "@pods"}},
        {"jump": {"target": "KUBE-MARK-MASQ"}}]}
    vmap_key = {"concat": [{"payload": {"protocol": family, "field": "daddr"}},
                           {"meta": {"key": "l4proto"}},
                           {"payload": {"protocol": "th", "field": "dport"}}]}
    chains: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
        "nat-prerouting": ({"type": "nat", "hook": "prerouting", "prio": -100,
                            "policy": "accept"},
                           [{"expr": [{"vmap": {"key": vmap_key, "data": "@service-ips"}}]}]),
        "KUBE-MARK-MASQ": ({}, [{"expr": [{"mangle": {"key": {"meta": {"key": "mark"}},
                                                       "value": {"|": [{"meta": {
                                                           "key": "mark"}}, 0x4000]}}}]}]),
        svc: ({}, [mark, _chooser(family, (H1, H2), 3, shape) | {"comment": CHOOSER},
                   *([{"expr": [{"reject": None}]}] if then_reject else [])]),
        api: ({}, [_chooser(family, OTHER, 2, shape)]),
    }
    service_ips = [[{"elem": {"val": {"concat": [vip, "tcp", 80]}, "comment": str(WEB)}},
                    {"goto": {"target": svc}}]]
    objects: list[dict[str, Any]] = [
        {"map": {"name": "service-ips", "map": "verdict", "elem": service_ips}},
        {"set": {"name": "pods", "flags": ["interval"], "elem": [
            {"prefix": {"addr": "10.244.0.0" if family == "ip" else "fd00:244::", "len": 16}}]}},
        _map(family, shape, elems),
    ]
    for name, (head, rules) in chains.items():
        objects.append({"chain": {"name": name, **head}})
        objects += [{"rule": {"chain": name, **rule}} for rule in rules]
    ours = {"family": family, "table": "nftproxy"}
    return {"nftables": [{kind: ours | body for kind, body in o.items()} for o in objects]}


def _trace(doc: dict[str, Any], family: str = "ip") -> Any:
    rs = Ruleset.from_listing(doc, family, "nftproxy")
    assert rs.problems() == []
    dst = "10.96.0.10" if family == "ip" else "fd00:96::10"
    src = "192.168.1.9" if family == "ip" else "fd00:50::9"
    return trace(rs, Packet(src, dst, 80), HOST)


def _endpoints(result: Any) -> list[tuple[str, str, str, Fraction]]:
    return [(p.endpoint.text(), p.endpoint.chain, p.endpoint.identity, p.probability)
            for p in result.paths if p.endpoint is not None]


@pytest.mark.parametrize("shape", SHAPES)
def test_three_endpoints_three_paths_of_a_third_named_by_kube_sep(shape: str) -> None:
    result = _trace(_listing(shape=shape))
    svc, seps = names.service_chain(WEB), _seps("ip")
    third = Fraction(1, 3)
    assert _endpoints(result) == [(f"10.1.0.{n}:8080", svc, seps[n - 1], third) for n in (1, 2, 3)]
    assert len(result.paths) == 3 and all(p.verdict == "accept" for p in result.paths)
    assert {p.service for p in result.paths} == {str(WEB)}
    assert all(p.chains == (svc,) for p in result.paths)
    assert result.to_json()["paths"][1]["endpoint"]["identity"] == seps[1]
    hits = [s for s in result.paths[2].steps if s.text.startswith("@" + MAP)]
    assert [(s.text, s.share, s.rule) for s in hits] == [
        (f"@{MAP}: {H1} . {H2} . 2 : dnat to 10.1.0.3:8080", third, 2)]
    assert hits[0].comment == f"{WEB} -> 10.1.0.3:8080 {seps[2]}"


def test_trace_text_names_each_endpoint_and_shows_the_rule() -> None:
    text = trace_text(_trace(_listing()))
    seps = _seps("ip")
    for n, sep in enumerate(seps, 1):
        assert f"10.1.0.{n}:8080" in text and text.count(sep) >= 2, text  # summary + step
    rule = (f"meta l4proto tcp dnat ip to numgen random mod 1 offset {H1} . numgen random "
            f"mod 1 offset {H2} . numgen random mod 3 map @{MAP}")
    assert rule in text, text
    assert f"{MAP}: {H1} . {H2} . 0 : dnat to 10.1.0.1:8080 [1/3]  ({WEB} -> 10.1.0.1:8080 " \
           f"{seps[0]})" in text, text


@pytest.mark.parametrize("shape", SHAPES)
def test_a_missing_element_goes_on_with_the_next_rule(shape: str) -> None:
    result = _trace(_listing(shape=shape, missing=1, then_reject=True))
    seps = _seps("ip")
    svc = names.service_chain(WEB)
    assert _endpoints(result) == [("10.1.0.1:8080", svc, seps[0], Fraction(1, 3)),
                                  ("10.1.0.3:8080", svc, seps[2], Fraction(1, 3))]
    (rejected,) = [p for p in result.paths if p.endpoint is None]
    assert (rejected.verdict, rejected.probability) == ("reject", Fraction(1, 3))
    texts = [s.text for s in rejected.steps if s.chain == svc]
    assert f"@{MAP}: no element {H1} . {H2} . 1" in texts
    assert texts[-1] == "reject"


def test_a_missing_element_at_the_chains_end_returns_undnatted() -> None:
    result = _trace(_listing(missing=0))
    assert [p.endpoint.address if p.endpoint else None for p in result.paths] == [
        "10.1.0.2", "10.1.0.3", None]
    assert (result.paths[2].verdict, result.paths[2].destination) == ("accept", "10.96.0.10:80")


@pytest.mark.parametrize("shape", SHAPES)
def test_ipv6_endpoints_map(shape: str) -> None:
    result = _trace(_listing("ip6", shape), "ip6")
    svc, seps = names.service_chain(WEB), _seps("ip6")
    assert _endpoints(result) == [
        (f"[fd00::{n}]:8080", svc, seps[n - 1], Fraction(1, 3)) for n in (1, 2, 3)]
    assert result.paths[0].destination == "[fd00::1]:8080"


@pytest.mark.parametrize("family", ["ip", "ip6"])
def test_the_element_that_sent_a_packet_is_found_by_its_target(family: str) -> None:
    rs = Ruleset.from_listing(_listing(family), family, "nftproxy")
    (chooser,) = [s for s in rs.chain(names.service_chain(WEB)).rules[1].statements
                  if isinstance(s, sx.DnatMap)]
    found = dnat_element(chooser, rs, ip_address(_ips(family)[1]), 8080)
    assert found is not None and found[0] == (H1, H2, 1)
    assert found[1].comment is not None and found[1].comment.endswith(_seps(family)[1])
    assert dnat_element(chooser, rs, ip_address(_ips(family)[1]), 8081) is None
    other = ip_address(_ips(family)[0][:-1] + "9")  # API's endpoint: not this chain's key
    assert dnat_element(chooser, rs, other, 8080) is None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["ip", "ip6"])
def test_dump_shows_the_chains_elements_a_third_each(family: str, shape: str) -> None:
    view = parse_table(_listing(family, shape), family=family, table="nftproxy")
    (web,) = view.to_json()["services"]
    seps, ips = _seps(family), _ips(family)
    assert [(e["address"], e["port"], e["identity"], e["probability"]) for e in web["endpoints"]
            ] == [(ip, 8080, sep, 0.3333) for ip, sep in zip(ips, seps, strict=True)]
    text = render_text(view)
    for ip, sep in zip(ips, seps, strict=True):
        where = f"{ip}:8080" if family == "ip" else f"[{ip}]:8080"
        assert f"      {where:<28}  33.33%  {sep}" in text, text
    assert "9:8080" not in text  # API's elements: another chain's key


def test_dump_leaves_a_missing_elements_share_out() -> None:
    view = parse_table(_listing(missing=1), family="ip", table="nftproxy")
    (web,) = view.services
    assert [(e.address, e.identity, e.probability) for e in web.endpoints] == [
        ("10.1.0.1", _seps("ip")[0], 0.3333), ("10.1.0.3", _seps("ip")[2], 0.3333)]
