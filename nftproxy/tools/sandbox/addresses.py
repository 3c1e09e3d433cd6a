"""The sandbox's address plan, and the values that describe a sandbox.

Layer: edge tooling (pure values; imports nothing of nftproxy). One job:
name every address the sandboxes use -- node, alternate node addresses,
clients, pod gateways, the bridge, the cluster, service and load-balancer
ranges -- and the specs and pods built from them (`PodSpec`, `Spec`,
`default_pods`, `Pod`). Callers: sandbox.topology (which builds them and
re-exports every name here), sandbox.cluster, tests, bench, the demo.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BRIDGE",
    "BRIDGE_IPV4",
    "BRIDGE_IPV6",
    "CLIENT_IPV4",
    "CLIENT_IPV6",
    "CLUSTER_CIDRS",
    "LB_RANGES",
    "NODE_ALT_IPV4",
    "NODE_ALT_IPV6",
    "NODE_IPV4",
    "NODE_IPV6",
    "NODE_NAME",
    "POD_GATEWAY_IPV4",
    "POD_GATEWAY_IPV6",
    "REMOTE_NODE_NAME",
    "SERVICE_RANGES",
    "Pod",
    "PodSpec",
    "Spec",
    "default_pods",
]

NODE_NAME = "node-a"
REMOTE_NODE_NAME = "node-b"

NODE_IPV4 = "192.168.50.1"
NODE_IPV6 = "fd00:50::1"
NODE_ALT_IPV4 = "192.168.51.1"
"""A second node address (e.g. one that nodePortAddresses leaves out)."""
NODE_ALT_IPV6 = "fd00:51::1"
CLIENT_IPV4 = ("192.168.50.2", "192.168.50.3")
CLIENT_IPV6 = ("fd00:50::2", "fd00:50::3")
POD_GATEWAY_IPV4 = "10.244.0.1"
"""The node's address on every pod veth: what a masqueraded pod peer shows."""
POD_GATEWAY_IPV6 = "fd00:244::1"
BRIDGE = "cbr0"
BRIDGE_IPV4 = "10.244.2.1"
BRIDGE_IPV6 = "fd00:244:2::1"
CLUSTER_CIDRS = ("10.244.0.0/16", "fd00:244::/48")
SERVICE_RANGES = ("10.96.0.0/16", "fd00:96::/64")
"""Where tests put ClusterIPs (routed from the client via the node)."""
LB_RANGES = ("192.168.60.0/24", "fd00:60::/64")
"""Where tests put LoadBalancer ingress and external IPs (routed likewise)."""


@dataclass(frozen=True, slots=True)
class PodSpec:
    name: str
    ipv4: str
    ipv6: str | None = None
    node_name: str = NODE_NAME
    """What EndpointSlices should say; every pod is wired to the one node."""
    bridge: bool = False


@dataclass(frozen=True, slots=True)
class Spec:
    pods: tuple[PodSpec, ...]
    client_ipv4: tuple[str, ...] = CLIENT_IPV4
    """The first one is the source of client routes; the rest are extra sources."""
    client_ipv6: tuple[str, ...] = CLIENT_IPV6
    tcp_ports: tuple[int, ...] = (8080,)
    udp_ports: tuple[int, ...] = (5353,)
    sctp_ports: tuple[int, ...] = (9090,)
    """Served only where the kernel has SCTP (Topology.sctp_unsupported)."""
    backends: bool = True


def default_pods(local: int = 3, remote: int = 2, bridged: int = 0) -> tuple[PodSpec, ...]:
    """local1.. (10.244.0.11.., fd00:244::11..) on this node, remote1..
    (10.244.1.11.., fd00:244::1:11..) on REMOTE_NODE_NAME, br1.. on the bridge
    (10.244.2.11.., fd00:244:2::11..)."""
    out = [
        PodSpec(f"local{i}", f"10.244.0.{10 + i}", f"fd00:244::{10 + i}")
        for i in range(1, local + 1)
    ]
    out += [
        PodSpec(f"remote{i}", f"10.244.1.{10 + i}", f"fd00:244::1:{10 + i}", REMOTE_NODE_NAME)
        for i in range(1, remote + 1)
    ]
    out += [
        PodSpec(f"br{i}", f"10.244.2.{10 + i}", f"fd00:244:2::{10 + i}", bridge=True)
        for i in range(1, bridged + 1)
    ]
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    netns: str
    ipv4: str
    ipv6: str | None
    node_name: str
    interface: str
    """The node-side interface (veth, enslaved to BRIDGE for bridged pods)."""
    gateway_ipv4: str
    gateway_ipv6: str

    def ip(self, family: int) -> str:
        """The pod's address of IP version `family` (4 or 6)."""
        if family == 4:
            return self.ipv4
        if self.ipv6 is None:
            raise ValueError(f"pod {self.name} has no IPv6 address")
        return self.ipv6

    def gateway(self, family: int) -> str:
        """Where masqueraded traffic comes from, as this pod sees it."""
        return self.gateway_ipv4 if family == 4 else self.gateway_ipv6
