"""Shared choosers: one chain per endpoint count, for every destination of a port.

Layer: rules (pure). One job: the names and the skeleton objects of
ruleset v8's shared dispatch (upstream's WIP `dispatch-N`).

A service port without ClientIP affinity, with 1..DISPATCH_MAX endpoints
at each destination it serves (`PortPlan.shared`), has no chain of its own.
Each destination's element goes to a shared chooser of its endpoint count
N, whose rules are the same for every port with N endpoints, and the port
owns N elements per destination in the map that chooser picks from:

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
`masquerade-nodeports` (the port's elements).

An external destination of an eTP=Local port (ruleset v8) goes to one
shared chain per generation that does what its KUBE-EXT would, per
destination through two verdict maps the port fills:

  external IP, LB VIP -> service-ips element goto external-local-<g>:
      <pod source> ip daddr . l4proto . th dport vmap @external-cluster-choosers-<g>
      fib saddr type local jump KUBE-MARK-MASQ
      fib saddr type local ip daddr . l4proto . th dport vmap @external-cluster-choosers-<g>
      ip daddr . l4proto . th dport vmap @external-local-choosers-<g>
  node port -> service-nodeports element goto nodeport-local-<g>: the same
      keyed by l4proto . th dport, with @nodeport-cluster-choosers-<g> /
      @nodeport-local-choosers-<g>

A `*-cluster-choosers` element goes to the destination's chooser of the
port's cluster endpoints (dispatch-<proto>-<g>-<N>, as above), a
`*-local-choosers` element to the chooser of its local endpoints,
dispatch-local-<proto>-<g>-<N> / dispatch-nodeport-local-<proto>-<g>-<N>
(no masquerade rule: external traffic keeps its source), picking from
vip-local-endpoints-<proto>-<g> / nodeport-local-endpoints-<proto>-<g>.
Without a local endpoint the port has no local element: the packet leaves
the chain undNATed and the no-endpoint map drops it, as before.

The elements' comments carry kube-proxy's identities: KUBE-SVC-<h>
(KUBE-SVL-<h> with iTP=Local) on a cluster IP's and a cluster chooser's,
KUBE-SVL-<h> on a local chooser's, KUBE-EXT-<h> on an external
destination's, KUBE-SEP-<h> on an endpoint's. Adding such a port adds
elements only: the kernel re-validates the chain graph for the goto
elements, but the graph no longer holds a chain per service. Ports with
ClientIP affinity or more than DISPATCH_MAX endpoints keep their
KUBE-SVC/SVL/EXT chains (core/rules/service.py).

The choosers and their maps come in the table's generation
(rules/generations.py), as the sharded endpoints maps, so a resync in steps
fills the next generation's maps chunk by chunk behind the old ones.
"""

from __future__ import annotations

from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.rules import expr
from nftproxy.core.rules.fragment import NUMGEN_KEY, Chain, Json, Rule, SetDecl

__all__ = [
    "DISPATCH_MAX",
    "PROTO_PORT",
    "choosers_map",
    "dispatch_chain",
    "dispatch_chains",
    "dispatch_maps",
    "external_local_chain",
    "external_local_chains",
    "generation_chains",
    "generation_maps",
    "nodeport_dispatch_chain",
    "nodeport_endpoints_map",
    "nodeport_local_chain",
    "vip_endpoints_map",
]

DISPATCH_MAX = 64
"""Shared choosers exist for 1..DISPATCH_MAX endpoints (per kind, protocol
and generation: 2 x 3 x 64 chains); a port with more keeps chains of its own.
A cluster IP, external IP or LB VIP (eTP=Cluster) and a node port reach the
chooser of its count through the pick tree (rules/picks.py)."""


def dispatch_chain(
    protocol: L4Protocol, generation: str, count: int, *, local: bool = False
) -> str:
    """dispatch-tcp-a-3: the shared chooser of `protocol` VIPs (cluster IP,
    external IP, LB VIP) with `count` endpoints; dispatch-local-tcp-a-3:
    of an eTP=Local external destination's local endpoints."""
    kind = "local-" if local else ""
    return f"dispatch-{kind}{protocol.nft}-{generation}-{count}"


def nodeport_dispatch_chain(
    protocol: L4Protocol, generation: str, count: int, *, local: bool = False
) -> str:
    """dispatch-nodeport-tcp-a-3: the shared chooser of `protocol` node ports
    with `count` endpoints; dispatch-nodeport-local-tcp-a-3: of an eTP=Local
    node port's local endpoints."""
    kind = "local-" if local else ""
    return f"dispatch-nodeport-{kind}{protocol.nft}-{generation}-{count}"


def vip_endpoints_map(protocol: L4Protocol, generation: str, *, local: bool = False) -> str:
    """vip-endpoints-tcp-a: VIP . port . index -> endpoint
    (vip-local-endpoints-tcp-a: the local endpoints of eTP=Local VIPs)."""
    kind = "local-" if local else ""
    return f"vip-{kind}endpoints-{protocol.nft}-{generation}"


def nodeport_endpoints_map(protocol: L4Protocol, generation: str, *, local: bool = False) -> str:
    """nodeport-endpoints-tcp-a: node port . index -> endpoint
    (nodeport-local-endpoints-tcp-a: the local endpoints of eTP=Local node ports)."""
    kind = "local-" if local else ""
    return f"nodeport-{kind}endpoints-{protocol.nft}-{generation}"


def external_local_chain(generation: str) -> str:
    """external-local-a: what KUBE-EXT does for an eTP=Local external IP or LB VIP."""
    return f"external-local-{generation}"


def nodeport_local_chain(generation: str) -> str:
    """nodeport-local-a: what KUBE-EXT does for an eTP=Local node port."""
    return f"nodeport-local-{generation}"


