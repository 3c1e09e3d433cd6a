"""One service port -> its fragment of the ruleset.

Layer: rules (pure). One job: kube-proxy's per-service-port semantics
(docs/kube-proxy-semantics.md, upstream-nftables-notes.md §1.5-§1.15) as
small per-feature renderers, each a pure function of the decisions in
`PortPlan`. `render_service_port` composes them.

A port without ClientIP affinity has no chain: each of its destinations
is an element that goes to the shared chooser of its endpoint count (an
eTP=Local external destination: to the shared external-local chain, whose
maps the port fills with its cluster and local choosers), and the port owns
the elements the chooser picks from (rules/dispatch.py has the shape). A
port with ClientIP affinity keeps kube-proxy's chains, in the affinity
table: KUBE-SVC (Cluster-policy chooser), KUBE-SVL (Local-policy chooser),
KUBE-EXT (external destinations). Their chooser is kube-proxy's numgen
cascade, DNATing inline: rule i of n is `numgen random mod (n-i) == 0
update @affinity { ip saddr . K1 . K2 timeout T } meta l4proto P dnat to
EP`, the last without numgen, after one lookup rule per endpoint, `ip
saddr . K1 . K2 @affinity` (K: the endpoint's key, from its KUBE-SEP-<h>);
one shared set remembers every client of every endpoint. Everything else a
port needs is elements of shared sets and maps: dispatch (service-ips,
...), hairpin (endpoint . endpoint), loadBalancerSourceRanges
(firewall-vips, firewall-allow; KUBE-FW-<h> in the comment).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import Endpoint, IPFamily, NodeInfo, ServicePort
from nftproxy.core.rules import dispatch, expr, names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.detect import LocalDetector, masquerade_source
from nftproxy.core.rules.fragment import (
    Chain,
    Element,
    Fragment,
    Json,
    Rule,
    Shared,
    Target,
    Verdict,
    affinity_table_name,
)
from nftproxy.core.topology import EndpointCategories, categorize

__all__ = ["PortPlan", "RenderContext", "RenderedPort", "plan_port", "render_service_port"]

REJECT = Verdict("goto", sk.REJECT)
DROP = Verdict("drop")
ACCEPT = Verdict("accept")


@dataclass(frozen=True, slots=True)
class RenderContext:
    """Everything a service port's fragment depends on besides the port itself."""

    family: IPFamily
    config: ProxyConfig
    node: NodeInfo
    detector: LocalDetector | None
    choosers: dispatch.Choosers = field(compare=False)
    """The shared choosers the render's ports use (skeleton.choosers)."""


@dataclass(frozen=True, slots=True)
class PortPlan:
    """The decisions kube-proxy's syncProxyRules makes per service port."""

    port: ServicePort
    cats: EndpointCategories
    has_internal: bool
    has_external: bool
    uses_cluster_chain: bool
    uses_local_chain: bool
    uses_ext_chain: bool
    uses_fw_chain: bool
    label: str
    """str(port.name), as comments start."""
    seps: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """The render's memo: endpoint address -> its KUBE-SEP name (an endpoint
    is named once per destination: cluster IP, node port, external IPs)."""
    uses: dict[int, Shared] = field(default_factory=dict, compare=False, repr=False)
    """The shared choosers and chains the port's elements go to, by identity."""

    def use(self, shared: Shared) -> None:
        self.uses.setdefault(id(shared), shared)

    @property
    def shared(self) -> bool:
        """Every destination of the port goes through the shared choosers
        (rules/dispatch.py) and the port has no chain of its own: all but
        ClientIP affinity."""
        return not self.port.affinity

    @property
    def internal_chain(self) -> str:
        spn = self.port.name
        return (
            names.local_chain(spn) if self.port.internal_policy_local else names.service_chain(spn)
        )

    @property
    def internal_endpoints(self) -> tuple[Endpoint, ...]:
        """What the cluster IP's chooser picks from (KUBE-SVC's or KUBE-SVL's)."""
        return _internal_endpoints(self.port, self.cats)

    @property
    def shared_chooser(self) -> tuple[Endpoint, ...] | None:
        """The endpoints the cluster IP's shared chooser picks from, None
        when it has none (the port is not `shared`, or its cluster IP has
        no endpoint to go to)."""
        return self.internal_endpoints if self.shared and self.has_internal else None

    @property
    def internal_verdict(self) -> Verdict:
        """What traffic to the cluster IP gets when has_internal is False."""
        return REJECT if not self.cats.has_any else DROP

    @property
    def external_verdict(self) -> Verdict:
        return REJECT if not self.cats.has_any else DROP


