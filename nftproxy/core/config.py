"""ProxyConfig: every setting of nftproxy as one immutable value.

Layer: model-level value (imports only model). One job: hold the settings that
shape the ruleset and the agent, with kube-proxy's defaults. Loading them from
flags and KubeProxyConfiguration YAML lives in `config_load.py`; the pure core
(rules, topology) only ever reads a ProxyConfig it is handed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from enum import Enum

from nftproxy.core.model import HostAddresses, IPFamily, NodeInfo, family_of

__all__ = [
    "PRIMARY",
    "ConntrackConfig",
    "DetectLocalMode",
    "ProxyConfig",
]

PRIMARY = "primary"
"""The nodePortAddresses keyword for "the node's primary IP of each family"."""


class DetectLocalMode(str, Enum):
    CLUSTER_CIDR = "ClusterCIDR"
    NODE_CIDR = "NodeCIDR"
    BRIDGE_INTERFACE = "BridgeInterface"
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"


@dataclass(frozen=True, slots=True)
class ConntrackConfig:
    """kube-proxy's linux.conntrack settings (0 means "leave the kernel's value")."""

    max_per_core: int = 32768
    min: int = 131072
    tcp_established_timeout: int = 86400
    tcp_close_wait_timeout: int = 3600
    tcp_be_liberal: bool = False
    udp_timeout: int = 0
    udp_stream_timeout: int = 0


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Settings with kube-proxy's defaults.

    `nodeport_addresses` empty means every local address except loopback;
    ("primary",) means the node's primary IP per family; otherwise CIDRs.
    """

    node_name: str = ""
    node_ips: tuple[str, ...] = ()
    cluster_cidrs: tuple[str, ...] = ()
    detect_local_mode: DetectLocalMode = DetectLocalMode.CLUSTER_CIDR
    bridge_interface: str = ""
    interface_name_prefix: str = ""
    nodeport_addresses: tuple[str, ...] = ()
    masquerade_all: bool = False
    masquerade_bit: int = 14
    table_name: str = "nftproxy"
    sync_period: float = 30.0
    min_sync_period: float = 1.0
    full_sync_period: float = 3600.0
    healthz_bind_address: str = "0.0.0.0:10256"
    metrics_bind_address: str = "127.0.0.1:10249"
    config_sync_period: float = 900.0
    prefer_same_node: bool = True
    allow_service_external_ips: bool = True
    """kube-proxy's AllowServiceExternalIPs feature gate (KEP-5707): False
    leaves every Service's spec.externalIPs unprogrammed."""
    bind_address_hard_fail: bool = False
    """A healthz or metrics server that cannot bind stops the agent."""
    kube_proxy_marker: bool = True
    """Write the kube-proxy marker (core/nft/marker.py): `ip`/`ip6 kube-proxy`
    with one inert chain, where peers look for kube-proxy's nftables mode."""
    conntrack: ConntrackConfig = field(default_factory=ConntrackConfig)

    @property
    def masquerade_mark(self) -> int:
        """The packet mark bit KUBE-MARK-MASQ sets (bit 14 -> 0x4000)."""
        return 1 << self.masquerade_bit

    def cluster_cidrs_of(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(c for c in self.cluster_cidrs if family_of(c) is family)

    def nodeport_cidrs_of(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(c for c in self.nodeport_addresses if c != PRIMARY and family_of(c) is family)

    @property
    def nodeport_primary(self) -> bool:
        return PRIMARY in self.nodeport_addresses

    def nodeport_matches_all(self, family: IPFamily) -> bool:
        """True when node ports are served on every non-loopback local address
        of `family`: nodePortAddresses lists no CIDR of that family (and is not
        "primary"), or lists a /0 of it -- as kube-proxy's NewNodePortAddresses."""
        if self.nodeport_primary:
            return False
        cidrs = self.nodeport_cidrs_of(family)
        return not cidrs or any(ipaddress.ip_network(c, strict=False).prefixlen == 0 for c in cidrs)

    @property
    def nodeport_addresses_restricted(self) -> bool:
        """nodePortAddresses leaves some local address out in some family:
        node ports then follow the host's interface addresses."""
        return not all(self.nodeport_matches_all(f) for f in IPFamily)

    def node_view(self, node: NodeInfo | None, host: HostAddresses | None) -> NodeInfo:
        """The node a sync renders for: the Node object (or just our name),
        the --node-ip flags' addresses first, and the host's interface
        addresses."""
        base = node or NodeInfo(self.node_name)
        v4 = tuple(ip for ip in self.node_ips if family_of(ip) is IPFamily.IPV4)
        v6 = tuple(ip for ip in self.node_ips if family_of(ip) is IPFamily.IPV6)
        return NodeInfo(
            name=base.name or self.node_name,
            ipv4=v4 + tuple(ip for ip in base.ipv4 if ip not in v4),
            ipv6=v6 + tuple(ip for ip in base.ipv6 if ip not in v6),
            labels=base.labels,
            pod_cidrs=base.pod_cidrs,
            deleting=base.deleting,
            to_be_deleted=base.to_be_deleted,
            host_addresses=host,
        )
