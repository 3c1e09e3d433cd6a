"""`nftproxy dump`: the live table, per service port, for humans and machines.

Layer: dump (pure over the JSON of `nft -j list table`; the CLI reads the
table through the backend). One job: answer "where does a packet for this
service go?" from what is actually programmed -- VIPs, node port, policies,
affinity, source ranges (from the shared `firewall-vips` / `firewall-allow`
sets, per service port, with the port's KUBE-FW-<h>), each endpoint with its
KUBE-SEP-<h> and the probability KUBE-SVC/SVL gives it -- through the shared
endpoints map (ruleset v3: `dnat to numgen . numgen . numgen random mod N
map @endpoints-<proto>-<a|b>`, the elements keyed by the chain's two
constants, each 1/N) or, for a port with ClientIP affinity, the inline
numgen cascade -- and rule counters where present. It needs no nftproxy process:
everything is recovered from the table (element comments name the service
port; chain names are recomputed hashes; kube-proxy's KUBE-SEP / KUBE-FW
names, no chains in ruleset v2, come from the comments of the DNAT rules
and of the `firewall-vips` elements, or of the endpoints map's elements).
A ruleset v1 table (KUBE-SEP and
KUBE-FW chains, written by an older nftproxy) is not read for endpoints or
source ranges; the view says so (`notice`) until a full sync replaces it.
Addresses: the text brackets an IPv6 address wherever a port follows
("[fd00:96::10]:80"); the JSON keeps address and port as separate fields
(VIPs, endpoints and no-endpoint entries alike).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nftproxy.core.address import format_address
from nftproxy.core.model import L4Protocol, ServicePortName
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.trace.identity import ENDPOINT, FIREWALL, identity

__all__ = [
    "EndpointView",
    "HostPort",
    "NoEndpoints",
    "ServiceView",
    "TableView",
    "parse_table",
    "render_text",
]


@dataclass
class HostPort:
    """Where a packet is addressed; address "" is a node port (any node-port address)."""

    address: str
    port: int

    def text(self) -> str:
        """'10.96.0.10:80', '[fd00:96::10]:80' or 'nodePort 30080'."""
        return format_address(self.address, self.port) if self.address else f"nodePort {self.port}"


@dataclass
class NoEndpoints(HostPort):
    """A destination of a service port without endpoints, and what it does."""

    verdict: str = ""


@dataclass
class EndpointView(HostPort):
    """One endpoint of a KUBE-SVC/SVL chain, named by its KUBE-SEP-<h>
    (from the comment of the DNAT rule or of the endpoints map's element;
    "" when the comment has none)."""

    identity: str = ""
    probability: float = 0.0
    local_chain: bool = False
    packets: int | None = None


@dataclass
class ServiceView:
    service: str
    protocol: str
    family: str
    vips: list[HostPort] = field(default_factory=list)
    node_port: int | None = None
    no_endpoints: list[NoEndpoints] = field(default_factory=list)
    source_ranges: list[str] = field(default_factory=list)
    firewall: str = ""
    """KUBE-FW-<h> of the port's `firewall-vips` elements ("" without source ranges)."""
    affinity_timeout: int | None = None
    policies: dict[str, str] = field(default_factory=dict)
    chains: list[str] = field(default_factory=list)
    endpoints: list[EndpointView] = field(default_factory=list)
    local_endpoints: list[EndpointView] = field(default_factory=list)


