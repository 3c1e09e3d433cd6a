"""/configz and /proxyMode: what kube-proxy's metrics server answers besides /metrics.

Layer: edge (serving; imports the core's config only). One job: render the
effective ProxyConfig the way kube-proxy's /configz prints its own, and the
proxy mode the way its /proxyMode does. Caller: serving/metrics.py.

kube-proxy registers its internal KubeProxyConfiguration with
component-base's configz under the group name, and that type has no JSON
tags: the body is `{"kubeproxy.config.k8s.io": {...}}` with Go field names
(`Linux`, `NFTables`, `DetectLocal`, ...), durations as Go prints them
("30s", "24h0m0s") and an unset list as null. Only the fields nftproxy
reads are printed (docs/config.md), with the values it runs with: flags
applied, `HostnameOverride` the node name in use, `FeatureGates` the two
gates it reads. `Mode` is always "nftables".
"""

from __future__ import annotations

import json
from typing import Any

from nftproxy.core.config import ProxyConfig
from nftproxy.serving.http import Response

__all__ = [
    "CONFIGZ_GROUP",
    "PROXY_MODE",
    "configz_body",
    "configz_response",
    "go_duration",
    "proxy_mode_response",
]

CONFIGZ_GROUP = "kubeproxy.config.k8s.io"
PROXY_MODE = "nftables"

_TEXT_HEADERS = {"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"}
_JSON_HEADERS = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}


def proxy_mode_response() -> Response:
    """kube-proxy's /proxyMode: the mode, as plain text without a newline."""
    return 200, dict(_TEXT_HEADERS), PROXY_MODE.encode()


def configz_response(config: ProxyConfig) -> Response:
    """kube-proxy's /configz for `config` (compact JSON, as Go marshals it)."""
    body = json.dumps(configz_body(config), separators=(",", ":")).encode()
    return 200, dict(_JSON_HEADERS), body


def configz_body(config: ProxyConfig) -> dict[str, Any]:
    ct = config.conntrack
    return {
        CONFIGZ_GROUP: {
            "Linux": {
                "Conntrack": {
                    "MaxPerCore": ct.max_per_core,
                    "Min": ct.min,
                    "TCPEstablishedTimeout": go_duration(ct.tcp_established_timeout),
                    "TCPCloseWaitTimeout": go_duration(ct.tcp_close_wait_timeout),
                    "TCPBeLiberal": ct.tcp_be_liberal,
                    "UDPTimeout": go_duration(ct.udp_timeout),
                    "UDPStreamTimeout": go_duration(ct.udp_stream_timeout),
                },
                "MasqueradeAll": config.masquerade_all,
            },
            "FeatureGates": {
                "AllowServiceExternalIPs": config.allow_service_external_ips,
                "PreferSameTrafficDistribution": config.prefer_same_node,
                "KubeProxyNFTablesLocalhostNodePorts": config.nftables_localhost_nodeports,
            },
            "HostnameOverride": config.node_name,
            "BindAddress": config.node_ips[0] if config.node_ips else "0.0.0.0",
            "HealthzBindAddress": config.healthz_bind_address,
            "MetricsBindAddress": config.metrics_bind_address,
            "BindAddressHardFail": config.bind_address_hard_fail,
            "Mode": PROXY_MODE,
            "NFTables": {"MasqueradeBit": config.masquerade_bit},
            "DetectLocalMode": config.detect_local_mode.value,
            "DetectLocal": {
                "BridgeInterface": config.bridge_interface,
                "ClusterCIDRs": list(config.cluster_cidrs) or None,
                "InterfaceNamePrefix": config.interface_name_prefix,
            },
            "NodePortAddresses": list(config.nodeport_addresses) or None,
            "SyncPeriod": go_duration(config.sync_period),
            "MinSyncPeriod": go_duration(config.min_sync_period),
            "ConfigSyncPeriod": go_duration(config.config_sync_period),
        }
    }


def go_duration(seconds: float) -> str:
    """`seconds` as Go's time.Duration.String() prints it ("1h0m0s", "1.5s", "250ms")."""
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if ns < 1_000_000_000:
        for unit, size in (("ms", 1_000_000), ("µs", 1_000)):
            if ns >= size:
                return f"{sign}{_fraction(ns, size)}{unit}"
        return f"{sign}{ns}ns"
    hours, rest = divmod(ns, 3_600_000_000_000)
    minutes, rest = divmod(rest, 60_000_000_000)
    text = f"{hours}h" if hours else ""
    if hours or minutes:
        text += f"{minutes}m"
    return f"{sign}{text}{_fraction(rest, 1_000_000_000)}s"


def _fraction(value: int, unit: int) -> str:
    """value / unit in decimal without trailing zeros ("1.5", "30", "0.25")."""
    whole, part = divmod(value, unit)
    if not part:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{part:0{digits}d}".rstrip("0")
