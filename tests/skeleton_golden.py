"""The golden IPv4 skeleton (default config) of tests/test_rules_skeleton.py,
and the shared objects the service ports use on demand (a chooser, the map
it picks from, the eTP=Local chains and their choosers maps: rules/dispatch.py),
as literal libnftables JSON: written out, not built with
nftproxy.core.rules.expr, so a change of spelling shows up in the tests.

The skeleton is the fixed list of chains and sets below (SKELETON_CHAINS,
SKELETON_SETS: 21 and 15 a family); no chooser, no endpoints map, no
choosers map, no eTP=Local chain and no affinity set is part of it.
"""

from __future__ import annotations

from typing import Any

# --- literal JSON pieces ---------------------------------------------------------

NEW = {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": "new"}}
L4PROTO = {"meta": {"key": "l4proto"}}
TH_DPORT = {"payload": {"protocol": "th", "field": "dport"}}
MARK = {"meta": {"key": "mark"}}


def jump(target: str) -> dict[str, Any]:
    return {"jump": {"target": target}}


def goto(target: str) -> dict[str, Any]:
    return {"goto": {"target": target}}


def daddr(ip: str) -> dict[str, Any]:
    return {"payload": {"protocol": ip, "field": "daddr"}}


def saddr(ip: str) -> dict[str, Any]:
    return {"payload": {"protocol": ip, "field": "saddr"}}


def vmap(key: Any, name: str) -> dict[str, Any]:
    return {"vmap": {"key": key, "data": "@" + name}}


def addr_proto_port(ip: str) -> dict[str, Any]:
    return {"concat": [daddr(ip), L4PROTO, TH_DPORT]}


PROTO_PORT = {"concat": [L4PROTO, TH_DPORT]}
FIB_DADDR_LOCAL = {
    "match": {"op": "==", "left": {"fib": {"result": "type", "flags": ["daddr"]}}, "right": "local"}
}
NOT_LOOPBACK_V4 = {
    "match": {"op": "!=", "left": daddr("ip"), "right": {"prefix": {"addr": "127.0.0.0", "len": 8}}}
}
NOT_LOOPBACK_V6 = {"match": {"op": "!=", "left": daddr("ip6"), "right": "::1"}}


def in_set(ip: str, name: str) -> dict[str, Any]:
    return {"match": {"op": "==", "left": daddr(ip), "right": "@" + name}}


def mark_and(bit: int, value: int) -> dict[str, Any]:
    return {"match": {"op": "==", "left": {"&": [MARK, bit]}, "right": value}}


def mark_or(bit: int) -> dict[str, Any]:
    return {"mangle": {"key": MARK, "value": {"|": [MARK, bit]}}}


def hairpin_rule(ip: str, bit: int) -> tuple[list[Any], str]:
    """After DNAT, source == destination == an endpoint (an element of the
    one hairpin-endpoints set): mark for masquerade."""
    dnated = {"match": {"op": "in", "left": {"ct": {"key": "status"}}, "right": "dnat"}}
    pair = {"match": {"op": "==", "left": {"concat": [saddr(ip), daddr(ip)]},
                      "right": "@hairpin-endpoints"}}
    return [dnated, pair, mark_or(bit)], "hairpin: the client is the endpoint it was sent to"


PROTOCOLS = ("tcp", "udp", "sctp")


# --- the shared objects (rules/dispatch.py), made with their first user ---------


def _dnat_pick(ip: str, protocol: str, key: list[Any], map_name: str) -> list[Any]:
    lookup = {"map": {"key": {"concat": key}, "data": "@" + map_name}}
    return [{"match": {"op": "==", "left": L4PROTO, "right": protocol}},
            {"dnat": {"family": ip, "addr": lookup}}]


def shared_chooser(ip: str, protocol: str, n: int, local: str = "") -> tuple[list[Any], str]:
    """dispatch-<protocol>-<n>'s DNAT: ip daddr . P dport . numgen random
    mod n in the protocol's vip-endpoints map (no masquerade rule before
    it: the default config has no local-traffic detector); with `local`
    ("local-"), dispatch-local-<protocol>-<n>'s, in vip-local-endpoints."""
    key = [daddr(ip), {"payload": {"protocol": protocol, "field": "dport"}},
           {"numgen": {"mode": "random", "mod": n}}]
    which = "local endpoints" if local else "endpoints"
    return (_dnat_pick(ip, protocol, key, f"vip-{local}endpoints-{protocol}"),
            f"VIP -> {n} {which}")


def nodeport_chooser(ip: str, protocol: str, n: int, local: str = "") -> tuple[list[Any], str]:
    """dispatch-nodeport-<protocol>-<n>'s one rule, a DNAT by P dport .
    numgen random mod n in the protocol's nodeport-endpoints map (no
    masquerade rule: KUBE-NODEPORTS marks the node port); with `local`, of
    dispatch-nodeport-local-<protocol>-<n>, in nodeport-local-endpoints."""
    key = [{"payload": {"protocol": protocol, "field": "dport"}},
           {"numgen": {"mode": "random", "mod": n}}]
    which = "local endpoints" if local else "endpoints"
    return (_dnat_pick(ip, protocol, key, f"nodeport-{local}endpoints-{protocol}"),
            f"node port -> {n} {which}")


def external_local(key: Any, where: str) -> list[tuple[list[Any], str]]:
    """external-local / nodeport-local (eTP=Local external destinations;
    no pod rule: the default config has no local-traffic detector)."""
    local_src = {"match": {"op": "==", "left": {"fib": {"result": "type", "flags": ["saddr"]}},
                           "right": "local"}}
    return [
        ([local_src, jump("KUBE-MARK-MASQ")], "masquerade LOCAL traffic"),
        ([local_src, vmap(key, f"{where}-cluster-choosers")], "LOCAL traffic: Cluster policy"),
        ([vmap(key, f"{where}-local-choosers")], "other traffic: local endpoints"),
    ]


def endpoints_map_text(kind: str, protocol: str, local: str = "") -> str:
    """How a chooser's map is declared: vip-[local-]endpoints-<p> keyed
    VIP . port . index, nodeport-[local-]endpoints-<p> node port . index."""
    which = "local endpoint" if local else "endpoint"
    key, what = ((f"ip daddr . {protocol} dport", "VIP . port") if kind == "vip"
                 else (f"{protocol} dport", "node port"))
    return (f"add map ip nftproxy {kind}-{local}endpoints-{protocol} {{ typeof "
            f"{key} . numgen random mod 1 : ip daddr . {protocol} dport; "
            f'comment "{protocol} {what} . index -> {which}"; }}')


# --- the golden IPv4 skeleton (default config) --------------------------------

BASE_CHAINS = {
    "filter-prerouting-pre-dnat": ("filter", "prerouting", -110),
    "filter-output-pre-dnat": ("filter", "output", -110),
    "nat-prerouting": ("nat", "prerouting", -100),
    "nat-output": ("nat", "output", -100),
    "filter-input": ("filter", "input", 0),
    "filter-forward": ("filter", "forward", 0),
    "filter-output": ("filter", "output", 0),
    "nat-postrouting": ("nat", "postrouting", 100),
    "affinity:nat-prerouting": ("nat", "prerouting", -99),
    "affinity:nat-output": ("nat", "output", -99),
}

KUBE_CHAINS = {
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-FIREWALL-CHECK",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-CLUSTER-IPS-CHECK",
    "KUBE-REJECT",
    "KUBE-MARK-MASQ",
    "KUBE-POSTROUTING",
    "KUBE-FORWARD",
}

AFFINITY_CHAINS = {"affinity:KUBE-SERVICES", "affinity:KUBE-MARK-MASQ"}
"""The affinity table's regular chains (nftproxy-affinity: KUBE-SERVICES,
KUBE-MARK-MASQ); the planner names its objects "affinity:<name>"."""

Rules = list[tuple[list[Any], str | None]]

GOLDEN_V4: dict[str, Rules] = {
    "filter-prerouting-pre-dnat": [([NEW, jump("KUBE-FIREWALL-CHECK")], None)],
    "filter-output-pre-dnat": [([NEW, jump("KUBE-FIREWALL-CHECK")], None)],
    "nat-prerouting": [([jump("KUBE-SERVICES")], None)],
    "nat-output": [([jump("KUBE-SERVICES")], None)],
    "filter-input": [([NEW, jump("KUBE-EXTERNAL-SERVICES")], None)],
    "filter-forward": [
        ([NEW, jump("KUBE-EXTERNAL-SERVICES")], None),
        ([NEW, jump("KUBE-CLUSTER-IPS-CHECK")], None),
        ([jump("KUBE-FORWARD")], None),
    ],
    "filter-output": [
        ([NEW, jump("KUBE-EXTERNAL-SERVICES")], None),
        ([NEW, jump("KUBE-CLUSTER-IPS-CHECK")], None),
    ],
    "nat-postrouting": [([jump("KUBE-POSTROUTING")], None)],
    "KUBE-SERVICES": [
        ([{"match": {"op": "==", "left": addr_proto_port("ip"), "right": "@masquerade-vips"}},
          jump("KUBE-MARK-MASQ")], "external destinations of services with shared choosers"),
        ([vmap(addr_proto_port("ip"), "service-ips")],
         "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        ([FIB_DADDR_LOCAL, NOT_LOOPBACK_V4, goto("KUBE-NODEPORTS")],
         "NodePort traffic (must be last)"),
    ],
    "KUBE-NODEPORTS": [
        ([{"match": {"op": "==", "left": PROTO_PORT, "right": "@masquerade-nodeports"}},
          jump("KUBE-MARK-MASQ")], "node ports of services with shared choosers"),
        ([vmap(PROTO_PORT, "service-nodeports")], None),
    ],
    "KUBE-FIREWALL-CHECK": [
        ([{"match": {"op": "==", "left": addr_proto_port("ip"), "right": "@firewall-vips"}},
          {"match": {"op": "!=",
                     "left": {"concat": [daddr("ip"), L4PROTO, TH_DPORT, saddr("ip")]},
                     "right": "@firewall-allow"}},
          {"drop": None}], "loadBalancerSourceRanges"),
    ],
    "KUBE-EXTERNAL-SERVICES": [
        ([vmap(addr_proto_port("ip"), "no-endpoint-services")],
         "services with no (local) endpoints"),
        ([FIB_DADDR_LOCAL, NOT_LOOPBACK_V4, vmap(PROTO_PORT, "no-endpoint-nodeports")],
         "node ports with no (local) endpoints"),
    ],
    "KUBE-CLUSTER-IPS-CHECK": [
        ([in_set("ip", "cluster-ips"), goto("KUBE-REJECT")],
         "Reject traffic to invalid ports of ClusterIPs"),
        ([in_set("ip", "service-cidrs"), {"drop": None}],
         "Drop traffic to unallocated ClusterIPs"),
    ],
    "KUBE-REJECT": [
        ([{"match": {"op": "==", "left": L4PROTO, "right": "tcp"}},
          {"reject": {"type": "tcp reset"}}], None),
        ([{"reject": {"type": "icmp", "expr": "port-unreachable"}}], None),
    ],
    "KUBE-MARK-MASQ": [([mark_or(16384)], None)],
    "KUBE-POSTROUTING": [
        hairpin_rule("ip", 16384),
        ([mark_and(16384, 0), {"return": None}], None),
        ([{"mangle": {"key": MARK, "value": {"^": [MARK, 16384]}}}], None),
        ([{"masquerade": {"flags": ["fully-random"]}}], None),
    ],
    "KUBE-FORWARD": [
        ([{"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": "invalid"}},
          {"drop": None}], "drop conntrack INVALID packets"),
        ([mark_and(16384, 16384), {"accept": None}], "forward marked for masquerade"),
        ([{"match": {"op": "in", "left": {"ct": {"key": "state"}},
                     "right": ["established", "related"]}},
          {"accept": None}], "forward established connections"),
    ],
    # the affinity table (nftproxy-affinity): its rules name its own objects
    "affinity:nat-prerouting": [([jump("KUBE-SERVICES")], None)],
    "affinity:nat-output": [([jump("KUBE-SERVICES")], None)],
    "affinity:KUBE-SERVICES": [
        ([vmap(addr_proto_port("ip"), "service-ips")],
         "ClusterIP, ExternalIP and LoadBalancer IP traffic (ClientIP affinity)"),
        ([FIB_DADDR_LOCAL, NOT_LOOPBACK_V4, vmap(PROTO_PORT, "service-nodeports")],
         "NodePort traffic (ClientIP affinity)"),
    ],
    "affinity:KUBE-MARK-MASQ": [([mark_or(16384)], None)],
}


