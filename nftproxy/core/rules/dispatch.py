"""Shared choosers: the layout of the chains and maps that pick an endpoint.

Layer: rules (pure). One job: name the shared choosers, the maps they pick
from and the eTP=Local chains, and build them. Every name the table holds
beyond the skeleton's fixed objects and a port's own KUBE-SVC/SVL/EXT chains
comes from here.

A service port without ClientIP affinity has no chain of its own. Each of
its destinations has one element that goes to the shared chooser of its
endpoint count N, and the port owns N elements per destination in the map
that chooser picks from:

  cluster IP, external IP, LB VIP -> service-ips element goto dispatch-<proto>-<N>:
      <source not local> jump KUBE-MARK-MASQ      (kube-proxy's KUBE-SVC rule)
      meta l4proto P dnat ip to ip daddr . P dport . numgen random mod N
          map @vip-endpoints-<proto>              (VIP, port, i) -> endpoint i
  node port -> service-nodeports element goto dispatch-nodeport-<proto>-<N>:
      meta l4proto P dnat ip to P dport . numgen random mod N
          map @nodeport-endpoints-<proto>         (node port, i) -> endpoint i

An external destination of an eTP=Local port goes to `external-local`
(`nodeport-local` for its node port), which does what its KUBE-EXT would
through two verdict maps the port fills: pod traffic and the node's own
(marked) to the destination's chooser of cluster endpoints
(`external-cluster-choosers`), the rest to its chooser of local endpoints
(`external-local-choosers` -> dispatch-local-<proto>-<N>, picking from
vip-local-endpoints-<proto>, with no masquerade rule). Without a local
endpoint the port has no local element: the packet leaves the chain
undNATed and the no-endpoint map drops it.

A chooser, its map and the eTP=Local chains exist only while some port uses
them (`fragment.Shared`: the planner adds them with their first user and
deletes them with their last), so an empty node holds none.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.rules import expr
from nftproxy.core.rules.fragment import NUMGEN_KEY, Chain, Json, Rule, SetDecl, Shared

__all__ = [
    "EXTERNAL_LOCAL",
    "NODEPORT_LOCAL",
    "PROTO_PORT",
    "Choosers",
    "choosers_map",
    "dispatch_chain",
    "is_chooser_chain",
    "is_choosers_map",
    "is_external_local_chain",
    "is_indexed_map",
    "is_shared_chain",
    "nodeport_dispatch_chain",
    "nodeport_endpoints_map",
    "vip_endpoints_map",
]

EXTERNAL_LOCAL = "external-local"
"""What KUBE-EXT does for every eTP=Local external IP or LB VIP."""
NODEPORT_LOCAL = "nodeport-local"
"""What KUBE-EXT does for every eTP=Local node port."""

PROTO_PORT = ("meta l4proto", "th dport")
"""The key of service-nodeports and the node-port choosers maps (as set selectors)."""

_BOTH = (False, True)


def _kind(local: bool) -> str:
    return "local-" if local else ""


def dispatch_chain(protocol: L4Protocol, count: int, *, local: bool = False) -> str:
    """dispatch-tcp-3: the shared chooser of `protocol` VIPs (cluster IP,
    external IP, LB VIP) with `count` endpoints; dispatch-local-tcp-3: of an
    eTP=Local external destination's local endpoints."""
    return f"dispatch-{_kind(local)}{protocol.nft}-{count}"


def nodeport_dispatch_chain(protocol: L4Protocol, count: int, *, local: bool = False) -> str:
    """dispatch-nodeport-tcp-3, dispatch-nodeport-local-tcp-3: as
    `dispatch_chain`, for node ports."""
    return f"dispatch-nodeport-{_kind(local)}{protocol.nft}-{count}"


def vip_endpoints_map(protocol: L4Protocol, *, local: bool = False) -> str:
    """vip-endpoints-tcp: VIP . port . index -> endpoint
    (vip-local-endpoints-tcp: the local endpoints of eTP=Local VIPs)."""
    return f"vip-{_kind(local)}endpoints-{protocol.nft}"


def nodeport_endpoints_map(protocol: L4Protocol, *, local: bool = False) -> str:
    """nodeport-endpoints-tcp: node port . index -> endpoint
    (nodeport-local-endpoints-tcp: the local endpoints of eTP=Local node ports)."""
    return f"nodeport-{_kind(local)}endpoints-{protocol.nft}"


def choosers_map(*, nodeport: bool, local: bool) -> str:
    """external-cluster-choosers (VIP . proto . port -> goto the cluster
    chooser), external-local-choosers (-> the local chooser), and
    nodeport-cluster-choosers / nodeport-local-choosers (proto . node port)."""
    where = "nodeport" if nodeport else "external"
    which = "local" if local else "cluster"
    return f"{where}-{which}-choosers"


_CHOOSER = re.compile(r"dispatch-(nodeport-)?(local-)?(tcp|udp|sctp)-[1-9][0-9]*")
_CHOOSERS_MAPS = frozenset(choosers_map(nodeport=n, local=lo) for n in _BOTH for lo in _BOTH)
_INDEXED = frozenset(
    name(p, local=local)
    for name in (vip_endpoints_map, nodeport_endpoints_map)
    for local in _BOTH
    for p in L4Protocol
)


def is_chooser_chain(name: str) -> bool:
    return _CHOOSER.fullmatch(name) is not None


def is_external_local_chain(name: str) -> bool:
    return name in (EXTERNAL_LOCAL, NODEPORT_LOCAL)


def is_shared_chain(name: str) -> bool:
    """A chooser or an eTP=Local chain: a chain no port owns alone."""
    return is_chooser_chain(name) or is_external_local_chain(name)


