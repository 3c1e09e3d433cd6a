"""What a listing of one of our tables shows: the planner's view of the kernel.

Layer: nft (pure; no kernel access). One job: the vocabulary of a table
listing -- chain names with the hook of base chains, and set/map
declarations -- and reading it out of libnftables JSON. Built by both
backends' `list_table_objects` (kernel/libnftables.py NftBackend,
kernel/fake.py FakeBackend); read by `plan.stage_full`, which diffs the
desired table against it. Rules and elements are left out on purpose: a full
sync flushes and rewrites them.

Set keys are listed in one of two forms: datatypes (`"type": "ipv4_addr"`
or a list), or -- by libnftables 1.1.x, for a set declared by typeof -- the
key expression (`"type": {"typeof": {...}}`, kept in `ListedSet.typeof` as
`expr_text`); 1.0.6 lists every set by datatypes (docs/userspaces.md).

Known limits (libnftables 1.0.6 JSON output, docs/nft-python-notes.md §2):
the "dynamic" set flag is never listed (a set created in the same
transaction as a rule that updates it is dynamic in the kernel all the
same), so `ListedSet.flags` cannot tell a dynamic set from a plain one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nftproxy.core.rules.fragment import BaseHook

__all__ = ["ListedSet", "TableListing", "expr_text"]

Json = Mapping[str, Any]


def expr_text(expr: Any) -> str:
    """A JSON expression as comparable text (key order and spacing fixed)."""
    return json.dumps(expr, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class ListedSet:
    """A set or map declaration as listed (`map` is the value type of maps;
    `type` is () and `typeof` the key expression's `expr_text` when it is
    listed by typeof)."""

    name: str
    type: tuple[str, ...]
    map: str | None = None
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    typeof: str | None = None


@dataclass(frozen=True, slots=True)
class TableListing:
    """The chains (None for a regular chain, its hook for a base chain) and
    the sets and maps of one table."""

    chains: Mapping[str, BaseHook | None]
    sets: Mapping[str, ListedSet]

    @classmethod
    def from_json(cls, family: str, table: str, objects: Iterable[Json]) -> TableListing:
        """Pick `family table`'s chains, sets and maps out of listed objects
        (`{"chain": {...}}` and friends; listings of a family show every
        table of it)."""
        chains: dict[str, BaseHook | None] = {}
        sets: dict[str, ListedSet] = {}
        for item in objects:
            for kind, obj in item.items():
                if obj.get("family") != family or obj.get("table") != table:
                    continue
                if kind == "chain":
                    chains[obj["name"]] = _hook(obj)
                elif kind in ("set", "map"):
                    sets[obj["name"]] = _listed_set(obj)
        return cls(chains, sets)


def _hook(chain: Json) -> BaseHook | None:
    if "hook" not in chain:
        return None
    return BaseHook(chain["type"], chain["hook"], int(chain["prio"]), chain.get("policy", "accept"))


def _listed_set(obj: Json) -> ListedSet:
    type_: str | Sequence[str] | Json = obj["type"]
    typeof = None
    if isinstance(type_, Mapping):
        typeof, type_ = expr_text(type_["typeof"]), ()
    data = obj.get("map")
    if isinstance(data, list):  # 1.1.x lists a concatenated value as a list
        data = " . ".join(data)
    return ListedSet(
        obj["name"],
        (type_,) if isinstance(type_, str) else tuple(type_),
        data,
        tuple(obj.get("flags", ())),
        obj.get("timeout"),
        typeof,
    )
