"""A small cluster that changes at random, validly and not: the generator of
the agent fuzzer.

Layer: tests (pure; a helper of fuzz_agent.py and test_fuzz_agent.py).
One job: `World.initial()` and then `World.step()`, one random change of
Services, EndpointSlices or this Node as a `Write` (an object to apply, or
a delete); fuzz_faults.py says which fields each object has made invalid.

Valid changes: ports added and removed, endpoints added, removed, moved
between nodes, ready/serving/terminating flipped, zone hints, type
ClusterIP <-> NodePort <-> LoadBalancer, dual-stack on and off, traffic
policies, affinity, external and load-balancer IPs (a few, shared by all
services, as the API allows), source ranges, trafficDistribution, the
headless and service-proxy-name labels, a slice's service-name label and
addressType (FQDN too), node zone and addresses, deletes and re-creates,
and "touches" (an unrelated label) that change no field the proxy reads.
Invalid ones plant fuzz_faults' bad values: ports and node ports out of
range or strings, unknown protocols, non-string names, bad IPs (cluster,
external, ingress, endpoint, node) and endpoint IPs of the other family,
bad CIDRs in loadBalancerSourceRanges and podCIDRs, unknown type, policies
and address types, affinity timeouts out of range, non-boolean conditions,
bad hints, non-string zones and zone labels; another change may fix them.
What the API server itself guarantees stays true (unique cluster IPs, node
ports and port names per Service): the proxy is not asked to survive what
cannot happen.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuzz_faults import BAD, BAD_CIDRS, BAD_IPS, NODE, NS, SERVICE_LABEL, TYPES, ZONE_LABEL

__all__ = ["World", "Write"]

Obj = dict[str, Any]
ZONES = ("zone-a", "zone-b")
PROTOCOLS = ("TCP", "UDP", "TCP", "SCTP")
"""The usual protocol of port p<k>, in Services and slices alike (so they match)."""


@dataclass(frozen=True)
class Write:
    """One change of the API: `obj` applied, or (obj None) kind/name deleted."""

    kind: str
    name: str
    obj: Obj | None
    what: str


# --- the objects ------------------------------------------------------------------------


def _v4(i: int) -> str:
    return f"10.96.1.{i + 1}"


def _v6(i: int) -> str:
    return f"fd00:96::1:{i + 1:x}"


def _service(i: int, hc_port: int) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"s{i}", "namespace": NS, "labels": {"app": f"s{i}"}},
        "spec": {"type": "ClusterIP", "clusterIP": _v4(i), "clusterIPs": [_v4(i)],
                 "ipFamilies": ["IPv4"], "ports": [], "healthCheckNodePort": hc_port},
        "status": {"loadBalancer": {}},
    }


def _endpoint(family: str, rng: random.Random) -> Obj:
    n, h = rng.randrange(2), rng.randrange(2, 8)
    ip = f"10.244.{n}.{h}" if family == "IPv4" else f"fd00:244:{n}::{h}"
    ready = rng.random() < 0.7
    ep: Obj = {
        "addresses": [ip],
        "conditions": {"ready": ready, "serving": ready or rng.random() < 0.5,
                       "terminating": not ready and rng.random() < 0.7},
        "nodeName": NODE if n == 0 else "node-b",
        "zone": ZONES[n],
    }
    return ep


def _slice(i: int, suffix: str, family: str) -> Obj:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"s{i}-{suffix}", "namespace": NS,
                     "labels": {SERVICE_LABEL: f"s{i}"}},
        "addressType": family, "ports": [], "endpoints": [],
    }


def _node() -> Obj:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE,
                                              ZONE_LABEL: "zone-a"}},
        "spec": {"podCIDRs": ["10.244.0.0/24", "fd00:244::/64"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.50.1"},
                                 {"type": "InternalIP", "address": "fd00:50::1"}]},
    }


SLICES = (("a", "IPv4"), ("b", "IPv6"), ("c", "IPv4"))


# --- the changes ------------------------------------------------------------------------


class World:
    """The cluster as the fuzzer wrote it. `initial()` once, then `step()`s."""

    def __init__(self, rng: random.Random, hc_ports: list[int]) -> None:
        self.rng = rng
        self.hc_ports = hc_ports
        self.live: dict[tuple[str, str], Obj] = {}
        self.dead: dict[tuple[str, str], Obj] = {}
        self._touches = 0

    def initial(self) -> list[Write]:
        """The node, and per service two ports and three slices (two endpoints each)."""
        objs = [_node()]
        for i, hc in enumerate(self.hc_ports):
            objs.append(_service(i, hc))
            objs[-1]["spec"]["ports"] = [_port(i, k, PROTOCOLS[k]) for k in range(2)]
            _cluster_ips(objs[-1], i % 2 == 1, [])
            for suffix, family in SLICES:
                objs.append(_slice(i, suffix, family))
                objs[-1]["ports"] = [{"name": f"p{k}", "port": 8080 + k,
                                      "protocol": PROTOCOLS[k]} for k in range(2)]
                eps = {e["addresses"][0]: e for e in (_endpoint(family, self.rng)
                                                      for _ in range(2))}
                objs[-1]["endpoints"] = list(eps.values())
        return [self._put(o["kind"], o, "initial") for o in objs]

    def step(self) -> Write:
        """One random change (applied to the world), as the Write the API needs."""
        while True:
            kind = self.rng.choices(("Service", "EndpointSlice", "Node"), (5, 6, 1))[0]
            if self.rng.random() < 0.03:
                write = self._delete_or_recreate(kind)
                if write is not None:
                    return write
                continue
            keys = sorted(k for k in self.live if k[0] == kind)
            if not keys:
                continue
            key = self.rng.choice(keys)
            obj = copy.deepcopy(self.live[key])
            change = self.rng.choice(_CHANGES[kind])
            what = change(self, obj)
            if what is not None:
                return self._put(kind, obj, f"{key[1]}: {what}")

    def _put(self, kind: str, obj: Obj, what: str) -> Write:
        name = _key(obj)
        self.live[(kind, name)] = obj
        return Write(kind, name, copy.deepcopy(obj), what)

    def _delete_or_recreate(self, kind: str) -> Write | None:
        dead = sorted(k for k in self.dead if k[0] == kind)
        if dead and self.rng.random() < 0.4 + 0.2 * len(dead):
            key = self.rng.choice(dead)
            return self._put(kind, self.dead.pop(key), f"{key[1]}: re-created")
        keys = sorted(k for k in self.live if k[0] == kind)
        if not keys:
            return None
        key = self.rng.choice(keys)
        self.dead[key] = self.live.pop(key)
        return Write(kind, key[1], None, f"{key[1]}: deleted")

    def touch(self, obj: Obj) -> str:
        self._touches += 1
        obj["metadata"].setdefault("labels", {})["fuzz-touch"] = str(self._touches)
        return "touched"


def _key(obj: Obj) -> str:
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta["name"])


Change = Callable[[World, Obj], "str | None"]


def _index(obj: Obj) -> int:
    return int(obj["metadata"]["name"][1:].split("-")[0])


def _port(i: int, k: int, protocol: str) -> Obj:
    return {"name": f"p{k}", "port": 80 + k, "protocol": protocol, "targetPort": 8080 + k,
            "nodePort": 30000 + 10 * i + k}


def _free(ports: list[Obj]) -> int | None:
    names = {p["name"] for p in ports}
    return next((k for k in range(4) if f"p{k}" not in names), None)


def _protocol(w: World, k: int) -> str:
    return PROTOCOLS[k] if w.rng.random() < 0.85 else w.rng.choice(PROTOCOLS)


def _subset(w: World, items: list[Any]) -> list[Any]:
    return [x for x in items if w.rng.random() < 0.5]


# Services -----------------------------------------------------------------------------


def _svc_port(w: World, svc: Obj) -> str | None:
    ports = svc["spec"]["ports"]
    k = _free(ports)
    if ports and (k is None or w.rng.random() < 0.4):
        gone = ports.pop(w.rng.randrange(len(ports)))
        return f"port {gone['name']} removed"
    if k is None:
        return None
    ports.append(_port(_index(svc), k, _protocol(w, k)))
    return f"port p{k} added"


def _svc_type(w: World, svc: Obj) -> str:
    svc["spec"]["type"] = w.rng.choice(TYPES)
    return f"type {svc['spec']['type']}"


def _cluster_ips(svc: Obj, dual: bool, tail: list[str]) -> None:
    i = _index(svc)
    svc["spec"]["clusterIPs"] = [_v4(i), *([_v6(i)] if dual else []), *tail]
    svc["spec"]["ipFamilies"] = ["IPv4", "IPv6"] if dual else ["IPv4"]


def _svc_dual(w: World, svc: Obj) -> str:
    ips = svc["spec"]["clusterIPs"]
    dual = _v6(_index(svc)) not in ips
    _cluster_ips(svc, dual, [ip for ip in ips if ip in BAD_IPS])
    return "dual-stack" if dual else "single-stack"


def _svc_policy(w: World, svc: Obj) -> str:
    key = w.rng.choice(("externalTrafficPolicy", "internalTrafficPolicy"))
    svc["spec"][key] = w.rng.choice(("Cluster", "Local", None))
    return f"{key} {svc['spec'][key]}"


def _affinity(svc: Obj, timeout: object) -> None:
    spec = svc["spec"]
    if timeout is None:
        spec.pop("sessionAffinity", None)
        spec.pop("sessionAffinityConfig", None)
    else:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": timeout}}


def _svc_affinity(w: World, svc: Obj) -> str:
    timeout = w.rng.choice((None, 10, 10800))
    _affinity(svc, timeout)
    return f"affinity {timeout}"


def _svc_addresses(w: World, svc: Obj) -> str:
    spec = svc["spec"]  # a few addresses for all: services may share them (the API allows)
    spec["externalIPs"] = _subset(w, ["192.168.99.1", "192.168.99.2", "fd00:99::1"])
    ingress = _subset(w, ["1.2.3.4", "1.2.3.5", "fd00:123::4"])
    svc["status"]["loadBalancer"] = {"ingress": [{"ip": ip} for ip in ingress]}
    spec["loadBalancerSourceRanges"] = _subset(w, ["192.168.50.0/24", "10.0.0.0/8",
                                                   "fd00:50::/64"])
    return "external IPs, ingress and source ranges"


def _svc_labels(w: World, svc: Obj) -> str:
    labels = svc["metadata"]["labels"]
    for key in ("service.kubernetes.io/headless", "service.kubernetes.io/service-proxy-name"):
        labels.pop(key, None)
    hidden = w.rng.choice((None,) * 6 + ("service.kubernetes.io/headless",
                                         "service.kubernetes.io/service-proxy-name"))
    if hidden is not None:
        labels[hidden] = "other"
    svc["spec"]["trafficDistribution"] = w.rng.choice(("PreferClose", None))
    return f"label {hidden}, trafficDistribution {svc['spec']['trafficDistribution']}"


def _svc_bad_port(w: World, svc: Obj) -> str | None:
    ports = svc["spec"]["ports"]
    if not ports:
        return None
    k = w.rng.randrange(len(ports))
    if w.rng.random() < 0.4:
        free = _free(ports[:k] + ports[k + 1:])
        if free is None:
            return None
        ports[k] = _port(_index(svc), free, PROTOCOLS[free])
        return f"spec.ports[{k}] made valid"
    field = w.rng.choice(("name", "protocol", "port", "nodePort"))
    ports[k][field] = w.rng.choice(BAD[field])
    return f"spec.ports[{k}].{field} = {ports[k][field]!r}"


def _svc_bad_field(w: World, svc: Obj) -> str:
    spec, bad = svc["spec"], w.rng.random() < 0.6
    what = w.rng.choice(("type", "clusterIPs", "policy", "timeout", "externalIPs", "ingress",
                         "sourceRanges", "healthCheckNodePort"))
    if what == "type":
        spec["type"] = w.rng.choice(BAD["type"] if bad else TYPES)
    elif what == "clusterIPs":
        _cluster_ips(svc, _v6(_index(svc)) in spec["clusterIPs"],
                     [w.rng.choice(BAD_IPS)] if bad else [])
    elif what == "policy":
        key = w.rng.choice(("externalTrafficPolicy", "internalTrafficPolicy"))
        spec[key] = w.rng.choice(BAD["policy"]) if bad else "Cluster"
    elif what == "timeout":
        _affinity(svc, w.rng.choice(BAD["timeout"]) if bad else None)
    elif what == "healthCheckNodePort":
        spec[what] = w.rng.choice(BAD["nodePort"]) if bad else w.hc_ports[_index(svc)]
    else:
        where = (svc["status"]["loadBalancer"].setdefault("ingress", []) if what == "ingress"
                 else spec.setdefault(what if what == "externalIPs"
                                      else "loadBalancerSourceRanges", []))
        valid = [x for x in where if x not in BAD_CIDRS and x not in BAD_IPS
                 and not (isinstance(x, dict) and x["ip"] in BAD_IPS)]
        where[:] = valid
        if bad:
            value = w.rng.choice(BAD_CIDRS if what == "sourceRanges" else BAD_IPS)
            where.append({"ip": value} if what == "ingress" else value)
    return f"{what} {'made invalid' if bad else 'made valid'}"


# EndpointSlices -----------------------------------------------------------------------


def _slice_port(w: World, eps: Obj) -> str | None:
    ports = eps["ports"]
    if ports and w.rng.random() < 0.4:
        gone = ports.pop(w.rng.randrange(len(ports)))
        return f"port {gone['name']} removed"
    k = _free(ports)
    if k is None:
        return None
    ports.append({"name": f"p{k}", "port": 8080 + k, "protocol": _protocol(w, k)})
    return f"port p{k} added"


def _slice_endpoint(w: World, eps: Obj) -> str | None:
    endpoints = eps["endpoints"]
    roll = w.rng.random()
    if not endpoints or (roll < 0.3 and len(endpoints) < 5):
        ep = _endpoint(eps["addressType"] if eps["addressType"] == "IPv6" else "IPv4", w.rng)
        if ep["addresses"] in [e["addresses"] for e in endpoints]:
            return None
        endpoints.append(ep)
        return f"endpoint {ep['addresses'][0]} added"
    j = w.rng.randrange(len(endpoints))
    ep = endpoints[j]
    if roll < 0.45:
        endpoints.pop(j)
        return f"endpoint {ep['addresses'][0]} removed"
    if roll < 0.7:
        ep["conditions"] = _endpoint("IPv4", w.rng)["conditions"]
        return f"endpoints[{j}] conditions {ep['conditions']}"
    if roll < 0.8:
        local = ep["nodeName"] != NODE
        ep["nodeName"], ep["zone"] = (NODE, "zone-a") if local else ("node-b", "zone-b")
        return f"endpoints[{j}] moved to {ep['nodeName']}"
    ep.pop("hints", None)
    if w.rng.random() < 0.7:
        ep["hints"] = {"forZones": [{"name": z} for z in _subset(w, list(ZONES)) or ["zone-a"]]}
    return f"endpoints[{j}] hints {ep.get('hints')}"


def _slice_labels(w: World, eps: Obj) -> str:
    labels = eps["metadata"]["labels"]
    if SERVICE_LABEL in labels and w.rng.random() < 0.5:
        del labels[SERVICE_LABEL]
        return "service-name label removed"
    labels[SERVICE_LABEL] = f"s{_index(eps)}"
    family = dict(SLICES)[eps["metadata"]["name"].rsplit("-", 1)[1]]
    eps["addressType"] = "FQDN" if w.rng.random() < 0.1 else family
    return f"service-name label set, addressType {eps['addressType']}"


def _slice_bad_port(w: World, eps: Obj) -> str | None:
    ports = eps["ports"]
    if not ports:
        return None
    k = w.rng.randrange(len(ports))
    field = w.rng.choice(("name", "protocol", "port"))
    ports[k][field] = w.rng.choice(BAD[field])
    return f"ports[{k}].{field} = {ports[k][field]!r}"


def _slice_bad_endpoint(w: World, eps: Obj) -> str | None:
    if not eps["endpoints"]:
        return None
    j = w.rng.randrange(len(eps["endpoints"]))
    ep = eps["endpoints"][j]
    what = w.rng.choice(("address", "family", "ready", "zone", "hints", "hint", "heal"))
    if what == "heal":
        eps["endpoints"][j] = _endpoint(eps["addressType"] if eps["addressType"] == "IPv6"
                                        else "IPv4", w.rng)
    elif what in ("address", "family"):
        other = "fd00:244::9" if ":" not in ep["addresses"][0] else "10.244.0.9"
        ep["addresses"] = [w.rng.choice(BAD_IPS) if what == "address" else other]
    elif what == "ready":
        ep["conditions"]["ready"] = w.rng.choice(BAD["bool"])
    elif what == "zone":
        ep["zone"] = w.rng.choice(BAD["zone"])
    elif what == "hints":
        ep["hints"] = w.rng.choice(BAD["hints"])
    else:
        ep["hints"] = {"forZones": [{"name": "zone-a"}, w.rng.choice(BAD["hint"])]}
    return f"endpoints[{j}] {what}"


def _slice_bad_type(w: World, eps: Obj) -> str:
    eps["addressType"] = w.rng.choice(BAD["addressType"])
    return f"addressType {eps['addressType']!r}"


# the Node -------------------------------------------------------------------------------


def _node_zone(w: World, node: Obj) -> str:
    labels = node["metadata"]["labels"]
    zone = w.rng.choice((*ZONES, None, *(BAD["zone"] if w.rng.random() < 0.3 else ())))
    labels.pop(ZONE_LABEL, None)
    if zone is not None:
        labels[ZONE_LABEL] = zone
    return f"zone {zone!r}"


def _node_addresses(w: World, node: Obj) -> str:
    extra = _subset(w, ["192.168.51.1", "fd00:51::1"])
    if w.rng.random() < 0.3:
        extra.append(w.rng.choice(BAD_IPS))
    node["status"]["addresses"] = [*_node()["status"]["addresses"],
                                   *({"type": "InternalIP", "address": a} for a in extra)]
    cidrs = _node()["spec"]["podCIDRs"]
    node["spec"]["podCIDRs"] = cidrs + ([w.rng.choice(BAD_CIDRS)] if w.rng.random() < 0.3
                                        else [])
    return f"addresses {extra}, podCIDRs {node['spec']['podCIDRs']}"


_CHANGES: dict[str, list[Change]] = {  # valid changes, then invalid ones
    "Service": [_svc_port, _svc_port, _svc_type, _svc_dual, _svc_policy, _svc_affinity,
                _svc_addresses, _svc_labels, World.touch,
                _svc_bad_port, _svc_bad_field, _svc_bad_field],
    "EndpointSlice": [_slice_port, _slice_endpoint, _slice_endpoint, _slice_endpoint,
                      _slice_labels, World.touch,
                      _slice_bad_port, _slice_bad_endpoint, _slice_bad_endpoint, _slice_bad_type],
    "Node": [_node_zone, _node_addresses, World.touch],  # both may plant bad values
}