@dataclass(frozen=True, slots=True)
class RenderedPort:
    fragment: Fragment
    internal_dropped: bool
    """iTP=Local with endpoints elsewhere but none here (metric no_local_endpoints)."""
    external_dropped: bool
    """eTP=Local with endpoints elsewhere but none here."""


def plan_port(port: ServicePort, endpoints: Sequence[Endpoint], ctx: RenderContext) -> PortPlan:
    cats = categorize(endpoints, port, ctx.node, prefer_same_node=ctx.config.prefer_same_node)
    has_internal = cats.has_any and (not port.internal_policy_local or bool(cats.local))
    has_external = cats.has_any and (not port.external_policy_local or bool(cats.local))
    uses_ext_chain = cats.has_any and port.externally_accessible
    return PortPlan(
        port=port,
        cats=cats,
        has_internal=has_internal,
        has_external=has_external,
        uses_cluster_chain=bool(cats.cluster) and port.uses_cluster_endpoints,
        uses_local_chain=bool(cats.local) and port.uses_local_endpoints,
        uses_ext_chain=uses_ext_chain,
        uses_fw_chain=bool(port.load_balancer_vips and port.load_balancer_source_ranges),
        label=str(port.name),
    )


def _internal_endpoints(port: ServicePort, cats: EndpointCategories) -> tuple[Endpoint, ...]:
    return cats.local if port.internal_policy_local else cats.cluster


def _key(ip: str, port: ServicePort, number: int) -> tuple[str, str, int]:
    return (ip, port.protocol.nft, number)


def _cluster_ip_elements(p: PortPlan, ctx: RenderContext) -> list[Element]:
    port, label = p.port, p.label
    key = _key(port.cluster_ip, port, port.port)
    out = [Element(sk.CLUSTER_IPS, (port.cluster_ip,))]
    if not p.has_internal:
        out.append(Element(sk.NO_ENDPOINT_SERVICES, key, p.internal_verdict, label))
    elif p.shared:
        out += _shared_vip(p, port.cluster_ip, p.internal_endpoints, p.internal_chain, ctx)
    else:
        out.append(Element(sk.SERVICE_IPS, key, Verdict("goto", p.internal_chain), label))
    return out


def _external_elements(p: PortPlan, ctx: RenderContext) -> list[Element]:
    """External IPs and LB VIPs go to KUBE-EXT, or, shared, with eTP=Local
    to the external-local chain and its choosers maps, with eTP=Cluster
    marked for masquerade to the cluster chooser; no (local) endpoints ->
    reject/drop."""
    port, label = p.port, p.label
    ext = names.external_chain(port.name)
    out: list[Element] = []
    for ip in (*port.external_ips, *port.load_balancer_vips):
        key = _key(ip, port, port.port)
        if p.uses_ext_chain and p.shared and port.external_policy_local:
            out += _local_vip(p, ip, ctx)
        elif p.uses_ext_chain and p.shared:
            out += _shared_vip(p, ip, p.cats.cluster, ext, ctx)
            out.append(Element(sk.MASQUERADE_VIPS, key, None, names.tagged(label, ext)))
        elif p.uses_ext_chain:
            out.append(Element(sk.SERVICE_IPS, key, Verdict("goto", ext), label))
        if not p.has_external:
            out.append(Element(sk.NO_ENDPOINT_SERVICES, key, p.external_verdict, label))
    return out


