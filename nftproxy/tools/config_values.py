"""The vocabulary of nftproxy's settings: each one's normaliser and its names.

Layer: tools (pure values and functions; imports the core's config, model
and address). One job: say, for every ProxyConfig field, how a raw value
(from YAML or from a flag) is checked and normalised, and what it is called
in a KubeProxyConfiguration file and on the command line (`SETTINGS`,
`CONNTRACK_SETTINGS`) -- so errors name the field path or the flag the value
came from. Also Go durations (`parse_duration`). Callers: config_load.py
(the file reader and build_config) and cli.py (duration flags).

A normaliser takes (label, raw value) and returns the normalised value, or
raises `ConfigError` whose message starts with the label
(`nftables.masqueradeBit: 40 is not in 0..31`).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from typing import Any

from nftproxy.core.address import format_address, parse_address
from nftproxy.core.config import LOCALHOST_NODEPORTS_GATE, NODEPORT_KEYWORDS, DetectLocalMode
from nftproxy.core.model import IPFamily, family_of
from nftproxy.core.nft.ownership import our_tables
from nftproxy.core.rules import names

__all__ = [
    "CONNTRACK_SETTINGS",
    "FEATURE_GATES",
    "SETTINGS",
    "WELL_KNOWN_TABLES",
    "ConfigError",
    "Normaliser",
    "as_bool",
    "as_cidrs",
    "as_ip",
    "as_port",
    "as_seconds",
    "as_str",
    "bind_address_of",
    "fail",
    "parse_duration",
    "parse_feature_gates",
]

DEFAULT_HEALTHZ_PORT = 10256
DEFAULT_METRICS_PORT = 10249


class ConfigError(ValueError):
    """An invalid setting; the message names the field path or flag."""


# -- Go durations ---------------------------------------------------------------------

_DURATION_UNITS: dict[str, float] = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,  # micro sign
    "\u03bcs": 1e-6,  # greek mu
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile("(\\d+\\.?\\d*|\\.\\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string (time.ParseDuration syntax).

    >>> parse_duration("1m0s"), parse_duration("500ms"), parse_duration("1h30m")
    (60.0, 0.5, 5400.0)
    >>> parse_duration("0")
    0.0
    """
    body = text.strip()
    sign = 1.0
    if body[:1] in ("+", "-"):
        sign = -1.0 if body[0] == "-" else 1.0
        body = body[1:]
    if body == "0":
        return 0.0
    if not body:
        raise ValueError(f"invalid duration {text!r}")
    total = 0.0
    pos = 0
    while pos < len(body):
        match = _DURATION_PART.match(body, pos)
        if match is None:
            hint = " (missing unit, e.g. \"30s\")" if body[pos:].replace(".", "").isdigit() else ""
            raise ValueError(f"invalid duration {text!r}{hint}")
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    return sign * total


# -- value normalisers: (label, raw value) -> normalised value, or ConfigError --------


def fail(label: str, problem: str) -> ConfigError:
    return ConfigError(f"{label}: {problem}")


