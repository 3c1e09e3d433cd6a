"""Kubernetes API objects (plain JSON dicts) -> model values, with validation.

Layer: convert (imports model only). One job: turn v1 Service,
discovery.k8s.io/v1 EndpointSlice, v1 Node and networking.k8s.io ServiceCIDR
dicts into validated model values. All input validation of nftproxy lives
here: an invalid field skips only that port / endpoint / range, and is
reported as a `Problem` value naming the object and the field. Nothing raises
out of this module, whatever the input.

Callers: tracker (services, slices), sources and proxier (nodes, CIDRs).

Parsing follows kube-proxy's: IPs and CIDRs are read "sloppily" as Go's
netutils.ParseIPSloppy does (IPv4 octets with leading zeros are decimal,
"010.001.002.003" is 10.1.2.3; an IPv4-mapped IPv6 address is IPv4), then
normalised to their canonical text. Blank externalIPs and source ranges are
skipped silently, as kube-proxy does.

Known limits:
- Every family view of a dual-stack Service validates the whole object, so
  an invalid field is reported once per family.
- healthCheckNodePort is kept only where kube-proxy serves it (type
  LoadBalancer with externalTrafficPolicy Local).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from nftproxy.core.model import (
    DEFAULT_AFFINITY_TIMEOUT,
    Endpoint,
    IPFamily,
    IPMode,
    L4Protocol,
    LoadBalancerIngress,
    NamespacedName,
    NodeInfo,
    ServicePort,
    ServicePortName,
    SessionAffinity,
    TrafficPolicy,
)

__all__ = [
    "HEADLESS_LABEL",
    "SERVICE_NAME_LABEL",
    "SERVICE_PROXY_NAME_LABEL",
    "EndpointSliceInfo",
    "Problem",
    "node_info",
    "service_cidrs",
    "service_name",
    "service_ports",
    "slice_info",
]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
_TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
_AUTOSCALER_TAINT = "ToBeDeletedByClusterAutoscaler"

_UNKNOWN = "<unknown>"
_MAX_AFFINITY_TIMEOUT = 86400  # API validation: 0 < timeoutSeconds <= 86400
_PROTOCOLS = {p.value: p for p in L4Protocol}
_IP_MODES = {m.value: m for m in IPMode}
_POLICIES = {p.value: p for p in TrafficPolicy}
_SERVICE_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"})
_ADDRESS_TYPES = {"IPv4": IPFamily.IPV4, "IPv6": IPFamily.IPV6, "FQDN": None}
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})"
)

_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Problem:
    """One invalid field that was skipped.

    >>> str(Problem("Service", "ns/web", "spec.ports[0].port", "70000 is out of range"))
    'Service ns/web: spec.ports[0].port: 70000 is out of range'
    """

    kind: str
    obj: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind} {self.obj}: {self.field}: {self.message}"


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


# --- public functions ---------------------------------------------------------


def service_name(obj: Mapping[str, Any]) -> NamespacedName | None:
    """namespace/name of any object dict, or None if metadata is unusable.

    The namespace is "" for cluster-scoped objects (Node, ServiceCIDR).

    >>> service_name({"metadata": {"namespace": "ns", "name": "web"}})
    NamespacedName(namespace='ns', name='web')
    >>> service_name({"metadata": {"namespace": "ns"}}) is None
    True
    """
    return _name_of(obj)


def service_ports(
    svc: Mapping[str, Any], family: IPFamily
) -> tuple[dict[ServicePortName, ServicePort], list[Problem]]:
    """The ServicePorts of `svc` in `family` (empty for headless, ExternalName,
    proxy-name-labelled, or services without a cluster IP of that family)."""
    try:
        return _service_ports(svc, family)
    except Exception as exc:  # a bug here must not stop the proxy
        return {}, [_internal_error("Service", svc, exc)]


def slice_info(
    eps: Mapping[str, Any], node_name: str
) -> tuple[EndpointSliceInfo | None, list[Problem]]:
    """The content of an EndpointSlice; None for FQDN slices, slices without
    the service-name label, and unusable metadata."""
    try:
        return _slice_info(eps, node_name)
    except Exception as exc:  # a bug here must not stop the proxy
        return None, [_internal_error("EndpointSlice", eps, exc)]


def node_info(node: Mapping[str, Any]) -> tuple[NodeInfo | None, list[Problem]]:
    """This node's NodeInfo from a v1 Node dict."""
    try:
        return _node_info(node)
    except Exception as exc:  # a bug here must not stop the proxy
        return None, [_internal_error("Node", node, exc)]


