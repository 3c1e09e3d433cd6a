"""The oracle of the agent fuzzer: which invalid fields an object carries,
as the agent must report them, and which objects the agent sees at all.

Layer: tests (pure; a helper of fuzz_cluster.py, fuzz_agent.py and
test_fuzz_agent.py). One job: `faults(kind, obj)` lists the fields the
fuzzer made invalid as (field path, bad value), or None when the agent
never sees the object (kube-proxy's label selector, `visible`).

It is not convert: it only recognises the bad values below, which
fuzz_cluster.py plants, where kube-proxy's rules say they are read (source
ranges and ingress only of LoadBalancers, nodePort only of NodePort and
LoadBalancer Services, an endpoint's other fields only when its address is
good, nothing of a slice without the service-name label or with an unknown
addressType but that). Each bad value reads differently in a Problem's
message, so a changed bad value is a new Problem, an unchanged one is not
(the node label's message names no value: any bad one is the same).
test_fuzz_agent.py checks this module against convert on random objects.
"""

from __future__ import annotations

import json
from typing import Any

from fakeapi import label_selector

from nftproxy.cluster.kube import LABEL_SELECTOR

__all__ = ["BAD", "BAD_CIDRS", "BAD_IPS", "NODE", "NS", "SERVICE_LABEL", "TYPES", "ZONE_LABEL",
           "Fault", "faults", "visible"]

Obj = dict[str, Any]
Fault = tuple[str, str]
"""(field path, the bad value as JSON)."""

NS = "fz"
NODE = "node-a"
ZONE_LABEL = "topology.kubernetes.io/zone"
SERVICE_LABEL = "kubernetes.io/service-name"
TYPES = ("ClusterIP", "NodePort", "LoadBalancer")

BAD_IPS = ("10.96.300.1", "not-an-ip", "fd00::g1", "1.2.3")
BAD_CIDRS = ("10.0.0.0/33", "192.168.1.1", "fd00::/129", "banana/8")
BAD = {
    "port": (70000, 0, "80", -1),
    "nodePort": (70000, "30001", -1),
    "protocol": ("ICMP", "tcp", 6),
    "name": (42, 7),
    "type": ("Weird", "nodeport"),
    "policy": ("Sometimes", "local", 1),
    "timeout": (0, 86401, "60"),
    "bool": ("yes", "true"),  # not 1: the informer compares objects with ==, and 1 == True
    "addressType": ("IPvX", "ipv4"),
    "zone": (5, False),
    "hints": ("zone-a", 3),
    "hint": ({"nombre": "zone-a"}, "zone-a"),
}

_visible = label_selector(LABEL_SELECTOR)


def _is(value: object, bads: tuple[object, ...]) -> bool:
    """`value` is one of `bads` (as JSON: 1 and True differ)."""
    return json.dumps(value) in {json.dumps(b) for b in bads}


def _j(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def visible(kind: str, obj: Obj) -> bool:
    """Whether the agent's watches see `obj` (the node's field selector aside)."""
    return kind == "Node" or _visible(obj)


def faults(kind: str, obj: Obj) -> frozenset[Fault] | None:
    """The invalid fields the agent must report for `obj`; None if unseen."""
    if not visible(kind, obj):
        return None
    scan = {"Service": _service_faults, "EndpointSlice": _slice_faults, "Node": _node_faults}
    return frozenset(scan[kind](obj))


def _service_faults(svc: Obj) -> list[Fault]:
    spec = svc["spec"]
    out: list[Fault] = []
    kind = spec.get("type")
    if _is(kind, BAD["type"]):
        out.append(("spec.type", _j(kind)))
    kind = kind if kind in TYPES else "ClusterIP"
    out += [(f"spec.clusterIPs[{k}]", _j(ip)) for k, ip in enumerate(spec["clusterIPs"])
            if ip in BAD_IPS]
    for key in ("externalTrafficPolicy", "internalTrafficPolicy"):
        if _is(spec.get(key), BAD["policy"]):
            out.append((f"spec.{key}", _j(spec[key])))
    if spec.get("sessionAffinity") == "ClientIP":
        timeout = spec["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"]
        if _is(timeout, BAD["timeout"]):
            path = "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
            out.append((path, _j(timeout)))
    out += [(f"spec.externalIPs[{k}]", _j(ip))
            for k, ip in enumerate(spec.get("externalIPs", [])) if ip in BAD_IPS]
    if kind == "LoadBalancer":
        ingress = svc.get("status", {}).get("loadBalancer", {}).get("ingress", [])
        out += [(f"status.loadBalancer.ingress[{k}].ip", _j(e["ip"]))
                for k, e in enumerate(ingress) if e["ip"] in BAD_IPS]
        out += [(f"spec.loadBalancerSourceRanges[{k}]", _j(r))
                for k, r in enumerate(spec.get("loadBalancerSourceRanges", []))
                if r in BAD_CIDRS]
        hc = spec.get("healthCheckNodePort")
        if spec.get("externalTrafficPolicy") == "Local" and _is(hc, BAD["nodePort"]):
            out.append(("spec.healthCheckNodePort", _j(hc)))
    fields = ("name", "protocol", "port") + (("nodePort",) if kind != "ClusterIP" else ())
    for k, port in enumerate(spec["ports"]):
        out += [(f"spec.ports[{k}].{f}", _j(port[f])) for f in fields
                if f in port and _is(port[f], BAD[f])]
    return out


def _slice_faults(eps: Obj) -> list[Fault]:
    if SERVICE_LABEL not in eps["metadata"].get("labels", {}):
        return []  # not a Service's slice: ignored, nothing to report
    family = eps["addressType"]
    if family not in ("IPv4", "IPv6"):
        return [("addressType", _j(family))] if family != "FQDN" else []
    out: list[Fault] = []
    for k, port in enumerate(eps["ports"]):
        out += [(f"ports[{k}].{f}", _j(port[f])) for f in ("name", "protocol", "port")
                if _is(port[f], BAD[f])]
    for j, ep in enumerate(eps["endpoints"]):
        path, ip = f"endpoints[{j}]", ep["addresses"][0]
        if ip in BAD_IPS or (":" in ip) != (family == "IPv6"):
            out.append((f"{path}.addresses[0]", _j(ip)))
            continue  # the endpoint is skipped: nothing else of it is read
        if _is(ep["conditions"]["ready"], BAD["bool"]):
            out.append((f"{path}.conditions.ready", _j(ep["conditions"]["ready"])))
        if _is(ep.get("zone"), BAD["zone"]):
            out.append((f"{path}.zone", _j(ep["zone"])))
        hints = ep.get("hints")
        if _is(hints, BAD["hints"]):
            out.append((f"{path}.hints", _j(hints)))
        elif isinstance(hints, dict):
            out += [(f"{path}.hints.forZones[{m}]", _j(h))
                    for m, h in enumerate(hints["forZones"]) if _is(h, BAD["hint"])]
    return out


def _node_faults(node: Obj) -> list[Fault]:
    out = [(f"status.addresses[{k}].address", _j(a["address"]))
           for k, a in enumerate(node["status"]["addresses"]) if a["address"] in BAD_IPS]
    zone = node["metadata"]["labels"].get(ZONE_LABEL)
    if _is(zone, BAD["zone"]):  # its message does not name the value: any bad one is the same
        out.append((f"metadata.labels['{ZONE_LABEL}']", "not a string"))
    out += [(f"spec.podCIDRs[{k}]", _j(c))
            for k, c in enumerate(node["spec"]["podCIDRs"]) if c in BAD_CIDRS]
    return out


