"""discovery.k8s.io/v1 EndpointSlice -> EndpointSliceInfo.

Layer: convert (imports model only). One job: turn an EndpointSlice dict
into the endpoints of each service port it serves: conditions with their
API defaults, topology hints, locality to this node, and the
last-change-trigger-time annotation. Slices of FQDN addresses and slices
without the service-name label are not for the proxy (None).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter
from typing import Any

from nftproxy.core.convert import fields, names, problems
from nftproxy.core.convert.problems import Problem
from nftproxy.core.model import Endpoint, IPFamily, NamespacedName, ServicePortName

__all__ = ["SERVICE_NAME_LABEL", "EndpointSliceInfo", "slice_info"]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"

_ADDRESS_TYPES = {"IPv4": IPFamily.IPV4, "IPv6": IPFamily.IPV6, "FQDN": None}
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})"
)


@dataclass(frozen=True, slots=True)
class EndpointSliceInfo:
    """The proxy-relevant content of one EndpointSlice.

    `ports` maps each service port the slice serves (ServicePortName built from
    the slice's service-name label, the slice port's name and protocol) to the
    endpoints of that port, sorted, de-duplicated by ip:port. A port whose
    endpoints were all invalid (or a slice without endpoints) maps to ().
    """

    service: NamespacedName
    slice_name: str
    family: IPFamily
    ports: Mapping[ServicePortName, tuple[Endpoint, ...]]
    trigger_time: float | None = None


def slice_info(
    eps: Mapping[str, Any], node_name: str
) -> tuple[EndpointSliceInfo | None, list[Problem]]:
    """The content of an EndpointSlice; None for FQDN slices, slices without
    the service-name label, and unusable metadata."""
    try:
        return _slice_info(eps, node_name)
    except Exception as exc:  # a bug here must not stop the proxy
        return None, [problems.internal_error("EndpointSlice", eps, exc)]


def _slice_info(
    eps: Mapping[str, Any], node_name: str
) -> tuple[EndpointSliceInfo | None, list[Problem]]:
    service = _service_name_label(eps)
    if not service:
        return None, []  # not managed for a Service: kube-proxy ignores it
    name = problems.required_namespaced_name("EndpointSlice", eps)
    if isinstance(name, Problem):
        return None, [name]
    report = problems.Report("EndpointSlice", str(name))
    if (why := names.dns1123_label(name.namespace)) is not None:
        report.add("metadata.namespace", why)
        return None, report.problems
    if (why := names.dns1123_subdomain(name.name)) is not None:
        report.add("metadata.name", why)
        return None, report.problems
    meta = fields.map_at(eps, "metadata", "metadata", report)
    family = _slice_family(eps.get("addressType"), report)
    if family is None:
        return None, report.problems
    svc = NamespacedName(name.namespace, service)
    ports = _slice_ports(eps, svc, report)
    # made at the first port's number: a slice of one port (nearly all) copies none
    endpoints = _slice_endpoints(eps, family, node_name, report, ports[0][1] if ports else 0)
    by_port: dict[ServicePortName, dict[tuple[str, int], Endpoint]] = {}
    for port_name, number in ports:
        unique = by_port.setdefault(port_name, {})
        for made in endpoints:
            endpoint = made if made.port == number else made.at_port(number)
            address = (endpoint.ip, number)
            if address not in unique or endpoint.is_local:
                unique[address] = endpoint
    info = EndpointSliceInfo(
        service=svc,
        slice_name=name.name,
        family=family,
        ports={key: _sorted(unique.values()) for key, unique in by_port.items()},
        trigger_time=_trigger_time(meta, report),
    )
    return info, report.problems


def _sorted(endpoints: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    """Endpoints of one port, unique by address, in Endpoint's order: as
    their IPs are unique, the IP decides it (a C key, not the dataclass's
    __lt__)."""
    return tuple(sorted(endpoints, key=_IP))


_IP = attrgetter("ip")


def _service_name_label(eps: object) -> str:
    meta = eps.get("metadata") if isinstance(eps, Mapping) else None
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    service = labels.get(SERVICE_NAME_LABEL) if isinstance(labels, Mapping) else None
    return service if isinstance(service, str) else ""


def _slice_family(value: object, report: problems.Report) -> IPFamily | None:
    if isinstance(value, str) and value in _ADDRESS_TYPES:
        return _ADDRESS_TYPES[value]
    report.add("addressType", f"unknown address type {problems.describe(value)}")
    return None


def _slice_ports(
    eps: Mapping[str, Any], service: NamespacedName, report: problems.Report
) -> list[tuple[ServicePortName, int]]:
    result: list[tuple[ServicePortName, int]] = []
    for i, entry in enumerate(fields.list_at(eps, "ports", "ports", report)):
        path = f"ports[{i}]"
        if not isinstance(entry, Mapping):
            report.add(path, f"expected an object, got {problems.describe(entry)}")
            continue
        name = fields.str_at(entry, "name", f"{path}.name", report)
        protocol = fields.protocol(entry, f"{path}.protocol", report)
        port = fields.port_number(entry, path, report, missing="no port number; port ignored")
        if name and (why := names.dns1123_label(name)) is not None:
            report.add(f"{path}.name", why)
            continue
        if name is not None and protocol is not None and port is not None:
            result.append((ServicePortName(service.namespace, service.name, name, protocol), port))
    return result


def _slice_endpoints(
    eps: Mapping[str, Any], family: IPFamily, node_name: str, report: problems.Report,
    port: int,
) -> list[Endpoint]:
    """The valid endpoints of the slice, at `port` (copied to each other port)."""
    result: list[Endpoint] = []
    for j, entry in enumerate(fields.list_at(eps, "endpoints", "endpoints", report)):
        endpoint = _plain_endpoint(entry, family, node_name, port)
        if endpoint is None:
            endpoint = _slice_endpoint(entry, f"endpoints[{j}]", family, node_name, report, port)
        if endpoint is not None:
            result.append(endpoint)
    return result


_CANONICAL_IPV4 = re.compile(r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}"
                             r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])")
"""A dotted quad as ipaddress writes it: no leading zeros, each octet <= 255."""


def _plain_endpoint(
    entry: object, family: IPFamily, node_name: str, port: int = 0
) -> Endpoint | None:
    """The endpoint of an entry of the shape nearly all have -- a canonical
    IPv4 address first, conditions, node and zone of the right types or
    absent, no hints -- read without `_slice_endpoint`'s problem paths (the
    initial list's hot spot: 100,000 entries at 10k x 10); None for any
    other entry, which `_slice_endpoint` reads and reports on. Both read a
    plain entry the same (tests/test_convert.py holds them to it)."""
    if type(entry) is not dict or family is not IPFamily.IPV4 or entry.get("hints") is not None:
        return None
    addresses = entry.get("addresses")
    if type(addresses) is not list or not addresses:
        return None
    ip = addresses[0]
    if type(ip) is not str or _CANONICAL_IPV4.fullmatch(ip) is None:
        return None
    conditions = entry.get("conditions")
    if conditions is None:
        conditions = {}
    elif type(conditions) is not dict:
        return None
    ready = _plain_flag(conditions.get("ready"), True)
    serving = _plain_flag(conditions.get("serving"), ready)
    terminating = _plain_flag(conditions.get("terminating"), False)
    node = _plain_name(entry.get("nodeName"))
    zone = _plain_name(entry.get("zone"))
    if ready is None or serving is None or terminating is None or node is None or zone is None:
        return None
    return Endpoint(
        ip, port, ready, serving, terminating, node, zone, _NO_HINTS, _NO_HINTS,
        bool(node_name) and node == node_name,
    )  # fmt: skip


def _plain_flag(value: object, default: bool | None) -> bool | None:
    """A condition: its value, `default` when absent, None when not a boolean."""
    if value is None:
        return default
    return value if type(value) is bool else None


def _plain_name(value: object) -> str | None:
    """A node or zone name, interned ("" when absent), None when not a string."""
    if value is None:
        return ""
    return sys.intern(value) if type(value) is str else None


def _slice_endpoint(
    entry: object, path: str, family: IPFamily, node_name: str, report: problems.Report,
    port: int = 0,
) -> Endpoint | None:
    if not isinstance(entry, Mapping):
        report.add(path, f"expected an object, got {problems.describe(entry)}")
        return None
    addresses = fields.list_at(entry, "addresses", f"{path}.addresses", report)
    addr = fields.parse_ip(addresses[0]) if addresses else None
    if addr is None or fields.address_family(addr) is not family:
        value = problems.describe(addresses[0]) if addresses else "no address"
        report.add(f"{path}.addresses[0]", f"{value} is not an {family.value} address")
        return None
    conditions = fields.map_at(entry, "conditions", f"{path}.conditions", report)
    ready = fields.bool_at(conditions, "ready", f"{path}.conditions.ready", report, default=True)
    hints = fields.map_at(entry, "hints", f"{path}.hints", report)
    # interned: one string per node and zone, not one per endpoint, which outnumber them
    node = sys.intern(fields.str_at(entry, "nodeName", f"{path}.nodeName", report) or "")
    return Endpoint(
        ip=str(addr),
        port=port,
        ready=ready,
        serving=fields.bool_at(
            conditions, "serving", f"{path}.conditions.serving", report, default=ready
        ),
        terminating=fields.bool_at(
            conditions, "terminating", f"{path}.conditions.terminating", report, default=False
        ),
        node_name=node,
        zone=sys.intern(fields.str_at(entry, "zone", f"{path}.zone", report) or ""),
        zone_hints=_hint_names(hints, "forZones", f"{path}.hints.forZones", report),
        node_hints=_hint_names(hints, "forNodes", f"{path}.hints.forNodes", report),
        is_local=bool(node_name) and node == node_name,
    )


_NO_HINTS: frozenset[str] = frozenset()
"""Shared by every endpoint without hints (most), so no hints cost no memory
per endpoint."""


def _hint_names(
    hints: Mapping[str, Any], key: str, path: str, report: problems.Report
) -> frozenset[str]:
    names: set[str] = set()
    for i, entry in enumerate(fields.list_at(hints, key, path, report)):
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if isinstance(name, str) and name:
            names.add(name)
        else:
            got = problems.describe(entry)
            report.add(f"{path}[{i}]", f"expected an object with a name, got {got}")
    return frozenset(names) if names else _NO_HINTS


def _trigger_time(meta: Mapping[str, Any], report: problems.Report) -> float | None:
    """The last-change-trigger-time annotation (RFC 3339) as epoch seconds."""
    path = f"metadata.annotations[{_TRIGGER_TIME_ANNOTATION}]"
    annotations = fields.map_at(meta, "annotations", "metadata.annotations", report)
    value = annotations.get(_TRIGGER_TIME_ANNOTATION)
    if value is None:
        return None
    if isinstance(value, str) and _RFC3339.fullmatch(value):
        try:
            return datetime.fromisoformat(value).timestamp()
        except (ValueError, OverflowError):
            pass
    report.add(path, f"{problems.describe(value)} is not an RFC 3339 time")
    return None
