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
    "ALL",
    "LOCALHOST",
    "LOCALHOST_NODEPORTS_GATE",
    "NODEPORT_KEYWORDS",
    "PRIMARY",
    "ConntrackConfig",
    "DetectLocalMode",
    "ProxyConfig",
]

PRIMARY = "primary"
"""The nodePortAddresses keyword for "the node's primary IP of each family"."""
LOCALHOST = "localhost"
"""The nodePortAddresses keyword for the loopback CIDRs, 127.0.0.0/8 and ::1/128 (KEP-6032)."""
ALL = "all"
"""The nodePortAddresses keyword for the zero CIDRs, 0.0.0.0/0 and ::/0 (KEP-6032)."""
NODEPORT_KEYWORDS = (PRIMARY, LOCALHOST, ALL)
LOCALHOST_NODEPORTS_GATE = "KubeProxyNFTablesLocalhostNodePorts"
"""kube-proxy's feature gate (alpha, off by default) that serves node ports
on a loopback address nodePortAddresses lists."""

_KEYWORD_CIDRS = {
    LOCALHOST: {IPFamily.IPV4: "127.0.0.0/8", IPFamily.IPV6: "::1/128"},
    ALL: {IPFamily.IPV4: "0.0.0.0/0", IPFamily.IPV6: "::/0"},
}
_IPV4_LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")


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
    otherwise CIDRs and the keywords "primary" (the node's primary IP per
    family), "localhost" (the loopback CIDRs) and "all" (the zero CIDRs),
    in any combination, as kube-proxy's nodePortAddresses.
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
    nftables_localhost_nodeports: bool = False
    """kube-proxy's KubeProxyNFTablesLocalhostNodePorts feature gate
    (KEP-6032): True serves node ports on the IPv4 loopback addresses
    nodePortAddresses lists (`localhost_nodeports`)."""
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
        """nodePortAddresses' CIDRs of `family`, "localhost" and "all" as theirs."""
        out: list[str] = []
        for entry in self.nodeport_addresses:
            if entry in _KEYWORD_CIDRS:
                out.append(_KEYWORD_CIDRS[entry][family])
            elif entry != PRIMARY and family_of(entry) is family:
                out.append(entry)
        return tuple(out)

    @property
    def nodeport_primary(self) -> bool:
        return PRIMARY in self.nodeport_addresses

    def nodeport_matches_all(self, family: IPFamily) -> bool:
        """True when node ports are served on every non-loopback local address
        of `family`: nodePortAddresses lists a /0 of that family ("all"), or
        neither a CIDR of it nor "primary" -- as kube-proxy's NewNodePortAddresses."""
        cidrs = self.nodeport_cidrs_of(family)
        if any(ipaddress.ip_network(c, strict=False).prefixlen == 0 for c in cidrs):
            return True
        return not cidrs and not self.nodeport_primary

    @property
    def nodeport_addresses_restricted(self) -> bool:
        """nodePortAddresses leaves some local address out in some family:
        node ports then follow the host's interface addresses."""
        return not all(self.nodeport_matches_all(f) for f in IPFamily)

    @property
    def nodeport_ipv4_loopback(self) -> tuple[str, ...]:
        """The IPv4 loopback addresses nodePortAddresses names explicitly
        ("localhost", or a CIDR other than a /0 that overlaps 127.0.0.0/8),
        as CIDRs inside 127.0.0.0/8 -- what kube-proxy's
        ContainsExplicitLoopback looks for."""
        found: list[ipaddress.IPv4Network] = []
        for cidr in self.nodeport_cidrs_of(IPFamily.IPV4):
            net = ipaddress.IPv4Network(cidr, strict=False)
            if net.prefixlen == 0 or not net.overlaps(_IPV4_LOOPBACK):
                continue
            found.append(net if net.subnet_of(_IPV4_LOOPBACK) else _IPV4_LOOPBACK)
        return tuple(str(n) for n in ipaddress.collapse_addresses(found))

    @property
    def localhost_nodeports(self) -> tuple[str, ...]:
        """The loopback destinations (CIDRs inside 127.0.0.0/8) that serve
        node ports to the node's own processes: those nodePortAddresses
        names, with the feature gate on; () otherwise. Never ::1: the kernel
        routes IPv6 loopback only on lo (route_localnet is IPv4's)."""
        return self.nodeport_ipv4_loopback if self.nftables_localhost_nodeports else ()

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
