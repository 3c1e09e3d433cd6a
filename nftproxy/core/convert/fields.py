"""Typed, never-raising access to the fields of Kubernetes JSON.

Layer: convert (imports model only). One job: read one field of a JSON dict
as the type it must have (object, list, string, boolean, integer in a range,
port number, protocol, IP address, CIDR); a field of the wrong type or value
becomes a problem in the object's `Report`, and the caller gets a default.

Parsing follows kube-proxy's: IPs and CIDRs are read "sloppily" as Go's
netutils.ParseIPSloppy does (IPv4 octets with leading zeros are decimal,
"010.001.002.003" is 10.1.2.3; an IPv4-mapped IPv6 address is IPv4), then
normalised to their canonical text. Blank externalIPs and source ranges are
skipped silently, as kube-proxy does.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from nftproxy.core.convert.problems import Report, describe
from nftproxy.core.model import IPFamily, L4Protocol

__all__: list[str] = []

_PROTOCOLS = {p.value: p for p in L4Protocol}

_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def map_at(parent: Mapping[str, Any], key: str, path: str, report: Report) -> Mapping[str, Any]:
    """parent[key] as a Mapping; {} when unset, {} plus a problem when not an object."""
    value = parent.get(key)
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return value
    report.add(path, f"expected an object, got {describe(value)}")
    return {}


def list_at(parent: Mapping[str, Any], key: str, path: str, report: Report) -> list[Any]:
    """parent[key] as a list; [] when unset, [] plus a problem when not a list."""
    value = parent.get(key)
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    report.add(path, f"expected a list, got {describe(value)}")
    return []


def str_at(parent: Mapping[str, Any], key: str, path: str, report: Report) -> str | None:
    """parent[key] as a string; "" when unset, None plus a problem when not a string."""
    value = parent.get(key)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    report.add(path, f"expected a string, got {describe(value)}")
    return None


def bool_at(
    parent: Mapping[str, Any], key: str, path: str, report: Report, *, default: bool
) -> bool:
    value = parent.get(key)
    if isinstance(value, bool):
        return value
    if value is not None:
        report.add(path, f"expected a boolean, got {describe(value)}; using {default}")
    return default


def int_in_range(value: object, path: str, report: Report, *, low: int, high: int) -> int | None:
    """value if it is an integer in low..high, else None plus a problem."""
    if not isinstance(value, int) or isinstance(value, bool):
        report.add(path, f"expected an integer, got {describe(value)}")
        return None
    if not low <= value <= high:
        report.add(path, f"{describe(value)} is out of range {low}..{high}")
        return None
    return value


def port_number(
    entry: Mapping[str, Any], path: str, report: Report, *, missing: str
) -> int | None:
    """entry["port"] if it is a valid port number, else None plus a problem."""
    value = entry.get("port")
    if value is None:
        report.add(f"{path}.port", missing)
        return None
    return int_in_range(value, f"{path}.port", report, low=1, high=65535)


def protocol(entry: Mapping[str, Any], path: str, report: Report) -> L4Protocol | None:
    value = entry.get("protocol")
    if value is None:
        return L4Protocol.TCP
    if isinstance(value, str) and value in _PROTOCOLS:
        return _PROTOCOLS[value]
    report.add(path, f"unknown protocol {describe(value)}")
    return None


# --- addresses ----------------------------------------------------------------


def _unpad_ipv4(text: str) -> str:
    """Drop leading zeros from dotted-quad octets ("203.0.113.000" -> "203.0.113.0"),
    which Go's ParseIPSloppy reads as decimal and Python's ipaddress rejects."""
    octets = text.split(".")
    if len(octets) != 4 or not all(o.isascii() and o.isdigit() for o in octets):
        return text
    return ".".join(o.lstrip("0") or "0" for o in octets)


def _plain_ipv4(text: str) -> ipaddress.IPv4Address | None:
    """A dotted quad of 1-3 digit octets, without ipaddress's parser, which
    is slow on the initial list's hot path; None for anything else."""
    octets = text.split(".")
    if len(octets) != 4:
        return None
    value = 0
    for o in octets:
        if not (0 < len(o) <= 3 and o.isascii() and o.isdigit()):
            return None
        n = int(o)  # leading zeros read as decimal, as _unpad_ipv4 does
        if n > 255:
            return None
        value = value << 8 | n
    return ipaddress.IPv4Address(value)


def parse_ip(value: object) -> _IPAddress | None:
    """An IP address as kube-proxy parses it, or None. No zones, no padding."""
    if not isinstance(value, str) or "%" in value:
        return None
    if (plain := _plain_ipv4(value)) is not None:
        return plain
    try:
        addr = ipaddress.ip_address(_unpad_ipv4(value))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped  # Go treats ::ffff:a.b.c.d as IPv4
    return addr


def parse_cidr(value: object) -> _IPNetwork | None:
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


def address_family(addr: _IPAddress | _IPNetwork) -> IPFamily:
    return IPFamily.IPV4 if addr.version == 4 else IPFamily.IPV6


def ips_of_family(values: list[Any], path: str, family: IPFamily, report: Report) -> list[str]:
    """Valid IPs of `family`, normalised, de-duplicated, in order. Other-family
    IPs are dropped silently, blank strings skipped, the rest reported."""
    kept: dict[str, None] = {}
    for i, value in enumerate(values):
        if isinstance(value, str) and not value.strip():
            continue
        addr = parse_ip(value)
        if addr is None:
            report.add(f"{path}[{i}]", f"invalid IP address {describe(value)}")
        elif address_family(addr) is family:
            kept[str(addr)] = None
    return list(kept)


def cidrs_of_family(
    values: list[Any], path: str, family: IPFamily | None, report: Report
) -> tuple[str, ...]:
    """Valid CIDRs (of `family`, or of any family if None), trimmed,
    normalised, de-duplicated, in order; blank strings skipped."""
    kept: dict[str, None] = {}
    for i, value in enumerate(values):
        text = value.strip() if isinstance(value, str) else value
        if text == "":
            continue
        net = parse_cidr(text)
        if net is None:
            report.add(f"{path}[{i}]", f"invalid CIDR {describe(value)}")
        elif family is None or address_family(net) is family:
            kept[str(net)] = None
    return tuple(kept)