def _nodeport_elements(p: PortPlan, ctx: RenderContext) -> list[Element]:
    port, label = p.port, p.label
    if not port.node_port:
        return []
    key = (port.protocol.nft, port.node_port)
    ext = names.external_chain(port.name)
    out: list[Element] = []
    if p.uses_ext_chain and p.shared and port.external_policy_local:
        out += _local_nodeport(p, ctx)
    elif p.uses_ext_chain and p.shared:
        out += _shared_nodeport(p, p.cats.cluster, ext, ctx)
        out.append(Element(sk.MASQUERADE_NODEPORTS, key, None, names.tagged(label, ext)))
    elif p.uses_ext_chain:
        out.append(Element(sk.SERVICE_NODEPORTS, key, Verdict("goto", ext), label))
    if not p.has_external:
        out.append(Element(sk.NO_ENDPOINT_NODEPORTS, key, p.external_verdict, label))
    return out


def _shared_vip(
    p: PortPlan,
    vip: str,
    endpoints: tuple[Endpoint, ...],
    identity: str,
    ctx: RenderContext,
    *,
    table: str = sk.SERVICE_IPS,
    local: bool = False,
) -> list[Element]:
    """A VIP's element in `table` (service-ips, or an eTP=Local destination's
    choosers map) to the shared chooser of len(endpoints) (its comment names
    the chain kube-proxy would send it to, `identity`), and the elements
    (VIP, port, i) -> endpoint i that chooser picks from."""
    if not endpoints:
        return []
    port = p.port
    chooser = ctx.choosers.vip(port.protocol, len(endpoints), local=local)
    p.use(chooser)
    comment = names.tagged(str(port.name), identity)
    goto = Verdict("goto", chooser.chains[0].name)
    map_name = dispatch.vip_endpoints_map(port.protocol, local=local)
    return [
        Element(table, _key(vip, port, port.port), goto, comment),
        *_picked(p, map_name, (vip, port.port), endpoints),
    ]


def _local_vip(p: PortPlan, vip: str, ctx: RenderContext) -> list[Element]:
    """An eTP=Local external destination: its service-ips element to the
    external-local chain (KUBE-EXT-<h>), its cluster chooser (KUBE-SVC-<h>)
    and, with local endpoints, its local one (KUBE-SVL-<h>)."""
    port = p.port
    spn, label = port.name, str(port.name)
    p.use(ctx.choosers.external_local(nodeport=False))
    out = [
        Element(
            sk.SERVICE_IPS,
            _key(vip, port, port.port),
            Verdict("goto", dispatch.EXTERNAL_LOCAL),
            names.tagged(label, names.external_chain(spn)),
        )
    ]
    for local, endpoints, identity in _local_policy_choosers(p):
        table = dispatch.choosers_map(nodeport=False, local=local)
        out += _shared_vip(p, vip, endpoints, identity, ctx, table=table, local=local)
    return out


def _local_policy_choosers(p: PortPlan) -> list[tuple[bool, tuple[Endpoint, ...], str]]:
    """An eTP=Local destination's choosers that have endpoints: (of the
    local ones?, the endpoints, the KUBE-SVC/SVL-<h> it stands for)."""
    spn = p.port.name
    both = (
        (False, p.cats.cluster, names.service_chain(spn)),
        (True, p.cats.local, names.local_chain(spn)),
    )
    return [(local, eps, identity) for local, eps, identity in both if eps]


