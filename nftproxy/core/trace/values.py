"""Typed packet values and the patterns they are compared with.

Layer: core/trace (pure). One job: read nft JSON literals -- addresses,
prefixes, ranges, ports, protocol names, interface names with nft's `*`
wildcard, ct state/status flags, fib types, concatenations -- as typed
patterns for the `Kind` of the expression they are compared with, match a
packet value against them, and print both back as nft does. Set and map
declarations are never consulted (their `type` / `typeof` spelling may
change): the kind always comes from the expression doing the lookup.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "Address",
    "Concat",
    "Exact",
    "Flags",
    "Kind",
    "Pattern",
    "PatternError",
    "Prefix",
    "Range",
    "Unsupported",
    "Value",
    "Wildcard",
    "matches",
    "parse_pattern",
    "pattern_text",
    "protocol_name",
    "protocol_number",
    "value_text",
]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Value = Address | int | str | frozenset[str] | tuple[Any, ...]


class Kind(Enum):
    ADDR = "address"
    PORT = "port"
    PROTO = "protocol"
    MARK = "mark"
    IFNAME = "interface name"
    CT_STATE = "ct state"
    CT_STATUS = "ct status"
    FIB_TYPE = "fib type"
    INT = "integer"


_PROTOCOLS = {"icmp": 1, "tcp": 6, "udp": 17, "icmpv6": 58, "sctp": 132}
_CT_STATES = frozenset({"new", "established", "related", "invalid", "untracked"})
_CT_STATUS = frozenset({"expected", "seen-reply", "assured", "confirmed", "snat", "dnat", "dying"})
_FIB_TYPES = frozenset(
    {"unspec", "unicast", "local", "broadcast", "anycast", "multicast", "blackhole",
     "unreachable", "prohibit"}
)


def protocol_number(name: str) -> int:
    """'tcp' -> 6 (ValueError for an unknown name)."""
    if name not in _PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}")
    return _PROTOCOLS[name]


def protocol_name(number: int) -> str:
    return next((n for n, v in _PROTOCOLS.items() if v == number), str(number))


# --- patterns ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exact:
    value: Value
    kind: Kind | None = None
    """Only for printing (a protocol number prints as its name)."""


@dataclass(frozen=True, slots=True)
class Prefix:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Range:
    low: Address | int
    high: Address | int


@dataclass(frozen=True, slots=True)
class Wildcard:
    """`iifname "veth*"`: names starting with `prefix`."""

    prefix: str


@dataclass(frozen=True, slots=True)
class Flags:
    """`ct state { established, related }`: a set of flag names."""

    names: frozenset[str]


@dataclass(frozen=True, slots=True)
class Concat:
    parts: tuple[Pattern, ...]


Pattern = Exact | Prefix | Range | Wildcard | Flags | Concat


class Unsupported(ValueError):
    """A JSON shape the tracer does not interpret (the message names it)."""


class PatternError(Unsupported):
    """A literal that does not fit the kind it is compared with."""


def parse_pattern(node: Any, kinds: tuple[Kind, ...]) -> Pattern:
    """One literal, prefix, range or concatenation, read for `kinds` (the
    kinds of the expression it is compared with, one per concat part)."""
    if isinstance(node, Mapping) and set(node) == {"elem"}:
        node = node["elem"].get("val")
    if isinstance(node, Mapping) and set(node) == {"concat"}:
        parts = node["concat"]
        if len(parts) != len(kinds):
            raise PatternError(f"{len(parts)}-part element for a {len(kinds)}-part key: {node!r}")
        return Concat(tuple(_single(p, k) for p, k in zip(parts, kinds, strict=True)))
    if len(kinds) != 1:
        raise PatternError(f"element {node!r} for a {len(kinds)}-part key")
    return _single(node, kinds[0])


def _single(node: Any, kind: Kind) -> Pattern:
    if isinstance(node, Mapping) and set(node) == {"prefix"} and kind is Kind.ADDR:
        body = node["prefix"]
        return Prefix(ipaddress.ip_network(f"{body['addr']}/{body['len']}", strict=False))
    if isinstance(node, Mapping) and set(node) == {"range"}:
        low, high = node["range"]
        lo, hi = _scalar(low, kind), _scalar(high, kind)
        if not isinstance(lo, (int, ipaddress.IPv4Address, ipaddress.IPv6Address)) or not (
            isinstance(hi, type(lo))
        ):
            raise PatternError(f"range {node!r} of a {kind.value}")
        return Range(lo, hi)
    if kind in (Kind.CT_STATE, Kind.CT_STATUS):
        return Flags(_flags(node, kind))
    if kind is Kind.IFNAME and isinstance(node, str) and node.endswith("*"):
        if not node.endswith("\\*"):
            return Wildcard(node[:-1])
        node = node[:-2] + "*"
    return Exact(_scalar(node, kind), kind)


def _flags(node: Any, kind: Kind) -> frozenset[str]:
    names = [node] if isinstance(node, str) else node
    known = _CT_STATES if kind is Kind.CT_STATE else _CT_STATUS
    if not isinstance(names, Sequence) or not all(n in known for n in names):
        raise PatternError(f"{kind.value} {node!r}")
    return frozenset(names)


def _scalar(node: Any, kind: Kind) -> Value:
    try:
        if kind is Kind.ADDR and isinstance(node, str):
            return ipaddress.ip_address(node)
        if kind is Kind.PROTO and isinstance(node, str) and not node.isdigit():
            return protocol_number(node)
        if kind in (Kind.PORT, Kind.PROTO, Kind.MARK, Kind.INT):
            return _integer(node)
        if kind is Kind.IFNAME and isinstance(node, str):
            return node
        if kind is Kind.FIB_TYPE and node in _FIB_TYPES:
            return str(node)
    except ValueError:
        pass
    raise PatternError(f"{node!r} is not a {kind.value}")


def _integer(node: Any) -> int:
    if isinstance(node, int) and not isinstance(node, bool):
        return node
    if isinstance(node, str):
        return int(node, 0)
    raise ValueError(node)


# --- matching ------------------------------------------------------------------------


def matches(pattern: Pattern, value: Value) -> bool:
    """Whether `value` (a tuple for concatenations) is in `pattern`."""
    if isinstance(pattern, Concat):
        return isinstance(value, tuple) and all(
            matches(p, v) for p, v in zip(pattern.parts, value, strict=True)
        )
    if isinstance(pattern, Exact):
        return _same(pattern.value, value)
    if isinstance(pattern, Prefix):
        return isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address)) and (
            value.version == pattern.network.version and value in pattern.network
        )
    if isinstance(pattern, Range):
        return _same_type(pattern.low, value) and pattern.low <= value <= pattern.high  # type: ignore[operator]
    if isinstance(pattern, Wildcard):
        return isinstance(value, str) and value.startswith(pattern.prefix)
    return isinstance(value, frozenset) and bool(pattern.names & value)


def _same(a: Value, b: Value) -> bool:
    return _same_type(a, b) and a == b


def _same_type(a: Any, b: Any) -> bool:
    if isinstance(a, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return type(a) is type(b)
    return isinstance(b, type(a)) and not isinstance(b, bool)


# --- text ----------------------------------------------------------------------------


def value_text(value: Value, kind: Kind | tuple[Kind, ...] | None = None) -> str:
    """A value as nft prints it; `kind` (one per part of a concatenation)
    names protocols and prints marks in hex."""
    if isinstance(value, tuple):
        kinds = kind if isinstance(kind, tuple) else (None,) * len(value)
        return " . ".join(value_text(v, k) for v, k in zip(value, kinds, strict=True))
    if isinstance(kind, tuple):
        kind = kind[0] if len(kind) == 1 else None
    if isinstance(value, frozenset):
        return ",".join(sorted(value))
    if kind is Kind.PROTO and isinstance(value, int):
        return protocol_name(value)
    if kind is Kind.MARK and isinstance(value, int):
        return hex(value)
    if kind is Kind.IFNAME:
        return f'"{value}"'
    return str(value)


def pattern_text(pattern: Pattern) -> str:
    if isinstance(pattern, Concat):
        return " . ".join(pattern_text(p) for p in pattern.parts)
    if isinstance(pattern, Exact):
        return value_text(pattern.value, pattern.kind)
    if isinstance(pattern, Prefix):
        return str(pattern.network)
    if isinstance(pattern, Range):
        return f"{pattern.low}-{pattern.high}"
    if isinstance(pattern, Wildcard):
        return f'"{pattern.prefix}*"'
    return ",".join(sorted(pattern.names))
