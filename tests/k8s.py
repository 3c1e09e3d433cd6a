"""Builders of Kubernetes API JSON (Service, EndpointSlice, Node) for tests.

Layer: tests. One job: let a test say "a NodePort service with two
endpoints" in one line, as the API server would send it (camelCase dicts).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

__all__ = ["endpoint_slice", "node", "service"]


def _family(ip: str) -> str:
    return "IPv4" if ipaddress.ip_address(ip).version == 4 else "IPv6"


def service(
    name: str,
    cluster_ips: str | Sequence[str],
    *,
    ns: str = "ns",
    ports: Sequence[tuple[str, int, str]] = (("http", 80, "TCP"),),
    type: str = "ClusterIP",
    node_ports: Sequence[int] = (),
    external_ips: Sequence[str] = (),
    lb_ips: Sequence[str] = (),
    source_ranges: Sequence[str] = (),
    etp: str | None = None,
    itp: str | None = None,
    affinity_timeout: int | None = None,
    health_check_node_port: int | None = None,
) -> dict[str, Any]:
    """A v1 Service; `ports` are (name, port, protocol), node ports pair by index."""
    ips = [cluster_ips] if isinstance(cluster_ips, str) else list(cluster_ips)
    spec_ports = []
    for i, (pname, port, proto) in enumerate(ports):
        p: dict[str, Any] = {"name": pname, "port": port, "protocol": proto, "targetPort": port}
        if i < len(node_ports):
            p["nodePort"] = node_ports[i]
        spec_ports.append(p)
    spec: dict[str, Any] = {
        "type": type,
        "clusterIP": ips[0],
        "clusterIPs": ips,
        "ipFamilies": [_family(ip) for ip in ips],
        "ports": spec_ports,
    }
    if external_ips:
        spec["externalIPs"] = list(external_ips)
    if source_ranges:
        spec["loadBalancerSourceRanges"] = list(source_ranges)
    if etp:
        spec["externalTrafficPolicy"] = etp
    if itp:
        spec["internalTrafficPolicy"] = itp
    if affinity_timeout is not None:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": affinity_timeout}}
    if health_check_node_port:
        spec["healthCheckNodePort"] = health_check_node_port
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": ns, "name": name},
        "spec": spec,
    }
    if lb_ips:
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": ip} for ip in lb_ips]}}
    return obj


def endpoint_slice(
    service_name: str,
    endpoints: Sequence[str | tuple[str, str] | dict[str, Any]],
    *,
    ns: str = "ns",
    name: str | None = None,
    ports: Sequence[tuple[str, int, str]] = (("http", 80, "TCP"),),
    family: str | None = None,
) -> dict[str, Any]:
    """An EndpointSlice. Each endpoint is an IP, (ip, nodeName), or a dict
    with "ip" and optional nodeName/ready/serving/terminating/zone."""
    eps = []
    for e in endpoints:
        spec = (
            {"ip": e}
            if isinstance(e, str)
            else {"ip": e[0], "nodeName": e[1]}
            if isinstance(e, tuple)
            else e
        )
        conditions = {k: spec[k] for k in ("ready", "serving", "terminating") if k in spec}
        item: dict[str, Any] = {"addresses": [spec["ip"]], "conditions": conditions}
        if "nodeName" in spec:
            item["nodeName"] = spec["nodeName"]
        if "zone" in spec:
            item["zone"] = spec["zone"]
        eps.append(item)
    first = next(iter(endpoints), None)
    fam = family or (
        _family(
            first
            if isinstance(first, str)
            else first[0]
            if isinstance(first, tuple)
            else first["ip"]
        )
        if first
        else "IPv4"
    )
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": ns,
            "name": name or f"{service_name}-{fam.lower()}",
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": fam,
        "endpoints": eps,
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
    }


def node(
    name: str, ips: Sequence[str], *, pod_cidrs: Sequence[str] = (), zone: str = ""
) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name}
    if zone:
        labels["topology.kubernetes.io/zone"] = zone
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"podCIDRs": list(pod_cidrs)},
        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in ips]},
    }
