"""One listed table as the tracer walks it: chains with parsed rules, and sets.

Layer: core/trace (pure). One job: read a libnftables listing of one table
(`{"nftables": [...]}` as `list table` returns it, or as FakeBackend lists
a committed transaction) into base chains (hook, type, priority, policy),
regular chains, rules parsed into syntax values, and named sets and maps
whose elements are read on first lookup, for the kinds of the expression
that looks them up (declarations are never read: `type` or `typeof`, the
key is whatever the lookup says; a map's data is a verdict, or for a
`dnat ... map` the address . port an element DNATs to). A rule or element the tracer does not
understand is kept with its error: the walk raises it if the packet reaches
it, and `problems()` lists them all (the meta-test over a rendered table).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import Any

from nftproxy.core.rules.fragment import BaseHook
from nftproxy.core.trace import syntax as sx
from nftproxy.core.trace.values import (
    Address,
    Concat,
    Exact,
    Kind,
    Pattern,
    Unsupported,
    parse_pattern,
)

__all__ = ["Chain", "Element", "Rule", "Ruleset", "SetInfo", "Target"]

Json = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Rule:
    """Rule `index` (1-based, in chain order) of `chain`: its statements; with
    `error`, those before the first one that could not be read."""

    chain: str
    index: int
    statements: tuple[sx.Statement, ...]
    comment: str | None = None
    error: str | None = None
    handle: int | None = None
    """The kernel's handle (listings have it; planned commands do not)."""

    @property
    def where(self) -> str:
        return f"{self.chain}/rule {self.index}"

    def text(self) -> str:
        """The rule in nft syntax (as `nft list` prints it)."""
        body = " ".join([*(str(s) for s in self.statements), *(["?"] if self.error else [])])
        return body + (f' comment "{self.comment}"' if self.comment else "")


@dataclass(frozen=True, slots=True)
class Chain:
    name: str
    base: BaseHook | None
    rules: tuple[Rule, ...]


Target = tuple[Address, int | None]
"""The data of a `dnat ... map` element: address, and port (None: keep it)."""


@dataclass(frozen=True, slots=True)
class Element:
    """One element of a named set or map, read for a lookup's kinds."""

    pattern: Pattern
    verdict: sx.Verdict | None
    comment: str | None = None
    expires: int | None = None
    target: Target | None = None
    """A `dnat ... map` element's address . port (its verdict is None)."""
    timeout: int | None = None
    """A dynamic set's element's own timeout (affinity), seconds."""


@dataclass(frozen=True, slots=True)
class SetInfo:
    name: str
    is_map: bool
    timeout: int | None
    elements: tuple[Any, ...]
    """Raw listed elements; read by `Ruleset.elements` for a lookup's kinds."""


class _Chains(Mapping[str, Chain]):
    """Chains by name, each parsed on first use: a trace meets a few dozen
    chains of a table that may hold 100,000 rules."""

    def __init__(self, listed: dict[str, tuple[BaseHook | None, list[Json]]]) -> None:
        self.listed = listed
        self._parsed: dict[str, Chain] = {}

    def __getitem__(self, name: str) -> Chain:
        if name not in self._parsed:
            base, rules = self.listed[name]
            parsed = tuple(_rule(name, i, r) for i, r in enumerate(rules, 1))
            self._parsed[name] = Chain(name, base, parsed)
        return self._parsed[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.listed)

    def __len__(self) -> int:
        return len(self.listed)