def choosers_map(generation: str, *, nodeport: bool, local: bool) -> str:
    """external-cluster-choosers-a (VIP . proto . port -> goto the cluster
    chooser), external-local-choosers-a (-> the local chooser), and the
    nodeport-cluster-choosers-a / nodeport-local-choosers-a (proto . node port)."""
    where = "nodeport" if nodeport else "external"
    which = "local" if local else "cluster"
    return f"{where}-{which}-choosers-{generation}"


_BOTH = (False, True)


def generation_chains(generations: tuple[str, ...]) -> dict[str, str]:
    """Every shared chain's name (choosers, external-local, nodeport-local) -> its generation."""
    choosers = {
        name(p, g, n, local=local): g
        for name in (dispatch_chain, nodeport_dispatch_chain)
        for local in _BOTH
        for p in L4Protocol
        for g in generations
        for n in range(1, DISPATCH_MAX + 1)
    }
    externals = {c(g): g for c in (external_local_chain, nodeport_local_chain) for g in generations}
    return {**choosers, **externals}


def generation_maps(generations: tuple[str, ...]) -> dict[str, str]:
    """Every map the shared chains pick from -> its generation."""
    endpoints = {
        name(p, g, local=local): g
        for name in (vip_endpoints_map, nodeport_endpoints_map)
        for local in _BOTH
        for p in L4Protocol
        for g in generations
    }
    choosers = {
        choosers_map(g, nodeport=nodeport, local=local): g
        for nodeport in _BOTH
        for local in _BOTH
        for g in generations
    }
    return {**endpoints, **choosers}


PROTO_PORT = ("meta l4proto", "th dport")
"""The key of service-nodeports and the node-port choosers maps (as set selectors)."""


def dispatch_maps(family: IPFamily, generation: str) -> tuple[SetDecl, ...]:
    """The generation's vip-endpoints and nodeport-endpoints maps of each
    protocol (cluster and local), and its four choosers maps."""
    daddr = f"{family.nft_family} daddr"
    out: list[SetDecl] = []
    for local in _BOTH:
        which = "local endpoint" if local else "endpoint"
        for p in L4Protocol:
            dport, target = f"{p.nft} dport", (daddr, f"{p.nft} dport")
            out += [
                SetDecl.data_map(
                    vip_endpoints_map(p, generation, local=local),
                    (daddr, dport, NUMGEN_KEY),
                    target,
                    comment=f"{p.nft} VIP . port . index -> {which}",
                ),
                SetDecl.data_map(
                    nodeport_endpoints_map(p, generation, local=local),
                    (dport, NUMGEN_KEY),
                    target,
                    comment=f"{p.nft} node port . index -> {which}",
                ),
            ]
    for nodeport in _BOTH:
        key = PROTO_PORT if nodeport else (daddr, *PROTO_PORT)
        where = "node port" if nodeport else "external IP / LB IP"
        for local in _BOTH:
            which = "local" if local else "cluster"
            out.append(
                SetDecl.keyed(
                    choosers_map(generation, nodeport=nodeport, local=local),
                    key,
                    map="verdict",
                    comment=f"eTP=Local {where}: its chooser of {which} endpoints",
                )
            )
    return tuple(out)


def dispatch_chains(family: IPFamily, generation: str, masq: tuple[Rule, ...]) -> tuple[Chain, ...]:
    """The generation's shared choosers; the cluster VIP ones start with
    `masq` (the masquerade rule of traffic to a cluster IP, or none)."""
    out: list[Chain] = []
    for local in _BOTH:
        which = "local endpoints" if local else "endpoints"
        for p in L4Protocol:
            vips = vip_endpoints_map(p, generation, local=local)
            nodeports = nodeport_endpoints_map(p, generation, local=local)
            for n in range(1, DISPATCH_MAX + 1):
                pick = expr.dnat_by_destination(family, p, n, vips)
                rule = Rule((expr.l4proto(p), pick), f"VIP -> {n} {which}")
                first = () if local else masq
                out.append(Chain(dispatch_chain(p, generation, n, local=local), (*first, rule)))
                pick = expr.dnat_by_port(family, p, n, nodeports)
                rule = Rule((expr.l4proto(p), pick), f"node port -> {n} {which}")
                out.append(Chain(nodeport_dispatch_chain(p, generation, n, local=local), (rule,)))
    return tuple(out)


def external_local_chains(
    family: IPFamily, generation: str, pod_source: tuple[Json, ...] | None, mark_chain: str
) -> tuple[Chain, ...]:
    """The generation's external-local and nodeport-local chains: kube-proxy's
    KUBE-EXT of an eTP=Local port, for every such port at once. Pod traffic
    (`pod_source`: the local-traffic detector's match; None: no detector,
    no such rule) and the node's own traffic (marked for masquerade) go to
    the destination's cluster chooser, the rest to its local chooser."""
    out: list[Chain] = []
    for nodeport in _BOTH:
        key = expr.concat_proto_dport() if nodeport else expr.concat_daddr_proto_dport(family)
        cluster = expr.vmap(key, choosers_map(generation, nodeport=nodeport, local=False))
        local = expr.vmap(key, choosers_map(generation, nodeport=nodeport, local=True))
        local_src = expr.fib_local("saddr")
        rules: list[Rule] = []
        if pod_source is not None:
            rules.append(Rule((*pod_source, cluster), "pod traffic: Cluster policy"))
        rules += [
            Rule((local_src, expr.jump(mark_chain)), "masquerade LOCAL traffic"),
            Rule((local_src, cluster), "LOCAL traffic: Cluster policy"),
            Rule((local,), "other traffic: local endpoints"),
        ]
        name = nodeport_local_chain if nodeport else external_local_chain
        out.append(Chain(name(generation), tuple(rules)))
    return tuple(out)
