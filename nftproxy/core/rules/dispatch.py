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
from nftproxy.core.rules.fragment import NUMGEN_KEY, Chain, Element, Json, Key, Rule, SetDecl

__all__ = [
    "COUNT_BITS",
    "DISPATCH_MAX",
    "PROTO_PORT",
    "choosers_map",
    "count_bit_set",
    "count_bits",
    "count_of",
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
    "pick_chain",
    "pick_chain_names",
    "pick_chains",
    "root_map",
    "selector_elements",
    "selector_rule",
    "selector_set_names",
    "selector_sets",
    "shared_set",
    "vip_endpoints_map",
]

COUNT_BITS = 6
DISPATCH_MAX = 1 << COUNT_BITS
"""Shared choosers exist for 1..DISPATCH_MAX endpoints (per kind, protocol
and generation: 2 x 3 x 64 chains); a port with more keeps chains of its own.
A cluster IP, external IP or LB VIP (eTP=Cluster) and a node port reach the
chooser of its count through the pick tree (`pick_chains`): its count - 1
in COUNT_BITS plain sets."""


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
    picks = {name: g for g in generations for name in pick_chain_names(g)}
    return {**choosers, **externals, **picks}


def generation_maps(generations: tuple[str, ...]) -> dict[str, str]:
    """Every map the shared chains pick from, and the pick trees'
    membership and count bit sets -> its generation."""
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
    picks = {
        name: g
        for nodeport in _BOTH
        for g in generations
        for name in (
            shared_set(g, nodeport=nodeport),
            *(count_bit_set(b, g, nodeport=nodeport) for b in range(COUNT_BITS)),
        )
    }
    return {**endpoints, **choosers, **picks}


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


# --- the pick trees (ruleset v10) ---------------------------------------------
#
# A destination's element in `service-ips` / `service-nodeports` used to be a
# goto to its shared chooser, and a commit that adds a goto element makes the
# kernel re-validate the table's whole chain graph, walking every goto
# element of those maps (~9,500 at 10k x 10: most of adding a service). Now
# the element is `continue` (same key, same comment), the destination is an
# element of the plain set `shared-vips-<g>` / `shared-nodeports-<g>`, and its
# count N is spelled by its membership in `<set>-bit0`..`-bit5` (the bits of
# N - 1). All of them come in the table's generation, as the choosers and
# endpoints maps they lead to, so a resync in steps writes them chunk by
# chunk and its final step carries none of them. A plain element is never
# validated, so adding, changing or deleting such a destination is elements
# only. After the map, one skeleton rule jumps through the root map (`meta
# l4proto` -> the generation's tree root: the generation switches with the
# root's elements, as the dispatch maps switch at a resync's final step);
# the root returns what is not a member, and a member goes down a binary
# tree of 63 chains, one set lookup per level, to dispatch-<proto>-<g>-N:
#
#   KUBE-SERVICES:  meta l4proto vmap @shared-vips-root        (tcp : jump pick-vip-a)
#   pick-vip-a:     ip daddr . l4proto . dport != @shared-vips-a return
#                   ip daddr . l4proto . dport @shared-vips-a-bit5 goto pick-vip-a-1
#                   goto pick-vip-a-0
#   ...
#   pick-vip-a-01001 (bits 5..1 decided):
#                   meta l4proto tcp ... @shared-vips-a-bit0 goto dispatch-tcp-a-20
#                   meta l4proto tcp goto dispatch-tcp-a-19   (and udp, sctp)


def _shared(nodeport: bool) -> str:
    return "shared-nodeports" if nodeport else "shared-vips"


def shared_set(generation: str, *, nodeport: bool) -> str:
    """shared-vips-a / shared-nodeports-a: the destinations that go through
    the generation's pick tree."""
    return f"{_shared(nodeport)}-{generation}"


def count_bit_set(bit: int, generation: str, *, nodeport: bool) -> str:
    """shared-vips-a-bit3: the destinations whose count - 1 has bit 3 set
    (the generation's, as the choosers the tree leads to)."""
    return f"{shared_set(generation, nodeport=nodeport)}-bit{bit}"


def root_map(*, nodeport: bool) -> str:
    """shared-vips-root: meta l4proto -> jump to the generation's pick tree."""
    return f"{_shared(nodeport)}-root"


def pick_chain(generation: str, prefix: str = "", *, nodeport: bool) -> str:
    """pick-vip-a (the root), pick-vip-a-10 (bits 5 and 4 decided: 1, 0) ..."""
    kind = "nodeport" if nodeport else "vip"
    return f"pick-{kind}-{generation}" + (f"-{prefix}" if prefix else "")


def count_bits(count: int) -> tuple[int, ...]:
    """The bits of count - 1 (1 <= count <= DISPATCH_MAX), lowest first."""
    return tuple(b for b in range(COUNT_BITS) if (count - 1) >> b & 1)


