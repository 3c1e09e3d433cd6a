"""The desired ruleset as values: chains, rules, sets, map elements.

Layer: rules (pure). One job: the vocabulary the renderers produce and the
planner diffs. A `Fragment` is everything one owner (one service port, or the
skeleton) contributes to one family's table. Rule expressions are kept as
libnftables JSON statement dicts (the shapes in docs/nft-python-notes.md §2);
map keys and verdicts are small hashable tuples so the planner can diff and
index them cheaply, and are turned into JSON only when a command is emitted.

Set and map keys are declared by what they match (`SELECTORS`, nft's
`typeof` vocabulary: "ip daddr", "meta l4proto", "th dport"), from which
their datatypes follow. Both spellings are needed: libnftables 1.1.x
declares by `typeof` (its `type` declarations crash nft 1.0.6's listing),
1.0.6's JSON only by `type` (docs/userspaces.md; core/nft/ops.py picks).
"""

from __future__ import annotations

import hashlib
import json
import marshal
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nftproxy.core.model import IPFamily

__all__ = [
    "AFFINITY_TABLE",
    "COMPRESS_FROM",
    "NAME",
    "NUMGEN_KEY",
    "SELECTORS",
    "BadValue",
    "BaseHook",
    "Chain",
    "CompactChain",
    "CompactFragment",
    "Element",
    "Fragment",
    "Json",
    "Key",
    "Rule",
    "SetDecl",
    "Shared",
    "Target",
    "Verdict",
    "affinity_table_name",
    "check_key",
    "compact",
    "compact_chain",
    "datatypes",
    "in_affinity_table",
    "kernel_name",
    "pack_elements",
    "unpack_elements",
]

Json = Mapping[str, Any]
Key = tuple[str | int, ...]
"""A map/set key: ("10.96.0.10", "tcp", 80), ("tcp", 30080) or ("10.96.0.10",)."""

AFFINITY_TABLE = "affinity:"
"""The prefix of the planner's name of an object in the affinity table
(`affinity_table_name`): "affinity:KUBE-SVC-<h>" is chain KUBE-SVC-<h> of
`<table>-affinity`. The ports with ClientIP affinity keep their chains
there, so a commit that adds a goto element to the main table does not make
the kernel re-validate them (it validates the table that changed).
Rules and elements name objects of their own
table without the prefix."""


def in_affinity_table(name: str) -> bool:
    return name.startswith(AFFINITY_TABLE)


def affinity_table_name(name: str) -> str:
    """The planner's name of object `name` of the affinity table."""
    return AFFINITY_TABLE + name


def kernel_name(name: str) -> str:
    """The object's name in its own table."""
    return name.removeprefix(AFFINITY_TABLE)


_KEY_TEXT = re.compile(r"(?:[0-9A-Fa-f.:]+(?:/[0-9]{1,3})?|tcp|udp|sctp)\Z")
"""A key part's text: an address, a CIDR or a protocol (nothing a printer quotes)."""
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*\Z")
"""A table, chain or set name nft's syntax can say: it quotes none."""
_JUMPS = ("goto", "jump")
_VERDICTS = ("accept", "drop", "return")


class BadValue(ValueError):
    """A key, verdict or target no printer may write."""


def check_key(key: Key) -> Key:
    """`key` if every part is an address, CIDR, protocol or 32-bit number."""
    for part in key:
        if type(part) is int:
            if not 0 <= part <= 0xFFFFFFFF:
                raise BadValue(f"key part {part!r} of {key!r}")
        elif type(part) is not str or not _KEY_TEXT.match(part):
            raise BadValue(f"key part {part!r} of {key!r}")
    return key


@dataclass(frozen=True, slots=True)
class Verdict:
    """A map element's value: ("goto", chain) or ("drop", "")."""

    kind: str
    target: str = ""

    def __post_init__(self) -> None:
        if self.kind in _JUMPS:
            if not NAME.match(self.target):
                raise BadValue(f"verdict {self.kind} {self.target!r}")
        elif self.kind not in _VERDICTS or self.target:
            raise BadValue(f"verdict {self.kind!r} {self.target!r}")

    def to_json(self) -> Json:
        if self.target:
            return {self.kind: {"target": self.target}}
        return {self.kind: None}

    def __str__(self) -> str:
        return f"{self.kind} {self.target}".strip()