def service_cidrs(obj: Mapping[str, Any]) -> tuple[tuple[str, ...], list[Problem]]:
    """spec.cidrs of a networking.k8s.io ServiceCIDR (normalised CIDR strings)."""
    try:
        return _service_cidrs(obj)
    except Exception as exc:  # a bug here must not stop the proxy
        return (), [_internal_error("ServiceCIDR", obj, exc)]


# --- problem reporting and typed access to JSON -------------------------------


@dataclass(slots=True)
class _Report:
    """The problems found in one object, collected while converting it."""

    kind: str
    obj: str
    problems: list[Problem] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(self.kind, self.obj, path, message))


def _describe(value: object) -> str:
    """A short, never-raising rendering of an input value for messages."""
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) < 10**18 else "a very large integer"
    if isinstance(value, str):
        return repr(value) if len(value) <= 64 else repr(value[:61]) + "..."
    return f"a {type(value).__name__}"


def _name_of(obj: object) -> NamespacedName | None:
    try:
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        if not isinstance(meta, Mapping):
            return None
        name = meta.get("name")
        namespace = meta.get("namespace")
        namespace = "" if namespace is None else namespace
        if not isinstance(name, str) or not name or not isinstance(namespace, str):
            return None
        return NamespacedName(namespace, name)
    except Exception:  # a hostile Mapping; nothing may raise out of convert
        return None


def _object_label(obj: object) -> str:
    """'ns/name', or 'name' for cluster-scoped objects, or '<unknown>'."""
    name = _name_of(obj)
    if name is None:
        return _UNKNOWN
    return str(name) if name.namespace else name.name


def _internal_error(kind: str, obj: object, exc: Exception) -> Problem:
    return Problem(kind, _object_label(obj), "", f"internal error: {type(exc).__name__}")


def _map_at(parent: Mapping[str, Any], key: str, path: str, report: _Report) -> Mapping[str, Any]:
    """parent[key] as a Mapping; {} when unset, {} plus a problem when not an object."""
    value = parent.get(key)
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return value
    report.add(path, f"expected an object, got {_describe(value)}")
    return {}


def _list_at(parent: Mapping[str, Any], key: str, path: str, report: _Report) -> list[Any]:
    """parent[key] as a list; [] when unset, [] plus a problem when not a list."""
    value = parent.get(key)
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    report.add(path, f"expected a list, got {_describe(value)}")
    return []


def _str_at(parent: Mapping[str, Any], key: str, path: str, report: _Report) -> str | None:
    """parent[key] as a string; "" when unset, None plus a problem when not a string."""
    value = parent.get(key)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    report.add(path, f"expected a string, got {_describe(value)}")
    return None


def _bool_at(
    parent: Mapping[str, Any], key: str, path: str, report: _Report, *, default: bool
) -> bool:
    value = parent.get(key)
    if isinstance(value, bool):
        return value
    if value is not None:
        report.add(path, f"expected a boolean, got {_describe(value)}; using {default}")
    return default


def _int_in_range(value: object, path: str, report: _Report, *, low: int, high: int) -> int | None:
    """value if it is an integer in low..high, else None plus a problem."""
    if not isinstance(value, int) or isinstance(value, bool):
        report.add(path, f"expected an integer, got {_describe(value)}")
        return None
    if not low <= value <= high:
        report.add(path, f"{_describe(value)} is out of range {low}..{high}")
        return None
    return value


