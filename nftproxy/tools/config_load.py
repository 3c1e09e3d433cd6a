"""Loading ProxyConfig from a KubeProxyConfiguration file and from flags.

Layer: edge (reads one file; imports the core's config, and config_values
for each setting's normaliser and names). One job: turn
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
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from nftproxy.core.config import ConntrackConfig, DetectLocalMode, ProxyConfig
from nftproxy.tools.config_values import (
    CONNTRACK_SETTINGS,
    SETTINGS,
    ConfigError,
    as_bool,
    as_ip,
    as_seconds,
    as_str,
    fail,
)

__all__ = [
    "API_VERSION",
    "KIND",
    "build_config",
    "load_config_file",
]

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"


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
            normalise, path, flag = SETTINGS[key]
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
        if key not in CONNTRACK_SETTINGS:
            raise ValueError(f"unknown ConntrackConfig setting {key!r}")
        if item is None:
            continue
        normalise, camel = CONNTRACK_SETTINGS[key]
        label = "--conntrack-" + key.replace("_", "-") if from_flags else f"conntrack.{camel}"
        result[key] = normalise(label, item)
    return result


def _check_combination(config: ProxyConfig, labels: Mapping[str, str]) -> None:
    def label(key: str, fallback: str) -> str:
        return labels.get(key, fallback)

    mode = config.detect_local_mode
    if mode is DetectLocalMode.BRIDGE_INTERFACE and not config.bridge_interface:
        raise fail(
            label("bridge_interface", label("detect_local_mode", "detectLocalMode")),
            "detectLocalMode BridgeInterface needs a bridge interface name "
            "(detectLocal.bridgeInterface / --pod-bridge-interface)",
        )
    if mode is DetectLocalMode.INTERFACE_NAME_PREFIX and not config.interface_name_prefix:
        raise fail(
            label("interface_name_prefix", label("detect_local_mode", "detectLocalMode")),
            "detectLocalMode InterfaceNamePrefix needs an interface name prefix "
            "(detectLocal.interfaceNamePrefix / --pod-interface-name-prefix)",
        )
    if config.min_sync_period > config.sync_period:
        raise fail(
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
            raise fail("kind", f"expected {KIND}, got {kind!r}")
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
        if skip_zero and as_seconds(path + name, value) == 0:
            return
        self.out[key] = SETTINGS[key][0](path + name, value)

    def _section(
        self, name: str, keys: frozenset[str], *, silent: frozenset[str] = frozenset()
    ) -> Mapping[str, Any]:
        value = self.doc.get(name)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise fail(name, f"expected an object, got {value!r}")
        for key in value:
            if key not in keys and key not in silent:
                self.warnings.append(f"{name}.{key}: unknown field, ignored")
        return value

    def _bind_address(self, value: Any) -> None:
        if value is None:
            return
        text = as_str("bindAddress", value)
        if not text:
            return
        ip = as_ip("bindAddress", text)
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
        mode = as_str("mode", value)
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
            as_bool(path + "masqueradeAll", section["masqueradeAll"])
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
        by_camel = {
            camel: (key, normalise) for key, (normalise, camel) in CONNTRACK_SETTINGS.items()
        }
        for path, section in sections:
            if section is None:
                continue
            if not isinstance(section, Mapping):
                raise fail(path, f"expected an object, got {section!r}")
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
