"""libnftables JSON expression and statement builders.

Layer: rules (pure). One job: spell nft JSON (schema of libnftables 1.0.6,
the shapes verified in docs/nft-python-notes.md §2) so the renderers read as
the rules they build. Every function returns a fresh JSON value.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.rules.fragment import Json

__all__ = [
    "accept",
    "addr_match",
    "affinity_lookup",
    "affinity_update",
    "concat_daddr_proto_dport",
    "concat_proto_dport",
    "ct_state",
    "dnat",
    "dnat_by_destination",
    "dnat_by_port",
    "drop",
    "fib_local",
    "goto",
    "iifname",
    "jump",
    "l4proto",
    "mark_clear",
    "mark_is_clear",
    "mark_is_set",
    "mark_set",
    "masquerade",
    "match",
    "numgen_zero",
    "payload",
    "port_match",
    "prefix",
    "reject_icmp",
    "reject_tcp_reset",
    "ret",
    "set_lookup",
    "vmap",
]


def _ip(family: IPFamily) -> str:
    return family.nft_family


def _payload(protocol: str, field: str) -> Json:
    return {"payload": {"protocol": protocol, "field": field}}


def _match(left: Any, right: Any, op: str = "==") -> Json:
    return {"match": {"op": op, "left": left, "right": right}}


def payload(family: IPFamily, field: str) -> Json:
    """`ip saddr` / `ip6 daddr` as an expression (a key part)."""
    return _payload(_ip(family), field)


def match(left: Any, right: Any, op: str = "==") -> Json:
    """`left op right`, e.g. a concatenation against "@set"."""
    return _match(left, right, op)


def prefix(cidr: str) -> Any:
    """A CIDR as nft JSON: a single address for host prefixes, else a prefix."""
    net = ipaddress.ip_network(cidr, strict=False)
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return {"prefix": {"addr": str(net.network_address), "len": net.prefixlen}}


def _addrs(values: Sequence[str]) -> Any:
    items = [prefix(v) for v in values]
    return items[0] if len(items) == 1 else {"set": items}


def addr_match(
    family: IPFamily, field: str, values: Sequence[str], *, negate: bool = False
) -> Json:
    """`ip saddr 10.0.0.0/8`, `ip6 daddr != { a, b }`."""
    return _match(_payload(_ip(family), field), _addrs(values), "!=" if negate else "==")


def set_lookup(family: IPFamily, field: str, set_name: str, *, negate: bool = False) -> Json:
    """`ip saddr @name` / `ip saddr != @name`."""
    return _match(_payload(_ip(family), field), "@" + set_name, "!=" if negate else "==")


def l4proto(protocol: L4Protocol) -> Json:
    return _match({"meta": {"key": "l4proto"}}, protocol.nft)


def port_match(protocol: L4Protocol, port: int) -> Json:
    """`tcp dport 80` (implies the protocol match)."""
    return _match(_payload(protocol.nft, "dport"), port)


def iifname(name: str, *, negate: bool = False) -> Json:
    """`iifname "cbr0"`; a trailing * is nft's interface-name wildcard."""
    return _match({"meta": {"key": "iifname"}}, name, "!=" if negate else "==")


def fib_local(field: str) -> Json:
    """`fib saddr type local` / `fib daddr type local`."""
    return _match({"fib": {"result": "type", "flags": [field]}}, "local")


def ct_state(*states: str) -> Json:
    """`ct state new` or `ct state established,related` (a flag match, not a set lookup)."""
    return _match({"ct": {"key": "state"}}, list(states) if len(states) > 1 else states[0], "in")


def mark_set(bit: int) -> Json:
    """`meta mark set meta mark | bit`."""
    mark = {"meta": {"key": "mark"}}
    return {"mangle": {"key": mark, "value": {"|": [mark, bit]}}}


def mark_clear(bit: int) -> Json:
    """`meta mark set meta mark ^ bit` (run only when the bit is set)."""
    mark = {"meta": {"key": "mark"}}
    return {"mangle": {"key": mark, "value": {"^": [mark, bit]}}}


