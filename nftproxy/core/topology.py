"""Which endpoints serve which traffic: kube-proxy's CategorizeEndpoints.

Layer: topology (imports model). One job: given one service port's endpoints
and this node, decide the endpoints used for Cluster-policy traffic and for
Local-policy traffic. Pure; feature switches arrive as arguments.

Rules (kube-proxy pkg/proxy/topology.go, newest):
- cluster endpoints: Ready endpoints, filtered by topology hints when the
  hint mode applies (PreferSameNode: prefer_same_node is on, every Ready
  endpoint has node hints and one names this node; else PreferSameZone: every
  Ready endpoint has zone hints and one matches the node's zone); if none is
  Ready, serving+terminating endpoints with topology ignored. Only computed
  when the port uses cluster endpoints.
- local endpoints: local Ready endpoints, else local serving+terminating.
  Topology never applies. Only computed when the port uses local endpoints.
- has_any: some Ready or serving+terminating endpoint exists anywhere.
- reachable: union of the two lists (the endpoints that get KUBE-SEP chains).
All lists are sorted (by ip, port) so rendering is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from nftproxy.core.model import Endpoint, NodeInfo, ServicePort

__all__ = ["EndpointCategories", "categorize"]


@dataclass(frozen=True, slots=True)
class EndpointCategories:
    """The endpoints of one service port, by the traffic they serve.

    cluster: endpoints for Cluster-policy traffic (empty if the port does not
        use cluster endpoints).
    local: endpoints for Local-policy traffic (empty if the port does not use
        local endpoints).
    reachable: cluster and local merged; each gets a KUBE-SEP chain.
    has_any: some usable endpoint exists anywhere, so "no local endpoint"
        means drop rather than reject.
    """

    cluster: tuple[Endpoint, ...]
    local: tuple[Endpoint, ...]
    reachable: tuple[Endpoint, ...]
    has_any: bool


class _TopologyMode(Enum):
    NONE = "none"
    SAME_NODE = "PreferSameNode"
    SAME_ZONE = "PreferSameZone"


def categorize(
    endpoints: Sequence[Endpoint],
    port: ServicePort,
    node: NodeInfo,
    *,
    prefer_same_node: bool = True,
) -> EndpointCategories:
    """kube-proxy's CategorizeEndpoints; `prefer_same_node` stands for the
    PreferSameTrafficDistribution feature gate (passed in, never global)."""
    cluster: tuple[Endpoint, ...] = ()
    has_any = False
    if port.uses_cluster_endpoints:
        cluster = _cluster_endpoints(endpoints, node, prefer_same_node)
        # Any Ready endpoint anywhere lands in `cluster` (the hint modes only
        # apply when they keep at least one), so non-empty means "has any".
        has_any = bool(cluster)
    if not port.uses_local_endpoints:
        return EndpointCategories(cluster, (), cluster, has_any)

    has_any = has_any or any(ep.ready or _serving_terminating(ep) for ep in endpoints)
    local = _local_endpoints(endpoints)
    if not port.uses_cluster_endpoints:
        return EndpointCategories((), local, local, has_any)
    # cluster may hold remote endpoints that local lacks, and local may hold
    # terminating or topology-filtered local endpoints that cluster lacks.
    merged = {(ep.ip, ep.port): ep for ep in (*cluster, *local)}
    return EndpointCategories(cluster, local, tuple(sorted(merged.values())), has_any)


def _serving_terminating(ep: Endpoint) -> bool:
    """The fallback class: still serving while terminating (non-serving
    terminating endpoints are never used)."""
    return ep.serving and ep.terminating


def _cluster_endpoints(
    endpoints: Sequence[Endpoint], node: NodeInfo, prefer_same_node: bool
) -> tuple[Endpoint, ...]:
    """Ready endpoints filtered by the hint mode; if none is Ready, the
    serving+terminating ones, topology ignored (best effort to keep
    connections alive rather than reject)."""
    mode = _topology_mode(endpoints, node, prefer_same_node)
    ready = [ep for ep in endpoints if ep.ready and _available(ep, mode, node)]
    if ready:
        return tuple(sorted(ready))
    return tuple(sorted(ep for ep in endpoints if _serving_terminating(ep)))


def _local_endpoints(endpoints: Sequence[Endpoint]) -> tuple[Endpoint, ...]:
    """Local Ready endpoints, else local serving+terminating; hints never apply."""
    local_ready = [ep for ep in endpoints if ep.is_local and ep.ready]
    if local_ready:
        return tuple(sorted(local_ready))
    return tuple(sorted(ep for ep in endpoints if ep.is_local and _serving_terminating(ep)))


def _topology_mode(
    endpoints: Sequence[Endpoint], node: NodeInfo, prefer_same_node: bool
) -> _TopologyMode:
    """Decided from the hints of Ready endpoints only: a hint mode applies when
    every Ready endpoint carries that kind of hint (the EndpointSlice
    controller writes all or none) and at least one names this node / zone,
    so filtering can never leave this node without an endpoint."""
    ready = [ep for ep in endpoints if ep.ready]
    if not ready:
        return _TopologyMode.NONE
    if (
        prefer_same_node
        and all(ep.node_hints for ep in ready)
        and any(node.name in ep.node_hints for ep in ready)
    ):
        return _TopologyMode.SAME_NODE
    zone = node.zone
    if zone and all(ep.zone_hints for ep in ready) and any(zone in ep.zone_hints for ep in ready):
        return _TopologyMode.SAME_ZONE
    return _TopologyMode.NONE


def _available(ep: Endpoint, mode: _TopologyMode, node: NodeInfo) -> bool:
    if mode is _TopologyMode.SAME_NODE:
        return node.name in ep.node_hints
    if mode is _TopologyMode.SAME_ZONE:
        return node.zone in ep.zone_hints
    return True
