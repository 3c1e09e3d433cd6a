"""Reading one parsed KubeProxyConfiguration document, per API version.

Layer: tools (pure: walks a dict; imports config_values for each setting's
normaliser). One job: turn a v1alpha1 or v1alpha2 document into ProxyConfig
overrides (ProxyConfig field -> value; `conntrack` is a dict of
ConntrackConfig field overrides) and one warning per field nftproxy does
not apply, naming the field. Caller: config_load.py, which parses the file,
picks the reader by apiVersion and applies configHardFail.

- v1alpha1 (`V1Alpha1Reader`): kube-proxy's flat format, read leniently: also
  the v1alpha2 places of syncPeriod/minSyncPeriod (top level), masqueradeAll
  and conntrack (`linux`) and detectLocal.clusterCIDRs, since kube-proxy
  releases moved them one at a time. Precedence of the sync settings:
  nftables > top level > iptables.
- v1alpha2 (`V1Alpha2Reader`, KEP-784): exactly its fields. A v1alpha1 field
  there is unknown, and its warning says where v1alpha2 moved it. Bind
  addresses are CIDR lists plus a port (config_values.bind_address_of).

Silently accepted: kube-proxy fields that do not change what an nftables
proxy does (clientConnection, ipvs, winkernel, windows, logging,
oomScoreAdj, enableProfiling, ...; iptables.localhostNodePorts, which
kube-proxy's own nftables mode ignores too). Read in both versions though
kube-proxy has no such field: `kubeProxyMarker` (core/nft/marker.py).
Warned about: unknown fields, `mode` other than nftables, and feature gates
nftproxy does not implement.
Zero durations and nulls mean "not set", as in kube-proxy's defaulting.
Invalid values raise ConfigError naming the field path.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any, ClassVar

from nftproxy.tools.config_values import (
    CONNTRACK_SETTINGS,
    DEFAULT_HEALTHZ_PORT,
    DEFAULT_METRICS_PORT,
    FEATURE_GATES,
    SETTINGS,
    as_bool,
    as_cidrs,
    as_ip,
    as_port,
    as_seconds,
    as_str,
    bind_address_of,
    fail,
)

__all__ = ["KIND", "V1ALPHA1", "V1ALPHA2", "Reader", "V1Alpha1Reader", "V1Alpha2Reader"]

KIND = "KubeProxyConfiguration"
V1ALPHA1 = "kubeproxy.config.k8s.io/v1alpha1"
V1ALPHA2 = "kubeproxy.config.k8s.io/v1alpha2"

_NEVER_WARNED = frozenset(
    {
        "apiVersion",
        "kind",
        "clientConnection",
        "enableProfiling",
        "showHiddenMetricsForVersion",
        "ipvs",
        "winkernel",
        "windows",
        "logging",
    }
)
_DETECT_LOCAL = frozenset({"clusterCIDRs", "bridgeInterface", "interfaceNamePrefix"})


class Reader:
    """The walk shared by both versions: `out` (overrides), `warnings`,
    and `hard_fail` (the file's configHardFail, None if absent)."""

    api_version: ClassVar[str]
    hard_fail_default: ClassVar[bool]

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.doc = doc
        self.out: dict[str, Any] = {}
        self.warnings: list[str] = []
        self.hard_fail: bool | None = None

    def read(self) -> None:
        raise NotImplementedError

    # ---- shared fields --------------------------------------------------------

    def _common(self) -> None:
        doc = self.doc
        if doc.get("configHardFail") is not None:
            self.hard_fail = as_bool("configHardFail", doc["configHardFail"])
        self._set("bind_address_hard_fail", doc, "bindAddressHardFail")
        self._set("kube_proxy_marker", doc, "kubeProxyMarker")
        self._set("node_name", doc, "hostnameOverride", skip_empty=True)
        self._set("detect_local_mode", doc, "detectLocalMode", skip_empty=True)
        self._set("nodeport_addresses", doc, "nodePortAddresses")
        self._set("config_sync_period", doc, "configSyncPeriod", skip_zero=True)
        self._mode(doc.get("mode"))
        self._feature_gates(doc.get("featureGates"))

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

    def _section(self, path: str, value: Any) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise fail(path, f"expected an object, got {value!r}")
        return value

    def _check_keys(
        self,
        path: str,
        section: Mapping[str, Any],
        known: frozenset[str],
        moved: Mapping[str, str] | None = None,
    ) -> None:
        """One warning per key of `section` not in `known`; `moved` names
        where v1alpha2 put a v1alpha1 field ("" when it was dropped)."""
        prefix = f"{path}." if path else ""
        for key in section:
            if key in known:
                continue
            if moved is not None and key in moved:
                where = f"; v1alpha2 has {moved[key]}" if moved[key] else " (dropped in v1alpha2)"
                self.warnings.append(f"{prefix}{key}: a v1alpha1 field{where}; ignored")
            else:
                self.warnings.append(f"{prefix}{key}: unknown field, ignored")

    def _mode(self, value: Any) -> None:
        if value is None:
            return
        mode = as_str("mode", value)
        if mode not in ("", "nftables"):
            self.warnings.append(f"mode: {mode!r} ignored; nftproxy always programs nftables")

    def _feature_gates(self, value: Any) -> None:
        gates = self._section("featureGates", value)
        for gate, enabled in gates.items():
            key = FEATURE_GATES.get(gate)
            if key is None:
                self.warnings.append(f"featureGates: {gate}={enabled!r} ignored by nftproxy")
            else:
                self.out[key] = as_bool(f"featureGates.{gate}", enabled)

    def _detect_local(self) -> None:
        section = self._section("detectLocal", self.doc.get("detectLocal"))
        self._check_keys("detectLocal", section, _DETECT_LOCAL)
        path = "detectLocal."
        self._set("cluster_cidrs", section, "clusterCIDRs", path=path, skip_empty=True)
        self._set("bridge_interface", section, "bridgeInterface", path=path)
        self._set("interface_name_prefix", section, "interfaceNamePrefix", path=path)

    def _conntrack(self, path: str, value: Any) -> None:
        """conntrack settings from one section, merged into out["conntrack"]."""
        section = self._section(path, value)
        by_camel = {camel: (key, norm) for key, (norm, camel) in CONNTRACK_SETTINGS.items()}
        self._check_keys(path, section, frozenset(by_camel))
        result: dict[str, Any] = dict(self.out.get("conntrack", {}))
        for camel, item in section.items():
            if camel in by_camel and item is not None:
                key, normalise = by_camel[camel]
                result[key] = normalise(f"{path}.{camel}", item)
        if result:
            self.out["conntrack"] = result

    def _masquerade_all(self, places: list[tuple[str, Mapping[str, Any]]]) -> None:
        """True if any place says so (kube-proxy ORs its copies)."""
        found = [
            as_bool(path + "masqueradeAll", section["masqueradeAll"])
            for path, section in places
            if section.get("masqueradeAll") is not None
        ]
        if found:
            self.out["masquerade_all"] = any(found)


# -- v1alpha1 -------------------------------------------------------------------------

_V1_TOP = frozenset(
    {
        *_NEVER_WARNED,
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
        "configHardFail",
        "bindAddressHardFail",
        "kubeProxyMarker",
        "oomScoreAdj",
        "portRange",
        "udpIdleTimeout",
    }
)
_V1_RULES = frozenset({"masqueradeAll", "masqueradeBit", "syncPeriod", "minSyncPeriod"})
_LINUX = frozenset({"conntrack", "masqueradeAll", "oomScoreAdj"})


class V1Alpha1Reader(Reader):
    api_version = V1ALPHA1
    hard_fail_default = False  # v1alpha1 has no configHardFail: kube-proxy only warns

    def read(self) -> None:
        doc = self.doc
        self._check_keys("", doc, _V1_TOP)
        self._common()
        self._bind_address(doc.get("bindAddress"))
        self._set("healthz_bind_address", doc, "healthzBindAddress")
        self._set("metrics_bind_address", doc, "metricsBindAddress")
        self._set("cluster_cidrs", doc, "clusterCIDR", skip_empty=True)
        self._detect_local()
        self._rules_settings()
        self._conntrack("conntrack", doc.get("conntrack"))
        linux = self._section("linux", doc.get("linux"))
        self._conntrack("linux.conntrack", linux.get("conntrack"))

    def _bind_address(self, value: Any) -> None:
        if value is None:
            return
        text = as_str("bindAddress", value)
        if not text:
            return
        ip = as_ip("bindAddress", text)
        if not ipaddress.ip_address(ip).is_unspecified:  # 0.0.0.0 / :: mean "all"
            self.out["node_ips"] = (ip,)

    def _rules_settings(self) -> None:
        """syncPeriod, minSyncPeriod, masquerade*: nftables > top level / linux > iptables."""
        nft = self._section("nftables", self.doc.get("nftables"))
        ipt = self._section("iptables", self.doc.get("iptables"))
        linux = self._section("linux", self.doc.get("linux"))
        self._check_keys("nftables", nft, _V1_RULES)
        self._check_keys("iptables", ipt, _V1_RULES | {"localhostNodePorts"})
        self._check_keys("linux", linux, _LINUX)
        # lowest precedence first; later sections overwrite
        for path, section in (("iptables.", ipt), ("", self.doc), ("nftables.", nft)):
            self._set("sync_period", section, "syncPeriod", path=path, skip_zero=True)
            self._set("min_sync_period", section, "minSyncPeriod", path=path, skip_zero=True)
            if section is not self.doc:
                self._set("masquerade_bit", section, "masqueradeBit", path=path)
        self._masquerade_all(
            [("", self.doc), ("iptables.", ipt), ("nftables.", nft), ("linux.", linux)]
        )


# -- v1alpha2 -------------------------------------------------------------------------

_V2_TOP = frozenset(
    {
        *_NEVER_WARNED,
        "hostnameOverride",
        "nodeIPOverride",
        "healthzBindAddresses",
        "healthzBindPort",
        "metricsBindAddresses",
        "metricsBindPort",
        "configHardFail",
        "bindAddressHardFail",
        "kubeProxyMarker",
        "mode",
        "featureGates",
        "linux",
        "iptables",
        "nftables",
        "detectLocalMode",
        "detectLocal",
        "nodePortAddresses",
        "syncPeriod",
        "minSyncPeriod",
        "configSyncPeriod",
    }
)
# v1alpha1 fields that KEP-784 moved or dropped -> their v1alpha2 place ("" dropped)
_V2_MOVED_TOP = {
    "bindAddress": "nodeIPOverride",
    "clusterCIDR": "detectLocal.clusterCIDRs",
    "healthzBindAddress": "healthzBindAddresses and healthzBindPort",
    "metricsBindAddress": "metricsBindAddresses and metricsBindPort",
    "conntrack": "linux.conntrack",
    "oomScoreAdj": "linux.oomScoreAdj",
    "masqueradeAll": "linux.masqueradeAll",
    "portRange": "",
    "udpIdleTimeout": "",
}
_V2_MOVED_BACKEND = {
    "syncPeriod": "syncPeriod (top level)",
    "minSyncPeriod": "minSyncPeriod (top level)",
    "masqueradeAll": "linux.masqueradeAll",
}


class V1Alpha2Reader(Reader):
    api_version = V1ALPHA2
    hard_fail_default = True  # KEP-784: configHardFail defaults to true

    def read(self) -> None:
        doc = self.doc
        self._check_keys("", doc, _V2_TOP, _V2_MOVED_TOP)
        self._common()
        self._set("node_ips", doc, "nodeIPOverride", skip_empty=True)
        self._bind("healthz_bind_address", "healthz", "0.0.0.0", DEFAULT_HEALTHZ_PORT)
        self._bind("metrics_bind_address", "metrics", "127.0.0.1", DEFAULT_METRICS_PORT)
        self._detect_local()
        self._set("sync_period", doc, "syncPeriod", skip_zero=True)
        self._set("min_sync_period", doc, "minSyncPeriod", skip_zero=True)
        linux = self._section("linux", doc.get("linux"))
        self._check_keys("linux", linux, _LINUX)
        self._masquerade_all([("linux.", linux)])
        self._conntrack("linux.conntrack", linux.get("conntrack"))
        nft = self._section("nftables", doc.get("nftables"))
        self._check_keys("nftables", nft, frozenset({"masqueradeBit"}), _V2_MOVED_BACKEND)
        self._set("masquerade_bit", nft, "masqueradeBit", path="nftables.")
        ipt = self._section("iptables", doc.get("iptables"))  # iptables mode only
        known = frozenset({"masqueradeBit", "localhostNodePorts"})
        self._check_keys("iptables", ipt, known, _V2_MOVED_BACKEND)

    def _bind(self, key: str, server: str, default_host: str, default_port: int) -> None:
        """`<server>BindAddresses` + `<server>BindPort` -> out[key] ("ip:port")."""
        cidrs_name, port_name = f"{server}BindAddresses", f"{server}BindPort"
        raw_cidrs, raw_port = self.doc.get(cidrs_name), self.doc.get(port_name)
        cidrs = as_cidrs(cidrs_name, raw_cidrs) if raw_cidrs is not None else ()
        port = as_port(port_name, raw_port) if raw_port is not None else 0
        if not cidrs and not port:
            return
        port = port or default_port
        address = bind_address_of(cidrs, port, self.out.get("node_ips", ()))
        if cidrs and address is None:
            self.warnings.append(
                f"{cidrs_name}: {list(cidrs)} name no single address nftproxy can listen on "
                f"(use /0 ranges, loopback, one address, or a range holding one "
                f"nodeIPOverride address); ignored"
            )
        self.out[key] = SETTINGS[key][0](cidrs_name, address or f"{default_host}:{port}")
