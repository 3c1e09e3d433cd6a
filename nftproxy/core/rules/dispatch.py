"""Shared choosers: one chain per endpoint count, for the cluster IPs.

Layer: rules (pure). One job: the names and the skeleton objects of
ruleset v7's shared dispatch (upstream's WIP `dispatch-N`), and which
service ports use it.

A service port reached only at its cluster IP (no node port, external IP
or LB VIP), without ClientIP affinity, with 1..DISPATCH_MAX endpoints in
its internal chooser, has no chain of its own: its `service-ips` element
goes to `dispatch-<proto>-<g>-<N>` (comment: its KUBE-SVC-<h> or
KUBE-SVL-<h>), whose rules are the same for every such port with N
endpoints:

  <source not local> jump KUBE-MARK-MASQ       (as kube-proxy's chooser)
  meta l4proto P dnat ip to ip daddr . P dport . numgen random mod N
      map @clusterip-endpoints-<proto>-<g>

and the port owns N elements of that map, (cluster IP, port, i) -> endpoint
i, named by its KUBE-SEP-<h> in their comment. Adding such a port adds
elements only: the kernel re-validates the chain graph for the goto element,
but the graph no longer holds a chain per service (bench/dispatch_probe.py:
adding a service 5.8 -> 1.0 ms in a minimal 10,000 x 10 table). Every
other port keeps its KUBE-SVC/SVL/EXT chains (core/rules/service.py).

The dispatch chains and the map come in the table's generation
(skeleton.GENERATIONS), as the sharded endpoints maps, so a resync in steps
fills the next generation's map chunk by chunk behind the old one.
"""

from __future__ import annotations

from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.rules import expr
from nftproxy.core.rules.fragment import NUMGEN_KEY, Chain, Rule, SetDecl

__all__ = [
    "CLUSTERIP_ENDPOINTS",
    "DISPATCH",
    "DISPATCH_MAX",
    "clusterip_endpoints_map",
    "dispatch_chain",
    "dispatch_chains",
    "dispatch_maps",
    "generation_chains",
]

DISPATCH = "dispatch"
CLUSTERIP_ENDPOINTS = "clusterip-endpoints"
DISPATCH_MAX = 64
"""Shared choosers exist for 1..DISPATCH_MAX endpoints (per protocol and
generation: 192 chains); a port with more keeps its own chooser chain."""


def dispatch_chain(protocol: L4Protocol, generation: str, count: int) -> str:
    """dispatch-tcp-a-3: the shared chooser of the cluster IPs of `protocol`
    ports with `count` endpoints."""
    return f"{DISPATCH}-{protocol.nft}-{generation}-{count}"


def clusterip_endpoints_map(protocol: L4Protocol, generation: str) -> str:
    """clusterip-endpoints-tcp-a: cluster IP . port . index -> endpoint."""
    return f"{CLUSTERIP_ENDPOINTS}-{protocol.nft}-{generation}"


def generation_chains(generations: tuple[str, ...]) -> dict[str, str]:
    """Every dispatch chain name -> its generation."""
    return {
        dispatch_chain(p, g, n): g
        for p in L4Protocol
        for g in generations
        for n in range(1, DISPATCH_MAX + 1)
    }


def dispatch_maps(family: IPFamily, generation: str) -> tuple[SetDecl, ...]:
    """The generation's clusterip-endpoints map of each protocol."""
    daddr = f"{family.nft_family} daddr"
    return tuple(
        SetDecl.data_map(
            clusterip_endpoints_map(p, generation),
            (daddr, f"{p.nft} dport", NUMGEN_KEY),
            (daddr, f"{p.nft} dport"),
            comment=f"{p.nft} cluster IP . port . index -> endpoint",
        )
        for p in L4Protocol
    )


def dispatch_chains(family: IPFamily, generation: str, masq: tuple[Rule, ...]) -> tuple[Chain, ...]:
    """The generation's shared choosers, each starting with `masq` (the
    masquerade rule of traffic to a cluster IP, or none)."""
    return tuple(
        Chain(
            dispatch_chain(p, generation, n),
            (
                *masq,
                Rule(
                    (
                        expr.l4proto(p),
                        expr.dnat_by_destination(
                            family, p, n, clusterip_endpoints_map(p, generation)
                        ),
                    ),
                    f"cluster IP -> {n} endpoints",
                ),
            ),
        )
        for p in L4Protocol
        for n in range(1, DISPATCH_MAX + 1)
    )
