"""The fixed part of each family's table: base chains, KUBE-* top-level
chains, the dispatch maps and the shared sets.

Layer: rules (pure). One job: render the skeleton as data. Per-service
content reaches the maps only as elements owned by service fragments.

Packet path of a new connection (docs/upstream-nftables-notes.md §1.6):
  filter prerouting/output -110  KUBE-FIREWALL-CHECK: loadBalancerSourceRanges, pre-DNAT
                                 (firewall-vips / firewall-allow sets)
  nat prerouting/output -100     KUBE-SERVICES: service-ips vmap (to the shared choosers,
                                 rules/dispatch.py), then KUBE-NODEPORTS
  nat prerouting/output -99      the affinity table's KUBE-SERVICES (ports with ClientIP
                                 affinity, which the main table's maps `accept`)
  filter input/forward/output 0  KUBE-EXTERNAL-SERVICES: no-endpoint reject/drop (post-DNAT)
                                 KUBE-CLUSTER-IPS-CHECK: unknown ports / unallocated IPs
  filter forward 0               KUBE-FORWARD
  nat postrouting 100            KUBE-POSTROUTING: mark hairpin (hairpin-endpoints),
                                 masquerade marked packets

Localhost node ports (ProxyConfig.localhost_nodeports, IPv4, off by
default) add four rules and nothing else (`_Localhost`): nat-output sends
the node's own connections to the loopback addresses nodePortAddresses
names (127.0.0.0/8 for "localhost") to KUBE-NODEPORTS, and the affinity
table's nat-output to its node-port map; KUBE-EXTERNAL-SERVICES rejects
them for node ports without endpoints; filter-input drops what
route_localnet would otherwise let in from the network (kube-proxy's
KUBE-FIREWALL rule, CVE-2020-8558). Masquerade comes from the rules that
mark the node's own node-port traffic already (KUBE-EXT's mark for
eTP=Cluster, "masquerade LOCAL traffic" for Local).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, L4Protocol, NodeInfo
from nftproxy.core.rules import dispatch, expr
from nftproxy.core.rules.detect import local_detector, masquerade_source
from nftproxy.core.rules.fragment import (
    NUMGEN_KEY,
    BaseHook,
    Chain,
    Fragment,
    Json,
    Rule,
    SetDecl,
    affinity_table_name,
)

__all__ = [
    "AFFINITY",
    "AFFINITY_NAT_PRIORITY",
    "AFFINITY_SIZE",
    "CLUSTER_IPS",
    "CLUSTER_IPS_CHECK",
    "EXTERNAL_SERVICES",
    "FIREWALL_ALLOW",
    "FIREWALL_CHECK",
    "FIREWALL_VIPS",
    "FORWARD",
    "HAIRPIN_ENDPOINTS",
    "KUBE_FIREWALL",
    "MARK_MASQ",
    "MASQUERADE_NODEPORTS",
    "MASQUERADE_VIPS",
    "NODEPORTS",
    "NODEPORT_IPS",
    "NO_ENDPOINT_NODEPORTS",
    "NO_ENDPOINT_SERVICES",
    "POSTROUTING",
    "REJECT",
    "SERVICES",
    "SERVICE_CIDRS",
    "SERVICE_IPS",
    "SERVICE_NODEPORTS",
    "addr_key",
    "addr_type",
    "choosers",
    "nodeport_ips",
    "render_skeleton",
]

SERVICES = "KUBE-SERVICES"
NODEPORTS = "KUBE-NODEPORTS"
FIREWALL_CHECK = "KUBE-FIREWALL-CHECK"
EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
CLUSTER_IPS_CHECK = "KUBE-CLUSTER-IPS-CHECK"
FORWARD = "KUBE-FORWARD"
REJECT = "KUBE-REJECT"
MARK_MASQ = "KUBE-MARK-MASQ"
POSTROUTING = "KUBE-POSTROUTING"
KUBE_FIREWALL = "KUBE-FIREWALL"
"""kube-proxy's chain of the localnet drop, named in that rule's comment (no chain here)."""

SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
NO_ENDPOINT_SERVICES = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
FIREWALL_VIPS = "firewall-vips"
FIREWALL_ALLOW = "firewall-allow"
HAIRPIN_ENDPOINTS = "hairpin-endpoints"
CLUSTER_IPS = "cluster-ips"
NODEPORT_IPS = "nodeport-ips"
SERVICE_CIDRS = "service-cidrs"
MASQUERADE_VIPS = "masquerade-vips"
MASQUERADE_NODEPORTS = "masquerade-nodeports"
AFFINITY = "affinity"
AFFINITY_SIZE = 1 << 20
"""Clients x endpoints the shared affinity set can remember at once (nft's
default for a dynamic set is 65,535, which kube-proxy's one set per endpoint
gave each endpoint; the kernel allocates per element, not by this size)."""
_LOOPBACK = {IPFamily.IPV4: "127.0.0.0/8", IPFamily.IPV6: "::1/128"}


def addr_type(family: IPFamily) -> str:
    return "ipv4_addr" if family is IPFamily.IPV4 else "ipv6_addr"


def _affinity_set(family: IPFamily) -> SetDecl:
    """ClientIP affinity, one set for every endpoint: client . the endpoint's
    key (names.endpoints_key of its KUBE-SEP-<h>), added and refreshed by the
    chooser rules with the port's timeout, so adding an endpoint with
    affinity adds no set (each named set slows libnftables' cache and the
    kernel's set lookups)."""
    return SetDecl.keyed(
        AFFINITY,
        (addr_key(family, "saddr"), NUMGEN_KEY, NUMGEN_KEY),
        flags=("dynamic", "timeout"),
        size=AFFINITY_SIZE,
        dynamic=True,
        comment="ClientIP affinity: client . KUBE-SEP key, expiring",
    )


def addr_key(family: IPFamily, field: str) -> str:
    """A set key of addresses, as the rules match it ("ip daddr", "ip6 saddr")."""
    return f"{family.nft_family} {field}"


def _rule(*statements: Json, comment: str | None = None) -> Rule:
    return Rule(tuple(statements), comment)


@dataclass(frozen=True, slots=True)
class _Localhost:
    """The rules that serve node ports on `destinations` (the loopback CIDRs
    nodePortAddresses names) to the node's own processes."""

    destinations: tuple[str, ...]

    @classmethod
    def of(cls, family: IPFamily, config: ProxyConfig) -> _Localhost | None:
        """The rules of `family`, None when off (and always for IPv6)."""
        if family is not IPFamily.IPV4 or not config.localhost_nodeports:
            return None
        return cls(config.localhost_nodeports)

    def _to(self) -> Json:
        return expr.addr_match(IPFamily.IPV4, "daddr", self.destinations)

    @property
    def nodeports(self) -> Rule:
        """nat-output, after KUBE-SERVICES: output only, so that a packet for
        127.0.0.1 from the network is never DNATed."""
        return _rule(self._to(), expr.goto(NODEPORTS),
                     comment="localhost NodePorts (route_localnet): KUBE-NODEPORTS")

    @property
    def affinity_nodeports(self) -> Rule:
        """The same in the affinity table's nat-output (its KUBE-EXT chains)."""
        return _rule(self._to(), expr.vmap(expr.concat_proto_dport(), SERVICE_NODEPORTS),
                     comment="localhost NodePorts (route_localnet), ClientIP affinity")

    @property
    def no_endpoints(self) -> Rule:
        """KUBE-EXTERNAL-SERVICES: a localhost node port without endpoints is
        rejected, as on the node's other addresses."""
        return _rule(self._to(), expr.vmap(expr.concat_proto_dport(), NO_ENDPOINT_NODEPORTS),
                     comment="localhost node ports with no (local) endpoints")

    @property
    def firewall(self) -> Rule:
        """kube-proxy's KUBE-FIREWALL rule, in filter-input only (where packets
        from the network arrive): route_localnet would let them reach the
        node's localhost-only services (CVE-2020-8558)."""
        loopback = (_LOOPBACK[IPFamily.IPV4],)
        return _rule(
            expr.addr_match(IPFamily.IPV4, "daddr", loopback),
            expr.addr_match(IPFamily.IPV4, "saddr", loopback, negate=True),
            expr.match({"ct": {"key": "state"}}, {"set": ["established", "related"]}, "!="),
            expr.match({"ct": {"key": "status"}}, "dnat", "!="),
            expr.drop(),
            comment=f"{KUBE_FIREWALL}: block incoming localnet connections (CVE-2020-8558)",
        )


def _base_chains(localhost: _Localhost | None) -> tuple[Chain, ...]:
    new = expr.ct_state("new")
    guard = () if localhost is None else (localhost.firewall,)
    nat_output = () if localhost is None else (localhost.nodeports,)
    return (
        Chain(
            "filter-prerouting-pre-dnat",
            (_rule(new, expr.jump(FIREWALL_CHECK)),),
            BaseHook("filter", "prerouting", -110),
        ),
        Chain(
            "filter-output-pre-dnat",
            (_rule(new, expr.jump(FIREWALL_CHECK)),),
            BaseHook("filter", "output", -110),
        ),
        Chain("nat-prerouting", (_rule(expr.jump(SERVICES)),), BaseHook("nat", "prerouting", -100)),
        Chain(
            "nat-output",
            (_rule(expr.jump(SERVICES)), *nat_output),
            BaseHook("nat", "output", -100),
        ),
        Chain(
            "filter-input",
            (*guard, _rule(new, expr.jump(EXTERNAL_SERVICES))),
            BaseHook("filter", "input", 0),
        ),
        Chain(
            "filter-forward",
            (
                _rule(new, expr.jump(EXTERNAL_SERVICES)),
                _rule(new, expr.jump(CLUSTER_IPS_CHECK)),
                _rule(expr.jump(FORWARD)),
            ),
            BaseHook("filter", "forward", 0),
        ),
        Chain(
            "filter-output",
            (
                _rule(new, expr.jump(EXTERNAL_SERVICES)),
                _rule(new, expr.jump(CLUSTER_IPS_CHECK)),
            ),
            BaseHook("filter", "output", 0),
        ),
        Chain(
            "nat-postrouting", (_rule(expr.jump(POSTROUTING)),), BaseHook("nat", "postrouting", 100)
        ),
    )


def _nodeport_address_match(family: IPFamily, config: ProxyConfig) -> tuple[Json, ...]:
    """Which destinations count as node-port addresses (kube-proxy: all local
    non-loopback addresses, or the nodeport-ips set when restricted)."""
    if config.nodeport_matches_all(family):
        loopback = expr.addr_match(family, "daddr", (_LOOPBACK[family],), negate=True)
        return (expr.fib_local("daddr"), loopback)
    return (expr.set_lookup(family, "daddr", NODEPORT_IPS),)


def _lookup_chains(
    family: IPFamily, config: ProxyConfig, localhost: _Localhost | None
) -> tuple[Chain, ...]:
    daddr_key = expr.concat_daddr_proto_dport(family)
    nodeport_dst = _nodeport_address_match(family, config)
    localhost_rejects = () if localhost is None else (localhost.no_endpoints,)
    return (
        Chain(
            SERVICES,
            (
                _rule(
                    expr.match(daddr_key, "@" + MASQUERADE_VIPS),
                    expr.jump(MARK_MASQ),
                    comment="external destinations of services with shared choosers",
                ),
                _rule(
                    expr.vmap(daddr_key, SERVICE_IPS),
                    comment="ClusterIP, ExternalIP and LoadBalancer IP traffic",
                ),
                _rule(
                    *nodeport_dst, expr.goto(NODEPORTS), comment="NodePort traffic (must be last)"
                ),
            ),
        ),
        Chain(
            NODEPORTS,
            (
                _rule(
                    expr.match(expr.concat_proto_dport(), "@" + MASQUERADE_NODEPORTS),
                    expr.jump(MARK_MASQ),
                    comment="node ports of services with shared choosers",
                ),
                _rule(expr.vmap(expr.concat_proto_dport(), SERVICE_NODEPORTS)),
            ),
        ),
        Chain(FIREWALL_CHECK, (_source_range_rule(family),)),
        Chain(
            EXTERNAL_SERVICES,
            (
                *_by_destination(
                    family,
                    config,
                    (NO_ENDPOINT_SERVICES, "services with no (local) endpoints"),
                    (NO_ENDPOINT_NODEPORTS, "node ports with no (local) endpoints"),
                ),
                *localhost_rejects,
            ),
        ),
        Chain(
            CLUSTER_IPS_CHECK,
            (
                _rule(
                    expr.set_lookup(family, "daddr", CLUSTER_IPS),
                    expr.goto(REJECT),
                    comment="Reject traffic to invalid ports of ClusterIPs",
                ),
                _rule(
                    expr.set_lookup(family, "daddr", SERVICE_CIDRS),
                    expr.drop(),
                    comment="Drop traffic to unallocated ClusterIPs",
                ),
            ),
        ),
    )


def _by_destination(
    family: IPFamily, config: ProxyConfig, vips: tuple[str, str], nodeports: tuple[str, str]
) -> tuple[Rule, Rule]:
    """`daddr . l4proto . dport vmap @<vips map>`, then for node-port
    destinations `l4proto . dport vmap @<nodeports map>` ((map, comment) each)."""
    return (
        _rule(expr.vmap(expr.concat_daddr_proto_dport(family), vips[0]), comment=vips[1]),
        _rule(
            *_nodeport_address_match(family, config),
            expr.vmap(expr.concat_proto_dport(), nodeports[0]),
            comment=nodeports[1],
        ),
    )


def _source_range_rule(family: IPFamily) -> Rule:
    """Drop a new connection to an LB VIP with source ranges from outside them."""
    vip = expr.concat_daddr_proto_dport(family)
    with_source = {"concat": [*vip["concat"], expr.payload(family, "saddr")]}
    return _rule(
        expr.match(vip, "@" + FIREWALL_VIPS),
        expr.match(with_source, "@" + FIREWALL_ALLOW, "!="),
        expr.drop(),
        comment="loadBalancerSourceRanges",
    )


def _hairpin_rule(family: IPFamily, bit: int) -> Rule:
    """After DNAT the destination is the chosen endpoint: source == destination
    (an endpoint . endpoint element) is exactly "the client is the endpoint
    it was sent to", which kube-proxy masquerades."""
    pair = {"concat": [expr.payload(family, "saddr"), expr.payload(family, "daddr")]}
    return _rule(
        expr.match({"ct": {"key": "status"}}, "dnat", "in"),
        expr.match(pair, "@" + HAIRPIN_ENDPOINTS),
        expr.mark_set(bit),
        comment="hairpin: the client is the endpoint it was sent to",
    )


def _helper_chains(family: IPFamily, config: ProxyConfig) -> tuple[Chain, ...]:
    bit = config.masquerade_mark
    forward: list[Rule] = []
    if not config.conntrack.tcp_be_liberal:
        forward.append(
            _rule(expr.ct_state("invalid"), expr.drop(), comment="drop conntrack INVALID packets")
        )
    forward += [
        _rule(expr.mark_is_set(bit), expr.accept(), comment="forward marked for masquerade"),
        _rule(
            expr.ct_state("established", "related"),
            expr.accept(),
            comment="forward established connections",
        ),
    ]
    return (
        Chain(
            REJECT,
            (
                _rule(expr.l4proto(L4Protocol.TCP), expr.reject_tcp_reset()),
                _rule(expr.reject_icmp(family)),
            ),
        ),
        Chain(MARK_MASQ, (_rule(expr.mark_set(bit)),)),
        Chain(
            POSTROUTING,
            (
                _hairpin_rule(family, bit),
                _rule(expr.mark_is_clear(bit), expr.ret()),
                _rule(expr.mark_clear(bit)),
                _rule(expr.masquerade()),
            ),
        ),
        Chain(FORWARD, tuple(forward)),
    )


def nodeport_ips(family: IPFamily, config: ProxyConfig, node: NodeInfo) -> tuple[str, ...]:
    """Addresses that accept node ports when nodePortAddresses restricts them,
    as kube-proxy's GetNodeIPs: the host's interface addresses (the node's
    own addresses when those were not read) inside a listed CIDR, or equal to
    the node's primary IP for "primary". Loopback is never served (as
    kube-proxy's nftables mode)."""
    if config.nodeport_matches_all(family):
        return ()
    nets = [ipaddress.ip_network(c, strict=False) for c in config.nodeport_cidrs_of(family)]
    primary = node.primary_ip(family)
    if config.nodeport_primary and primary:
        nets.append(ipaddress.ip_network(primary))
    host = node.host_addresses
    candidates = node.ips_of(family) if host is None else host.of(family)
    chosen = (ipaddress.ip_address(ip) for ip in candidates)
    return tuple(str(a) for a in chosen if not a.is_loopback and any(a in n for n in nets))


def _network(cidr: str) -> str:
    """A CIDR in canonical form, a host prefix as its address (an interval key part)."""
    net = ipaddress.ip_network(cidr, strict=False)
    return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)


