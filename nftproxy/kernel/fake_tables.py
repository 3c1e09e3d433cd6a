"""The fake kernel's tables: what FakeBackend holds, and reading it.

Layer: kernel edge's test double (no kernel; used by kernel/fake_txn.py and
kernel/fake.py). One job: the in-memory objects of the fake's tables
(tables, chains with their rules, sets and maps with their elements, and the
reference counts the kernel keeps), what a command's JSON refers to (jump
and goto targets, "@set" lookups, set updates), the refusal a command meets
(`Refused`, with the kernel's errno text), the kernel's loop check, and a
table listed as libnftables 1.0.6 lists it (JSON output; it never shows the
"dynamic" flag).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nftproxy.core.nft.errors import NftBusy, NftExists, NftNotFound, NftRejected
from nftproxy.kernel.libnftables import Json, dumps

__all__ = [
    "DYNSET_SIZE",
    "EBUSY",
    "EEXIST",
    "EINVAL_TYPE",
    "EMLINK",
    "ENOENT",
    "EOPNOTSUPP",
    "VERDICTS",
    "FChain",
    "FElem",
    "FRule",
    "FSet",
    "FTable",
    "Refused",
    "SetKey",
    "TableKey",
    "canon",
    "check_table_loops",
    "dynset_refs",
    "dynset_targets",
    "elem_key",
    "listing",
    "refs",
]

TableKey = tuple[str, str]
SetKey = tuple[str, str, str]
"""(family, table, set name)."""

ENOENT = "No such file or directory"
EEXIST = "File exists"
EBUSY = "Device or resource busy"
EOPNOTSUPP = "Operation not supported"
EMLINK = "Too many links"
EINVAL_TYPE = "Invalid set datatype"
"""libnftables 1.0.6's JSON parser on a typeof declaration (not an errno)."""
VERDICTS = frozenset({"accept", "drop", "continue", "return", "jump", "goto", "queue"})
_ERRORS: dict[str, type[NftRejected]] = {
    ENOENT: NftNotFound,
    EEXIST: NftExists,
    EBUSY: NftBusy,
}
DYNSET_SIZE = 65535
"""The size nft_dynset_init gives a set that has none (kernel 6.x)."""


class Refused(Exception):
    """The kernel would refuse this command (`errno_text` as libnftables prints it)."""

    def __init__(self, errno_text: str, what: str) -> None:
        super().__init__(f"Could not process rule: {errno_text} (fake: {what})")
        self.errno_text = errno_text

    def as_error(self, index: int, command: Mapping[str, Any]) -> NftRejected:
        """The error the backend raises: NftNotFound/NftExists/NftBusy, or
        NftRejected for any other errno (EOPNOTSUPP, EMLINK, EINVAL)."""
        return _ERRORS.get(self.errno_text, NftRejected)(str(self), index, command)


def refs(node: Any) -> tuple[set[str], set[str]]:
    """(chains jumped/goto'd to, sets looked up as "@name") anywhere in JSON."""
    chains: set[str] = set()
    sets: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key in ("jump", "goto") and isinstance(value, dict) and "target" in value:
                    chains.add(value["target"])
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and item.startswith("@"):
            sets.add(item[1:])
    return chains, sets


def dynset_refs(node: Any) -> set[str]:
    """Sets that `set` statements add to or update anywhere in JSON."""
    names: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stmt = item.get("set")
            if isinstance(stmt, dict) and stmt.get("op") in ("add", "update"):
                target = stmt.get("set")
                if isinstance(target, str) and target.startswith("@"):
                    names.add(target[1:])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return names


def dynset_targets(commands: Iterable[Mapping[str, Any]]) -> frozenset[SetKey]:
    """The sets the rules of one batch add to or update: libnftables 1.0.6
    creates each of them "dynamic" if the same batch creates it."""
    out: set[SetKey] = set()
    for command in commands:
        for verb in ("add", "insert"):
            body = command.get(verb)
            spec = body.get("rule") if isinstance(body, Mapping) else None
            if spec is not None:
                updated = dynset_refs(spec.get("expr", ()))
                out.update((spec["family"], spec["table"], name) for name in updated)
    return frozenset(out)