def is_choosers_map(name: str) -> bool:
    """One of the four verdict maps from an eTP=Local destination to a chooser."""
    return name in _CHOOSERS_MAPS


def is_indexed_map(name: str) -> bool:
    """Whether `name` maps a destination . endpoint index -> endpoint: its
    keys end in the index 0..N-1 of the chooser's N endpoints."""
    return name in _INDEXED


@dataclass
class Choosers:
    """The shared objects of one family's render, each built once
    (`masq`: the masquerade rule of traffic to a cluster IP, or none;
    `pod_source`: the local-traffic detector's match, None without one)."""

    family: IPFamily
    masq: tuple[Rule, ...]
    pod_source: tuple[Json, ...] | None
    mark_chain: str
    affinity_set: SetDecl
    """The set that remembers ClientIP affinity's clients (skeleton's)."""
    _made: dict[tuple[object, ...], Shared] = field(default_factory=dict)

    def affinity(self) -> Shared:
        """The affinity set, which every port with ClientIP affinity uses."""
        return self._once(("affinity",), lambda: Shared.of((), (self.affinity_set,)))

    def vip(self, protocol: L4Protocol, count: int, *, local: bool = False) -> Shared:
        """dispatch[-local]-<proto>-<N> and the map it picks from."""
        key = ("vip", protocol, count, local)
        return self._once(key, lambda: self._chooser(protocol, count, local, nodeport=False))

    def nodeport(self, protocol: L4Protocol, count: int, *, local: bool = False) -> Shared:
        """dispatch-nodeport[-local]-<proto>-<N> and the map it picks from."""
        key = ("nodeport", protocol, count, local)
        return self._once(key, lambda: self._chooser(protocol, count, local, nodeport=True))

    def _once(self, key: tuple[object, ...], build: Callable[[], Shared]) -> Shared:
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = build()
        return made

    def _chooser(self, protocol: L4Protocol, count: int, local: bool, *, nodeport: bool) -> Shared:
        """A node port's chooser picks by port, a VIP's by address and port;
        only the cluster VIP's starts with the masquerade rule."""
        which = "local endpoints" if local else "endpoints"
        first: tuple[Rule, ...] = ()
        if nodeport:
            decl = self._nodeport_map(protocol, local)
            pick = expr.dnat_by_port(self.family, protocol, count, decl.name)
            name = nodeport_dispatch_chain(protocol, count, local=local)
        else:
            decl = self._vip_map(protocol, local)
            pick = expr.dnat_by_destination(self.family, protocol, count, decl.name)
            name, first = dispatch_chain(protocol, count, local=local), () if local else self.masq
        where = "node port" if nodeport else "VIP"
        rule = Rule((expr.l4proto(protocol), pick), f"{where} -> {count} {which}")
        return Shared.of((Chain(name, (*first, rule)),), (decl,))

    def external_local(self, *, nodeport: bool) -> Shared:
        """external-local (nodeport-local) and its two choosers maps."""
        def build() -> Shared:
            maps = tuple(self._choosers_map(nodeport, local) for local in _BOTH)
            return Shared.of((self._external_local_chain(nodeport),), maps)

        return self._once(("external-local", nodeport), build)

    def _daddr(self) -> str:
        return f"{self.family.nft_family} daddr"

    def _vip_map(self, p: L4Protocol, local: bool) -> SetDecl:
        which = "local endpoint" if local else "endpoint"
        return SetDecl.data_map(
            vip_endpoints_map(p, local=local),
            (self._daddr(), f"{p.nft} dport", NUMGEN_KEY),
            (self._daddr(), f"{p.nft} dport"),
            comment=f"{p.nft} VIP . port . index -> {which}",
        )

    def _nodeport_map(self, p: L4Protocol, local: bool) -> SetDecl:
        which = "local endpoint" if local else "endpoint"
        return SetDecl.data_map(
            nodeport_endpoints_map(p, local=local),
            (f"{p.nft} dport", NUMGEN_KEY),
            (self._daddr(), f"{p.nft} dport"),
            comment=f"{p.nft} node port . index -> {which}",
        )

    def _choosers_map(self, nodeport: bool, local: bool) -> SetDecl:
        key = PROTO_PORT if nodeport else (self._daddr(), *PROTO_PORT)
        where = "node port" if nodeport else "external IP / LB IP"
        which = "local" if local else "cluster"
        return SetDecl.keyed(
            choosers_map(nodeport=nodeport, local=local),
            key,
            map="verdict",
            comment=f"eTP=Local {where}: its chooser of {which} endpoints",
        )

    def _external_local_chain(self, nodeport: bool) -> Chain:
        """kube-proxy's KUBE-EXT of an eTP=Local port, for every such port at
        once: pod traffic and the node's own traffic (marked for masquerade)
        go to the destination's cluster chooser, the rest to its local one."""
        family = self.family
        key = expr.concat_proto_dport() if nodeport else expr.concat_daddr_proto_dport(family)
        cluster = expr.vmap(key, choosers_map(nodeport=nodeport, local=False))
        local = expr.vmap(key, choosers_map(nodeport=nodeport, local=True))
        local_src = expr.fib_local("saddr")
        rules: list[Rule] = []
        if self.pod_source is not None:
            rules.append(Rule((*self.pod_source, cluster), "pod traffic: Cluster policy"))
        rules += [
            Rule((local_src, expr.jump(self.mark_chain)), "masquerade LOCAL traffic"),
            Rule((local_src, cluster), "LOCAL traffic: Cluster policy"),
            Rule((local,), "other traffic: local endpoints"),
        ]
        return Chain(NODEPORT_LOCAL if nodeport else EXTERNAL_LOCAL, tuple(rules))
