"""Loading ProxyConfig from a KubeProxyConfiguration file and from flags.

Layer: tools (reads one file; imports the core's config, config_read for
walking the document and config_values for each setting's normaliser and
names). One job: turn kube-proxy's configuration file
(kubeproxy.config.k8s.io/v1alpha1 or v1alpha2) and the CLI's flag values
into one validated `ProxyConfig`, with flags overriding the file. Caller:
cli.py.

Both `load_config_file` and `build_config` speak in *overrides*: a dict from
ProxyConfig field name to value, holding only what was given. The
`conntrack` entry is itself a dict of ConntrackConfig field overrides, so a
file may set some conntrack fields and keep the defaults of the others.

Invalid values raise `ConfigError` whose message starts with the field path
(`nftables.masqueradeBit: 40 is not in 0..31`) or the flag (`--masquerade-bit:
...`). Fields nftproxy does not apply (config_read.py says which) produce one
warning each -- or, with configHardFail on (v1alpha2's default), one
ConfigError listing them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from nftproxy.core.config import (
    LOCALHOST,
    LOCALHOST_NODEPORTS_GATE,
    ConntrackConfig,
    DetectLocalMode,
    ProxyConfig,
)
from nftproxy.tools.config_read import (
    KIND,
    V1ALPHA1,
    V1ALPHA2,
    Reader,
    V1Alpha1Reader,
    V1Alpha2Reader,
)
from nftproxy.tools.config_values import CONNTRACK_SETTINGS, SETTINGS, ConfigError, fail

__all__ = [
    "API_VERSION",
    "API_VERSIONS",
    "KIND",
    "build_config",
    "config_notes",
    "load_config_file",
]

API_VERSION = V1ALPHA1
API_VERSIONS = (V1ALPHA1, V1ALPHA2)


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


def config_notes(config: ProxyConfig) -> list[str]:
    """Warnings about settings that take no effect together: a loopback
    address in nodePortAddresses without the localhost feature gate (kube-proxy
    serves none then either), and the gate without a loopback address."""
    loopback = config.nodeport_ipv4_loopback
    gate = f"featureGates {LOCALHOST_NODEPORTS_GATE}"
    if loopback and not config.nftables_localhost_nodeports:
        return [
            f"nodePortAddresses: {', '.join(loopback)} (loopback) not served: localhost "
            f"node ports need {gate}=true"
        ]
    if config.nftables_localhost_nodeports and not loopback:
        return [
            f"{gate} is on, but nodePortAddresses names no IPv4 loopback address (add "
            f"{LOCALHOST!r}): no node port is served on localhost"
        ]
    return []


# -- load_config_file -----------------------------------------------------------------

_READERS: dict[str, type[Reader]] = {V1ALPHA1: V1Alpha1Reader, V1ALPHA2: V1Alpha2Reader}


def load_config_file(
    path: str | Path, *, hard_fail: bool | None = None
) -> tuple[dict[str, Any], list[str]]:
    """ProxyConfig overrides from a KubeProxyConfiguration YAML (or JSON) file,
    and one warning per ignored field.

    With configHardFail on, any such warning is an error instead: the file's
    `configHardFail`, else the version's default (v1alpha1 false, v1alpha2
    true); `hard_fail` (the --config-hard-fail flag) overrides both. Raises
    ConfigError for an unreadable or malformed file, for invalid values and
    for warnings under configHardFail; the message names the file and the
    field path.
    """
    doc = _parse(path)
    if doc is None:
        reader: Reader = V1Alpha1Reader({})
        reader.warnings.append(f"{path}: empty configuration file")
    else:
        try:
            reader = _reader_for(doc)
            reader.read()
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    strict = next(v for v in (hard_fail, reader.hard_fail, reader.hard_fail_default)
                  if v is not None)
    if strict and reader.warnings:
        raise ConfigError(
            f"{path}: configHardFail: {'; '.join(reader.warnings)} "
            "(configHardFail: false, or --config-hard-fail=false, only warns)"
        )
    return reader.out, reader.warnings


def _parse(path: str | Path) -> Mapping[str, Any] | None:
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
    if doc is not None and not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: expected a {KIND} object, got {type(doc).__name__}")
    return doc


def _reader_for(doc: Mapping[str, Any]) -> Reader:
    """The reader of the document's apiVersion; another or none is read as
    v1alpha1, with a warning (as is a missing kind)."""
    kind = doc.get("kind")
    if kind is not None and kind != KIND:
        raise ConfigError(f"kind: expected {KIND}, got {kind!r}")
    api_version = doc.get("apiVersion")
    known = _READERS.get(api_version) if isinstance(api_version, str) else None
    reader = (known or V1Alpha1Reader)(doc)
    if kind is None:
        reader.warnings.append(f"kind: missing (expected {KIND})")
    if known is None:
        reader.warnings.append(
            f"apiVersion: {api_version!r} is not {V1ALPHA1} or {V1ALPHA2}; "
            f"reading it as {V1ALPHA1}"
        )
    return reader