# --- addresses ----------------------------------------------------------------


def _unpad_ipv4(text: str) -> str:
    """Drop leading zeros from dotted-quad octets ("203.0.113.000" -> "203.0.113.0"),
    which Go's ParseIPSloppy reads as decimal and Python's ipaddress rejects."""
    octets = text.split(".")
    if len(octets) != 4 or not all(o.isascii() and o.isdigit() for o in octets):
        return text
    return ".".join(o.lstrip("0") or "0" for o in octets)


def _parse_ip(value: object) -> _IPAddress | None:
    """An IP address as kube-proxy parses it, or None. No zones, no padding."""
    if not isinstance(value, str) or "%" in value:
        return None
    try:
        addr = ipaddress.ip_address(_unpad_ipv4(value))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped  # Go treats ::ffff:a.b.c.d as IPv4
    return addr


def _parse_cidr(value: object) -> _IPNetwork | None:
    """A CIDR "addr/prefix" (host bits cleared), or None. Netmask forms and
    bare addresses are rejected, as Go's ParseCIDR does."""
    if not isinstance(value, str):
        return None
    text, slash, prefix = value.partition("/")
    if not slash or "%" in text or not (prefix.isascii() and prefix.isdigit()):
        return None
    prefix = prefix.lstrip("0") or "0"
    if len(prefix) > 3:
        return None
    try:
        return ipaddress.ip_network(f"{_unpad_ipv4(text)}/{prefix}", strict=False)
    except ValueError:
        return None


def _family(addr: _IPAddress | _IPNetwork) -> IPFamily:
    return IPFamily.IPV4 if addr.version == 4 else IPFamily.IPV6


def _ips_of_family(values: list[Any], path: str, family: IPFamily, report: _Report) -> list[str]:
    """Valid IPs of `family`, normalised, de-duplicated, in order. Other-family
    IPs are dropped silently, blank strings skipped, the rest reported."""
    kept: dict[str, None] = {}
    for i, value in enumerate(values):
        if isinstance(value, str) and not value.strip():
            continue
        addr = _parse_ip(value)
        if addr is None:
            report.add(f"{path}[{i}]", f"invalid IP address {_describe(value)}")
        elif _family(addr) is family:
            kept[str(addr)] = None
    return list(kept)


def _cidrs_of_family(
    values: list[Any], path: str, family: IPFamily | None, report: _Report
) -> tuple[str, ...]:
    """Valid CIDRs (of `family`, or of any family if None), trimmed,
    normalised, de-duplicated, in order; blank strings skipped."""
    kept: dict[str, None] = {}
    for i, value in enumerate(values):
        text = value.strip() if isinstance(value, str) else value
        if text == "":
            continue
        net = _parse_cidr(text)
        if net is None:
            report.add(f"{path}[{i}]", f"invalid CIDR {_describe(value)}")
        elif family is None or _family(net) is family:
            kept[str(net)] = None
    return tuple(kept)


# --- Service ------------------------------------------------------------------


def _service_ports(
    svc: Mapping[str, Any], family: IPFamily
) -> tuple[dict[ServicePortName, ServicePort], list[Problem]]:
    name = _required_namespaced_name("Service", svc)
    if isinstance(name, Problem):
        return {}, [name]
    report = _Report("Service", str(name))
    if _ignored_by_label(svc) or _is_headless(svc.get("spec")):
        return {}, []
    spec = _map_at(svc, "spec", "spec", report)
    svc_type = _service_type(spec, report)
    if svc_type == "ExternalName":
        return {}, []
    cluster_ip = _cluster_ip(spec, family, report)
    if cluster_ip is None:
        return {}, report.problems
    template = _service_template(svc, spec, svc_type, cluster_ip, family, report)
    with_node_ports = svc_type in ("NodePort", "LoadBalancer")
    result: dict[ServicePortName, ServicePort] = {}
    for i, entry in enumerate(_list_at(spec, "ports", "spec.ports", report)):
        path = f"spec.ports[{i}]"
        parsed = _service_port(entry, path, with_node_ports, report)
        if parsed is None:
            continue
        port_name, protocol, port, node_port = parsed
        key = ServicePortName(name.namespace, name.name, port_name, protocol)
        if key in result:
            report.add(f"{path}.name", f"duplicate port {port_name!r}/{protocol.value}")
            continue
        result[key] = replace(template, name=key, port=port, protocol=protocol, node_port=node_port)
    return result, report.problems


