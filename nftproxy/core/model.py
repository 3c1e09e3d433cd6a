"""Core vocabulary of nftproxy: immutable values shared by every layer.

Layer: model (bottom; imports nothing from nftproxy). One job: name the things
the proxy reasons about -- service ports, endpoints, the node -- as frozen
dataclasses, so every other module can pass them around as values.

A ServicePort is single-family, as in kube-proxy, where each IP family has its
own proxier: a dual-stack Service yields one IPv4 ServicePort and one IPv6
ServicePort per port, each tracked and rendered into its own table.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "DEFAULT_AFFINITY_TIMEOUT",
    "Endpoint",
    "HostAddresses",
    "IPFamily",
    "IPMode",
    "L4Protocol",
    "LoadBalancerIngress",
    "NamespacedName",
    "NodeInfo",
    "ServiceInfo",
    "ServicePort",
    "ServicePortName",
    "SessionAffinity",
    "TrafficPolicy",
    "family_of",
]

DEFAULT_AFFINITY_TIMEOUT = 10800
"""kube-proxy's default sessionAffinityConfig.clientIP.timeoutSeconds (3 h)."""


class IPFamily(str, Enum):
    IPV4 = "IPv4"
    IPV6 = "IPv6"

    @property
    def nft_family(self) -> str:
        """The nftables table family for this IP family ("ip" / "ip6")."""
        return "ip" if self is IPFamily.IPV4 else "ip6"


class L4Protocol(str, Enum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"

    @property
    def nft(self) -> str:
        """Lower-case name as nft and kube-proxy's chain hashes spell it."""
        return str.lower(self)  # not self.value: an Enum descriptor, slow in the render loop


class TrafficPolicy(str, Enum):
    CLUSTER = "Cluster"
    LOCAL = "Local"


class SessionAffinity(str, Enum):
    NONE = "None"
    CLIENT_IP = "ClientIP"


class IPMode(str, Enum):
    VIP = "VIP"
    PROXY = "Proxy"


def family_of(ip: str) -> IPFamily:
    """Family of an address or CIDR string; raises ValueError if it is neither."""
    text = ip.split("/", 1)[0]
    return IPFamily.IPV4 if ipaddress.ip_address(text).version == 4 else IPFamily.IPV6


@dataclass(frozen=True, slots=True, order=True)
class NamespacedName:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True, order=True)
class ServicePortName:
    """Identity of one port of one Service, as kube-proxy's ServicePortName.

    >>> str(ServicePortName("ns", "web", "http", L4Protocol.TCP))
    'ns/web:http'
    >>> str(ServicePortName("ns", "web", "", L4Protocol.TCP))
    'ns/web'
    """

    namespace: str
    name: str
    port: str
    protocol: L4Protocol

    @property
    def service(self) -> NamespacedName:
        return NamespacedName(self.namespace, self.name)

    def __str__(self) -> str:
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.port}" if self.port else base


