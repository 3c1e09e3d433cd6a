"""Shared choosers: one chain per endpoint count, for every destination of a port.

Layer: rules (pure). One job: the names and the skeleton objects of
ruleset v7's shared dispatch (upstream's WIP `dispatch-N`).

A service port without ClientIP affinity and without an eTP=Local external
destination, with 1..DISPATCH_MAX endpoints at each destination it serves
(`PortPlan.shared`), has no chain of its own. Each destination's element
goes to a shared chooser of its endpoint count N, whose rules are the same
for every port with N endpoints, and the port owns N elements per
destination in the map that chooser picks from:

  cluster IP, external IP, LB VIP -> service-ips element goto dispatch-<proto>-<g>-<N>:
      <source not local> jump KUBE-MARK-MASQ      (kube-proxy's KUBE-SVC rule)
      meta l4proto P dnat ip to ip daddr . P dport . numgen random mod N
          map @vip-endpoints-<proto>-<g>        (VIP, port, i) -> endpoint i
  node port -> service-nodeports element goto dispatch-nodeport-<proto>-<g>-<N>:
      meta l4proto P dnat ip to P dport . numgen random mod N
          map @nodeport-endpoints-<proto>-<g>   (node port, i) -> endpoint i

External destinations (eTP=Cluster) are marked for masquerade as kube-proxy's
KUBE-EXT marks them, by one skeleton rule each in KUBE-SERVICES and
KUBE-NODEPORTS that looks them up in `masquerade-vips` /
`masquerade-nodeports` (the port's elements). The elements' comments carry
kube-proxy's identities: KUBE-SVC-<h> (KUBE-SVL-<h> with iTP=Local) on a
cluster IP's, KUBE-EXT-<h> on an external destination's, KUBE-SEP-<h> on an
endpoint's. Adding such a port adds elements only: the kernel re-validates
the chain graph for the goto elements, but the graph no longer holds a
chain per service. Every other port keeps its KUBE-SVC/SVL/EXT chains
(core/rules/service.py).

The choosers and their maps come in the table's generation
(rules/generations.py), as the sharded endpoints maps, so a resync in steps
fills the next generation's maps chunk by chunk behind the old ones.
"""

from __future__ import annotations

from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.rules import expr
from nftproxy.core.rules.fragment import NUMGEN_KEY, Chain, Rule, SetDecl

__all__ = [
    "DISPATCH_MAX",
    "dispatch_chain",
    "dispatch_chains",
    "dispatch_maps",
    "generation_chains",
    "generation_maps",
    "nodeport_dispatch_chain",
    "nodeport_endpoints_map",
    "vip_endpoints_map",
]

DISPATCH_MAX = 64
"""Shared choosers exist for 1..DISPATCH_MAX endpoints (per kind, protocol
and generation: 2 x 3 x 64 chains); a port with more keeps chains of its own."""


def dispatch_chain(protocol: L4Protocol, generation: str, count: int) -> str:
    """dispatch-tcp-a-3: the shared chooser of `protocol` VIPs (cluster IP,
    external IP, LB VIP) with `count` endpoints."""
    return f"dispatch-{protocol.nft}-{generation}-{count}"


def nodeport_dispatch_chain(protocol: L4Protocol, generation: str, count: int) -> str:
    """dispatch-nodeport-tcp-a-3: the shared chooser of `protocol` node ports
    with `count` endpoints."""
    return f"dispatch-nodeport-{protocol.nft}-{generation}-{count}"


def vip_endpoints_map(protocol: L4Protocol, generation: str) -> str:
    """vip-endpoints-tcp-a: VIP . port . index -> endpoint."""
    return f"vip-endpoints-{protocol.nft}-{generation}"


def nodeport_endpoints_map(protocol: L4Protocol, generation: str) -> str:
    """nodeport-endpoints-tcp-a: node port . index -> endpoint."""
    return f"nodeport-endpoints-{protocol.nft}-{generation}"


def generation_chains(generations: tuple[str, ...]) -> dict[str, str]:
    """Every shared chooser's name -> its generation."""
    return {
        name(p, g, n): g
        for name in (dispatch_chain, nodeport_dispatch_chain)
        for p in L4Protocol
        for g in generations
        for n in range(1, DISPATCH_MAX + 1)
    }


def generation_maps(generations: tuple[str, ...]) -> dict[str, str]:
    """Every map the shared choosers pick from -> its generation."""
    return {
        name(p, g): g
        for name in (vip_endpoints_map, nodeport_endpoints_map)
        for p in L4Protocol
        for g in generations
    }


def dispatch_maps(family: IPFamily, generation: str) -> tuple[SetDecl, ...]:
    """The generation's vip-endpoints and nodeport-endpoints map of each protocol."""
    daddr = f"{family.nft_family} daddr"
    out: list[SetDecl] = []
    for p in L4Protocol:
        dport, target = f"{p.nft} dport", (daddr, f"{p.nft} dport")
        out += [
            SetDecl.data_map(
                vip_endpoints_map(p, generation),
                (daddr, dport, NUMGEN_KEY),
                target,
                comment=f"{p.nft} VIP . port . index -> endpoint",
            ),
            SetDecl.data_map(
                nodeport_endpoints_map(p, generation),
                (dport, NUMGEN_KEY),
                target,
                comment=f"{p.nft} node port . index -> endpoint",
            ),
        ]
    return tuple(out)


def dispatch_chains(family: IPFamily, generation: str, masq: tuple[Rule, ...]) -> tuple[Chain, ...]:
    """The generation's shared choosers; the VIP ones start with `masq` (the
    masquerade rule of traffic to a cluster IP, or none)."""
    out: list[Chain] = []
    for p in L4Protocol:
        vips, nodeports = vip_endpoints_map(p, generation), nodeport_endpoints_map(p, generation)
        for n in range(1, DISPATCH_MAX + 1):
            pick = expr.dnat_by_destination(family, p, n, vips)
            rule = Rule((expr.l4proto(p), pick), f"VIP -> {n} endpoints")
            out.append(Chain(dispatch_chain(p, generation, n), (*masq, rule)))
            pick = expr.dnat_by_port(family, p, n, nodeports)
            rule = Rule((expr.l4proto(p), pick), f"node port -> {n} endpoints")
            out.append(Chain(nodeport_dispatch_chain(p, generation, n), (rule,)))
    return tuple(out)