def _required_namespaced_name(kind: str, obj: object) -> NamespacedName | Problem:
    """metadata namespace/name of a namespaced object, or the Problem saying why not."""
    name = _name_of(obj)
    if name is not None and name.namespace:
        return name
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        return Problem(kind, _UNKNOWN, "metadata", "expected an object with name and namespace")
    if name is None:
        return Problem(kind, _UNKNOWN, "metadata.name", "missing or not a string")
    return Problem(kind, _UNKNOWN, "metadata.namespace", "missing or not a string")


def _ignored_by_label(svc: Mapping[str, Any]) -> bool:
    """kube-proxy's informer selector: !service-proxy-name, !headless (any value)."""
    meta = svc.get("metadata")
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    if not isinstance(labels, Mapping):
        return False
    return SERVICE_PROXY_NAME_LABEL in labels or HEADLESS_LABEL in labels


def _is_headless(spec: object) -> bool:
    if not isinstance(spec, Mapping):
        return False
    ips = spec.get("clusterIPs")
    return spec.get("clusterIP") == "None" or (isinstance(ips, list) and "None" in ips)


def _service_type(spec: Mapping[str, Any], report: _Report) -> str:
    value = spec.get("type")
    if value is None:
        return "ClusterIP"
    if isinstance(value, str) and value in _SERVICE_TYPES:
        return value
    report.add("spec.type", f"unknown type {_describe(value)}; using ClusterIP")
    return "ClusterIP"


def _cluster_ip(spec: Mapping[str, Any], family: IPFamily, report: _Report) -> str | None:
    """The first valid cluster IP of `family` from spec.clusterIPs (or, when
    that is empty, spec.clusterIP). Unset and empty mean "no cluster IP"."""
    ips = _list_at(spec, "clusterIPs", "spec.clusterIPs", report)
    if ips:
        candidates = [(f"spec.clusterIPs[{i}]", value) for i, value in enumerate(ips)]
    else:
        candidates = [("spec.clusterIP", spec.get("clusterIP"))]
    chosen: str | None = None
    for path, value in candidates:
        if value is None or value == "":
            continue
        addr = _parse_ip(value)
        if addr is None:
            report.add(path, f"invalid IP address {_describe(value)}")
        elif chosen is None and _family(addr) is family:
            chosen = str(addr)
    return chosen


def _service_template(
    svc: Mapping[str, Any],
    spec: Mapping[str, Any],
    svc_type: str,
    cluster_ip: str,
    family: IPFamily,
    report: _Report,
) -> ServicePort:
    """A ServicePort holding the service-wide fields; name and port are placeholders."""
    is_lb = svc_type == "LoadBalancer"
    distribution = _str_at(spec, "trafficDistribution", "spec.trafficDistribution", report)
    etp = _traffic_policy(spec, "externalTrafficPolicy", report)
    affinity, timeout = _session_affinity(spec, report)
    external_ips = _list_at(spec, "externalIPs", "spec.externalIPs", report)
    ranges = _list_at(spec, "loadBalancerSourceRanges", "spec.loadBalancerSourceRanges", report)
    return ServicePort(
        name=ServicePortName("", "", "", L4Protocol.TCP),
        family=family,
        cluster_ip=cluster_ip,
        port=0,
        protocol=L4Protocol.TCP,
        external_ips=tuple(_ips_of_family(external_ips, "spec.externalIPs", family, report)),
        load_balancer_ingress=_lb_ingress(svc, family, report) if is_lb else (),
        load_balancer_source_ranges=(
            _cidrs_of_family(ranges, "spec.loadBalancerSourceRanges", family, report)
            if is_lb
            else ()
        ),
        external_traffic_policy=etp,
        internal_traffic_policy=_traffic_policy(spec, "internalTrafficPolicy", report),
        session_affinity=affinity,
        affinity_timeout=timeout,
        health_check_node_port=(
            _health_check_node_port(spec, report) if is_lb and etp is TrafficPolicy.LOCAL else 0
        ),
        traffic_distribution=distribution or "",
    )