@dataclass
class TableView:
    family: str
    table: str
    services: list[ServiceView]
    chains: int
    rules: int
    elements: int
    notice: str = ""
    """Why part of the table is not shown (a ruleset v1 table), or ""."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_Target = tuple[str, int, str]
"""An endpoints-map element: address, port, KUBE-SEP-<h> (or "")."""


@dataclass
class _Parsed:
    chains: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)
    sets: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    keyed: dict[str, dict[tuple[int, int], dict[int, _Target]]] = field(default_factory=dict)
    """Endpoints maps read by key (`_keyed_elements`), on first use."""


def _objects(doc: Mapping[str, Any]) -> _Parsed:
    parsed = _Parsed()
    for item in doc.get("nftables", ()):
        if "chain" in item:
            parsed.chains.setdefault(item["chain"]["name"], [])
        elif "rule" in item:
            parsed.chains.setdefault(item["rule"]["chain"], []).append(item["rule"])
        elif "map" in item or "set" in item:
            obj = item.get("map") or item["set"]
            parsed.sets[obj["name"]] = obj
    return parsed


def _elem_parts(elem: Any) -> tuple[Any, str | None, Any]:
    """(key, comment, verdict) of one listed element."""
    verdict = None
    if isinstance(elem, list) and len(elem) == 2:
        elem, verdict = elem
    comment = None
    if isinstance(elem, dict) and "elem" in elem:
        comment = elem["elem"].get("comment")
        elem = elem["elem"]["val"]
    key = elem["concat"] if isinstance(elem, dict) and "concat" in elem else [elem]
    return key, comment, verdict


def _spn(comment: str, protocol: str) -> ServicePortName | None:
    ns, _, rest = comment.partition("/")
    name, _, port = rest.partition(":")
    try:
        return ServicePortName(ns, name, port, L4Protocol(protocol.upper()))
    except ValueError:
        return None


def _target(verdict: Any) -> str:
    if isinstance(verdict, dict):
        for kind, body in verdict.items():
            return f"{kind} {body['target']}" if isinstance(body, dict) else kind
    return str(verdict)


def _cascade(rules: Sequence[Mapping[str, Any]], parsed: _Parsed) -> list[EndpointView]:
    """Endpoints of a KUBE-SVC/SVL chain with the probability it gives each:
    every rule that DNATs (a cascade rule, or the lookup in the endpoints
    map), but the affinity rules (a lookup of the source in a set: they
    only repeat a past choice)."""
    out: list[EndpointView] = []
    remaining = 1.0
    for rule in rules:
        exprs = rule.get("expr", [])
        dnat = next((e["dnat"] for e in exprs if "dnat" in e), None)
        if not isinstance(dnat, Mapping) or any(_is_set_lookup(e) for e in exprs):
            continue
        if isinstance(dnat.get("addr"), Mapping):
            found, taken = _map_endpoints(dnat["addr"], parsed, remaining)
            out, remaining = out + found, remaining - taken
            continue
        share = remaining / _numgen_mod(exprs)
        remaining -= share
        sep = identity(rule.get("comment"), ENDPOINT)
        out.append(
            EndpointView(
                str(dnat.get("addr", "?")),
                int(dnat.get("port", 0)),
                sep,
                round(share, 4),
                packets=_counter(rule),
            )
        )
    return out


def _map_endpoints(
    addr: Mapping[str, Any], parsed: _Parsed, share: float
) -> tuple[list[EndpointView], float]:
    """The endpoints `dnat to numgen random mod 1 offset H1 . numgen random
    mod 1 offset H2 . numgen random mod N map @m` reaches -- the elements
    of @m keyed (H1, H2, i < N), each with 1/N of `share` -- and the share
    they take (a missing element's falls through to the next rule)."""
    lookup = addr.get("map")
    key = _map_key(lookup.get("key") if isinstance(lookup, Mapping) else None)
    data = lookup.get("data") if isinstance(lookup, Mapping) else None
    if key is None or not isinstance(data, str):
        return [], 0.0
    chain, first, n = key
    elements = _keyed_elements(parsed, data.removeprefix("@")).get(chain, {})
    found = [
        EndpointView(addr, port, sep, round(share / n, 4))
        for addr, port, sep in (elements[i] for i in sorted(elements) if first <= i < first + n)
    ]
    return found, share * len(found) / n


def _keyed_elements(parsed: _Parsed, name: str) -> dict[tuple[int, int], dict[int, _Target]]:
    """@name's `address . port` elements by (H1, H2), then index (built
    once per map: a dump looks up every service port's chain in it)."""
    if name not in parsed.keyed:
        index: dict[tuple[int, int], dict[int, _Target]] = {}
        for elem in parsed.sets.get(name, {}).get("elem", []):
            parts, comment, data = _elem_parts(elem)
            target = _target_of(data, comment)
            if len(parts) == 3 and all(_index(p, 2**32) for p in parts) and target:
                index.setdefault((parts[0], parts[1]), {}).setdefault(parts[2], target)
        parsed.keyed[name] = index
    return parsed.keyed[name]


def _map_key(node: Any) -> tuple[tuple[int, int], int, int] | None:
    """((H1, H2), O, N) of a `numgen random mod 1 offset H1 . numgen random
    mod 1 offset H2 . numgen random mod N [offset O]` key, or None."""
    parts: Any = node.get("concat") if isinstance(node, Mapping) else None
    if not isinstance(parts, list) or len(parts) != 3:
        return None
    gens: list[Any] = [p.get("numgen") if isinstance(p, Mapping) else None for p in parts]
    if not all(isinstance(g, Mapping) for g in gens):
        return None
    (h1, one1), (h2, one2), (first, n) = ((g.get("offset", 0), g.get("mod")) for g in gens)
    if one1 != 1 or one2 != 1 or not all(_index(v, 2**32) for v in (h1, h2, first, n)):
        return None
    return ((h1, h2), first, n) if n > 0 else None


def _index(value: Any, below: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < below


def _target_of(data: Any, comment: str | None) -> _Target | None:
    """An endpoints-map element's (address, port, KUBE-SEP-<h>), or None."""
    pair = data.get("concat") if isinstance(data, Mapping) else None
    if not isinstance(pair, list) or len(pair) != 2 or not _index(pair[1], 65536):
        return None
    return str(pair[0]), pair[1], identity(comment, ENDPOINT)


def _is_set_lookup(e: Mapping[str, Any]) -> bool:
    right = e["match"]["right"] if "match" in e else None
    return isinstance(right, str) and right.startswith("@")


def _numgen_mod(exprs: Iterable[Mapping[str, Any]]) -> int:
    for e in exprs:
        left = e["match"]["left"] if "match" in e else None
        if isinstance(left, Mapping) and "numgen" in left:
            return int(left["numgen"]["mod"])
    return 1


def _counter(rule: Mapping[str, Any]) -> int | None:
    for e in rule.get("expr", []):
        if "counter" in e and isinstance(e["counter"], dict):
            return int(e["counter"].get("packets", 0))
    return None


def _collect(parsed: _Parsed, family: str) -> dict[tuple[str, str], ServiceView]:
    views: dict[tuple[str, str], ServiceView] = {}
    for set_name in (
        sk.SERVICE_IPS,
        sk.SERVICE_NODEPORTS,
        sk.NO_ENDPOINT_SERVICES,
        sk.NO_ENDPOINT_NODEPORTS,
    ):
        for elem in parsed.sets.get(set_name, {}).get("elem", []):
            key, comment, verdict = _elem_parts(elem)
            if not comment:
                continue
            proto = key[1] if len(key) == 3 else key[0]
            view = views.setdefault((comment, proto), ServiceView(comment, proto, family))
            where = (
                HostPort(str(key[0]), int(key[2])) if len(key) == 3 else HostPort("", int(key[1]))
            )
            if set_name == sk.SERVICE_IPS:
                view.vips.append(where)
                if _target(verdict).startswith("goto KUBE-SVL-"):
                    view.policies["internalTrafficPolicy"] = "Local"
            elif set_name == sk.SERVICE_NODEPORTS:
                view.node_port = int(key[1])
            else:
                view.no_endpoints.append(NoEndpoints(where.address, where.port, _target(verdict)))
    return views


def _fill(view: ServiceView, parsed: _Parsed) -> None:
    spn = _spn(view.service, view.protocol)
    if spn is None:
        return
    view.chains = [
        c
        for c in (names.service_chain(spn), names.local_chain(spn), names.external_chain(spn))
        if c in parsed.chains
    ]
    view.endpoints = _cascade(parsed.chains.get(names.service_chain(spn), []), parsed)
    view.local_endpoints = _cascade(parsed.chains.get(names.local_chain(spn), []), parsed)
    _source_ranges(view, names.firewall_chain(spn), parsed)
    ext = parsed.chains.get(names.external_chain(spn))
    if ext is not None:
        local = any("fib" in str(r.get("expr")) for r in ext)
        view.policies["externalTrafficPolicy"] = "Local" if local else "Cluster"
    for chain in (names.service_chain(spn), names.local_chain(spn)):
        timeout = _affinity_timeout(parsed.chains.get(chain, []), parsed)
        if timeout is not None:
            view.affinity_timeout = timeout


def _affinity_timeout(rules: Sequence[Mapping[str, Any]], parsed: _Parsed) -> int | None:
    """A chooser's ClientIP affinity timeout: that of the element its rules
    add or refresh (ruleset v4: `update @affinity { ip saddr . K1 . K2
    timeout T }`), else of the set they update (v3: a set per endpoint,
    `update @KUBE-SEP-<h>-affinity { ip saddr }`); None without affinity."""
    for rule in rules:
        for e in rule.get("expr", []):
            update = e.get("set") if isinstance(e, Mapping) else None
            if not isinstance(update, Mapping) or update.get("op") not in ("add", "update"):
                continue
            elem = update.get("elem")
            inner = elem.get("elem") if isinstance(elem, Mapping) else None
            timeout = inner.get("timeout") if isinstance(inner, Mapping) else None
            if timeout is None:
                name = str(update.get("set", "")).removeprefix("@")
                timeout = parsed.sets.get(name, {}).get("timeout")
            if isinstance(timeout, int) and _index(timeout, 2**32):
                return timeout
    return None


def _source_ranges(view: ServiceView, fw: str, parsed: _Parsed) -> None:
    """The port's loadBalancerSourceRanges: the `firewall-allow` ranges of
    its VIPs, which are the `firewall-vips` elements its KUBE-FW-<h> names."""
    vips = set()
    for elem in parsed.sets.get(sk.FIREWALL_VIPS, {}).get("elem", []):
        key, comment, _ = _elem_parts(elem)
        if identity(comment, FIREWALL) == fw:
            vips.add(_key_text(key))
    if not vips:
        return
    view.firewall = fw
    for elem in parsed.sets.get(sk.FIREWALL_ALLOW, {}).get("elem", []):
        key, _, _ = _elem_parts(elem)
        allowed = _range_text(key[-1])
        if _key_text(key[:-1]) in vips and allowed not in view.source_ranges:
            view.source_ranges.append(allowed)


def _key_text(parts: Sequence[Any]) -> str:
    """A VIP . protocol . port key, comparable across sets (a one-address
    range, as an interval set may list it, is the address)."""
    return " . ".join(_range_text(p) for p in parts)


def _range_text(r: Any) -> str:
    if isinstance(r, dict) and "prefix" in r:
        return f"{r['prefix']['addr']}/{r['prefix']['len']}"
    if isinstance(r, dict) and "range" in r:
        low, high = r["range"]
        return str(low) if low == high else f"{low}-{high}"
    return str(r)


def _v1_notice(parsed: _Parsed) -> str:
    old = [c for c in parsed.chains if c.startswith(("KUBE-SEP-", "KUBE-FW-"))]
    if not old and "firewall-ips" not in parsed.sets:
        return ""
    return (
        "ruleset v1 (KUBE-SEP / KUBE-FW chains), written by an older nftproxy: "
        "endpoints and source ranges are not shown; the next full sync replaces it"
    )


def parse_table(
    doc: Mapping[str, Any], *, family: str, table: str, service: str | None = None
) -> TableView:
    """Per-service view of one listed table (`service`: "ns/name" filter)."""
    parsed = _objects(doc)
    views = _collect(parsed, family)
    selected = [
        v for (c, _), v in sorted(views.items()) if service is None or c.split(":")[0] == service
    ]
    for view in selected:
        _fill(view, parsed)
    n_rules = sum(len(r) for r in parsed.chains.values())
    n_elems = sum(len(s.get("elem", [])) for s in parsed.sets.values())
    return TableView(
        family, table, selected, len(parsed.chains), n_rules, n_elems, _v1_notice(parsed)
    )


def render_text(view: TableView) -> str:
    lines = [
        f"table {view.family} {view.table}: {view.chains} chains, {view.rules} rules, "
        f"{view.elements} set/map elements"
    ]
    if view.notice:
        lines.append(f"  note: {view.notice}")
    for s in view.services:
        lines.append(f"  {s.service} ({s.protocol})")
        if s.vips:
            lines.append(f"    VIPs:        {', '.join(v.text() for v in s.vips)}")
        if s.node_port:
            lines.append(f"    nodePort:    {s.node_port}")
        for k, v in s.policies.items():
            lines.append(f"    {k}: {v}")
        if s.affinity_timeout:
            lines.append(f"    sessionAffinity: ClientIP, timeout {s.affinity_timeout}s")
        if s.source_ranges:
            lines.append(f"    sourceRanges: {', '.join(s.source_ranges)}  ({s.firewall})")
        for n in s.no_endpoints:
            lines.append(f"    no endpoints: {n.text()} -> {n.verdict}")
        for label, eps in (("endpoints", s.endpoints), ("local endpoints", s.local_endpoints)):
            if eps:
                lines.append(f"    {label}:")
            for ep in eps:
                pk = f"  packets={ep.packets}" if ep.packets is not None else ""
                lines.append(f"      {ep.text():<28} {ep.probability:>7.2%}  {ep.identity}{pk}")
        lines.append(f"    chains: {', '.join(s.chains)}")
    return "\n".join(lines)