@dataclass(frozen=True, slots=True)
class LoadBalancerIngress:
    ip: str
    ip_mode: IPMode = IPMode.VIP


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One port of one Service in one IP family, already validated.

    Every address field holds only addresses of `family`. `node_port` and
    `health_check_node_port` are 0 when unset.
    """

    name: ServicePortName
    family: IPFamily
    cluster_ip: str
    port: int
    protocol: L4Protocol
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ingress: tuple[LoadBalancerIngress, ...] = ()
    load_balancer_source_ranges: tuple[str, ...] = ()
    external_traffic_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    internal_traffic_policy: TrafficPolicy = TrafficPolicy.CLUSTER
    session_affinity: SessionAffinity = SessionAffinity.NONE
    affinity_timeout: int = DEFAULT_AFFINITY_TIMEOUT
    health_check_node_port: int = 0
    traffic_distribution: str = ""

    def at_port(
        self, name: ServicePortName, port: int, protocol: L4Protocol, node_port: int
    ) -> ServicePort:
        """This service's port `name` (dataclasses.replace spelled out, as it
        runs once per port of the initial list and replace() is slower)."""
        return ServicePort(
            name, self.family, self.cluster_ip, port, protocol, node_port, self.external_ips,
            self.load_balancer_ingress, self.load_balancer_source_ranges,
            self.external_traffic_policy, self.internal_traffic_policy, self.session_affinity,
            self.affinity_timeout, self.health_check_node_port, self.traffic_distribution,
        )  # fmt: skip

    def _vip_ingress(self) -> Iterator[LoadBalancerIngress]:
        """The LB ingress kube-proxy captures (ipMode VIP; Proxy is left alone)."""
        return (i for i in self.load_balancer_ingress if i.ip_mode is IPMode.VIP)

    @property
    def load_balancer_vips(self) -> tuple[str, ...]:
        """LB ingress IPs that kube-proxy captures."""
        return tuple(i.ip for i in self._vip_ingress())

    @property
    def externally_accessible(self) -> bool:
        # without building load_balancer_vips: asked of every port, every full sync
        return bool(self.node_port or self.external_ips) or any(True for _ in self._vip_ingress())

    @property
    def external_policy_local(self) -> bool:
        return self.externally_accessible and self.external_traffic_policy is TrafficPolicy.LOCAL

    @property
    def internal_policy_local(self) -> bool:
        return self.internal_traffic_policy is TrafficPolicy.LOCAL

    @property
    def uses_cluster_endpoints(self) -> bool:
        """Cluster endpoints are needed for iTP=Cluster, and for any externally
        accessible service (its pod/host short-circuit uses them even with eTP=Local)."""
        return not self.internal_policy_local or self.externally_accessible

    @property
    def uses_local_endpoints(self) -> bool:
        return self.internal_policy_local or self.external_policy_local

    @property
    def affinity(self) -> bool:
        return self.session_affinity is SessionAffinity.CLIENT_IP


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    """One backend address of one service port.

    `ready` follows EndpointSlice semantics (a missing condition counts as
    ready); `serving` defaults to `ready` when absent, as in the API.
    """

    ip: str
    port: int
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str = ""
    zone: str = ""
    zone_hints: frozenset[str] = frozenset()
    node_hints: frozenset[str] = frozenset()
    is_local: bool = False

    def at_port(self, port: int) -> Endpoint:
        """This endpoint at `port` (dataclasses.replace spelled out, as it
        runs once per endpoint and port of the initial list and replace()
        is slower)."""
        return Endpoint(
            self.ip, port, self.ready, self.serving, self.terminating, self.node_name,
            self.zone, self.zone_hints, self.node_hints, self.is_local,
        )

    @property
    def address(self) -> str:
        """ip:port, with brackets for IPv6, as kube-proxy's endpoint string."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    """A Service as the proxy sees it: its ServicePorts in each family. A
    family the Service has no cluster IP in (and a headless, ExternalName or
    proxy-name-labelled Service in both) has none."""

    name: NamespacedName
    ipv4: Mapping[ServicePortName, ServicePort] = field(default_factory=dict)
    ipv6: Mapping[ServicePortName, ServicePort] = field(default_factory=dict)

    def ports(self, family: IPFamily) -> Mapping[ServicePortName, ServicePort]:
        return self.ipv4 if family is IPFamily.IPV4 else self.ipv6


@dataclass(frozen=True, slots=True)
class HostAddresses:
    """The addresses on the host's interfaces (the agent's network
    namespace), per family, sorted: what nodePortAddresses CIDRs select from,
    as kube-proxy's GetNodeIPs. Read by nftproxy.kernel.addresses."""

    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()

    def of(self, family: IPFamily) -> tuple[str, ...]:
        return self.ipv4 if family is IPFamily.IPV4 else self.ipv6


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the proxy knows of its own node.

    `ipv4`/`ipv6` hold the node's addresses per family, primary first (from
    --node-ip, then the Node object's InternalIP then ExternalIP). `pod_cidrs`
    are the Node's spec.podCIDRs (used by detectLocalMode NodeCIDR).
    `host_addresses` are the host's interface addresses, None when not read
    (no nodePortAddresses CIDRs, `sync --dry-run`): node ports restricted by
    nodePortAddresses then select from `ipv4`/`ipv6` instead.
    """

    name: str
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    pod_cidrs: tuple[str, ...] = ()
    deleting: bool = False
    to_be_deleted: bool = False
    host_addresses: HostAddresses | None = None

    @property
    def zone(self) -> str:
        return dict(self.labels).get("topology.kubernetes.io/zone", "")

    def ips_of(self, family: IPFamily) -> tuple[str, ...]:
        return self.ipv4 if family is IPFamily.IPV4 else self.ipv6

    def primary_ip(self, family: IPFamily) -> str | None:
        ips = self.ips_of(family)
        return ips[0] if ips else None