def _service_port(
    entry: object, path: str, with_node_port: bool, report: _Report
) -> tuple[str, L4Protocol, int, int] | None:
    """(name, protocol, port, nodePort) of one spec.ports entry, or None to skip it."""
    if not isinstance(entry, Mapping):
        report.add(path, f"expected an object, got {_describe(entry)}")
        return None
    name = _str_at(entry, "name", f"{path}.name", report)
    protocol = _protocol(entry, f"{path}.protocol", report)
    port = _port_number(entry, path, report, missing="missing")
    node_port = 0
    if with_node_port and entry.get("nodePort") is not None:
        checked = _int_in_range(entry["nodePort"], f"{path}.nodePort", report, low=0, high=65535)
        node_port = checked or 0
    if name is None or protocol is None or port is None:
        return None
    return name, protocol, port, node_port


def _port_number(
    entry: Mapping[str, Any], path: str, report: _Report, *, missing: str
) -> int | None:
    """entry["port"] if it is a valid port number, else None plus a problem."""
    value = entry.get("port")
    if value is None:
        report.add(f"{path}.port", missing)
        return None
    return _int_in_range(value, f"{path}.port", report, low=1, high=65535)


def _protocol(entry: Mapping[str, Any], path: str, report: _Report) -> L4Protocol | None:
    value = entry.get("protocol")
    if value is None:
        return L4Protocol.TCP
    if isinstance(value, str) and value in _PROTOCOLS:
        return _PROTOCOLS[value]
    report.add(path, f"unknown protocol {_describe(value)}")
    return None


def _traffic_policy(spec: Mapping[str, Any], key: str, report: _Report) -> TrafficPolicy:
    """spec[key]: Cluster (default) or Local; eTP's legacy "Global" is Cluster."""
    value = spec.get(key)
    if value is None or (value == "Global" and key == "externalTrafficPolicy"):
        return TrafficPolicy.CLUSTER
    if isinstance(value, str) and value in _POLICIES:
        return _POLICIES[value]
    report.add(f"spec.{key}", f"unknown policy {_describe(value)}; using Cluster")
    return TrafficPolicy.CLUSTER


def _session_affinity(spec: Mapping[str, Any], report: _Report) -> tuple[SessionAffinity, int]:
    value = spec.get("sessionAffinity")
    if value is None or value == "None":
        return SessionAffinity.NONE, DEFAULT_AFFINITY_TIMEOUT
    if value != "ClientIP":
        report.add("spec.sessionAffinity", f"unknown affinity {_describe(value)}; using None")
        return SessionAffinity.NONE, DEFAULT_AFFINITY_TIMEOUT
    path = "spec.sessionAffinityConfig"
    config = _map_at(spec, "sessionAffinityConfig", path, report)
    client_ip = _map_at(config, "clientIP", f"{path}.clientIP", report)
    timeout = client_ip.get("timeoutSeconds")
    if timeout is not None:
        timeout = _int_in_range(
            timeout, f"{path}.clientIP.timeoutSeconds", report, low=1, high=_MAX_AFFINITY_TIMEOUT
        )
    return SessionAffinity.CLIENT_IP, timeout or DEFAULT_AFFINITY_TIMEOUT


