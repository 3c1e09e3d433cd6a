"""The flags of `nftproxy`'s subcommands, and what they override.

Layer: tools (argparse only; imports the core's config for names and
config_values for durations). One job: the four flag groups subcommands
combine -- `table_flags` (every command), `ruleset_flags` (the
configuration file and the settings that shape the ruleset: run, sync,
trace, demo), `agent_flags` (the long-running agent's servers and timing:
run, demo), `marker_flags` (the kube-proxy marker: run, sync) -- so each
`--help` lists only the flags its command reads; and
`flag_overrides`, the ProxyConfig overrides of parsed flags, where a flag
a subcommand does not have stays None, with the warnings about feature
gates nftproxy does not implement. Caller: cli.py (build_parser,
_load_config).
"""

from __future__ import annotations

import argparse
from typing import Any

from nftproxy.core.config import ALL, LOCALHOST, LOCALHOST_NODEPORTS_GATE, PRIMARY, DetectLocalMode
from nftproxy.tools.config_values import (
    FEATURE_GATES,
    ConfigError,
    parse_duration,
    parse_feature_gates,
)

__all__ = ["agent_flags", "flag_overrides", "marker_flags", "ruleset_flags", "table_flags"]

# Flags that are not given are None: the file's value or the default applies.


def table_flags() -> argparse.ArgumentParser:
    """What every subcommand takes: the table names, and -v."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--table-name", metavar="NAME",
                   help="nftables table name, in families ip and ip6 (default nftproxy)")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more log detail (-v debug, -vv trace)")
    return p


def ruleset_flags() -> argparse.ArgumentParser:
    """The configuration file, and the settings that shape the ruleset."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("configuration (flags override --config)")
    g.add_argument("--config", metavar="FILE",
                   help="KubeProxyConfiguration YAML file (v1alpha1 or v1alpha2)")
    g.add_argument("--config-hard-fail", metavar="BOOL", nargs="?", const=True,
                   type=_bool_arg,
                   help="unknown or unsupported fields in --config are errors, not warnings "
                   "(default: the file's configHardFail; v1alpha2 true, v1alpha1 false)")
    g.add_argument("--node-name", metavar="NAME",
                   help="this node's name (default: $NODE_NAME, then the hostname; "
                   "with --source, the only Node in the files)")
    g.add_argument("--node-ip", metavar="IP", action="append",
                   help="this node's primary IP; repeat once per family")
    g.add_argument("--cluster-cidr", metavar="CIDRS",
                   help="pod CIDRs, comma-separated (one per family)")
    modes = [m.value for m in DetectLocalMode]
    g.add_argument("--detect-local-mode", choices=modes, metavar="MODE",
                   help=f"how pod traffic is told apart: {', '.join(modes)} "
                   "(default ClusterCIDR)")
    g.add_argument("--pod-bridge-interface", metavar="IFACE",
                   help="pods' bridge, for --detect-local-mode BridgeInterface")
    g.add_argument("--pod-interface-name-prefix", metavar="PREFIX",
                   help="pods' interface prefix, for --detect-local-mode InterfaceNamePrefix")
    g.add_argument("--nodeport-addresses", metavar="CIDRS",
                   help=f"CIDRs serving node ports, comma-separated, and the keywords "
                   f"{PRIMARY!r} (the node's primary IPs), {LOCALHOST!r} (loopback; served "
                   f"only with the {LOCALHOST_NODEPORTS_GATE} feature gate, IPv4 only) and "
                   f"{ALL!r} (default: every local address but loopback)")
    g.add_argument("--masquerade-all", action="store_true", default=None,
                   help="masquerade all traffic sent to service IPs")
    g.add_argument("--masquerade-bit", metavar="N", type=int,
                   help="packet mark bit for masquerading, 0..31 (default 14)")
    g.add_argument("--feature-gates", metavar="GATE=BOOL,...",
                   help=f"kube-proxy feature gates, comma-separated; nftproxy reads "
                   f"{', '.join(FEATURE_GATES)} and warns about others")
    g.add_argument("--allow-service-external-ips", metavar="BOOL", nargs="?", const=True,
                   type=_bool_arg,
                   help="program Services' spec.externalIPs (default true; kube-proxy's "
                   "AllowServiceExternalIPs feature gate)")
    return p


def agent_flags() -> argparse.ArgumentParser:
    """Settings of the long-running agent: its servers and sync timing."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("agent (flags override --config)")
    g.add_argument("--healthz-bind-address", metavar="IP:PORT",
                   help="health server address (default 0.0.0.0:10256; empty disables)")
    g.add_argument("--metrics-bind-address", metavar="IP:PORT",
                   help="metrics server address (default 127.0.0.1:10249; empty disables)")
    g.add_argument("--bind-address-hard-fail", metavar="BOOL", nargs="?", const=True,
                   type=_bool_arg,
                   help="exit if the health or metrics server cannot bind (default false)")
    g.add_argument("--sync-period", metavar="DURATION",
                   help="longest time between syncs, e.g. 30s (default)")
    g.add_argument("--min-sync-period", metavar="DURATION",
                   help="shortest time between syncs, e.g. 1s (default)")
    return p


def marker_flags() -> argparse.ArgumentParser:
    """What writes nftproxy's tables for a node (run, sync) also writes the
    kube-proxy marker, unless told not to."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("peers (flags override --config)")
    g.add_argument("--kube-proxy-marker", metavar="BOOL", nargs="?", const=True,
                   type=_bool_arg,
                   help="write tables ip/ip6 kube-proxy holding one inert chain where none "
                   "exists, so tools that look for kube-proxy's nftables mode (Calico's "
                   "nftablesMode Auto) find an nftables proxy (default true)")
    return p


def _bool_arg(text: str) -> bool:
    """kube-proxy's boolean flag values: --flag, --flag=true, --flag=false."""
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in ("true", "1")


# ProxyConfig field -> the flag's argparse dest (flags a subcommand lacks stay None)
_FLAG_DESTS = {
    "node_name": "node_name",
    "node_ips": "node_ip",
    "cluster_cidrs": "cluster_cidr",
    "detect_local_mode": "detect_local_mode",
    "bridge_interface": "pod_bridge_interface",
    "interface_name_prefix": "pod_interface_name_prefix",
    "nodeport_addresses": "nodeport_addresses",
    "masquerade_all": "masquerade_all",
    "masquerade_bit": "masquerade_bit",
    "allow_service_external_ips": "allow_service_external_ips",
    "table_name": "table_name",
    "healthz_bind_address": "healthz_bind_address",
    "metrics_bind_address": "metrics_bind_address",
    "bind_address_hard_fail": "bind_address_hard_fail",
    "kube_proxy_marker": "kube_proxy_marker",
}


def flag_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The overrides of the parsed flags (a gate's own flag, like
    --allow-service-external-ips, wins over --feature-gates), and the
    warnings about gates nftproxy does not implement."""
    overrides: dict[str, Any] = {}
    warnings: list[str] = []
    gates = getattr(args, "feature_gates", None)
    if gates is not None:
        parsed, warnings = parse_feature_gates("--feature-gates", gates)
        overrides.update(parsed)
    for key, dest in _FLAG_DESTS.items():
        value = getattr(args, dest, None)
        if value is not None or key not in overrides:
            overrides[key] = value
    overrides["sync_period"] = _duration_flag(
        "--sync-period", getattr(args, "sync_period", None))
    overrides["min_sync_period"] = _duration_flag(
        "--min-sync-period", getattr(args, "min_sync_period", None))
    return overrides, warnings


def _duration_flag(flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