def mark_is_clear(bit: int) -> Json:
    return _match({"&": [{"meta": {"key": "mark"}}, bit]}, 0)


def mark_is_set(bit: int) -> Json:
    return _match({"&": [{"meta": {"key": "mark"}}, bit]}, bit)


def concat_daddr_proto_dport(family: IPFamily) -> Json:
    return {
        "concat": [
            _payload(_ip(family), "daddr"),
            {"meta": {"key": "l4proto"}},
            _payload("th", "dport"),
        ]
    }


def concat_proto_dport() -> Json:
    return {"concat": [{"meta": {"key": "l4proto"}}, _payload("th", "dport")]}


def vmap(key: Json, map_name: str) -> Json:
    return {"vmap": {"key": key, "data": "@" + map_name}}


def numgen_zero(modulus: int) -> Json:
    """`numgen random mod N == 0`: true with probability 1/N."""
    return _match({"numgen": {"mode": "random", "mod": modulus}}, 0)


def _constant(value: int) -> Json:
    """`numgen random mod 1 offset V`, the constant V (nft takes no literal
    in a concatenated key)."""
    return {"numgen": {"mode": "random", "mod": 1, "offset": value}}


def _client_key(family: IPFamily, fixed: tuple[int, int]) -> Json:
    return {"concat": [_payload(_ip(family), "saddr"), *(_constant(f) for f in fixed)]}


def affinity_lookup(family: IPFamily, fixed: tuple[int, int], set_name: str) -> Json:
    """`ip saddr . F1 . F2 @set`: the client was sent to the endpoint whose
    key is (F1, F2) within its timeout."""
    return _match(_client_key(family, fixed), "@" + set_name)


def affinity_update(family: IPFamily, fixed: tuple[int, int], set_name: str, timeout: int) -> Json:
    """`update @set { ip saddr . F1 . F2 timeout T }`: remember (or refresh)
    that the client goes to the endpoint keyed (F1, F2), for T seconds."""
    elem = {"elem": {"val": _client_key(family, fixed), "timeout": timeout}}
    return {"set": {"op": "update", "set": "@" + set_name, "elem": elem}}


def dnat(ip: str, port: int) -> Json:
    return {"dnat": {"addr": ip, "port": port}}


def _dnat_pick(family: IPFamily, fixed: list[Json], count: int, map_name: str) -> Json:
    """`dnat ip to FIXED . numgen random mod N map @m`: the key is (*FIXED, i),
    i uniform over 0..N-1."""
    parts = [*fixed, {"numgen": {"mode": "random", "mod": count}}]
    lookup = {"map": {"key": {"concat": parts}, "data": "@" + map_name}}
    return {"dnat": {"family": _ip(family), "addr": lookup}}


def dnat_by_destination(family: IPFamily, protocol: L4Protocol, count: int, map_name: str) -> Json:
    """`dnat ip to ip daddr . P dport . numgen random mod N map @m`: the key
    is (destination, port, i)."""
    destination = [payload(family, "daddr"), _payload(protocol.nft, "dport")]
    return _dnat_pick(family, destination, count, map_name)


def dnat_by_port(family: IPFamily, protocol: L4Protocol, count: int, map_name: str) -> Json:
    """`dnat ip to P dport . numgen random mod N map @m`: the key is (port, i)."""
    return _dnat_pick(family, [_payload(protocol.nft, "dport")], count, map_name)


def masquerade() -> Json:
    return {"masquerade": {"flags": ["fully-random"]}}


def reject_tcp_reset() -> Json:
    return {"reject": {"type": "tcp reset"}}


def reject_icmp(family: IPFamily) -> Json:
    kind = "icmp" if family is IPFamily.IPV4 else "icmpv6"
    return {"reject": {"type": kind, "expr": "port-unreachable"}}


def jump(target: str) -> Json:
    return {"jump": {"target": target}}


def goto(target: str) -> Json:
    return {"goto": {"target": target}}


def drop() -> Json:
    return {"drop": None}


def accept() -> Json:
    return {"accept": None}


def ret() -> Json:
    return {"return": None}
