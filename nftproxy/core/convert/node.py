"""v1 Node -> NodeInfo, and networking.k8s.io ServiceCIDR -> CIDRs.

Layer: convert (imports model only). One job: the cluster-scoped objects
the proxier reads: this node's addresses, labels, pod CIDRs and deletion
state, and the CIDRs of a ServiceCIDR.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nftproxy.core.convert import fields, names, problems
from nftproxy.core.convert.problems import Problem, service_name
from nftproxy.core.model import NodeInfo

__all__ = ["node_info", "service_cidrs"]

_AUTOSCALER_TAINT = "ToBeDeletedByClusterAutoscaler"


def node_info(node: Mapping[str, Any]) -> tuple[NodeInfo | None, list[Problem]]:
    """This node's NodeInfo from a v1 Node dict."""
    try:
        return _node_info(node)
    except Exception as exc:  # a bug here must not stop the proxy
        return None, [problems.internal_error("Node", node, exc)]


def service_cidrs(obj: Mapping[str, Any]) -> tuple[tuple[str, ...], list[Problem]]:
    """spec.cidrs of a networking.k8s.io ServiceCIDR (normalised CIDR strings)."""
    try:
        return _service_cidrs(obj)
    except Exception as exc:  # a bug here must not stop the proxy
        return (), [problems.internal_error("ServiceCIDR", obj, exc)]


def _node_info(node: Mapping[str, Any]) -> tuple[NodeInfo | None, list[Problem]]:
    name = service_name(node)
    if name is None:
        return None, [Problem("Node", problems.UNKNOWN, "metadata.name", "missing or not a string")]
    report = problems.Report("Node", name.name)
    if (why := names.dns1123_subdomain(name.name)) is not None:
        report.add("metadata.name", why)  # a file's Node: the API server never saw it
        return None, report.problems
    meta = fields.map_at(node, "metadata", "metadata", report)
    spec = fields.map_at(node, "spec", "spec", report)
    status = fields.map_at(node, "status", "status", report)
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
    status: Mapping[str, Any], report: problems.Report
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(IPv4, IPv6) node addresses: every InternalIP, then every ExternalIP."""
    by_type: dict[str, list[str]] = {"InternalIP": [], "ExternalIP": []}
    for i, entry in enumerate(fields.list_at(status, "addresses", "status.addresses", report)):
        path = f"status.addresses[{i}]"
        if not isinstance(entry, Mapping):
            report.add(path, f"expected an object, got {problems.describe(entry)}")
            continue
        kind = entry.get("type")
        if not isinstance(kind, str) or kind not in by_type:
            continue  # Hostname, InternalDNS, ...
        addr = fields.parse_ip(entry.get("address"))
        if addr is None:
            got = problems.describe(entry.get("address"))
            report.add(f"{path}.address", f"invalid IP address {got}")
            continue
        by_type[kind].append(str(addr))
    ordered = dict.fromkeys(by_type["InternalIP"] + by_type["ExternalIP"])
    v4 = tuple(ip for ip in ordered if ":" not in ip)
    return v4, tuple(ip for ip in ordered if ":" in ip)


def _node_labels(meta: Mapping[str, Any], report: problems.Report) -> tuple[tuple[str, str], ...]:
    labels = fields.map_at(meta, "labels", "metadata.labels", report)
    pairs: list[tuple[str, str]] = []
    for key, value in labels.items():
        if isinstance(key, str) and isinstance(value, str):
            pairs.append((key, value))
        else:
            label = problems.describe(key)
            report.add(f"metadata.labels[{label}]", "expected string key and value")
    return tuple(sorted(pairs))


def _node_pod_cidrs(spec: Mapping[str, Any], report: problems.Report) -> tuple[str, ...]:
    cidrs = fields.list_at(spec, "podCIDRs", "spec.podCIDRs", report)
    if cidrs:
        return fields.cidrs_of_family(cidrs, "spec.podCIDRs", None, report)
    single = spec.get("podCIDR")
    if single is None or single == "":
        return ()
    net = fields.parse_cidr(single)
    if net is None:
        report.add("spec.podCIDR", f"invalid CIDR {problems.describe(single)}")
        return ()
    return (str(net),)


def _has_autoscaler_taint(spec: Mapping[str, Any], report: problems.Report) -> bool:
    for taint in fields.list_at(spec, "taints", "spec.taints", report):
        if isinstance(taint, Mapping) and taint.get("key") == _AUTOSCALER_TAINT:
            return True
    return False


def _service_cidrs(obj: Mapping[str, Any]) -> tuple[tuple[str, ...], list[Problem]]:
    if not isinstance(obj, Mapping):
        got = problems.describe(obj)
        problem = Problem("ServiceCIDR", problems.UNKNOWN, "", f"expected an object, got {got}")
        return (), [problem]
    report = problems.Report("ServiceCIDR", problems.object_label(obj))
    spec = fields.map_at(obj, "spec", "spec", report)
    cidrs = fields.list_at(spec, "cidrs", "spec.cidrs", report)
    return fields.cidrs_of_family(cidrs, "spec.cidrs", None, report), report.problems
