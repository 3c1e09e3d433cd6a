"""Loading ProxyConfig from a KubeProxyConfiguration file and from flags.

Layer: edge (reads one file; imports config and model). One job: turn
kube-proxy's configuration file (kubeproxy.config.k8s.io/v1alpha1, also the
top-level `syncPeriod`/`minSyncPeriod`/`linux` fields of v1alpha2) and the
CLI's flag values into one validated `ProxyConfig`, with flags overriding the
file. Caller: cli.py.

Both `load_config_file` and `build_config` speak in *overrides*: a dict from
ProxyConfig field name to value, holding only what was given. The
`conntrack` entry is itself a dict of ConntrackConfig field overrides, so a
file may set some conntrack fields and keep the defaults of the others.

Invalid values raise `ConfigError` whose message starts with the field path
(`nftables.masqueradeBit: 40 is not in 0..31`) or the flag (`--masquerade-bit:
...`). Unknown fields only produce warnings, as do kube-proxy fields that do
not apply to nftproxy and are set to something nftproxy would not do
(`mode: iptables`, non-empty `featureGates`). kube-proxy fields without
meaning here (clientConnection, ipvs, winkernel, logging, oomScoreAdj, ...)
are accepted silently, so a kubeadm-generated file loads without noise.

Zero durations and null values count as "not set", as in kube-proxy's
defaulting (kubeadm writes `syncPeriod: 0s` and `masqueradeBit: null`).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from nftproxy.core.config import PRIMARY, ConntrackConfig, DetectLocalMode, ProxyConfig
from nftproxy.core.model import IPFamily, family_of

__all__ = [
    "API_VERSION",
    "KIND",
    "ConfigError",
    "build_config",
    "load_config_file",
    "parse_duration",
]

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"

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


def _fail(label: str, problem: str) -> ConfigError:
    return ConfigError(f"{label}: {problem}")


def _str(label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(label, f"expected a string, got {value!r}")
    return value.strip()


def _bool(label: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(label, f"expected true or false, got {value!r}")
    return value


def _int(label: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(label, f"expected an integer, got {value!r}")
    return value


def _list(label: str, value: Any) -> list[Any]:
    if isinstance(value, str):
        return [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, list | tuple):
        raise _fail(label, f"expected a list, got {value!r}")
    return list(value)


def _seconds(label: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _fail(label, f"expected a duration like \"30s\", got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        try:
            seconds = parse_duration(_str(label, value))
        except ValueError as exc:
            raise _fail(label, str(exc)) from None
    if seconds < 0:
        raise _fail(label, f"{value} is negative")
    return seconds


def _ip(label: str, value: Any) -> str:
    text = _str(label, value)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise _fail(label, f"{text!r} is not an IP address") from None


def _cidr(label: str, value: Any) -> str:
    text = _str(label, value)
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise _fail(label, f"{text!r} is not a CIDR") from None


def _one_per_family(label: str, values: Iterable[str], what: str) -> None:
    seen: dict[IPFamily, str] = {}
    for value in values:
        family = family_of(value)
        if family in seen:
            raise _fail(
                label,
                f"two {family.value} {what} ({seen[family]}, {value}); give at most one per family",
            )
        seen[family] = value


def _cidr_list(label: str, value: Any) -> tuple[str, ...]:
    cidrs = tuple(_cidr(label, v) for v in _list(label, value))
    _one_per_family(label, cidrs, "CIDRs")
    return cidrs


def _node_ips(label: str, value: Any) -> tuple[str, ...]:
    ips = tuple(_ip(label, v) for v in _list(label, value))
    _one_per_family(label, ips, "addresses")
    return ips


def _nodeport_addresses(label: str, value: Any) -> tuple[str, ...]:
    items = [_str(label, v) for v in _list(label, value)]
    if PRIMARY in items:
        if len(items) != 1:
            raise _fail(label, f"{PRIMARY!r} must be the only entry, got {items}")
        return (PRIMARY,)
    return tuple(_cidr(label, v) for v in items)


def _detect_local_mode(label: str, value: Any) -> DetectLocalMode:
    if isinstance(value, DetectLocalMode):
        return value
    text = _str(label, value)
    try:
        return DetectLocalMode(text)
    except ValueError:
        choices = ", ".join(m.value for m in DetectLocalMode)
        raise _fail(label, f"{text!r} is not one of {choices}") from None


def _masquerade_bit(label: str, value: Any) -> int:
    bit = _int(label, value)
    if not 0 <= bit <= 31:
        raise _fail(label, f"{bit} is not in 0..31")
    return bit


def _host_port(label: str, value: Any, default_port: int) -> str:
    """`ip:port` / `[ip6]:port`; a bare IP gets `default_port`; "" stays "" (disabled)."""
    text = _str(label, value)
    if not text:
        return ""
    host, port_text = text, str(default_port)
    bracketed = re.fullmatch(r"\[([^\]]+)\](?::(\d*))?", text)
    if bracketed:
        host, port_text = bracketed.group(1), bracketed.group(2) or port_text
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        example = f"0.0.0.0:{default_port}"
        raise _fail(label, f"{text!r} is not an address:port (e.g. {example})") from None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise _fail(label, f"{text!r}: port {port_text!r} is not in 1..65535")
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"{host}:{int(port_text)}"


def _node_name(label: str, value: Any) -> str:
    return _str(label, value).lower()


def _table_name(label: str, value: Any) -> str:
    text = _str(label, value)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,254}", text):
        raise _fail(label, f"{text!r} is not a valid nftables table name")
    return text


def _positive_seconds(label: str, value: Any) -> float:
    seconds = _seconds(label, value)
    if seconds <= 0:
        raise _fail(label, "must be greater than 0")
    return seconds


def _conntrack_seconds(label: str, value: Any) -> int:
    return int(_seconds(label, value))  # truncated, as kube-proxy's Duration / time.Second


def _non_negative_int(label: str, value: Any) -> int:
    number = _int(label, value)
    if number < 0:
        raise _fail(label, f"{number} is negative")
    return number


_Normaliser = Callable[[str, Any], Any]

# ProxyConfig field -> (normaliser, config file path, flag) -- the labels of errors
# found by build_config, by where the value came from.
_SETTINGS: dict[str, tuple[_Normaliser, str, str]] = {
    "node_name": (_node_name, "hostnameOverride", "--node-name"),
    "node_ips": (_node_ips, "bindAddress", "--node-ip"),
    "cluster_cidrs": (_cidr_list, "clusterCIDR", "--cluster-cidr"),
    "detect_local_mode": (_detect_local_mode, "detectLocalMode", "--detect-local-mode"),
    "bridge_interface": (_str, "detectLocal.bridgeInterface", "--pod-bridge-interface"),
    "interface_name_prefix": (
        _str,
        "detectLocal.interfaceNamePrefix",
        "--pod-interface-name-prefix",
    ),
    "nodeport_addresses": (_nodeport_addresses, "nodePortAddresses", "--nodeport-addresses"),
    "masquerade_all": (_bool, "masqueradeAll", "--masquerade-all"),
    "masquerade_bit": (_masquerade_bit, "nftables.masqueradeBit", "--masquerade-bit"),
    "table_name": (_table_name, "tableName", "--table-name"),
    "sync_period": (_positive_seconds, "syncPeriod", "--sync-period"),
    "min_sync_period": (_seconds, "minSyncPeriod", "--min-sync-period"),
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
    "config_sync_period": (_seconds, "configSyncPeriod", "--config-sync-period"),
    "prefer_same_node": (_bool, "preferSameNode", "--prefer-same-node"),
}

# ConntrackConfig field -> (normaliser, camelCase name in `conntrack:`)
_CONNTRACK: dict[str, tuple[_Normaliser, str]] = {
    "max_per_core": (_non_negative_int, "maxPerCore"),
    "min": (_non_negative_int, "min"),
    "tcp_established_timeout": (_conntrack_seconds, "tcpEstablishedTimeout"),
    "tcp_close_wait_timeout": (_conntrack_seconds, "tcpCloseWaitTimeout"),
    "tcp_be_liberal": (_bool, "tcpBeLiberal"),
    "udp_timeout": (_conntrack_seconds, "udpTimeout"),
    "udp_stream_timeout": (_conntrack_seconds, "udpStreamTimeout"),
}


# -- build_config ---------------------------------------------------------------------


def build_config(
    file_overrides: Mapping[str, Any], flag_overrides: Mapping[str, Any]
) -> ProxyConfig:
    """The ProxyConfig of kube-proxy's defaults, then the file, then the flags.

    Both mappings hold ProxyConfig field names (None values are skipped, so a
    CLI can pass every flag). Values are normalised and validated again, and
    the combination is checked (e.g. BridgeInterface needs a bridge name);
    errors name the flag when the value came from a flag.
    """
    known = {f.name for f in fields(ProxyConfig)}
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    conntrack: dict[str, Any] = {}
    for from_flags, overrides in ((False, file_overrides), (True, flag_overrides)):
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in known:
                raise ValueError(f"unknown ProxyConfig setting {key!r}")
            if key == "conntrack":
                conntrack.update(_conntrack_overrides(value, from_flags=from_flags))
                continue
            normalise, path, flag = _SETTINGS[key]
            labels[key] = flag if from_flags else path
            values[key] = normalise(labels[key], value)
    config = ProxyConfig(**values, conntrack=ConntrackConfig(**conntrack))
    _check_combination(config, labels)
    return config


def _conntrack_overrides(value: Any, *, from_flags: bool) -> dict[str, Any]:
    if isinstance(value, ConntrackConfig):
        return {f.name: getattr(value, f.name) for f in fields(ConntrackConfig)}
    if not isinstance(value, Mapping):
        raise ValueError(f"conntrack overrides must be a mapping, got {value!r}")
    result: dict[str, Any] = {}
    for key, item in value.items():
        if key not in _CONNTRACK:
            raise ValueError(f"unknown ConntrackConfig setting {key!r}")
        if item is None:
            continue
        normalise, camel = _CONNTRACK[key]
        label = "--conntrack-" + key.replace("_", "-") if from_flags else f"conntrack.{camel}"
        result[key] = normalise(label, item)
    return result


def _check_combination(config: ProxyConfig, labels: Mapping[str, str]) -> None:
    def label(key: str, fallback: str) -> str:
        return labels.get(key, fallback)

    mode = config.detect_local_mode
    if mode is DetectLocalMode.BRIDGE_INTERFACE and not config.bridge_interface:
        raise _fail(
            label("bridge_interface", label("detect_local_mode", "detectLocalMode")),
            "detectLocalMode BridgeInterface needs a bridge interface name "
            "(detectLocal.bridgeInterface / --pod-bridge-interface)",
        )
    if mode is DetectLocalMode.INTERFACE_NAME_PREFIX and not config.interface_name_prefix:
        raise _fail(
            label("interface_name_prefix", label("detect_local_mode", "detectLocalMode")),
            "detectLocalMode InterfaceNamePrefix needs an interface name prefix "
            "(detectLocal.interfaceNamePrefix / --pod-interface-name-prefix)",
        )
    if config.min_sync_period > config.sync_period:
        raise _fail(
            label("min_sync_period", label("sync_period", "syncPeriod")),
            f"minSyncPeriod ({config.min_sync_period:g}s) is longer than "
            f"syncPeriod ({config.sync_period:g}s)",
        )


# -- load_config_file -----------------------------------------------------------------

# KubeProxyConfiguration fields that do not change what nftproxy does; accepted silently.
_SILENT_TOP = frozenset(
    {
        "apiVersion",
        "kind",
        "clientConnection",
        "bindAddressHardFail",
        "enableProfiling",
        "showHiddenMetricsForVersion",
        "ipvs",
        "winkernel",
        "windows",
        "oomScoreAdj",
        "portRange",
        "udpIdleTimeout",
        "logging",
    }
)
_DETECT_LOCAL_KEYS = frozenset({"clusterCIDRs", "bridgeInterface", "interfaceNamePrefix"})
_RULES_KEYS = frozenset({"masqueradeAll", "masqueradeBit", "syncPeriod", "minSyncPeriod"})
_IPTABLES_SILENT = frozenset({"localhostNodePorts"})
_LINUX_KEYS = frozenset({"conntrack", "masqueradeAll", "oomScoreAdj"})


class _Reader:
    """Walks one parsed file, collecting overrides and warnings."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.doc = doc
        self.out: dict[str, Any] = {}
        self.warnings: list[str] = []

    def read(self) -> None:
        doc = self.doc
        self._header()
        for key in doc:
            if key not in _TOP_KEYS and key not in _SILENT_TOP:
                self.warnings.append(f"{key}: unknown field, ignored")
        self._set("node_name", doc, "hostnameOverride", skip_empty=True)
        self._bind_address(doc.get("bindAddress"))
        self._set("healthz_bind_address", doc, "healthzBindAddress")
        self._set("metrics_bind_address", doc, "metricsBindAddress")
        self._set("detect_local_mode", doc, "detectLocalMode", skip_empty=True)
        self._set("nodeport_addresses", doc, "nodePortAddresses")
        self._set("config_sync_period", doc, "configSyncPeriod", skip_zero=True)
        self._set("cluster_cidrs", doc, "clusterCIDR", skip_empty=True)
        self._detect_local(self._section("detectLocal", _DETECT_LOCAL_KEYS))
        self._mode(doc.get("mode"))
        self._feature_gates(doc.get("featureGates"))
        self._rules_settings()
        self._conntrack()

    def _header(self) -> None:
        kind = self.doc.get("kind")
        if kind is not None and kind != KIND:
            raise _fail("kind", f"expected {KIND}, got {kind!r}")
        if kind is None:
            self.warnings.append(f"kind: missing (expected {KIND})")
        api_version = self.doc.get("apiVersion")
        if api_version != API_VERSION:
            self.warnings.append(
                f"apiVersion: {api_version!r} is not {API_VERSION}; reading it as {API_VERSION}"
            )

    def _set(
        self,
        key: str,
        section: Mapping[str, Any],
        name: str,
        *,
        path: str = "",
        skip_empty: bool = False,
        skip_zero: bool = False,
    ) -> None:
        """out[key] = section[name], normalised; `skip_zero` is for durations
        where 0 means "use the default", as in kube-proxy's defaulting."""
        value = section.get(name)
        if value is None or (skip_empty and value in ("", [])):
            return
        if skip_zero and _seconds(path + name, value) == 0:
            return
        self.out[key] = _SETTINGS[key][0](path + name, value)

    def _section(
        self, name: str, keys: frozenset[str], *, silent: frozenset[str] = frozenset()
    ) -> Mapping[str, Any]:
        value = self.doc.get(name)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise _fail(name, f"expected an object, got {value!r}")
        for key in value:
            if key not in keys and key not in silent:
                self.warnings.append(f"{name}.{key}: unknown field, ignored")
        return value

    def _bind_address(self, value: Any) -> None:
        if value is None:
            return
        text = _str("bindAddress", value)
        if not text:
            return
        ip = _ip("bindAddress", text)
        if not ipaddress.ip_address(ip).is_unspecified:  # 0.0.0.0 / :: mean "all"
            self.out["node_ips"] = (ip,)

    def _detect_local(self, section: Mapping[str, Any]) -> None:
        self._set("cluster_cidrs", section, "clusterCIDRs", path="detectLocal.", skip_empty=True)
        self._set("bridge_interface", section, "bridgeInterface", path="detectLocal.")
        self._set(
            "interface_name_prefix", section, "interfaceNamePrefix", path="detectLocal."
        )

    def _mode(self, value: Any) -> None:
        if value is None:
            return
        mode = _str("mode", value)
        if mode not in ("", "nftables"):
            self.warnings.append(f"mode: {mode!r} ignored; nftproxy always programs nftables")

    def _feature_gates(self, value: Any) -> None:
        if value:
            self.warnings.append(f"featureGates: {value!r} ignored by nftproxy")

    def _rules_settings(self) -> None:
        """syncPeriod, minSyncPeriod, masquerade*: nftables > top level / linux > iptables."""
        nft = self._section("nftables", _RULES_KEYS)
        ipt = self._section("iptables", _RULES_KEYS, silent=_IPTABLES_SILENT)
        linux = self._section("linux", _LINUX_KEYS)
        # lowest precedence first; later sections overwrite
        for path, section in (("iptables.", ipt), ("", self.doc), ("nftables.", nft)):
            self._set("sync_period", section, "syncPeriod", path=path, skip_zero=True)
            self._set("min_sync_period", section, "minSyncPeriod", path=path, skip_zero=True)
            if section is not self.doc:
                self._set("masquerade_bit", section, "masqueradeBit", path=path)
        masquerade_all = [
            _bool(path + "masqueradeAll", section["masqueradeAll"])
            for path, section in (
                ("", self.doc),
                ("iptables.", ipt),
                ("nftables.", nft),
                ("linux.", linux),
            )
            if section.get("masqueradeAll") is not None
        ]
        if masquerade_all:
            self.out["masquerade_all"] = any(masquerade_all)

    def _conntrack(self) -> None:
        linux = self.doc.get("linux")
        sections: list[tuple[str, Any]] = [("conntrack", self.doc.get("conntrack"))]
        if isinstance(linux, Mapping):
            sections.append(("linux.conntrack", linux.get("conntrack")))
        result: dict[str, Any] = {}
        by_camel = {camel: (key, normalise) for key, (normalise, camel) in _CONNTRACK.items()}
        for path, section in sections:
            if section is None:
                continue
            if not isinstance(section, Mapping):
                raise _fail(path, f"expected an object, got {section!r}")
            for camel, value in section.items():
                if camel not in by_camel:
                    self.warnings.append(f"{path}.{camel}: unknown field, ignored")
                    continue
                if value is None:
                    continue
                key, normalise = by_camel[camel]
                result[key] = normalise(f"{path}.{camel}", value)
        if result:
            self.out["conntrack"] = result


_TOP_KEYS = frozenset(
    {
        "bindAddress",
        "healthzBindAddress",
        "metricsBindAddress",
        "clusterCIDR",
        "detectLocalMode",
        "detectLocal",
        "nodePortAddresses",
        "hostnameOverride",
        "syncPeriod",
        "minSyncPeriod",
        "masqueradeAll",
        "nftables",
        "iptables",
        "linux",
        "conntrack",
        "configSyncPeriod",
        "mode",
        "featureGates",
    }
)


def load_config_file(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """ProxyConfig overrides from a KubeProxyConfiguration YAML (or JSON) file,
    and one warning per ignored field.

    Raises ConfigError for an unreadable or malformed file and for invalid
    values; the message names the file and the field path.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if doc is None:
        return {}, [f"{path}: empty configuration file"]
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: expected a {KIND} object, got {type(doc).__name__}")
    reader = _Reader(doc)
    try:
        reader.read()
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return reader.out, reader.warnings