def _maps_and_sets(
    family: IPFamily, config: ProxyConfig, node: NodeInfo, service_cidrs: tuple[str, ...]
) -> tuple[SetDecl, ...]:
    addr = (addr_key(family, "daddr"),)
    proto_port = dispatch.PROTO_PORT
    three = (*addr, *proto_port)
    return (
        SetDecl.keyed(
            SERVICE_IPS,
            three,
            map="verdict",
            comment="ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        SetDecl.keyed(SERVICE_NODEPORTS, proto_port, map="verdict", comment="NodePort traffic"),
        SetDecl.keyed(
            NO_ENDPOINT_SERVICES,
            three,
            map="verdict",
            comment="drop or reject services with no endpoints",
        ),
        SetDecl.keyed(
            NO_ENDPOINT_NODEPORTS,
            proto_port,
            map="verdict",
            comment="drop or reject node ports with no endpoints",
        ),
        SetDecl.keyed(
            MASQUERADE_VIPS,
            three,
            comment="external IPs and LB IPs of shared choosers: masquerade",
        ),
        SetDecl.keyed(
            MASQUERADE_NODEPORTS,
            proto_port,
            comment="node ports of shared choosers: masquerade",
        ),
        SetDecl.keyed(
            FIREWALL_VIPS,
            three,
            comment="LoadBalancer IPs with loadBalancerSourceRanges",
        ),
        SetDecl.keyed(
            FIREWALL_ALLOW,
            (*three, addr_key(family, "saddr")),
            flags=("interval",),
            comment="LoadBalancer IP . allowed source range",
        ),
        SetDecl.keyed(
            HAIRPIN_ENDPOINTS,
            (addr_key(family, "saddr"), addr_key(family, "daddr")),
            comment="endpoint . endpoint: hairpin connections",
        ),
        SetDecl.keyed(CLUSTER_IPS, addr, comment="Active ClusterIPs"),
        SetDecl.keyed(
            NODEPORT_IPS,
            addr,
            elements=nodeport_ips(family, config, node),
            comment="IPs that accept NodePort traffic",
        ),
        SetDecl.keyed(
            SERVICE_CIDRS,
            addr,
            flags=("interval",),
            elements=tuple(_network(c) for c in service_cidrs),
            comment="service CIDRs (ServiceCIDR objects)",
        ),
    )


def render_skeleton(
    family: IPFamily, config: ProxyConfig, node: NodeInfo, service_cidrs: tuple[str, ...] = ()
) -> Fragment:
    """The fixed part of `family`'s table; `service_cidrs` are this family's."""
    localhost = _Localhost.of(family, config)
    chains = (
        *_base_chains(localhost),
        *_lookup_chains(family, config, localhost),
        *_helper_chains(family, config),
    )
    sets = _maps_and_sets(family, config, node, service_cidrs)
    aside_chains, aside_sets = _affinity_table(family, config, node, localhost)
    return Fragment(family, (*chains, *aside_chains), (*sets, *aside_sets))


def choosers(family: IPFamily, config: ProxyConfig, node: NodeInfo) -> dispatch.Choosers:
    """The shared choosers of `family`'s render. Those of a cluster IP start
    with kube-proxy's KUBE-SVC masquerade rule, matched on the cluster IP:
    an eTP=Local external destination's pod traffic reaches the same
    chooser unmarked."""
    detector = local_detector(family, config, node)
    source = masquerade_source(config, detector)
    cluster_ip = expr.set_lookup(family, "daddr", CLUSTER_IPS)
    masq = (
        ()
        if source is None
        else (_rule(cluster_ip, *source, expr.jump(MARK_MASQ), comment="cluster IP"),)
    )
    pods = None if detector is None else detector.if_local
    affinity = replace(_affinity_set(family), name=affinity_table_name(AFFINITY))
    return dispatch.Choosers(family, masq, pods, MARK_MASQ, affinity)


AFFINITY_NAT_PRIORITY = -99
"""The affinity table's nat chains run right after the main table's (-100):
nat base chains of one hook run in priority order until one of them NATs
the connection, and the main table's `accept` for an affinity port's
destination ends its chain without NAT."""


def _affinity_table(
    family: IPFamily, config: ProxyConfig, node: NodeInfo, localhost: _Localhost | None
) -> tuple[tuple[Chain, ...], tuple[SetDecl, ...]]:
    """The affinity table (fragment.AFFINITY_TABLE): the dispatch maps of
    the ports with ClientIP affinity (their elements go to the ports'
    KUBE-SVC/SVL/EXT chains, which live there too, with the affinity set
    they use: dispatch.Choosers.affinity), a KUBE-MARK-MASQ of its own, and
    nat chains that look the destination up after the main table's.
    Everything else those ports need -- source ranges, no-endpoint
    verdicts, cluster-IP checks, hairpin and masquerade -- stays in the
    main table."""
    services = Chain(
        SERVICES,
        _by_destination(
            family,
            config,
            (SERVICE_IPS, "ClusterIP, ExternalIP and LoadBalancer IP traffic (ClientIP affinity)"),
            (SERVICE_NODEPORTS, "NodePort traffic (ClientIP affinity)"),
        ),
    )
    enter = (_rule(expr.jump(SERVICES)),)
    output = enter if localhost is None else (*enter, localhost.affinity_nodeports)
    chains = (
        Chain("nat-prerouting", enter, BaseHook("nat", "prerouting", AFFINITY_NAT_PRIORITY)),
        Chain("nat-output", output, BaseHook("nat", "output", AFFINITY_NAT_PRIORITY)),
        services,
        Chain(MARK_MASQ, (_rule(expr.mark_set(config.masquerade_mark)),)),
    )
    main = {d.name: d for d in _maps_and_sets(family, config, node, ())}
    sets = (
        main[SERVICE_IPS],
        main[SERVICE_NODEPORTS],
        main[NODEPORT_IPS],
    )
    return (
        tuple(replace(c, name=affinity_table_name(c.name)) for c in chains),
        tuple(replace(d, name=affinity_table_name(d.name)) for d in sets),
    )