class Ruleset:
    """One family's table. Chains are parsed on first use, the elements of a
    set once per key shape that looks them up."""

    def __init__(self, family: str, table: str, objects: Iterable[Json]) -> None:
        self.family = family
        self.table = table
        self.sets: dict[str, SetInfo] = {}
        self.chains = _Chains(self._read(objects))
        self._elements: dict[tuple[str, tuple[Kind, ...], bool], tuple[Element, ...]] = {}

    @classmethod
    def from_listing(cls, doc: Json, family: str, table: str) -> Ruleset:
        return cls(family, table, doc.get("nftables", ()))

    def _read(self, objects: Iterable[Json]) -> dict[str, tuple[BaseHook | None, list[Json]]]:
        """Sets into self.sets; chains as (hook, listed rules) by name."""
        bases: dict[str, BaseHook | None] = {}
        rules: dict[str, list[Json]] = {}
        for item in objects:
            for kind, obj in item.items():
                if not isinstance(obj, Mapping) or not self._ours(obj):
                    continue
                if kind == "chain":
                    bases[obj["name"]] = _base(obj)
                    rules.setdefault(obj["name"], [])
                elif kind == "rule":
                    rules.setdefault(obj["chain"], []).append(obj)
                elif kind in ("set", "map"):
                    self.sets[obj["name"]] = SetInfo(
                        obj["name"], kind == "map", obj.get("timeout"), tuple(obj.get("elem", ()))
                    )
        return {name: (bases.get(name), listed) for name, listed in rules.items()}

    def _ours(self, obj: Json) -> bool:
        return bool(
            obj.get("family", self.family) == self.family
            and obj.get("table", self.table) == self.table
        )

    def base_chains(self, hook: str) -> list[Chain]:
        """The base chains on `hook`, in priority order (listing order on ties)."""
        found = [
            (base.prio, name)
            for name, (base, _) in self.chains.listed.items()
            if base is not None and base.hook == hook
        ]
        return [self.chains[name] for _, name in sorted(found, key=lambda f: f[0])]

    def chain(self, name: str) -> Chain:
        if name not in self.chains:
            raise Unsupported(f"no chain {name!r} in table {self.family} {self.table}")
        return self.chains[name]

    def rule_by_handle(self, chain: str, handle: int) -> Rule | None:
        found = self.chains.get(chain)
        return next((r for r in found.rules if r.handle == handle), None) if found else None

    def set_info(self, name: str) -> SetInfo:
        if name not in self.sets:
            raise Unsupported(f"no set or map @{name} in table {self.family} {self.table}")
        return self.sets[name]

    def elements(
        self, name: str, kinds: tuple[Kind, ...], *, targets: bool = False
    ) -> tuple[Element, ...]:
        """The elements of @name read for a key of `kinds`, a map's data as
        verdicts or, with `targets`, as DNAT targets (Unsupported if one
        does not fit)."""
        key = (name, kinds, targets)
        if key not in self._elements:
            info = self.set_info(name)
            if targets and not info.is_map:
                raise Unsupported(f"@{name} is a set, not a map of addresses")
            self._elements[key] = tuple(
                _element(e, kinds, info.is_map, targets) for e in info.elements
            )
        return self._elements[key]

    def problems(self) -> list[str]:
        """Every rule the tracer cannot interpret, and every set element that
        does not fit the lookups made of it: empty for a table it fully
        understands."""
        out = [r.error for c in self.chains.values() for r in c.rules if r.error]
        for chain in self.chains.values():
            for rule in chain.rules:
                for statement in rule.statements:
                    for name, kinds, targets in _lookups(statement):
                        try:
                            self.elements(name, kinds, targets=targets)
                        except Unsupported as exc:
                            out.append(f"{rule.where}: @{name}: {exc}")
        return out


def _base(obj: Json) -> BaseHook | None:
    if "hook" not in obj:
        return None
    return BaseHook(
        str(obj.get("type", "filter")),
        obj["hook"],
        int(obj.get("prio", 0)),
        str(obj.get("policy", "accept")),
    )


def _rule(chain: str, index: int, obj: Json) -> Rule:
    """The rule's statements up to the first one that cannot be read (the
    kernel would not reach that one either if an earlier match fails)."""
    comment, handle = obj.get("comment"), obj.get("handle")
    statements: list[sx.Statement] = []
    error = None
    for node in obj.get("expr", ()):
        try:
            statements.append(sx.parse_statement(node))
        except (Unsupported, KeyError, TypeError, ValueError) as exc:
            error = f"unsupported expression at {chain}/rule {index}: {exc}"
            break
    return Rule(
        chain, index, tuple(statements), comment, error, handle if isinstance(handle, int) else None
    )


def _element(raw: Any, kinds: tuple[Kind, ...], is_map: bool, targets: bool) -> Element:
    verdict, target = None, None
    if is_map:
        if not isinstance(raw, list) or len(raw) != 2:
            raise Unsupported(f"map element {raw!r}")
        raw, data = raw
        if targets:
            target = _target(data)
        else:
            verdict = sx.parse_verdict(data)
    meta = raw.get("elem", {}) if isinstance(raw, Mapping) and "elem" in raw else {}
    expires, timeout = meta.get("expires"), meta.get("timeout")
    return Element(
        parse_pattern(raw, kinds),
        verdict,
        meta.get("comment"),
        expires if isinstance(expires, int) else None,
        target,
        timeout if isinstance(timeout, int) else None,
    )


def _target(data: Any) -> Target:
    """`{"concat": [ADDR, PORT]}` or a bare address: where the element DNATs."""
    two = isinstance(data, Mapping) and set(data) == {"concat"}
    pattern = parse_pattern(data, (Kind.ADDR, Kind.PORT) if two else (Kind.ADDR,))
    parts = pattern.parts if isinstance(pattern, Concat) else (pattern,)
    addr = parts[0].value if isinstance(parts[0], Exact) else None
    port = parts[-1].value if two and isinstance(parts[-1], Exact) else None
    if not isinstance(addr, (IPv4Address, IPv6Address)) or (two and not isinstance(port, int)):
        raise Unsupported(f"map data {data!r} is not an address or address . port")
    return addr, port if isinstance(port, int) else None


def _lookups(statement: sx.Statement) -> list[tuple[str, tuple[Kind, ...], bool]]:
    """(set, key kinds, whether its data are DNAT targets) a statement looks up."""
    if isinstance(statement, sx.Match) and isinstance(statement.right, sx.SetRef):
        return [(statement.right.name, sx.kinds_of(statement.left), False)]
    if isinstance(statement, sx.Vmap) and isinstance(statement.data, sx.SetRef):
        return [(statement.data.name, sx.kinds_of(statement.key), False)]
    if isinstance(statement, sx.DnatMap):
        return [(statement.map, sx.kinds_of(statement.key), True)]
    return []