def _health_check_node_port(spec: Mapping[str, Any], report: _Report) -> int:
    value = spec.get("healthCheckNodePort")
    if value is None or value == 0:
        return 0
    return _int_in_range(value, "spec.healthCheckNodePort", report, low=1, high=65535) or 0


def _lb_ingress(
    svc: Mapping[str, Any], family: IPFamily, report: _Report
) -> tuple[LoadBalancerIngress, ...]:
    """status.loadBalancer.ingress IPs of `family` (hostname-only entries ignored)."""
    status = _map_at(svc, "status", "status", report)
    balancer = _map_at(status, "loadBalancer", "status.loadBalancer", report)
    kept: dict[str, LoadBalancerIngress] = {}
    for k, entry in enumerate(_list_at(balancer, "ingress", "status.loadBalancer.ingress", report)):
        path = f"status.loadBalancer.ingress[{k}]"
        if not isinstance(entry, Mapping):
            report.add(path, f"expected an object, got {_describe(entry)}")
            continue
        value = entry.get("ip")
        if value is None or value == "":
            continue
        addr = _parse_ip(value)
        if addr is None:
            report.add(f"{path}.ip", f"invalid IP address {_describe(value)}")
            continue
        mode = _ip_mode(entry.get("ipMode"), f"{path}.ipMode", report)
        if _family(addr) is family and str(addr) not in kept:
            kept[str(addr)] = LoadBalancerIngress(str(addr), mode)
    return tuple(kept.values())


def _ip_mode(value: object, path: str, report: _Report) -> IPMode:
    if value is None:
        return IPMode.VIP
    if isinstance(value, str) and value in _IP_MODES:
        return _IP_MODES[value]
    report.add(path, f"unknown ipMode {_describe(value)}; using VIP")
    return IPMode.VIP


# --- EndpointSlice ------------------------------------------------------------


def _slice_info(
    eps: Mapping[str, Any], node_name: str
) -> tuple[EndpointSliceInfo | None, list[Problem]]:
    service = _service_name_label(eps)
    if not service:
        return None, []  # not managed for a Service: kube-proxy ignores it
    name = _required_namespaced_name("EndpointSlice", eps)
    if isinstance(name, Problem):
        return None, [name]
    report = _Report("EndpointSlice", str(name))
    meta = _map_at(eps, "metadata", "metadata", report)
    family = _slice_family(eps.get("addressType"), report)
    if family is None:
        return None, report.problems
    svc = NamespacedName(name.namespace, service)
    ports = _slice_ports(eps, svc, report)
    endpoints = _slice_endpoints(eps, family, node_name, report)
    by_port: dict[ServicePortName, dict[str, Endpoint]] = {}
    for port_name, number in ports:
        unique = by_port.setdefault(port_name, {})
        for template in endpoints:
            endpoint = replace(template, port=number)
            if endpoint.address not in unique or endpoint.is_local:
                unique[endpoint.address] = endpoint
    info = EndpointSliceInfo(
        service=svc,
        slice_name=name.name,
        family=family,
        ports={key: tuple(sorted(unique.values())) for key, unique in by_port.items()},
        trigger_time=_trigger_time(meta, report),
    )
    return info, report.problems


def _service_name_label(eps: object) -> str:
    meta = eps.get("metadata") if isinstance(eps, Mapping) else None
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    service = labels.get(SERVICE_NAME_LABEL) if isinstance(labels, Mapping) else None
    return service if isinstance(service, str) else ""


def _slice_family(value: object, report: _Report) -> IPFamily | None:
    if isinstance(value, str) and value in _ADDRESS_TYPES:
        return _ADDRESS_TYPES[value]
    report.add("addressType", f"unknown address type {_describe(value)}")
    return None