def _set(
    kind: str,
    name: str,
    key: str,
    comment: str,
    table: str = "nftproxy",
    *,
    map: str = "",
    flags: tuple[str, ...] = (),
) -> str:
    """A declaration as nft's syntax writes it (by typeof, in both printers)."""
    body = [f"typeof {key}" + (f" : {map}" if map else "")]
    body += [f"flags {', '.join(flags)}"] if flags else []
    body.append(f'comment "{comment}"')
    return f"add {kind} ip {table} {name} {{ {'; '.join(body)}; }}"


THREE = "ip daddr . meta l4proto . th dport"
TWO = "meta l4proto . th dport"
GOLDEN_SETS_V4 = [
    _set("map", "service-ips", THREE, "ClusterIP, ExternalIP and LoadBalancer IP traffic",
         map="verdict"),
    _set("map", "service-nodeports", TWO, "NodePort traffic", map="verdict"),
    _set("map", "no-endpoint-services", THREE, "drop or reject services with no endpoints",
         map="verdict"),
    _set("map", "no-endpoint-nodeports", TWO, "drop or reject node ports with no endpoints",
         map="verdict"),
    _set("set", "masquerade-vips", THREE, "external IPs and LB IPs of shared choosers: masquerade"),
    _set("set", "masquerade-nodeports", TWO, "node ports of shared choosers: masquerade"),
    _set("set", "firewall-vips", THREE, "LoadBalancer IPs with loadBalancerSourceRanges"),
    _set("set", "firewall-allow", f"{THREE} . ip saddr", "LoadBalancer IP . allowed source range",
         flags=("interval",)),
    _set("set", "hairpin-endpoints", "ip saddr . ip daddr",
         "endpoint . endpoint: hairpin connections"),
    _set("set", "cluster-ips", "ip daddr", "Active ClusterIPs"),
    _set("set", "nodeport-ips", "ip daddr", "IPs that accept NodePort traffic"),
    _set("set", "service-cidrs", "ip daddr", "service CIDRs (ServiceCIDR objects)",
         flags=("interval",)),
    _set("map", "service-ips", THREE, "ClusterIP, ExternalIP and LoadBalancer IP traffic",
         "nftproxy-affinity", map="verdict"),
    _set("map", "service-nodeports", TWO, "NodePort traffic", "nftproxy-affinity",
         map="verdict"),
    _set("set", "nodeport-ips", "ip daddr", "IPs that accept NodePort traffic",
         "nftproxy-affinity"),
]