def count_of(bits: tuple[int, ...] | list[int]) -> int:
    """The count whose `count_bits` are `bits`."""
    return 1 + sum(1 << b for b in bits)


def selector_elements(key: Key, count: int, generation: str, *, nodeport: bool) -> list[Element]:
    """A destination's elements of the pick tree's sets: its membership and
    the bits of its count in the generation's bit sets (no comments: the
    dispatch map's `continue` element carries the port's name)."""
    return [
        Element(shared_set(generation, nodeport=nodeport), key),
        *(
            Element(count_bit_set(b, generation, nodeport=nodeport), key)
            for b in count_bits(count)
        ),
    ]


def _tree_key(family: IPFamily, nodeport: bool) -> Json:
    return expr.concat_proto_dport() if nodeport else expr.concat_daddr_proto_dport(family)


def selector_rule(*, nodeport: bool) -> Rule:
    """The rule after the dispatch map: jump to the generation's pick tree
    (the root map's element), whose root returns what is not a member."""
    root = expr.vmap({"meta": {"key": "l4proto"}}, root_map(nodeport=nodeport))
    what = "node ports" if nodeport else "VIPs"
    return Rule((root,), f"{what} of shared choosers: by endpoint count")


def selector_sets(family: IPFamily, generation: str) -> tuple[SetDecl, ...]:
    """Per kind: the generation's membership set and count bits, and the
    root map (its elements name the generation's tree root)."""
    out: list[SetDecl] = []
    for nodeport in _BOTH:
        key = PROTO_PORT if nodeport else (f"{family.nft_family} daddr", *PROTO_PORT)
        what = "node port" if nodeport else "VIP"
        out.append(
            SetDecl.keyed(
                shared_set(generation, nodeport=nodeport),
                key,
                comment=f"{what}s of the shared choosers",
            )
        )
        out += [
            SetDecl.keyed(
                count_bit_set(b, generation, nodeport=nodeport),
                key,
                comment=f"{what}s: endpoints - 1, bit {b}",
            )
            for b in range(COUNT_BITS)
        ]
        root = {"jump": {"target": pick_chain(generation, nodeport=nodeport)}}
        out.append(
            SetDecl.keyed(
                root_map(nodeport=nodeport),
                ("meta l4proto",),
                map="verdict",
                elements=tuple([p.nft, root] for p in L4Protocol),
                comment=f"{what}s of the shared choosers: the generation's pick tree",
            )
        )
    return tuple(out)


def _not_member(key: Json, generation: str, nodeport: bool) -> Rule:
    """The tree root's first rule: what is not a destination of the
    generation's shared choosers goes back to KUBE-SERVICES / KUBE-NODEPORTS."""
    outside = expr.match(key, "@" + shared_set(generation, nodeport=nodeport), "!=")
    return Rule((outside, expr.ret()), "not a destination of the shared choosers")


def _prefixes() -> list[str]:
    """The tree's nodes: the bits decided so far, highest first ("" is the root)."""
    return [format(v, f"0{n}b") if n else "" for n in range(COUNT_BITS) for v in range(1 << n)]


def pick_chains(family: IPFamily, generation: str) -> tuple[Chain, ...]:
    """The generation's pick trees: a node tests the next bit (highest
    first) and goes down; the last level tests bit 0 and goes to the
    chooser of its protocol and count."""
    out: list[Chain] = []
    for nodeport in _BOTH:
        key = _tree_key(family, nodeport)
        leaf = nodeport_dispatch_chain if nodeport else dispatch_chain
        for prefix in _prefixes():
            bit = COUNT_BITS - 1 - len(prefix)
            member = expr.match(key, "@" + count_bit_set(bit, generation, nodeport=nodeport))
            if bit:
                down = pick_chain(generation, prefix + "1", nodeport=nodeport)
                rules = [] if prefix else [_not_member(key, generation, nodeport)]
                rules += [
                    Rule((member, expr.goto(down))),
                    Rule((expr.goto(pick_chain(generation, prefix + "0", nodeport=nodeport)),)),
                ]
            else:
                rules = []
                for p in L4Protocol:
                    high = int(prefix + "1", 2) + 1
                    rules += [
                        Rule(
                            (expr.l4proto(p), member, expr.goto(leaf(p, generation, high))),
                            f"{high} endpoints",
                        ),
                        Rule(
                            (expr.l4proto(p), expr.goto(leaf(p, generation, high - 1))),
                            f"{high - 1} endpoints",
                        ),
                    ]
            out.append(Chain(pick_chain(generation, prefix, nodeport=nodeport), tuple(rules)))
    return tuple(out)


def selector_set_names() -> frozenset[str]:
    """The pick trees' root maps (the only part not per generation)."""
    return frozenset(root_map(nodeport=nodeport) for nodeport in _BOTH)


def pick_chain_names(generation: str) -> list[str]:
    """Every pick tree chain of the generation."""
    return [pick_chain(generation, p, nodeport=n) for n in _BOTH for p in _prefixes()]