def _shared_nodeport(
    p: PortPlan,
    endpoints: tuple[Endpoint, ...],
    identity: str,
    ctx: RenderContext,
    *,
    table: str = sk.SERVICE_NODEPORTS,
    local: bool = False,
) -> list[Element]:
    """The node port's element in `table` (service-nodeports, or an eTP=Local
    node port's choosers map) to the shared chooser of len(endpoints) (its
    comment names the chain kube-proxy would send it to, `identity`), and
    the elements (node port, i) -> endpoint i it picks from."""
    if not endpoints:
        return []
    port = p.port
    chooser = ctx.choosers.nodeport(port.protocol, len(endpoints), local=local)
    p.use(chooser)
    comment = names.tagged(str(port.name), identity)
    goto = Verdict("goto", chooser.chains[0].name)
    map_name = dispatch.nodeport_endpoints_map(port.protocol, local=local)
    return [
        Element(table, (port.protocol.nft, port.node_port), goto, comment),
        *_picked(p, map_name, (port.node_port,), endpoints),
    ]


def _local_nodeport(p: PortPlan, ctx: RenderContext) -> list[Element]:
    """An eTP=Local node port: its service-nodeports element to the
    nodeport-local chain (KUBE-EXT-<h>), its cluster chooser (KUBE-SVC-<h>)
    and, with local endpoints, its local one (KUBE-SVL-<h>)."""
    port = p.port
    spn, label = port.name, str(port.name)
    p.use(ctx.choosers.external_local(nodeport=True))
    ext = Verdict("goto", dispatch.NODEPORT_LOCAL)
    key = (port.protocol.nft, port.node_port)
    out = [Element(sk.SERVICE_NODEPORTS, key, ext, names.tagged(label, names.external_chain(spn)))]
    for local, endpoints, identity in _local_policy_choosers(p):
        table = dispatch.choosers_map(nodeport=True, local=local)
        out += _shared_nodeport(p, endpoints, identity, ctx, table=table, local=local)
    return out


def _picked(
    p: PortPlan, map_name: str, fixed: tuple[str | int, ...], endpoints: tuple[Endpoint, ...]
) -> list[Element]:
    """The elements (*fixed, i) -> endpoint i of `map_name` (each named by
    its KUBE-SEP identity in the comment)."""
    return [
        Element(map_name, (*fixed, i), Target(ep.ip, ep.port), _endpoint_comment(p, ep))
        for i, ep in enumerate(endpoints)
    ]


def _masquerade_rule(p: PortPlan, ctx: RenderContext) -> list[Rule]:
    """Mark off-cluster traffic to the cluster IP (or all of it with
    masqueradeAll); no detector and no masqueradeAll -> no rule (kube-proxy)."""
    port = p.port
    source = masquerade_source(ctx.config, ctx.detector)
    if source is None:
        return []
    dst = (
        expr.addr_match(ctx.family, "daddr", (port.cluster_ip,)),
        expr.port_match(port.protocol, port.port),
    )
    return [Rule((*dst, *source, expr.jump(sk.MARK_MASQ)), f"{port.name} cluster IP")]


def _endpoint_tail(
    p: PortPlan, ep: Endpoint, fixed: tuple[int, int], ctx: RenderContext
) -> tuple[Json, ...]:
    """What sending to `ep` (affinity key `fixed`) with affinity does:
    remember (or refresh) the client's entry for it, then DNAT."""
    refresh = expr.affinity_update(ctx.family, fixed, sk.AFFINITY, p.port.affinity_timeout)
    return (refresh, expr.l4proto(p.port.protocol), expr.dnat(ep.ip, ep.port))


def _endpoint_comment(p: PortPlan, ep: Endpoint, what: str = "") -> str:
    address = ep.address
    sep = p.seps.get(address)
    if sep is None:
        sep = p.seps[address] = names.endpoint_chain(p.port.name, ep)
    return names.tagged(f"{p.label} -> {address}{what}", sep)