def as_str(label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise fail(label, f"expected a string, got {value!r}")
    return value.strip()


def as_bool(label: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise fail(label, f"expected true or false, got {value!r}")
    return value


def _int(label: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(label, f"expected an integer, got {value!r}")
    return value


def _list(label: str, value: Any) -> list[Any]:
    if isinstance(value, str):
        return [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, list | tuple):
        raise fail(label, f"expected a list, got {value!r}")
    return list(value)


def as_seconds(label: str, value: Any) -> float:
    if isinstance(value, bool):
        raise fail(label, f"expected a duration like \"30s\", got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        try:
            seconds = parse_duration(as_str(label, value))
        except ValueError as exc:
            raise fail(label, str(exc)) from None
    if seconds < 0:
        raise fail(label, f"{value} is negative")
    return seconds


def as_ip(label: str, value: Any) -> str:
    text = as_str(label, value)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise fail(label, f"{text!r} is not an IP address") from None


def _cidr(label: str, value: Any) -> str:
    text = as_str(label, value)
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise fail(label, f"{text!r} is not a CIDR") from None


def _one_per_family(label: str, values: Iterable[str], what: str) -> None:
    seen: dict[IPFamily, str] = {}
    for value in values:
        family = family_of(value)
        if family in seen:
            raise fail(
                label,
                f"two {family.value} {what} ({seen[family]}, {value}); give at most one per family",
            )
        seen[family] = value


def _cidr_list(label: str, value: Any) -> tuple[str, ...]:
    cidrs = tuple(_cidr(label, v) for v in _list(label, value))
    _one_per_family(label, cidrs, "CIDRs")
    return cidrs


def _node_ips(label: str, value: Any) -> tuple[str, ...]:
    ips = tuple(as_ip(label, v) for v in _list(label, value))
    _one_per_family(label, ips, "addresses")
    return ips


def _nodeport_addresses(label: str, value: Any) -> tuple[str, ...]:
    """CIDRs and the keywords primary, localhost and all, in any combination
    (kube-proxy 1.37, KEP-6032); the keywords stay words."""
    items = [as_str(label, v) for v in _list(label, value)]
    return tuple(v if v in NODEPORT_KEYWORDS else _cidr(label, v) for v in items)


def _detect_local_mode(label: str, value: Any) -> DetectLocalMode:
    if isinstance(value, DetectLocalMode):
        return value
    text = as_str(label, value)
    try:
        return DetectLocalMode(text)
    except ValueError:
        choices = ", ".join(m.value for m in DetectLocalMode)
        raise fail(label, f"{text!r} is not one of {choices}") from None


def _masquerade_bit(label: str, value: Any) -> int:
    bit = _int(label, value)
    if not 0 <= bit <= 31:
        raise fail(label, f"{bit} is not in 0..31")
    return bit


def _host_port(label: str, value: Any, default_port: int) -> str:
    """`ip:port` / `[ip6]:port`; a bare IP gets `default_port`; "" stays "" (disabled)."""
    text = as_str(label, value)
    if not text:
        return ""
    try:
        host, port = parse_address(
            text, default_port=default_port, min_port=1, require_host=True
        )
    except ValueError as exc:
        raise fail(label, str(exc)) from None
    return format_address(host, port)


def as_cidrs(label: str, value: Any) -> tuple[str, ...]:
    """A list of CIDRs, any number per family (bind address ranges)."""
    return tuple(_cidr(label, v) for v in _list(label, value))


def as_port(label: str, value: Any) -> int:
    """A TCP port, 1..65535; 0 means "not set" (the caller's default)."""
    port = _int(label, value)
    if not 0 <= port <= 65535:
        raise fail(label, f"{port} is not in 1..65535")
    return port


def bind_address_of(cidrs: Iterable[str], port: int, node_ips: Iterable[str]) -> str | None:
    """v1alpha2's bind ranges and port as the one `ip:port` nftproxy listens
    on, or None when no single address stands for them. kube-proxy serves on
    every node address inside the ranges; one socket does the same for the
    ranges used in practice: all /0 -> the wildcard ("[::]" serves both
    families), loopback ranges only -> 127.0.0.1 (else ::1), a single
    address -> it, else the one node IP (nodeIPOverride) inside a range.

    >>> bind_address_of(["0.0.0.0/0", "::/0"], 10256, [])
    '[::]:10256'
    >>> bind_address_of(["127.0.0.0/8", "::1/128"], 10249, [])
    '127.0.0.1:10249'
    >>> bind_address_of(["10.0.0.0/8"], 10249, ["10.1.2.3"])
    '10.1.2.3:10249'
    """
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    if not nets:
        return None
    if all(n.prefixlen == 0 for n in nets):
        host = "::" if any(n.version == 6 for n in nets) else "0.0.0.0"
    elif all(_is_loopback(n) for n in nets):
        host = "127.0.0.1" if any(n.version == 4 for n in nets) else "::1"
    elif len(nets) == 1 and nets[0].prefixlen == nets[0].max_prefixlen:
        host = str(nets[0].network_address)
    else:
        inside = [ip for ip in node_ips if any(ipaddress.ip_address(ip) in n for n in nets)]
        if len(inside) != 1:
            return None
        host = inside[0]
    return format_address(host, port)


def _is_loopback(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    return net.network_address.is_loopback and net.broadcast_address.is_loopback


def _node_name(label: str, value: Any) -> str:
    return as_str(label, value).lower()


def _longest_table(table: str) -> str:
    return max((name for _, name in our_tables(table)), key=len)


_TABLE_NAME_MAX = names.NAME_MAX - 1 - len(_longest_table(""))
"""A table name leaves room for the longest suffix of the tables nftproxy
writes for it (`-affinity` and the like; names < 256 bytes)."""


WELL_KNOWN_TABLES = frozenset(
    {
        # iptables-nft (filter, nat, mangle, raw, security), ebtables-nft
        # (filter, nat, broute) and arptables-nft (filter)
        "filter",
        "nat",
        "mangle",
        "raw",
        "security",
        "broute",
        # kube-proxy's nftables mode
        "kube-proxy",
        # firewalld (inet firewalld; older releases also firewalld_policy_drop)
        "firewalld",
        "firewalld_policy_drop",
    }
)
"""Other programs' tables: refused as tableName, whatever their case, so that
nftproxy cannot replace or delete them even where they do not exist yet."""


def _table_name(label: str, value: Any) -> str:
    text = as_str(label, value)
    if not re.fullmatch(rf"[A-Za-z][A-Za-z0-9_.-]{{0,{_TABLE_NAME_MAX - 1}}}", text):
        raise fail(
            label,
            f"{text!r} is not a valid nftables table name of at most {_TABLE_NAME_MAX} "
            f"characters (its longest table is {_longest_table('<name>')!r})",
        )
    derived = next((t for _, t in our_tables("<name>") if t != "<name>"
                    and text.endswith(t.removeprefix("<name>"))), None)
    if derived is not None:
        raise fail(
            label,
            f"{text!r} is named like the table {derived!r} that nftproxy writes for another "
            "name, so two proxies could share a table: choose another name",
        )
    for name in sorted({name for _, name in our_tables(text)}, key=len):
        if name.lower() in WELL_KNOWN_TABLES:
            raise fail(
                label,
                f"{name!r} is another program's table (iptables-nft, ebtables-nft, "
                "arptables-nft, kube-proxy or firewalld); nftproxy never touches another "
                "table: choose another name",
            )
    return text


_IFNAMSIZ = 16
"""The kernel's interface name buffer, its NUL included."""


def _interface_name(label: str, value: Any, *, wildcard: bool = False) -> str:
    """An interface name the kernel could hold: at most 15 bytes, printable,
    no whitespace, '/' or ':'; `wildcard`: a prefix nft matches as
    `PREFIX*`, whose '*' takes one of those bytes."""
    text = as_str(label, value)
    limit = _IFNAMSIZ - 1 - (1 if wildcard else 0)
    if len(text.encode()) > limit:
        raise fail(
            label,
            f"{text!r} is longer than {limit} bytes"
            + (" (nft matches it as PREFIX*, in a 16-byte interface name)" if wildcard
               else " (interface names hold at most 15)"),
        )
    if any(c in "/:*" or c.isspace() or not c.isprintable() for c in text):
        raise fail(label, f"{text!r} is not an interface name (no whitespace, '/', ':' or '*')")
    return text


def _positive_seconds(label: str, value: Any) -> float:
    seconds = as_seconds(label, value)
    if seconds <= 0:
        raise fail(label, "must be greater than 0")
    return seconds


def _conntrack_seconds(label: str, value: Any) -> int:
    return int(as_seconds(label, value))  # truncated, as kube-proxy's Duration / time.Second


def _non_negative_int(label: str, value: Any) -> int:
    number = _int(label, value)
    if number < 0:
        raise fail(label, f"{number} is negative")
    return number


Normaliser = Callable[[str, Any], Any]

# ProxyConfig field -> (normaliser, config file path, flag) -- the labels of errors
# found by build_config, by where the value came from.
SETTINGS: dict[str, tuple[Normaliser, str, str]] = {
    "node_name": (_node_name, "hostnameOverride", "--node-name"),
    "node_ips": (_node_ips, "bindAddress", "--node-ip"),
    "cluster_cidrs": (_cidr_list, "clusterCIDR", "--cluster-cidr"),
    "detect_local_mode": (_detect_local_mode, "detectLocalMode", "--detect-local-mode"),
    "bridge_interface": (
        _interface_name,
        "detectLocal.bridgeInterface",
        "--pod-bridge-interface",
    ),
    "interface_name_prefix": (
        lambda label, v: _interface_name(label, v, wildcard=True),
        "detectLocal.interfaceNamePrefix",
        "--pod-interface-name-prefix",
    ),
    "nodeport_addresses": (_nodeport_addresses, "nodePortAddresses", "--nodeport-addresses"),
    "masquerade_all": (as_bool, "masqueradeAll", "--masquerade-all"),
    "masquerade_bit": (_masquerade_bit, "nftables.masqueradeBit", "--masquerade-bit"),
    "table_name": (_table_name, "tableName", "--table-name"),
    "sync_period": (_positive_seconds, "syncPeriod", "--sync-period"),
    "min_sync_period": (as_seconds, "minSyncPeriod", "--min-sync-period"),
    "full_sync_period": (_positive_seconds, "fullSyncPeriod", "--full-sync-period"),
    "healthz_bind_address": (
        lambda label, v: _host_port(label, v, DEFAULT_HEALTHZ_PORT),
        "healthzBindAddress",
        "--healthz-bind-address",
    ),
    "metrics_bind_address": (
        lambda label, v: _host_port(label, v, DEFAULT_METRICS_PORT),
        "metricsBindAddress",
        "--metrics-bind-address",
    ),
    "config_sync_period": (as_seconds, "configSyncPeriod", "--config-sync-period"),
    "prefer_same_node": (
        as_bool,
        "featureGates.PreferSameTrafficDistribution",
        "--prefer-same-node",
    ),
    "allow_service_external_ips": (
        as_bool,
        "featureGates.AllowServiceExternalIPs",
        "--allow-service-external-ips",
    ),
    "nftables_localhost_nodeports": (
        as_bool,
        f"featureGates.{LOCALHOST_NODEPORTS_GATE}",
        "--feature-gates",
    ),
    "bind_address_hard_fail": (as_bool, "bindAddressHardFail", "--bind-address-hard-fail"),
    "kube_proxy_marker": (as_bool, "kubeProxyMarker", "--kube-proxy-marker"),
}

FEATURE_GATES: dict[str, str] = {
    "AllowServiceExternalIPs": "allow_service_external_ips",
    "PreferSameTrafficDistribution": "prefer_same_node",
    LOCALHOST_NODEPORTS_GATE: "nftables_localhost_nodeports",
}
"""The feature gates nftproxy implements -> the ProxyConfig field each sets."""


def parse_feature_gates(label: str, value: Any) -> tuple[dict[str, bool], list[str]]:
    """`--feature-gates` (kube-proxy's `Gate=true,Other=false`): the
    ProxyConfig overrides of the gates nftproxy implements, and one warning
    per gate it does not (as for featureGates in the file)."""
    overrides: dict[str, bool] = {}
    warnings: list[str] = []
    for item in _list(label, value):
        gate, sep, text = as_str(label, item).partition("=")
        gate, text = gate.strip(), text.strip().lower()
        if not sep or not gate or text not in ("true", "false"):
            raise fail(label, f"{item!r} is not Gate=true or Gate=false")
        key = FEATURE_GATES.get(gate)
        if key is None:
            warnings.append(f"{label}: {gate}={text} ignored by nftproxy")
        else:
            overrides[key] = text == "true"
    return overrides, warnings

# ConntrackConfig field -> (normaliser, camelCase name in `conntrack:`)
CONNTRACK_SETTINGS: dict[str, tuple[Normaliser, str]] = {
    "max_per_core": (_non_negative_int, "maxPerCore"),
    "min": (_non_negative_int, "min"),
    "tcp_established_timeout": (_conntrack_seconds, "tcpEstablishedTimeout"),
    "tcp_close_wait_timeout": (_conntrack_seconds, "tcpCloseWaitTimeout"),
    "tcp_be_liberal": (as_bool, "tcpBeLiberal"),
    "udp_timeout": (_conntrack_seconds, "udpTimeout"),
    "udp_stream_timeout": (_conntrack_seconds, "udpStreamTimeout"),
}
