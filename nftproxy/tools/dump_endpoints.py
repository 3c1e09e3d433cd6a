"""`nftproxy dump`'s reading of a listed table: objects, and the endpoints a chooser reaches.

Layer: dump (pure over the JSON of `nft -j list table`; below tools/dump.py,
its only user). One job: the listing's chains and sets by name, and the
endpoints one chooser chain gives with their probabilities -- a numgen
cascade (ClientIP affinity), or a shared chooser's lookup by the
destination the packet was sent to: `dispatch-<proto>-<N>`'s `ip daddr .
tcp dport . numgen random mod N` (vip-endpoints elements keyed (VIP, port,
i)), `dispatch-nodeport-<proto>-<N>`'s `tcp dport . numgen random mod N`
(nodeport-endpoints elements keyed (node port, i)) -- each endpoint with
the KUBE-SEP-<h> its DNAT rule's or element's comment carries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nftproxy.core.address import format_address
from nftproxy.core.trace.identity import ENDPOINT, identity

__all__ = [
    "Dispatched",
    "EndpointView",
    "HostPort",
    "Listing",
    "cascade",
    "elem_parts",
    "is_index",
    "read_listing",
]


@dataclass
class HostPort:
    """Where a packet is addressed; address "" is a node port (any node-port address)."""

    address: str
    port: int

    def text(self) -> str:
        """'10.96.0.10:80', '[fd00:96::10]:80' or 'nodePort 30080'."""
        return format_address(self.address, self.port) if self.address else f"nodePort {self.port}"


@dataclass
class EndpointView(HostPort):
    """One endpoint of a KUBE-SVC/SVL chain, named by its KUBE-SEP-<h>
    (from the comment of the DNAT rule or of the endpoints map's element;
    "" when the comment has none)."""

    identity: str = ""
    probability: float = 0.0
    local_chain: bool = False
    packets: int | None = None


@dataclass
class Dispatched(HostPort):
    """A destination of a service port whose element goes to a shared
    chooser (address "": the node port): the chooser, the
    KUBE-SVC/SVL/EXT-<h> the `service-ips` / `service-nodeports` element
    names, and the endpoints the chooser gives it."""

    chooser: str = ""
    identity: str = ""
    endpoints: list[EndpointView] = field(default_factory=list)


_Target = tuple[str, int, str]
"""An endpoints-map element: address, port, KUBE-SEP-<h> (or "")."""

_Fixed = tuple[str | int, ...]
"""The fixed parts of an endpoints-map key: a VIP and port (a vip-endpoints
map), or a node port (nodeport-endpoints)."""


@dataclass
class Listing:
    chains: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)
    sets: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    keyed: dict[str, dict[_Fixed, dict[int, _Target]]] = field(default_factory=dict)
    """Endpoints maps read by key (`_keyed_elements`), on first use."""
    shared: dict[tuple[str, str], list[Dispatched]] = field(default_factory=dict)
    """(service port, protocol) -> its destinations that go to shared
    choosers, in the listing's order."""


def read_listing(doc: Mapping[str, Any]) -> Listing:
    parsed = Listing()
    for item in doc.get("nftables", ()):
        if "chain" in item:
            parsed.chains.setdefault(item["chain"]["name"], [])
        elif "rule" in item:
            parsed.chains.setdefault(item["rule"]["chain"], []).append(item["rule"])
        elif "map" in item or "set" in item:
            obj = item.get("map") or item["set"]
            parsed.sets[obj["name"]] = obj
    return parsed


def elem_parts(elem: Any) -> tuple[Any, str | None, Any]:
    """(key, comment, verdict) of one listed element."""
    verdict = None
    if isinstance(elem, list) and len(elem) == 2:
        elem, verdict = elem
    comment = None
    if isinstance(elem, dict) and "elem" in elem:
        comment = elem["elem"].get("comment")
        elem = elem["elem"]["val"]
    key = elem["concat"] if isinstance(elem, dict) and "concat" in elem else [elem]
    return key, comment, verdict


def cascade(
    rules: Sequence[Mapping[str, Any]], parsed: Listing, vip: HostPort | None = None
) -> list[EndpointView]:
    """Endpoints of a KUBE-SVC/SVL chain with the probability it gives each:
    every rule that DNATs (a cascade rule, or a shared chooser's lookup,
    for the destination `vip`: a VIP, or a node port), but the affinity
    rules (a lookup of the source in a set: they only repeat a past
    choice)."""
    out: list[EndpointView] = []
    remaining = 1.0
    for rule in rules:
        exprs = rule.get("expr", [])
        dnat = next((e["dnat"] for e in exprs if "dnat" in e), None)
        if not isinstance(dnat, Mapping) or any(_is_set_lookup(e) for e in exprs):
            continue
        if isinstance(dnat.get("addr"), Mapping):
            found, taken = _map_endpoints(dnat["addr"], parsed, remaining, vip)
            out, remaining = out + found, remaining - taken
            continue
        share = remaining / _numgen_mod(exprs)
        remaining -= share
        sep = identity(rule.get("comment"), ENDPOINT)
        out.append(
            EndpointView(
                str(dnat.get("addr", "?")),
                int(dnat.get("port", 0)),
                sep,
                round(share, 4),
                packets=_counter(rule),
            )
        )
    return out