@dataclass(frozen=True, slots=True)
class Target:
    """An endpoints map element's value: the address . port a DNAT goes to."""

    ip: str
    port: int

    def __post_init__(self) -> None:
        if type(self.port) is not int or not 0 < self.port <= 0xFFFF:
            raise BadValue(f"target port {self.port!r}")
        check_key((self.ip,))
        if "/" in self.ip:
            raise BadValue(f"target address {self.ip!r}")

    def to_json(self) -> Json:
        return {"concat": [self.ip, self.port]}

    def __str__(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


@dataclass(frozen=True, slots=True)
class BaseHook:
    """How a base chain hooks into netfilter (priorities are integers: 1.0.6
    JSON silently creates a plain chain for a string priority)."""

    type: str
    hook: str
    prio: int
    policy: str = "accept"


@dataclass(frozen=True, slots=True)
class Rule:
    expr: tuple[Json, ...]
    comment: str | None = None


@dataclass(frozen=True, slots=True)
class Chain:
    name: str
    rules: tuple[Rule, ...] = ()
    hook: BaseHook | None = None


NUMGEN_KEY = "numgen random mod 1"
"""A 32-bit integer key part, as the endpoints maps declare theirs (nft has
no datatype for it: libnftables 1.0.6 declares it only in text, ops.py)."""

SELECTORS: Mapping[str, tuple[Json, str]] = {
    "ip saddr": ({"payload": {"protocol": "ip", "field": "saddr"}}, "ipv4_addr"),
    "ip daddr": ({"payload": {"protocol": "ip", "field": "daddr"}}, "ipv4_addr"),
    "ip6 saddr": ({"payload": {"protocol": "ip6", "field": "saddr"}}, "ipv6_addr"),
    "ip6 daddr": ({"payload": {"protocol": "ip6", "field": "daddr"}}, "ipv6_addr"),
    "meta l4proto": ({"meta": {"key": "l4proto"}}, "inet_proto"),
    "th dport": ({"payload": {"protocol": "th", "field": "dport"}}, "inet_service"),
    "tcp dport": ({"payload": {"protocol": "tcp", "field": "dport"}}, "inet_service"),
    "udp dport": ({"payload": {"protocol": "udp", "field": "dport"}}, "inet_service"),
    "sctp dport": ({"payload": {"protocol": "sctp", "field": "dport"}}, "inet_service"),
    NUMGEN_KEY: ({"numgen": {"mode": "random", "mod": 1, "offset": 0}}, "integer"),
}
"""A key part as nft's typeof names it -> (its libnftables JSON expression,
its datatype)."""


def datatypes(key: tuple[str, ...]) -> tuple[str, ...]:
    """The datatypes of a key given by selectors ("ip daddr" -> "ipv4_addr")."""
    return tuple(SELECTORS[part][1] for part in key)


@dataclass(frozen=True, slots=True)
class SetDecl:
    """A named set or verdict map.

    `type` is the key type (a tuple for concatenations); `key` the same key
    as the selectors it is matched by (`SELECTORS`; `SetDecl.keyed` fills
    both), which declarations use where libnftables can say `typeof`; `map`
    the value type for maps ("verdict"); `elements` the static content:
    addresses, or CIDRs in interval sets. `dynamic` sets (affinity) are
    filled by the datapath: the planner adds them idempotently and never
    flushes them. Elements of the shared dispatch maps are not here: they
    are `Element`s owned by fragments.
    """

    name: str
    type: tuple[str, ...]
    map: str | None = None
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    elements: tuple[str, ...] = ()
    dynamic: bool = False
    size: int | None = None
    """The most elements it holds (None: nft's default)."""
    comment: str | None = None
    key: tuple[str, ...] = ()
    data: tuple[str, ...] = ()
    """A data map's value as selectors (the endpoints maps': "ip daddr",
    "tcp dport"); `map` is then its datatypes as listed ("ipv4_addr . inet_service")."""

    @classmethod
    def keyed(cls, name: str, key: tuple[str, ...], **fields: Any) -> SetDecl:
        """A declaration whose key is given by selectors (its type follows)."""
        return cls(name, datatypes(key), key=key, **fields)

    @classmethod
    def data_map(
        cls, name: str, key: tuple[str, ...], data: tuple[str, ...], **fields: Any
    ) -> SetDecl:
        """A map of key and data given by selectors (their types follow)."""
        value = " . ".join(datatypes(data))
        return cls(name, datatypes(key), map=value, key=key, data=data, **fields)

    def declaration(self) -> tuple[Any, ...]:
        """What cannot change in place: a different declaration means delete + add."""
        return (self.type, self.map, self.flags, self.timeout, self.size)


@dataclass(frozen=True, slots=True)
class Element:
    """One element of a shared set or map (`set_name`), owned by a fragment.

    `value`: a verdict map's verdict, an endpoints map's DNAT target, None
    for plain sets.
    """

    set_name: str
    key: Key
    value: Verdict | Target | None = None
    comment: str | None = None

    def __post_init__(self) -> None:
        check_key(self.key)


@dataclass(frozen=True, slots=True)
class Fragment:
    """What one owner contributes to one family's table; `shared`: the
    objects it uses with other owners."""

    family: IPFamily
    chains: tuple[Chain, ...] = ()
    sets: tuple[SetDecl, ...] = ()
    elements: tuple[Element, ...] = ()
    shared: tuple[Shared, ...] = ()

    def chain_names(self) -> frozenset[str]:
        return frozenset(c.name for c in self.chains)


@dataclass(frozen=True, slots=True)
class CompactChain:
    """A chain as the committed state keeps it: a digest of its rules, not
    the rules.

    Rules as Python dicts are the bulk of a large table's memory. The
    planner only needs to tell whether a
    newly rendered chain differs (renderers are deterministic: equal rules,
    equal digest), which sets its rules reference (a chain is rewritten when
    a set it uses is re-declared), and its size; a changed chain is always
    rewritten whole from the fresh render, never from this record.
    """

    name: str
    hook: BaseHook | None
    digest: bytes
    size: int
    refs: tuple[str, ...] = ()
    """The named sets and maps its rules reference ("@name"), sorted."""


@dataclass(frozen=True, slots=True)
class CompactFragment:
    """A Fragment whose chains are CompactChains (see there), its sets as
    rendered, and its elements packed (`pack_elements`): the planner reads
    them back (`elements`) only for an owner that changes, or to hand a
    contested key to its next claimant. Records compare by value, so by
    the packed bytes: equal renders pack equal (the renderers are
    deterministic); were two equal renders ever to share objects
    differently (marshal's back-references follow object identity), they
    would read as a change whose diff is empty -- no command, never a
    wrong one."""

    family: IPFamily
    chains: tuple[CompactChain, ...] = ()
    sets: tuple[SetDecl, ...] = ()
    packed: bytes = b""
    shared: tuple[Shared, ...] = ()

    @property
    def elements(self) -> tuple[Element, ...]:
        return unpack_elements(self.packed)

    def chain_names(self) -> frozenset[str]:
        return frozenset(c.name for c in self.chains)


@dataclass(frozen=True, slots=True)
class Shared:
    """Chains and maps that several owners use (a chooser and the map it
    picks from): the planner adds them with their first user and deletes
    them with their last. Compared by their records and declarations."""

    chains: tuple[Chain, ...] = field(compare=False)
    records: tuple[CompactChain, ...]
    sets: tuple[SetDecl, ...]

    @classmethod
    def of(cls, chains: tuple[Chain, ...], sets: tuple[SetDecl, ...]) -> Shared:
        return cls(chains, tuple(compact_chain(c) for c in chains), sets)


_VERDICT, _TARGET = 0, 1


_MARSHALLED, _COMPRESSED = b"m", b"z"
COMPRESS_FROM = 1024
"""Packed rows of at least this many bytes are compressed (zlib level 1):
a port of many endpoints shrinks severalfold, one of a single endpoint too
little to pay for the time (bench/RESULTS.md, "What moved the numbers")."""


def pack_elements(elements: Sequence[Element]) -> bytes:
    """`elements` as one marshalled tuple of plain rows (set name, key,
    value, comment), compressed from COMPRESS_FROM bytes: ~25 bytes an
    element of a port of 10 endpoints, ~80 of a port of one, where the
    objects cost ~300 (10,000 services x 10 endpoints keep 266,000 of
    them). Only this process reads it back, with the same Python."""
    if not elements:
        return b""
    raw = marshal.dumps(tuple((e.set_name, e.key, _value_row(e.value), e.comment)
                              for e in elements))
    if len(raw) >= COMPRESS_FROM:
        return _COMPRESSED + zlib.compress(raw, 1)
    return _MARSHALLED + raw


def unpack_elements(packed: bytes) -> tuple[Element, ...]:
    if not packed:
        return ()
    body = memoryview(packed)[1:]
    rows = marshal.loads(zlib.decompress(body) if packed[:1] == _COMPRESSED else body)
    return tuple(Element(name, key, _value(row), comment) for name, key, row, comment in rows)


def _value_row(value: Verdict | Target | None) -> tuple[int, str, str | int] | None:
    if value is None:
        return None
    if isinstance(value, Target):
        return (_TARGET, value.ip, value.port)
    return (_VERDICT, value.kind, value.target)


def _value(row: tuple[int, str, Any] | None) -> Verdict | Target | None:
    if row is None:
        return None
    tag, first, second = row
    return Target(first, second) if tag == _TARGET else Verdict(first, second)


_SET_REF = re.compile(r'"@([^"\\]+)"')
_DUMPS = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


def compact_chain(chain: Chain) -> CompactChain:
    """The chain's record: digest (16 bytes of BLAKE2b over its rules' JSON),
    size and set references."""
    text = _DUMPS([[r.expr, r.comment] for r in chain.rules])
    digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
    refs = tuple(sorted(set(_SET_REF.findall(text)))) if '"@' in text else ()
    if in_affinity_table(chain.name):  # its rules name the sets of its own table
        refs = tuple(affinity_table_name(r) for r in refs)
    return CompactChain(chain.name, chain.hook, digest, len(chain.rules), refs)


def compact(fragment: Fragment | CompactFragment) -> CompactFragment:
    if isinstance(fragment, CompactFragment):
        return fragment
    chains = tuple(compact_chain(c) for c in fragment.chains)
    return CompactFragment(
        fragment.family, chains, fragment.sets, pack_elements(fragment.elements), fragment.shared
    )