def _slice_ports(
    eps: Mapping[str, Any], service: NamespacedName, report: _Report
) -> list[tuple[ServicePortName, int]]:
    result: list[tuple[ServicePortName, int]] = []
    for i, entry in enumerate(_list_at(eps, "ports", "ports", report)):
        path = f"ports[{i}]"
        if not isinstance(entry, Mapping):
            report.add(path, f"expected an object, got {_describe(entry)}")
            continue
        name = _str_at(entry, "name", f"{path}.name", report)
        protocol = _protocol(entry, f"{path}.protocol", report)
        port = _port_number(entry, path, report, missing="no port number; port ignored")
        if name is not None and protocol is not None and port is not None:
            result.append((ServicePortName(service.namespace, service.name, name, protocol), port))
    return result


def _slice_endpoints(
    eps: Mapping[str, Any], family: IPFamily, node_name: str, report: _Report
) -> list[Endpoint]:
    """The valid endpoints of the slice, with port 0 (filled in per port)."""
    result: list[Endpoint] = []
    for j, entry in enumerate(_list_at(eps, "endpoints", "endpoints", report)):
        endpoint = _slice_endpoint(entry, f"endpoints[{j}]", family, node_name, report)
        if endpoint is not None:
            result.append(endpoint)
    return result


def _slice_endpoint(
    entry: object, path: str, family: IPFamily, node_name: str, report: _Report
) -> Endpoint | None:
    if not isinstance(entry, Mapping):
        report.add(path, f"expected an object, got {_describe(entry)}")
        return None
    addresses = _list_at(entry, "addresses", f"{path}.addresses", report)
    addr = _parse_ip(addresses[0]) if addresses else None
    if addr is None or _family(addr) is not family:
        value = _describe(addresses[0]) if addresses else "no address"
        report.add(f"{path}.addresses[0]", f"{value} is not an {family.value} address")
        return None
    conditions = _map_at(entry, "conditions", f"{path}.conditions", report)
    ready = _bool_at(conditions, "ready", f"{path}.conditions.ready", report, default=True)
    hints = _map_at(entry, "hints", f"{path}.hints", report)
    node = _str_at(entry, "nodeName", f"{path}.nodeName", report) or ""
    return Endpoint(
        ip=str(addr),
        port=0,
        ready=ready,
        serving=_bool_at(
            conditions, "serving", f"{path}.conditions.serving", report, default=ready
        ),
        terminating=_bool_at(
            conditions, "terminating", f"{path}.conditions.terminating", report, default=False
        ),
        node_name=node,
        zone=_str_at(entry, "zone", f"{path}.zone", report) or "",
        zone_hints=_hint_names(hints, "forZones", f"{path}.hints.forZones", report),
        node_hints=_hint_names(hints, "forNodes", f"{path}.hints.forNodes", report),
        is_local=bool(node_name) and node == node_name,
    )


_NO_HINTS: frozenset[str] = frozenset()
"""Shared by every endpoint without hints (most): 43 MB at 100,000 endpoints
(bench/RESULTS.md)."""


def _hint_names(hints: Mapping[str, Any], key: str, path: str, report: _Report) -> frozenset[str]:
    names: set[str] = set()
    for i, entry in enumerate(_list_at(hints, key, path, report)):
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if isinstance(name, str) and name:
            names.add(name)
        else:
            report.add(f"{path}[{i}]", f"expected an object with a name, got {_describe(entry)}")
    return frozenset(names) if names else _NO_HINTS


def _trigger_time(meta: Mapping[str, Any], report: _Report) -> float | None:
    """The last-change-trigger-time annotation (RFC 3339) as epoch seconds."""
    path = f"metadata.annotations[{_TRIGGER_TIME_ANNOTATION}]"
    annotations = _map_at(meta, "annotations", "metadata.annotations", report)
    value = annotations.get(_TRIGGER_TIME_ANNOTATION)
    if value is None:
        return None
    if isinstance(value, str) and _RFC3339.fullmatch(value):
        try:
            return datetime.fromisoformat(value).timestamp()
        except (ValueError, OverflowError):
            pass
    report.add(path, f"{_describe(value)} is not an RFC 3339 time")
    return None