SKELETON_CHAINS = [
    "filter-prerouting-pre-dnat", "filter-output-pre-dnat", "nat-prerouting", "nat-output",
    "filter-input", "filter-forward", "filter-output", "nat-postrouting",
    "KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-FIREWALL-CHECK", "KUBE-EXTERNAL-SERVICES",
    "KUBE-CLUSTER-IPS-CHECK", "KUBE-REJECT", "KUBE-MARK-MASQ", "KUBE-POSTROUTING", "KUBE-FORWARD",
    "affinity:nat-prerouting", "affinity:nat-output", "affinity:KUBE-SERVICES",
    "affinity:KUBE-MARK-MASQ",
]
"""Every chain of a family's skeleton, in order, whatever the cluster: 21."""

SKELETON_SETS = [
    "service-ips", "service-nodeports", "no-endpoint-services", "no-endpoint-nodeports",
    "masquerade-vips", "masquerade-nodeports", "firewall-vips", "firewall-allow",
    "hairpin-endpoints", "cluster-ips", "nodeport-ips", "service-cidrs",
    "affinity:service-ips", "affinity:service-nodeports", "affinity:nodeport-ips",
]
"""Every set and map of a family's skeleton, in order: 15."""

GOLDEN_CHOOSERS_MAPS_V4 = [
    _set("map", f"{where}-{which}-choosers", key,
         f"eTP=Local {text}: its chooser of {which} endpoints", map="verdict")
    for where, key, text in (("external", THREE, "external IP / LB IP"),
                             ("nodeport", TWO, "node port"))
    for which in ("cluster", "local")
]
"""The four choosers maps of the eTP=Local chains (external-local's two,
then nodeport-local's)."""

AFFINITY_SET_TEXT_V4 = (
    "add set ip nftproxy-affinity affinity { typeof ip "
    "saddr . numgen random mod 1 . numgen random mod 1; flags dynamic, timeout; size "
    '1048576; comment "ClientIP affinity: client . KUBE-SEP key, expiring"; }'
)
"""The affinity table's shared affinity set (the ClientIP affinity ports'
shared object)."""
