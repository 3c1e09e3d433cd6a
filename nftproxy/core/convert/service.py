"""v1 Service -> the ServicePorts of one IP family.

Layer: convert (imports model only). One job: turn a v1 Service dict into
its ServicePorts for one family, with its names (as the API server checks
them: a file source's were never checked) and every service-wide field (external
IPs, load-balancer ingress and source ranges, traffic policies, session
affinity, health-check node port, traffic distribution) validated. Headless,
ExternalName and proxy-name-labelled Services, and Services without a
cluster IP of that family, have no ports.

Known limits:
- Every family view of a dual-stack Service validates the whole object, so
  an invalid field is reported once per family.
- healthCheckNodePort is kept only where kube-proxy serves it (type
  LoadBalancer with externalTrafficPolicy Local).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nftproxy.core.convert import fields, names, problems
from nftproxy.core.convert.problems import Problem
from nftproxy.core.model import (
    DEFAULT_AFFINITY_TIMEOUT,
    IPFamily,
    IPMode,
    L4Protocol,
    LoadBalancerIngress,
    NamespacedName,
    ServicePort,
    ServicePortName,
    SessionAffinity,
    TrafficPolicy,
)

__all__ = ["HEADLESS_LABEL", "SERVICE_PROXY_NAME_LABEL", "service_ports"]

SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"

_MAX_AFFINITY_TIMEOUT = 86400  # API validation: 0 < timeoutSeconds <= 86400
_IP_MODES = {m.value: m for m in IPMode}
_POLICIES = {p.value: p for p in TrafficPolicy}
_SERVICE_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"})


def service_ports(
    svc: Mapping[str, Any], family: IPFamily
) -> tuple[dict[ServicePortName, ServicePort], list[Problem]]:
    """The ServicePorts of `svc` in `family` (empty for headless, ExternalName,
    proxy-name-labelled, or services without a cluster IP of that family)."""
    try:
        return _service_ports(svc, family)
    except Exception as exc:  # a bug here must not stop the proxy
        return {}, [problems.internal_error("Service", svc, exc)]


def _service_ports(
    svc: Mapping[str, Any], family: IPFamily
) -> tuple[dict[ServicePortName, ServicePort], list[Problem]]:
    name = problems.required_namespaced_name("Service", svc)
    if isinstance(name, Problem):
        return {}, [name]
    report = problems.Report("Service", str(name))
    if (why := _invalid_name(name)) is not None:
        report.add(*why)
        return {}, report.problems
    if _ignored_by_label(svc) or _is_headless(svc.get("spec")):
        return {}, []
    spec = fields.map_at(svc, "spec", "spec", report)
    svc_type = _service_type(spec, report)
    if svc_type == "ExternalName":
        return {}, []
    cluster_ip = _cluster_ip(spec, family, report)
    if cluster_ip is None:
        return {}, report.problems
    template = _service_template(svc, spec, svc_type, cluster_ip, family, report)
    with_node_ports = svc_type in ("NodePort", "LoadBalancer")
    result: dict[ServicePortName, ServicePort] = {}
    for i, entry in enumerate(fields.list_at(spec, "ports", "spec.ports", report)):
        path = f"spec.ports[{i}]"
        parsed = _service_port(entry, path, with_node_ports, report)
        if parsed is None:
            continue
        port_name, protocol, port, node_port = parsed
        key = ServicePortName(name.namespace, name.name, port_name, protocol)
        if key in result:
            report.add(f"{path}.name", f"duplicate port {port_name!r}/{protocol.value}")
            continue
        result[key] = template.at_port(key, port, protocol, node_port)
    return result, report.problems


def _invalid_name(name: NamespacedName) -> tuple[str, str] | None:
    """(field, why) when the API server would have refused the name (a file
    source's Service): the whole Service is skipped."""
    why = names.dns1123_label(name.namespace)
    if why is not None:
        return "metadata.namespace", why
    why = names.dns1035_label(name.name)
    return None if why is None else ("metadata.name", why)


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


def _service_type(spec: Mapping[str, Any], report: problems.Report) -> str:
    value = spec.get("type")
    if value is None:
        return "ClusterIP"
    if isinstance(value, str) and value in _SERVICE_TYPES:
        return value
    report.add("spec.type", f"unknown type {problems.describe(value)}; using ClusterIP")
    return "ClusterIP"


def _cluster_ip(spec: Mapping[str, Any], family: IPFamily, report: problems.Report) -> str | None:
    """The first valid cluster IP of `family` from spec.clusterIPs (or, when
    that is empty, spec.clusterIP). Unset and empty mean "no cluster IP"."""
    ips = fields.list_at(spec, "clusterIPs", "spec.clusterIPs", report)
    if ips:
        candidates = [(f"spec.clusterIPs[{i}]", value) for i, value in enumerate(ips)]
    else:
        candidates = [("spec.clusterIP", spec.get("clusterIP"))]
    chosen: str | None = None
    for path, value in candidates:
        if value is None or value == "":
            continue
        addr = fields.parse_ip(value)
        if addr is None:
            report.add(path, f"invalid IP address {problems.describe(value)}")
        elif chosen is None and fields.address_family(addr) is family:
            chosen = str(addr)
    return chosen


def _service_template(
    svc: Mapping[str, Any],
    spec: Mapping[str, Any],
    svc_type: str,
    cluster_ip: str,
    family: IPFamily,
    report: problems.Report,
) -> ServicePort:
    """A ServicePort holding the service-wide fields; name and port are placeholders."""
    is_lb = svc_type == "LoadBalancer"
    distribution = fields.str_at(spec, "trafficDistribution", "spec.trafficDistribution", report)
    etp = _traffic_policy(spec, "externalTrafficPolicy", report)
    affinity, timeout = _session_affinity(spec, report)
    external_ips = fields.list_at(spec, "externalIPs", "spec.externalIPs", report)
    ranges = fields.list_at(
        spec, "loadBalancerSourceRanges", "spec.loadBalancerSourceRanges", report
    )
    return ServicePort(
        name=ServicePortName("", "", "", L4Protocol.TCP),
        family=family,
        cluster_ip=cluster_ip,
        port=0,
        protocol=L4Protocol.TCP,
        external_ips=tuple(fields.ips_of_family(external_ips, "spec.externalIPs", family, report)),
        load_balancer_ingress=_lb_ingress(svc, family, report) if is_lb else (),
        load_balancer_source_ranges=(
            fields.cidrs_of_family(ranges, "spec.loadBalancerSourceRanges", family, report)
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
    entry: object, path: str, with_node_port: bool, report: problems.Report
) -> tuple[str, L4Protocol, int, int] | None:
    """(name, protocol, port, nodePort) of one spec.ports entry, or None to skip it."""
    if not isinstance(entry, Mapping):
        report.add(path, f"expected an object, got {problems.describe(entry)}")
        return None
    name = fields.str_at(entry, "name", f"{path}.name", report)
    protocol = fields.protocol(entry, f"{path}.protocol", report)
    port = fields.port_number(entry, path, report, missing="missing")
    node_port = 0
    if with_node_port and entry.get("nodePort") is not None:
        checked = fields.int_in_range(
            entry["nodePort"], f"{path}.nodePort", report, low=0, high=65535
        )
        node_port = checked or 0
    if name and (why := names.dns1123_label(name)) is not None:
        report.add(f"{path}.name", why)
        return None
    if name is None or protocol is None or port is None:
        return None
    return name, protocol, port, node_port


def _traffic_policy(spec: Mapping[str, Any], key: str, report: problems.Report) -> TrafficPolicy:
    """spec[key]: Cluster (default) or Local; eTP's legacy "Global" is Cluster."""
    value = spec.get(key)
    if value is None or (value == "Global" and key == "externalTrafficPolicy"):
        return TrafficPolicy.CLUSTER
    if isinstance(value, str) and value in _POLICIES:
        return _POLICIES[value]
    report.add(f"spec.{key}", f"unknown policy {problems.describe(value)}; using Cluster")
    return TrafficPolicy.CLUSTER


def _session_affinity(
    spec: Mapping[str, Any], report: problems.Report
) -> tuple[SessionAffinity, int]:
    value = spec.get("sessionAffinity")
    if value is None or value == "None":
        return SessionAffinity.NONE, DEFAULT_AFFINITY_TIMEOUT
    if value != "ClientIP":
        got = problems.describe(value)
        report.add("spec.sessionAffinity", f"unknown affinity {got}; using None")
        return SessionAffinity.NONE, DEFAULT_AFFINITY_TIMEOUT
    path = "spec.sessionAffinityConfig"
    config = fields.map_at(spec, "sessionAffinityConfig", path, report)
    client_ip = fields.map_at(config, "clientIP", f"{path}.clientIP", report)
    timeout = client_ip.get("timeoutSeconds")
    if timeout is not None:
        timeout = fields.int_in_range(
            timeout, f"{path}.clientIP.timeoutSeconds", report, low=1, high=_MAX_AFFINITY_TIMEOUT
        )
    return SessionAffinity.CLIENT_IP, timeout or DEFAULT_AFFINITY_TIMEOUT


def _health_check_node_port(spec: Mapping[str, Any], report: problems.Report) -> int:
    value = spec.get("healthCheckNodePort")
    if value is None or value == 0:
        return 0
    return fields.int_in_range(value, "spec.healthCheckNodePort", report, low=1, high=65535) or 0


def _lb_ingress(
    svc: Mapping[str, Any], family: IPFamily, report: problems.Report
) -> tuple[LoadBalancerIngress, ...]:
    """status.loadBalancer.ingress IPs of `family` (hostname-only entries ignored)."""
    status = fields.map_at(svc, "status", "status", report)
    balancer = fields.map_at(status, "loadBalancer", "status.loadBalancer", report)
    kept: dict[str, LoadBalancerIngress] = {}
    ingress = fields.list_at(balancer, "ingress", "status.loadBalancer.ingress", report)
    for k, entry in enumerate(ingress):
        path = f"status.loadBalancer.ingress[{k}]"
        if not isinstance(entry, Mapping):
            report.add(path, f"expected an object, got {problems.describe(entry)}")
            continue
        value = entry.get("ip")
        if value is None or value == "":
            continue
        addr = fields.parse_ip(value)
        if addr is None:
            report.add(f"{path}.ip", f"invalid IP address {problems.describe(value)}")
            continue
        mode = _ip_mode(entry.get("ipMode"), f"{path}.ipMode", report)
        if fields.address_family(addr) is family and str(addr) not in kept:
            kept[str(addr)] = LoadBalancerIngress(str(addr), mode)
    return tuple(kept.values())


def _ip_mode(value: object, path: str, report: problems.Report) -> IPMode:
    if value is None:
        return IPMode.VIP
    if isinstance(value, str) and value in _IP_MODES:
        return _IP_MODES[value]
    report.add(path, f"unknown ipMode {problems.describe(value)}; using VIP")
    return IPMode.VIP