def _affinity_rules(p: PortPlan, endpoints: tuple[Endpoint, ...], ctx: RenderContext) -> list[Rule]:
    """ClientIP affinity: lookups, then the numgen cascade over `endpoints`,
    each rule DNATing to its endpoint (named by its KUBE-SEP identity in the
    comment) and refreshing the client's entry for it in the shared
    affinity set."""
    p.use(ctx.choosers.affinity())
    keys = [names.affinity_key(p.port.name, ep) for ep in endpoints]
    tails = [_endpoint_tail(p, ep, fixed, ctx) for ep, fixed in zip(endpoints, keys, strict=True)]
    rules: list[Rule] = []
    for ep, fixed, tail in zip(endpoints, keys, tails, strict=True):
        lookup = expr.affinity_lookup(ctx.family, fixed, sk.AFFINITY)
        rules.append(Rule((lookup, *tail), _endpoint_comment(p, ep, " affinity")))
    n = len(endpoints)
    for i, (ep, tail) in enumerate(zip(endpoints, tails, strict=True)):
        pick = () if i == n - 1 else (expr.numgen_zero(n - i),)
        rules.append(Rule((*pick, *tail), _endpoint_comment(p, ep)))
    return rules


def _policy_chains(p: PortPlan, ctx: RenderContext) -> list[Chain]:
    """KUBE-SVC / KUBE-SVL of a port with ClientIP affinity."""
    spn = p.port.name
    chains: list[Chain] = []
    for used, name, eps, is_local in (
        (p.uses_cluster_chain, names.service_chain(spn), p.cats.cluster, False),
        (p.uses_local_chain, names.local_chain(spn), p.cats.local, True),
    ):
        if not used:
            continue
        internal = p.has_internal and is_local == p.port.internal_policy_local
        rules = _masquerade_rule(p, ctx) if internal else []
        rules += _affinity_rules(p, eps, ctx)
        chains.append(Chain(name, tuple(rules)))
    return chains


def _external_chain(p: PortPlan, ctx: RenderContext) -> list[Chain]:
    if not p.uses_ext_chain:
        return []
    spn, label = p.port.name, p.label
    svc = expr.goto(names.service_chain(spn))
    if not p.port.external_policy_local:
        rules = [
            Rule(
                (expr.jump(sk.MARK_MASQ),), f"masquerade traffic for {label} external destinations"
            ),
            Rule((svc,)),
        ]
        return [Chain(names.external_chain(spn), tuple(rules))]
    rules = []
    if ctx.detector is not None:
        rules.append(
            Rule((*ctx.detector.if_local, svc), f"pod traffic for {label} external destinations")
        )
    local_src = expr.fib_local("saddr")
    rules += [
        Rule((local_src, expr.jump(sk.MARK_MASQ)), f"masquerade LOCAL traffic for {label}"),
        Rule((local_src, svc), f"route LOCAL traffic for {label} external destinations"),
    ]
    if p.has_external:
        rules.append(Rule((expr.goto(names.local_chain(spn)),)))
    return [Chain(names.external_chain(spn), tuple(rules))]


def _firewall_elements(p: PortPlan, ctx: RenderContext) -> list[Element]:
    """loadBalancerSourceRanges as elements of the shared `firewall-vips` and
    `firewall-allow` sets (one skeleton rule drops the rest, pre-DNAT); when
    a range contains a node IP the LB IPs are allowed too (VIP-style LBs
    loop a node's own request back with the VIP as source)."""
    if not p.uses_fw_chain:
        return []
    port, family = p.port, ctx.family
    ranges = list(port.load_balancer_source_ranges)
    if _contains_any(ranges, ctx.node.ips_of(family)):
        ranges += [
            f"{ip}/{32 if family is IPFamily.IPV4 else 128}" for ip in port.load_balancer_vips
        ]
    allowed = _merge(ranges)
    label = f"{names.firewall_chain(port.name)} {port.name}"
    out: list[Element] = []
    for vip in port.load_balancer_vips:
        key = _key(vip, port, port.port)
        out.append(Element(sk.FIREWALL_VIPS, key, None, label))
        out += [Element(sk.FIREWALL_ALLOW, (*key, cidr)) for cidr in allowed]
    return out