# --- Node and ServiceCIDR -----------------------------------------------------


def _node_info(node: Mapping[str, Any]) -> tuple[NodeInfo | None, list[Problem]]:
    name = service_name(node)
    if name is None:
        return None, [Problem("Node", _UNKNOWN, "metadata.name", "missing or not a string")]
    report = _Report("Node", name.name)
    meta = _map_at(node, "metadata", "metadata", report)
    spec = _map_at(node, "spec", "spec", report)
    status = _map_at(node, "status", "status", report)
    ipv4, ipv6 = _node_addresses(status, report)
    info = NodeInfo(
        name=name.name,
        ipv4=ipv4,
        ipv6=ipv6,
        labels=_node_labels(meta, report),
        pod_cidrs=_node_pod_cidrs(spec, report),
        deleting=meta.get("deletionTimestamp") is not None,
        to_be_deleted=_has_autoscaler_taint(spec, report),
    )
    return info, report.problems


def _node_addresses(
    status: Mapping[str, Any], report: _Report
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(IPv4, IPv6) node addresses: every InternalIP, then every ExternalIP."""
    by_type: dict[str, list[str]] = {"InternalIP": [], "ExternalIP": []}
    for i, entry in enumerate(_list_at(status, "addresses", "status.addresses", report)):
        path = f"status.addresses[{i}]"
        if not isinstance(entry, Mapping):
            report.add(path, f"expected an object, got {_describe(entry)}")
            continue
        kind = entry.get("type")
        if not isinstance(kind, str) or kind not in by_type:
            continue  # Hostname, InternalDNS, ...
        addr = _parse_ip(entry.get("address"))
        if addr is None:
            report.add(f"{path}.address", f"invalid IP address {_describe(entry.get('address'))}")
            continue
        by_type[kind].append(str(addr))
    ordered = dict.fromkeys(by_type["InternalIP"] + by_type["ExternalIP"])
    v4 = tuple(ip for ip in ordered if ":" not in ip)
    return v4, tuple(ip for ip in ordered if ":" in ip)


def _node_labels(meta: Mapping[str, Any], report: _Report) -> tuple[tuple[str, str], ...]:
    labels = _map_at(meta, "labels", "metadata.labels", report)
    pairs: list[tuple[str, str]] = []
    for key, value in labels.items():
        if isinstance(key, str) and isinstance(value, str):
            pairs.append((key, value))
        else:
            report.add(f"metadata.labels[{_describe(key)}]", "expected string key and value")
    return tuple(sorted(pairs))


def _node_pod_cidrs(spec: Mapping[str, Any], report: _Report) -> tuple[str, ...]:
    cidrs = _list_at(spec, "podCIDRs", "spec.podCIDRs", report)
    if cidrs:
        return _cidrs_of_family(cidrs, "spec.podCIDRs", None, report)
    single = spec.get("podCIDR")
    if single is None or single == "":
        return ()
    net = _parse_cidr(single)
    if net is None:
        report.add("spec.podCIDR", f"invalid CIDR {_describe(single)}")
        return ()
    return (str(net),)


def _has_autoscaler_taint(spec: Mapping[str, Any], report: _Report) -> bool:
    for taint in _list_at(spec, "taints", "spec.taints", report):
        if isinstance(taint, Mapping) and taint.get("key") == _AUTOSCALER_TAINT:
            return True
    return False


def _service_cidrs(obj: Mapping[str, Any]) -> tuple[tuple[str, ...], list[Problem]]:
    if not isinstance(obj, Mapping):
        problem = Problem("ServiceCIDR", _UNKNOWN, "", f"expected an object, got {_describe(obj)}")
        return (), [problem]
    report = _Report("ServiceCIDR", _object_label(obj))
    spec = _map_at(obj, "spec", "spec", report)
    cidrs = _list_at(spec, "cidrs", "spec.cidrs", report)
    return _cidrs_of_family(cidrs, "spec.cidrs", None, report), report.problems
