"""Which endpoints serve cluster and local traffic (kube-proxy's CategorizeEndpoints).

Each case names one rule of pkg/proxy/topology.go in plain words; the
expected lists are endpoint IPs (every endpoint here uses port 80).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    L4Protocol,
    NodeInfo,
    ServicePort,
    ServicePortName,
    TrafficPolicy,
)
from nftproxy.core.topology import EndpointCategories, categorize

NODE = NodeInfo(name="node-a", labels=(("topology.kubernetes.io/zone", "zone-a"),))
ZONELESS_NODE = NodeInfo(name="node-a")
CLUSTER_IP_ONLY = ServicePort(
    name=ServicePortName("ns", "web", "http", L4Protocol.TCP),
    family=IPFamily.IPV4,
    cluster_ip="10.96.0.10",
    port=80,
    protocol=L4Protocol.TCP,
)
ITP_LOCAL = ServicePort(
    name=CLUSTER_IP_ONLY.name,
    family=IPFamily.IPV4,
    cluster_ip="10.96.0.10",
    port=80,
    protocol=L4Protocol.TCP,
    internal_traffic_policy=TrafficPolicy.LOCAL,
)
NODEPORT_ETP_LOCAL = ServicePort(
    name=CLUSTER_IP_ONLY.name,
    family=IPFamily.IPV4,
    cluster_ip="10.96.0.10",
    port=80,
    protocol=L4Protocol.TCP,
    node_port=30080,
    external_traffic_policy=TrafficPolicy.LOCAL,
    health_check_node_port=32000,
)
CLUSTER_IP_ETP_LOCAL = ServicePort(
    name=CLUSTER_IP_ONLY.name,
    family=IPFamily.IPV4,
    cluster_ip="10.96.0.10",
    port=80,
    protocol=L4Protocol.TCP,
    external_traffic_policy=TrafficPolicy.LOCAL,
)


def ep(
    ip: str,
    *,
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
    local: bool = False,
    zones: tuple[str, ...] = (),
    nodes: tuple[str, ...] = (),
) -> Endpoint:
    return Endpoint(
        ip=ip,
        port=80,
        ready=ready,
        serving=ready if serving is None else serving,
        terminating=terminating,
        node_name="node-a" if local else "node-b",
        zone_hints=frozenset(zones),
        node_hints=frozenset(nodes),
        is_local=local,
    )


def draining(ip: str, *, local: bool = False, serving: bool = True) -> Endpoint:
    """A terminating endpoint (never Ready), serving or not."""
    return ep(ip, ready=False, serving=serving, terminating=True, local=local)


@dataclass(frozen=True)
class Case:
    id: str
    endpoints: tuple[Endpoint, ...]
    cluster: tuple[str, ...]
    local: tuple[str, ...]
    reachable: tuple[str, ...]
    has_any: bool
    port: ServicePort = CLUSTER_IP_ONLY
    node: NodeInfo = NODE
    prefer_same_node: bool = True


CASES = [
    Case(
        "ready endpoints serve cluster traffic, sorted by address",
        (ep("10.0.0.3"), ep("10.0.0.1"), ep("10.0.0.2", ready=False, serving=False)),
        cluster=("10.0.0.1", "10.0.0.3"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.3"),
        has_any=True,
    ),
    Case(
        "no endpoints at all means nothing reachable and has_any false",
        (),
        cluster=(),
        local=(),
        reachable=(),
        has_any=False,
    ),
    Case(
        "serving terminating endpoints are a fallback used only when none is ready",
        (ep("10.0.0.1"), draining("10.0.0.2")),
        cluster=("10.0.0.1",),
        local=(),
        reachable=("10.0.0.1",),
        has_any=True,
    ),
    Case(
        "with no ready endpoint the serving terminating ones serve cluster traffic",
        (draining("10.0.0.2"), draining("10.0.0.1"), draining("10.0.0.3", serving=False)),
        cluster=("10.0.0.1", "10.0.0.2"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
    ),
    Case(
        "non-serving terminating endpoints are never used",
        (draining("10.0.0.1", serving=False), ep("10.0.0.2", ready=False, serving=False)),
        cluster=(),
        local=(),
        reachable=(),
        has_any=False,
    ),
    Case(
        "zone hints keep only the endpoints hinted for this node's zone",
        (
            ep("10.0.0.1", zones=("zone-a",)),
            ep("10.0.0.2", zones=("zone-b",)),
            ep("10.0.0.3", zones=("zone-a", "zone-b")),
        ),
        cluster=("10.0.0.1", "10.0.0.3"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.3"),
        has_any=True,
    ),
    Case(
        "zone hints are decided from ready endpoints only",
        (
            ep("10.0.0.1", zones=("zone-a",)),
            ep("10.0.0.2", zones=("zone-b",)),
            ep("10.0.0.3", ready=False, serving=False),
        ),
        cluster=("10.0.0.1",),
        local=(),
        reachable=("10.0.0.1",),
        has_any=True,
    ),
    Case(
        "zone hints are ignored when one ready endpoint has none",
        (ep("10.0.0.1", zones=("zone-a",)), ep("10.0.0.2", zones=("zone-b",)), ep("10.0.0.3")),
        cluster=("10.0.0.1", "10.0.0.2", "10.0.0.3"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.2", "10.0.0.3"),
        has_any=True,
    ),
    Case(
        "zone hints are ignored when none names this node's zone",
        (ep("10.0.0.1", zones=("zone-b",)), ep("10.0.0.2", zones=("zone-c",))),
        cluster=("10.0.0.1", "10.0.0.2"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
    ),
    Case(
        "zone hints are ignored when the node has no zone label",
        (ep("10.0.0.1", zones=("zone-a",)), ep("10.0.0.2", zones=("zone-b",))),
        cluster=("10.0.0.1", "10.0.0.2"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
        node=ZONELESS_NODE,
    ),
    Case(
        "zone hints do not apply to the serving terminating fallback",
        (draining("10.0.0.1"), draining("10.0.0.2")),
        cluster=("10.0.0.1", "10.0.0.2"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
    ),
    Case(
        "node hints keep only the endpoints hinted for this node when prefer-same-node is on",
        (
            ep("10.0.0.1", nodes=("node-a",), zones=("zone-a",)),
            ep("10.0.0.2", nodes=("node-b",), zones=("zone-a",)),
        ),
        cluster=("10.0.0.1",),
        local=(),
        reachable=("10.0.0.1",),
        has_any=True,
    ),
    Case(
        "node hints are ignored when prefer-same-node is off, zone hints still apply",
        (
            ep("10.0.0.1", nodes=("node-a",), zones=("zone-a",)),
            ep("10.0.0.2", nodes=("node-b",), zones=("zone-a",)),
            ep("10.0.0.3", nodes=("node-c",), zones=("zone-b",)),
        ),
        cluster=("10.0.0.1", "10.0.0.2"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
        prefer_same_node=False,
    ),
    Case(
        "node hints are ignored when none names this node, falling back to zone hints",
        (
            ep("10.0.0.1", nodes=("node-b",), zones=("zone-a",)),
            ep("10.0.0.2", nodes=("node-c",), zones=("zone-b",)),
        ),
        cluster=("10.0.0.1",),
        local=(),
        reachable=("10.0.0.1",),
        has_any=True,
    ),
    Case(
        "node hints are ignored when one ready endpoint has none",
        (ep("10.0.0.1", nodes=("node-a",)), ep("10.0.0.2")),
        cluster=("10.0.0.1", "10.0.0.2"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
    ),
    Case(
        "internal traffic policy Local uses only local ready endpoints",
        (ep("10.0.0.1", local=True), ep("10.0.0.2"), draining("10.0.0.3", local=True)),
        cluster=(),
        local=("10.0.0.1",),
        reachable=("10.0.0.1",),
        has_any=True,
        port=ITP_LOCAL,
    ),
    Case(
        "internal traffic policy Local falls back to local serving terminating endpoints",
        (draining("10.0.0.1", local=True), ep("10.0.0.2"), draining("10.0.0.3", serving=False)),
        cluster=(),
        local=("10.0.0.1",),
        reachable=("10.0.0.1",),
        has_any=True,
        port=ITP_LOCAL,
    ),
    Case(
        "internal traffic policy Local ignores topology hints",
        (ep("10.0.0.1", local=True, zones=("zone-b",)), ep("10.0.0.2", zones=("zone-a",))),
        cluster=(),
        local=("10.0.0.1",),
        reachable=("10.0.0.1",),
        has_any=True,
        port=ITP_LOCAL,
    ),
    Case(
        "internal traffic policy Local with only remote endpoints has some but none local",
        (ep("10.0.0.2"), draining("10.0.0.3")),
        cluster=(),
        local=(),
        reachable=(),
        has_any=True,
        port=ITP_LOCAL,
    ),
    Case(
        "internal traffic policy Local counts remote serving terminating endpoints as some",
        (draining("10.0.0.3"),),
        cluster=(),
        local=(),
        reachable=(),
        has_any=True,
        port=ITP_LOCAL,
    ),
    Case(
        "internal traffic policy Local with nothing usable has none",
        (draining("10.0.0.3", serving=False, local=True),),
        cluster=(),
        local=(),
        reachable=(),
        has_any=False,
        port=ITP_LOCAL,
    ),
    Case(
        "external traffic policy Local computes cluster and local, reachable is their union",
        (ep("10.0.0.1", local=True), ep("10.0.0.2")),
        cluster=("10.0.0.1", "10.0.0.2"),
        local=("10.0.0.1",),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
        port=NODEPORT_ETP_LOCAL,
    ),
    Case(
        "external traffic policy Local adds local terminating endpoints to reachable",
        (draining("10.0.0.1", local=True), ep("10.0.0.2")),
        cluster=("10.0.0.2",),
        local=("10.0.0.1",),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
        port=NODEPORT_ETP_LOCAL,
    ),
    Case(
        "external traffic policy Local adds local endpoints that zone hints filtered out",
        (ep("10.0.0.1", local=True, zones=("zone-b",)), ep("10.0.0.2", zones=("zone-a",))),
        cluster=("10.0.0.2",),
        local=("10.0.0.1",),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
        port=NODEPORT_ETP_LOCAL,
    ),
    Case(
        "external traffic policy Local with only remote endpoints still serves pods",
        (ep("10.0.0.2"),),
        cluster=("10.0.0.2",),
        local=(),
        reachable=("10.0.0.2",),
        has_any=True,
        port=NODEPORT_ETP_LOCAL,
    ),
    Case(
        "external traffic policy Local on a port that is not externally accessible acts as Cluster",
        (ep("10.0.0.1", local=True), ep("10.0.0.2")),
        cluster=("10.0.0.1", "10.0.0.2"),
        local=(),
        reachable=("10.0.0.1", "10.0.0.2"),
        has_any=True,
        port=CLUSTER_IP_ETP_LOCAL,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_categorize(case: Case) -> None:
    got = categorize(case.endpoints, case.port, case.node, prefer_same_node=case.prefer_same_node)
    assert (
        tuple(e.ip for e in got.cluster),
        tuple(e.ip for e in got.local),
        tuple(e.ip for e in got.reachable),
        got.has_any,
    ) == (case.cluster, case.local, case.reachable, case.has_any)


def test_categories_hold_the_endpoint_values_themselves() -> None:
    local = ep("10.0.0.1", local=True)
    remote = ep("10.0.0.2")
    assert categorize([remote, local], NODEPORT_ETP_LOCAL, NODE) == EndpointCategories(
        cluster=(local, remote), local=(local,), reachable=(local, remote), has_any=True
    )


def test_endpoints_sort_by_ip_then_port() -> None:
    a81 = Endpoint("10.0.0.1", 81)
    a80 = Endpoint("10.0.0.1", 80)
    b80 = Endpoint("10.0.0.2", 80)
    got = categorize([b80, a81, a80], CLUSTER_IP_ONLY, NODE)
    assert got.cluster == (a80, a81, b80)