def _contains_any(cidrs: Sequence[str], ips: Sequence[str]) -> bool:
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    return any(ipaddress.ip_address(ip) in n for ip in ips for n in nets)


def _merge(cidrs: Sequence[str]) -> list[str]:
    """Collapse overlapping ranges: an interval set refuses overlaps."""
    v4 = [n for n in map(_net, cidrs) if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in map(_net, cidrs) if isinstance(n, ipaddress.IPv6Network)]
    merged = [*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)]
    return [str(n) for n in merged]


def _net(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(cidr, strict=False)


def _hairpin_elements(p: PortPlan, ctx: RenderContext) -> list[Element]:
    """endpoint . endpoint for each reachable endpoint that can be its own
    client here: KUBE-POSTROUTING
    masquerades a DNATed packet whose source is the endpoint it was sent to.

    An endpoint on another node never is: its packets to a service are
    DNATed by its own node's proxy, never here (as kube-proxy's IPVS mode
    fills KUBE-LOOP-BACK with local endpoints only). One without a node, or
    any when this node's name is unknown, might be, and keeps its element."""
    ips = sorted({ep.ip for ep in p.cats.reachable if _may_hairpin_here(ep, ctx.node)})
    return [Element(sk.HAIRPIN_ENDPOINTS, (ip, ip)) for ip in ips]


def _may_hairpin_here(ep: Endpoint, node: NodeInfo) -> bool:
    return ep.is_local or not ep.node_name or not node.name


_DISPATCH_MAPS = frozenset({sk.SERVICE_IPS, sk.SERVICE_NODEPORTS})


def _in_affinity_table(
    chains: Sequence[Chain], elements: Sequence[Element]
) -> tuple[tuple[Chain, ...], tuple[Element, ...]]:
    """A port with ClientIP affinity keeps its chains in the affinity table
    (fragment.AFFINITY_TABLE; their rules name that table's KUBE-MARK-MASQ
    and affinity set): each destination that goes to one of them is an
    `accept` in the main table's map, which ends the main table's nat chain
    without NAT, and the same key's goto in the affinity table's map of the
    same name. A commit that adds a goto element to the main table then
    makes the kernel re-validate the main table only, without the affinity
    ports' cascades of two rules per endpoint. Their other elements stay in
    the main table."""
    own = {c.name for c in chains}
    out: list[Element] = []
    for e in elements:
        if e.set_name in _DISPATCH_MAPS and isinstance(e.value, Verdict) and e.value.target in own:
            out += [replace(e, value=ACCEPT), replace(e, set_name=affinity_table_name(e.set_name))]
        else:
            out.append(e)
    return tuple(replace(c, name=affinity_table_name(c.name)) for c in chains), tuple(out)


def render_service_port(
    port: ServicePort, endpoints: Sequence[Endpoint], ctx: RenderContext
) -> RenderedPort:
    """The whole fragment of one service port in ctx.family's table."""
    p = plan_port(port, endpoints, ctx)
    chains = () if p.shared else (*_policy_chains(p, ctx), *_external_chain(p, ctx))
    elements = (
        *_cluster_ip_elements(p, ctx),
        *_external_elements(p, ctx),
        *_nodeport_elements(p, ctx),
        *_firewall_elements(p, ctx),
        *_hairpin_elements(p, ctx),
    )
    if port.affinity:
        chains, elements = _in_affinity_table(chains, elements)
    fragment = Fragment(ctx.family, chains, (), elements, tuple(p.uses.values()))
    dropped_int = p.cats.has_any and not p.has_internal
    dropped_ext = p.cats.has_any and not p.has_external and port.externally_accessible
    return RenderedPort(fragment, dropped_int, dropped_ext)
