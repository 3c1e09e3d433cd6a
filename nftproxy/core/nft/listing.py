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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nftproxy.core.rules import names
from nftproxy.core.rules.fragment import BaseHook, affinity_table_name

__all__ = [
    "ListedSet",
    "TableListing",
    "expr_text",
    "list_family",
    "list_family_objects",
    "live_name",
    "merged_document",
]

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

    @property
    def hooked(self) -> bool:
        """Whether the table has a base chain: traffic reaches it."""
        return any(h is not None for h in self.chains.values())

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

    @staticmethod
    def of_family(main: TableListing | None, affinity: TableListing | None) -> TableListing | None:
        """What a family's two tables hold, as the planner names it: the
        affinity table's objects under `fragment.affinity_table_name`; None
        when neither table exists."""
        if main is None and affinity is None:
            return None
        chains = dict(main.chains) if main else {}
        sets = dict(main.sets) if main else {}
        if affinity is not None:
            chains.update((affinity_table_name(n), h) for n, h in affinity.chains.items())
            for n, ks in affinity.sets.items():
                sets[affinity_table_name(n)] = replace(ks, name=affinity_table_name(n))
        return TableListing(chains, sets)


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


def list_family_objects(
    list_objects: Callable[[str, str], TableListing | None], family: str, table: str
) -> TableListing | None:
    """What `family`'s two tables hold (`list_objects(family, name)`: a
    backend's `list_table_objects`), as `TableListing.of_family` names it."""
    return TableListing.of_family(
        list_objects(family, table), list_objects(family, names.affinity_table(table))
    )


def live_name(list_objects: Callable[[str, str], TableListing | None], table: str) -> str:
    """The one of `names.table_pair(table)` whose tables traffic reaches (a
    base chain in either family), else `table`: a full sync in steps
    switches from one name to the other (agent/chunked.py)."""
    for name in names.table_pair(table):
        for family in ("ip", "ip6"):
            listing = list_family_objects(list_objects, family, name)
            if listing is not None and listing.hooked:
                return name
    return table


def list_family(
    list_table: Callable[[str, str], Json | None], family: str, table: str
) -> Json | None:
    """One listing of `family`'s two tables (`list_table(family, name)`: a
    backend's), as `merged_document` joins them; None when neither exists."""
    return merged_document(
        list_table(family, table), list_table(family, names.affinity_table(table)), table
    )


def merged_document(main: Json | None, affinity: Json | None, table: str) -> Json | None:
    """The listings of a family's main table and its affinity table
    (`{"nftables": [...]}` each, or None) as one listing of `table`, for the
    readers of a whole ruleset (dump, trace). The affinity table's objects
    whose names the main table also uses -- its nat chains, KUBE-SERVICES,
    KUBE-MARK-MASQ, its dispatch maps -- are renamed as the planner names
    them ("affinity:service-ips"), and so are the references to them in its
    rules and map elements; the ports' own KUBE-SVC/SVL/EXT-<h> chains keep
    their names (a port has them in one table only)."""
    if affinity is None:
        return main
    items = list((main or {}).get("nftables", ()))
    taken = {
        (kind in ("set", "map"), obj.get("name"))
        for item in items
        for kind, obj in item.items()
        if kind in ("chain", "set", "map")
    }

    def rename(name: str, is_set: bool) -> str:
        return affinity_table_name(name) if (is_set, name) in taken else name

    for item in affinity.get("nftables", ()):
        for kind, obj in item.items():
            if kind not in ("chain", "set", "map", "rule"):
                continue
            out = {**obj, "table": table}
            if kind == "rule":
                out["chain"] = rename(obj["chain"], False)
                out["expr"] = _renamed(obj.get("expr", []), rename)
            else:
                out["name"] = rename(obj["name"], kind != "chain")
                if "elem" in obj:
                    out["elem"] = _renamed(obj["elem"], rename)
            items.append({kind: out})
    return {"nftables": items}


def _renamed(value: Any, rename: Callable[[str, bool], str]) -> Any:
    """`value` (rule expressions, map elements) with its jump/goto targets
    and "@set" references renamed."""
    if isinstance(value, str):
        return "@" + rename(value[1:], True) if value.startswith("@") else value
    if isinstance(value, list):
        return [_renamed(v, rename) for v in value]
    if not isinstance(value, Mapping):
        return value
    out = {}
    for k, v in value.items():
        if k in ("jump", "goto") and isinstance(v, Mapping) and "target" in v:
            out[k] = {**v, "target": rename(v["target"], False)}
        elif k == "comment":
            out[k] = v
        else:
            out[k] = _renamed(v, rename)
    return out