def _map_endpoints(
    addr: Mapping[str, Any], parsed: Listing, share: float, vip: HostPort | None
) -> tuple[list[EndpointView], float]:
    """The endpoints a shared chooser's `dnat to ip daddr . tcp dport .
    numgen random mod N map @m` reaches for `vip` -- the elements of @m
    keyed (VIP, port, i < N), or (node port, i < N) for a `tcp dport .
    numgen random mod N` key, each with 1/N of `share` -- and the share
    they take (a missing element's falls through to the next rule)."""
    lookup = addr.get("map")
    key = _map_key(lookup.get("key") if isinstance(lookup, Mapping) else None, vip)
    data = lookup.get("data") if isinstance(lookup, Mapping) else None
    if key is None or not isinstance(data, str):
        return [], 0.0
    chain, first, n = key
    elements = _keyed_elements(parsed, data.removeprefix("@")).get(chain, {})
    found = [
        EndpointView(addr, port, sep, round(share / n, 4))
        for addr, port, sep in (elements[i] for i in sorted(elements) if first <= i < first + n)
    ]
    return found, share * len(found) / n


def _keyed_elements(parsed: Listing, name: str) -> dict[_Fixed, dict[int, _Target]]:
    """@name's `address . port` elements by their fixed parts (VIP, port;
    node port), then index (built once per map: a dump looks up every
    destination in it)."""
    if name not in parsed.keyed:
        index: dict[_Fixed, dict[int, _Target]] = {}
        for elem in parsed.sets.get(name, {}).get("elem", []):
            parts, comment, data = elem_parts(elem)
            target = _target_of(data, comment)
            if _is_fixed(parts[:-1]) and is_index(parts[-1], 2**32) and target:
                index.setdefault(tuple(parts[:-1]), {}).setdefault(parts[-1], target)
        parsed.keyed[name] = index
    return parsed.keyed[name]


def _map_key(node: Any, vip: HostPort | None) -> tuple[_Fixed, int, int] | None:
    """((VIP, port), O, N) of an `ip daddr . tcp dport . numgen random mod
    N [offset O]` key and ((node port,), O, N) of a `tcp dport . numgen
    random mod N [offset O]` key (the destination: `vip`), or None."""
    parts: Any = node.get("concat") if isinstance(node, Mapping) else None
    if not isinstance(parts, list) or len(parts) not in (2, 3):
        return None
    fixed: Any = tuple(_fixed_part(p, vip) for p in parts[:-1])
    last = parts[-1].get("numgen") if isinstance(parts[-1], Mapping) else None
    if not isinstance(last, Mapping) or not _is_fixed(fixed):
        return None
    first: Any = last.get("offset", 0)
    n: Any = last.get("mod")
    if not (is_index(first, 2**32) and is_index(n, 2**32)) or n == 0:
        return None
    return fixed, first, n


def _fixed_part(part: Any, vip: HostPort | None) -> Any:
    """A key part known without the packet's choice: the destination
    address or port (`vip`'s; a node port has no address)."""
    payload = part.get("payload") if isinstance(part, Mapping) else None
    field_name = payload.get("field") if isinstance(payload, Mapping) else None
    if vip is None:
        return None
    return {"daddr": vip.address or None, "dport": vip.port}.get(str(field_name))


def _is_fixed(parts: Sequence[Any]) -> bool:
    """An address and a port, or a port."""
    if len(parts) == 2:
        address, port = parts
        return isinstance(address, str) and address != "" and is_index(port, 65536)
    return len(parts) == 1 and is_index(parts[0], 65536)


def is_index(value: Any, below: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < below


def _target_of(data: Any, comment: str | None) -> _Target | None:
    """An endpoints-map element's (address, port, KUBE-SEP-<h>), or None."""
    pair = data.get("concat") if isinstance(data, Mapping) else None
    if not isinstance(pair, list) or len(pair) != 2 or not is_index(pair[1], 65536):
        return None
    return str(pair[0]), pair[1], identity(comment, ENDPOINT)


def _is_set_lookup(e: Mapping[str, Any]) -> bool:
    right = e["match"]["right"] if "match" in e else None
    return isinstance(right, str) and right.startswith("@")


def _numgen_mod(exprs: Iterable[Mapping[str, Any]]) -> int:
    for e in exprs:
        left = e["match"]["left"] if "match" in e else None
        if isinstance(left, Mapping) and "numgen" in left:
            return int(left["numgen"]["mod"])
    return 1


def _counter(rule: Mapping[str, Any]) -> int | None:
    for e in rule.get("expr", []):
        if "counter" in e and isinstance(e["counter"], dict):
            return int(e["counter"].get("packets", 0))
    return None