def canon(value: Any) -> str:
    """One text per JSON value (element keys and verdicts are compared so)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def elem_key(item: Any) -> Any:
    """An element's key without its `{"elem": {"val": ..., "comment": ...}}` wrapper."""
    if isinstance(item, dict) and "elem" in item and isinstance(item["elem"], dict):
        return item["elem"].get("val")
    return item


@dataclass
class FRule:
    obj: Json
    chains: frozenset[str]
    sets: frozenset[str]


@dataclass
class FChain:
    obj: Json
    rules: list[FRule] = field(default_factory=list)

    @property
    def is_base(self) -> bool:
        return "hook" in self.obj


@dataclass
class FElem:
    item: Any  # as given: key, {"elem": {"val": key, ...}} or [key, value]
    value: str | None  # canonical map value
    chains: frozenset[str]


@dataclass
class FSet:
    kind: str  # "set" | "map"
    obj: Json
    elems: dict[str, FElem] = field(default_factory=dict)
    dynamic: bool = False  # never listed: 1.0.6 JSON output omits the flag


@dataclass
class FTable:
    """One table: its objects, and how often each chain and set is referenced."""

    obj: Json
    chains: dict[str, FChain] = field(default_factory=dict)
    sets: dict[str, FSet] = field(default_factory=dict)
    chain_refs: Counter[str] = field(default_factory=Counter)
    set_refs: Counter[str] = field(default_factory=Counter)
    next_handle: int = 1
    comment: str | None = None  # kept apart from obj: 1.0.6's JSON lists no table comment

    def handle(self) -> int:
        self.next_handle += 1
        return self.next_handle - 1


def check_table_loops(t: FTable) -> None:
    """Refused (EMLINK) if a jump/goto cycle is reachable from a base chain,
    through rules or verdict-map elements."""

    def successors(c: FChain) -> set[str]:
        out: set[str] = set()
        for rule in c.rules:
            out |= rule.chains
            for name in rule.sets:
                s = t.sets.get(name)
                if s is not None and s.kind == "map":
                    for elem in s.elems.values():
                        out |= elem.chains
        return out

    done: set[str] = set()
    for root in (name for name, c in t.chains.items() if c.is_base):
        path: set[str] = set()
        stack: list[tuple[str, Iterator[str]]] = [(root, iter(successors(t.chains[root])))]
        path.add(root)
        while stack:
            name, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.discard(name)
                done.add(name)
            elif nxt in path:
                raise Refused(EMLINK, f"loop through chain {nxt}")
            elif nxt not in done and nxt in t.chains:
                path.add(nxt)
                stack.append((nxt, iter(successors(t.chains[nxt]))))


def listing(t: FTable, *, elems: bool = True, dynamic_flag: bool = False) -> list[Json]:
    """One table as libnftables 1.0.6 lists it: the table, sets and maps in
    creation order, chains in creation order, then each chain's rules;
    `dynamic_flag`: list a dynamic set's "dynamic" flag, as 1.1.x does."""
    out: list[Json] = [{"table": dict(t.obj)}]
    for s in t.sets.values():
        obj = json.loads(dumps(s.obj))
        if dynamic_flag and s.dynamic:
            obj["flags"] = [*obj.get("flags", ()), "dynamic"]
        if elems and s.elems:
            obj["elem"] = [json.loads(dumps(e.item)) for e in s.elems.values()]
        out.append({s.kind: obj})
    out += [{"chain": dict(c.obj)} for c in t.chains.values()]
    out += [{"rule": json.loads(dumps(r.obj))} for c in t.chains.values() for r in c.rules]
    return out
