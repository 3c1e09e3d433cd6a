"""`nftproxy dump`: the live table, per service port, for humans and machines.

Layer: dump (pure over the JSON of `nft -j list table`; the CLI reads the
table through the backend). One job: answer "where does a packet for this
service go?" from what is actually programmed -- VIPs, node port, policies,
affinity, source ranges (from the shared `firewall-vips` / `firewall-allow`
sets, per service port, with the port's KUBE-FW-<h>), each endpoint with its
KUBE-SEP-<h> and the probability KUBE-SVC/SVL gives it (dump_endpoints.py
reads the chooser: the inline numgen cascade of a port with ClientIP
affinity, or the shared endpoints map, each endpoint 1/N) -- and rule
counters where present. A port without ClientIP affinity has no chain of
its own: its cluster IP's, external IPs' and LB VIPs' `service-ips`
elements go to `dispatch-<proto>-<N>` (comment "ns/svc:port
KUBE-SVC-<h>", KUBE-SVL-<h> for iTP=Local, KUBE-EXT-<h> for an external
destination), its node port's `service-nodeports` element to
`dispatch-nodeport-<proto>-<N>` (KUBE-EXT-<h>). Each destination's
endpoints are the chooser's elements for it (`vip-endpoints-<proto>` keyed
by the VIP, `nodeport-endpoints-<proto>` by the node port), listed in
`dispatched`. An eTP=Local port's external destination goes to the shared
`external-local` / `nodeport-local` chain (KUBE-EXT-<h>), and its choosers
are the elements of the `*-cluster-choosers` (KUBE-SVC-<h>) and
`*-local-choosers` (KUBE-SVL-<h>) maps, listed in `dispatched` too. A port
with ClientIP affinity keeps its chains in the affinity table
(`nftproxy-affinity`; core/nft/listing.py `list_family` reads both tables
as one): its destinations are `accept` elements of the main table's maps,
read through the same keys of the affinity table's `affinity:service-ips`
/ `affinity:service-nodeports`. The view shows a shared port as one with
chains: the KUBE-SVC/SVL/EXT-<h> the elements name (`chains`, `chooser`
naming the first dispatch chain), its externalTrafficPolicy, the
endpoints (`endpoints`: KUBE-SVC's, which KUBE-EXT goes to;
`local_endpoints`: KUBE-SVL's). It needs no nftproxy process: everything
is recovered from the table (element comments name the service port;
chain names are recomputed hashes; kube-proxy's KUBE-SEP / KUBE-FW names
come from the comments of the endpoints maps' elements or cascade rules,
and of the `firewall-vips` elements).
Addresses: the text brackets an IPv6 address wherever a port follows
("[fd00:96::10]:80"); the JSON keeps address and port as separate fields
(VIPs, endpoints and no-endpoint entries alike).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nftproxy.core.convert.names import printable
from nftproxy.core.model import L4Protocol, ServicePortName
from nftproxy.core.rules import dispatch, names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.fragment import affinity_table_name
from nftproxy.core.trace.identity import EXTERNAL, FIREWALL, LOCAL, chooser, identity, split
from nftproxy.tools.dump_endpoints import (
    Dispatched,
    EndpointView,
    HostPort,
    Listing,
    cascade,
    elem_parts,
    is_index,
    read_listing,
)

__all__ = [
    "Dispatched",
    "EndpointView",
    "HostPort",
    "NoEndpoints",
    "ServiceView",
    "TableView",
    "parse_table",
    "render_text",
]


@dataclass
class NoEndpoints(HostPort):
    """A destination of a service port without endpoints, and what it does."""

    verdict: str = ""


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
    """The port's KUBE-SVC/SVL/EXT chains; for a port with shared choosers,
    the KUBE-SVC/SVL/EXT-<h> they stand in for (no chains in v7)."""
    chooser: str = ""
    """The shared chooser of its first destination in `dispatched` (the
    cluster IP's, if it has one), or "" (the port has chains of its own)."""
    endpoints: list[EndpointView] = field(default_factory=list)
    local_endpoints: list[EndpointView] = field(default_factory=list)
    dispatched: list[Dispatched] = field(default_factory=list)
    """Its destinations that go to shared choosers, each with its chooser,
    KUBE-SVC/SVL/EXT-<h> and endpoints: the cluster IP, external IPs and
    LB VIPs, then the node port."""


@dataclass
class TableView:
    family: str
    table: str
    services: list[ServiceView]
    chains: int
    rules: int
    elements: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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


def _affinity_table_verdicts(parsed: Listing, set_name: str) -> dict[str, Any]:
    """The verdicts of the affinity table's map of the same name (ruleset
    v9: a port with ClientIP affinity is an `accept` in the main table's
    map and a goto into its own chain there), by key."""
    elems = parsed.sets.get(affinity_table_name(set_name), {}).get("elem", [])
    return {_key_text(key): verdict for key, _, verdict in map(elem_parts, elems)}


def _collect(parsed: Listing, family: str) -> dict[tuple[str, str], ServiceView]:
    views: dict[tuple[str, str], ServiceView] = {}
    choosers = [name for name in parsed.sets if dispatch.is_choosers_map(name)]
    for set_name in (
        sk.SERVICE_IPS,
        sk.SERVICE_NODEPORTS,
        sk.NO_ENDPOINT_SERVICES,
        sk.NO_ENDPOINT_NODEPORTS,
        *choosers,
    ):
        aside = _affinity_table_verdicts(parsed, set_name)
        for elem in parsed.sets.get(set_name, {}).get("elem", []):
            key, comment, verdict = elem_parts(elem)
            if not comment:
                continue
            if _target(verdict) == "accept":
                verdict = aside.get(_key_text(key), verdict)
            tag = chooser(comment)
            label = split(comment)[1] if tag else comment
            proto = key[1] if len(key) == 3 else key[0]
            view = views.setdefault((label, proto), ServiceView(label, proto, family))
            where = (
                HostPort(str(key[0]), int(key[2])) if len(key) == 3 else HostPort("", int(key[1]))
            )
            target = _target(verdict).split()[-1]
            if dispatch.is_shared_chain(target) and tag:
                shared = Dispatched(where.address, where.port, target, tag)
                parsed.shared.setdefault((label, proto), []).append(shared)
            if dispatch.is_choosers_map(set_name):
                continue  # an eTP=Local destination's chooser: its VIP is listed already
            if set_name == sk.SERVICE_IPS:
                view.vips.append(where)
                if target.startswith(LOCAL) or tag.startswith(LOCAL):
                    view.policies["internalTrafficPolicy"] = "Local"
            elif set_name == sk.SERVICE_NODEPORTS:
                view.node_port = int(key[1])
            else:
                view.no_endpoints.append(NoEndpoints(where.address, where.port, _target(verdict)))
    return views


def _fill(view: ServiceView, parsed: Listing) -> None:
    spn = _spn(view.service, view.protocol)
    if spn is not None:
        _own_chains(view, spn, parsed)
    _shared_chooser(view, parsed)


def _own_chains(view: ServiceView, spn: ServicePortName, parsed: Listing) -> None:
    """What the port's own chains (recomputed names) say."""
    view.chains = [
        c
        for c in (names.service_chain(spn), names.local_chain(spn), names.external_chain(spn))
        if c in parsed.chains
    ]
    view.endpoints = cascade(parsed.chains.get(names.service_chain(spn), []), parsed)
    view.local_endpoints = cascade(parsed.chains.get(names.local_chain(spn), []), parsed)
    _source_ranges(view, names.firewall_chain(spn), parsed)
    ext = parsed.chains.get(names.external_chain(spn))
    if ext is not None:
        local = any("fib" in str(r.get("expr")) for r in ext)
        view.policies["externalTrafficPolicy"] = "Local" if local else "Cluster"
    for chain in (names.service_chain(spn), names.local_chain(spn)):
        timeout = _affinity_timeout(parsed.chains.get(chain, []))
        if timeout is not None:
            view.affinity_timeout = timeout


def _shared_chooser(view: ServiceView, parsed: Listing) -> None:
    """A port whose destinations go to shared choosers: each destination's
    endpoints are its chooser's elements for it, named by the KUBE-SVC/SVL/
    EXT-<h> its element names (also when the comment had to cut the service
    port's name); the port shows the chains they stand in for."""
    found = sorted(
        parsed.shared.get((view.service, view.protocol), []),
        key=lambda d: (d.identity.startswith(EXTERNAL), d.address == ""),
    )
    if not found:
        return
    for d in found:
        d.endpoints = cascade(parsed.chains.get(d.chooser, []), parsed, d)
        if d.identity.startswith(LOCAL):
            view.local_endpoints = view.local_endpoints or d.endpoints
        elif not dispatch.is_external_local_chain(d.chooser):
            view.endpoints = view.endpoints or d.endpoints
    external = [d for d in found if d.identity.startswith(EXTERNAL)]
    if external:
        local = any(dispatch.is_external_local_chain(d.chooser) for d in external)
        view.policies["externalTrafficPolicy"] = "Local" if local else "Cluster"
    tags = sorted({d.identity for d in found}, key=lambda t: _CHAIN_ORDER.index(t[:9]))
    view.chains = [*tags, *(c for c in view.chains if c not in tags)]
    view.chooser = found[0].chooser
    view.dispatched = found


_CHAIN_ORDER = ("KUBE-SVC-", "KUBE-SVL-", EXTERNAL)
"""The order a port's own chains are shown in (`_own_chains`)."""


def _affinity_timeout(rules: Sequence[Mapping[str, Any]]) -> int | None:
    """A chooser's ClientIP affinity timeout: that of the element its rules
    add or refresh (`update @affinity { ip saddr . K1 . K2 timeout T }`);
    None without affinity."""
    for rule in rules:
        for e in rule.get("expr", []):
            update = e.get("set") if isinstance(e, Mapping) else None
            if not isinstance(update, Mapping) or update.get("op") not in ("add", "update"):
                continue
            elem = update.get("elem")
            inner = elem.get("elem") if isinstance(elem, Mapping) else None
            timeout = inner.get("timeout") if isinstance(inner, Mapping) else None
            if isinstance(timeout, int) and is_index(timeout, 2**32):
                return timeout
    return None


def _source_ranges(view: ServiceView, fw: str, parsed: Listing) -> None:
    """The port's loadBalancerSourceRanges: the `firewall-allow` ranges of
    its VIPs, which are the `firewall-vips` elements its KUBE-FW-<h> names."""
    vips = set()
    for elem in parsed.sets.get(sk.FIREWALL_VIPS, {}).get("elem", []):
        key, comment, _ = elem_parts(elem)
        if identity(comment, FIREWALL) == fw:
            vips.add(_key_text(key))
    if not vips:
        return
    view.firewall = fw
    for elem in parsed.sets.get(sk.FIREWALL_ALLOW, {}).get("elem", []):
        key, _, _ = elem_parts(elem)
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


def parse_table(
    doc: Mapping[str, Any], *, family: str, table: str, service: str | None = None
) -> TableView:
    """Per-service view of one listed table (`service`: "ns/name" filter)."""
    parsed = read_listing(doc)
    views = _collect(parsed, family)
    selected = [
        v for (c, _), v in sorted(views.items()) if service is None or c.split(":")[0] == service
    ]
    for view in selected:
        _fill(view, parsed)
    n_rules = sum(len(r) for r in parsed.chains.values())
    n_elems = sum(len(s.get("elem", [])) for s in parsed.sets.values())
    return TableView(family, table, selected, len(parsed.chains), n_rules, n_elems)


def render_text(view: TableView) -> str:
    lines = [
        f"table {view.family} {view.table}: {view.chains} chains, {view.rules} rules, "
        f"{view.elements} set/map elements"
    ]
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
            lines += _endpoint_lines(eps, "      ")
        lines += _dispatched_lines(s)
        choosers = list(
            dict.fromkeys(
                d.chooser for d in s.dispatched if not dispatch.is_external_local_chain(d.chooser)
            )
        )
        many = "s" if len(choosers) > 1 else ""
        shared = f" (shared chooser{many} {', '.join(choosers)})" if choosers else ""
        if s.chains or shared:  # a port without endpoints may have neither
            lines.append(f"    chains: {(', '.join(s.chains) + shared).lstrip()}")
    # Escaped: comments name services, and whoever wrote the table chose the names.
    return "\n".join(map(printable, lines))


def _endpoint_lines(eps: Sequence[EndpointView], indent: str) -> list[str]:
    out = []
    for ep in eps:
        pk = f"  packets={ep.packets}" if ep.packets is not None else ""
        out.append(f"{indent}{ep.text():<28} {ep.probability:>7.2%}  {ep.identity}{pk}")
    return out


def _dispatched_lines(s: ServiceView) -> list[str]:
    """Each destination with its shared chooser and the KUBE-SVC/SVL/EXT-<h>
    it stands for; its endpoints too where they are not the ones shown."""
    lines = ["    shared choosers:"] if s.dispatched else []
    for d in s.dispatched:
        lines.append(f"      {d.text():<28} -> {d.chooser}  {d.identity}")
        shown = s.local_endpoints if d.identity.startswith(LOCAL) else s.endpoints
        if d.endpoints != shown and not dispatch.is_external_local_chain(d.chooser):
            lines += _endpoint_lines(d.endpoints, "        ") or ["        no endpoints"]
    return lines
