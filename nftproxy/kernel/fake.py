"""FakeBackend: an in-memory nftables with the kernel's refusals.

Layer: nft edge's test double (no kernel). One job: apply a JSON transaction
atomically on a copy of in-memory tables, refusing it as the kernel would --
EEXIST for an element re-added with another verdict, ENOENT for missing
objects and jump/goto/@set targets, EBUSY for deleting a referenced chain,
loops reachable from base chains -- so proxier tests run without root.
Checked against the real kernel in tests/test_backend.py.

Known limits: rule expressions and element keys are stored verbatim (the
kernel lists them in canonical form), and expression types, jump depth and
interval overlaps are not modelled.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nftproxy.core.nft.errors import (
    NftBusy,
    NftExists,
    NftNotFound,
    NftRejected,
)
from nftproxy.kernel.libnftables import FAMILIES, METAINFO, Json, T, TableObjects, dumps

__all__ = ["FakeBackend"]


# --- the fake -----------------------------------------------------------------


def _refs(node: Any) -> tuple[set[str], set[str]]:
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


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _elem_key(item: Any) -> Any:
    if isinstance(item, dict) and "elem" in item and isinstance(item["elem"], dict):
        return item["elem"].get("val")
    return item


@dataclass
class _FRule:
    obj: Json
    chains: frozenset[str]
    sets: frozenset[str]


@dataclass
class _FChain:
    obj: Json
    rules: list[_FRule] = field(default_factory=list)

    @property
    def is_base(self) -> bool:
        return "hook" in self.obj


@dataclass
class _FElem:
    item: Any  # as given: key, {"elem": {"val": key, ...}} or [key, value]
    value: str | None  # canonical map value
    chains: frozenset[str]


@dataclass
class _FSet:
    kind: str  # "set" | "map"
    obj: Json
    elems: dict[str, _FElem] = field(default_factory=dict)


@dataclass
class _FTable:
    obj: Json
    chains: dict[str, _FChain] = field(default_factory=dict)
    sets: dict[str, _FSet] = field(default_factory=dict)
    chain_refs: Counter[str] = field(default_factory=Counter)
    set_refs: Counter[str] = field(default_factory=Counter)
    next_handle: int = 1

    def handle(self) -> int:
        self.next_handle += 1
        return self.next_handle - 1


_TableKey = tuple[str, str]

_ENOENT = "No such file or directory"
_EEXIST = "File exists"
_EBUSY = "Device or resource busy"
_EOPNOTSUPP = "Operation not supported"
_EMLINK = "Too many links"
_ERRORS: dict[str, type[NftRejected]] = {
    _ENOENT: NftNotFound,
    _EEXIST: NftExists,
    _EBUSY: NftBusy,
}


class _Refused(Exception):
    def __init__(self, errno_text: str, what: str) -> None:
        super().__init__(f"Could not process rule: {errno_text} (fake: {what})")
        self.errno_text = errno_text


class _Txn:
    """One transaction over a copy-on-write view of the fake's tables."""

    def __init__(self, tables: dict[_TableKey, _FTable], next_table_handle: int) -> None:
        self.tables = dict(tables)
        self.next_table_handle = next_table_handle
        self.edges_added: set[_TableKey] = set()
        self._own: set[int] = set()  # ids of objects copied (or made) in this txn

    def _mine(self, obj: T) -> T:
        self._own.add(id(obj))
        return obj

    def table(self, family: str, name: str) -> _FTable:
        key = (family, name)
        t = self.tables.get(key)
        if t is None:
            raise _Refused(_ENOENT, f"table {family} {name}")
        if id(t) not in self._own:
            t = self._mine(
                _FTable(
                    dict(t.obj),
                    dict(t.chains),
                    dict(t.sets),
                    Counter(t.chain_refs),
                    Counter(t.set_refs),
                    t.next_handle,
                )
            )
            self.tables[key] = t
        return t

    def chain(self, t: _FTable, name: str) -> _FChain:
        c = t.chains.get(name)
        if c is None:
            raise _Refused(_ENOENT, f"chain {name}")
        if id(c) not in self._own:
            c = t.chains[name] = self._mine(_FChain(dict(c.obj), list(c.rules)))
        return c

    def named_set(self, t: _FTable, name: str, kind: str | None = None) -> _FSet:
        s = t.sets.get(name)
        if s is None or (kind is not None and s.kind != kind):
            raise _Refused(_ENOENT, f"{kind or 'set'} {name}")
        if id(s) not in self._own:
            s = t.sets[name] = self._mine(_FSet(s.kind, dict(s.obj), dict(s.elems)))
        return s

    # verbs -------------------------------------------------------------

    def apply(self, verb: str, kind: str, spec: Json) -> None:
        handler = getattr(self, f"_{verb}_{kind}", None)
        if handler is None:
            raise NotImplementedError(f"FakeBackend does not model {verb} {kind}")
        handler(spec)

    def _add_table(self, spec: Json) -> None:
        key = (spec["family"], spec["name"])
        if key not in self.tables:
            obj = {"family": key[0], "name": key[1], "handle": self.next_table_handle}
            self.next_table_handle += 1
            self.tables[key] = self._mine(_FTable(obj))

    def _flush_table(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["name"])
        for name in list(t.chains):
            self._clear_rules(t, self.chain(t, name))

    def _delete_table(self, spec: Json) -> None:
        self.table(spec["family"], spec["name"])
        del self.tables[(spec["family"], spec["name"])]

    def _add_chain(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        # 1.0.6 JSON: a non-integer prio silently makes a regular chain.
        base = "hook" in spec and "type" in spec and isinstance(spec.get("prio"), int)
        old = t.chains.get(name)
        if old is None:
            obj: Json = {"family": spec["family"], "table": spec["table"], "name": name}
            obj["handle"] = t.handle()
            if base:
                obj.update(type=spec["type"], hook=spec["hook"], prio=spec["prio"])
                obj["policy"] = spec.get("policy", "accept")
            t.chains[name] = self._mine(_FChain(obj))
        elif base and not old.is_base:
            # nf_tables_updchain checks a policy before the hook (kernel 6.18)
            errno_text = _EOPNOTSUPP if "policy" in spec else _EEXIST
            raise _Refused(errno_text, f"regular chain {name} re-added as a base chain")
        elif base:
            have = (old.obj["type"], old.obj["hook"], old.obj["prio"])
            if have != (spec["type"], spec["hook"], spec["prio"]):
                raise _Refused(_EOPNOTSUPP, f"base chain {name} re-hooked")
            if "policy" in spec:
                self.chain(t, name).obj["policy"] = spec["policy"]

    def _flush_chain(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        self._clear_rules(t, self.chain(t, spec["name"]))

    def _delete_chain(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        self._clear_rules(t, self.chain(t, name))
        if t.chain_refs[name] > 0:
            raise _Refused(_EBUSY, f"chain {name} is still referenced")
        del t.chains[name]

    def _clear_rules(self, t: _FTable, c: _FChain) -> None:
        for rule in c.rules:
            t.chain_refs.subtract(rule.chains)
            t.set_refs.subtract(rule.sets)
        c.rules.clear()

    def _check_targets(self, t: _FTable, targets: Iterable[str]) -> None:
        for target in targets:
            dest = t.chains.get(target)
            if dest is None:
                raise _Refused(_ENOENT, f"jump/goto to missing chain {target}")
            if dest.is_base:
                raise _Refused(_EOPNOTSUPP, f"jump/goto to base chain {target}")

    def _add_rule(self, spec: Json, *, insert: bool = False) -> None:
        if any(k in spec for k in ("handle", "index", "position")):
            raise NotImplementedError("FakeBackend does not model rule positions")
        t = self.table(spec["family"], spec["table"])
        c = self.chain(t, spec["chain"])
        chains, sets = _refs(spec["expr"])
        self._check_targets(t, chains)
        for name in sets:
            if name not in t.sets:
                raise _Refused(_ENOENT, f"lookup of missing set @{name}")
        obj = {k: spec[k] for k in ("family", "table", "chain")}
        obj["handle"] = t.handle()
        obj["expr"] = json.loads(dumps(spec["expr"]))
        if "comment" in spec:
            obj["comment"] = spec["comment"]
        rule = _FRule(obj, frozenset(chains), frozenset(sets))
        if insert:
            c.rules.insert(0, rule)
        else:
            c.rules.append(rule)
        t.chain_refs.update(rule.chains)
        t.set_refs.update(rule.sets)
        if rule.chains or rule.sets:
            self.edges_added.add((spec["family"], spec["table"]))

    def _insert_rule(self, spec: Json) -> None:
        self._add_rule(spec, insert=True)

    def _delete_rule(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        c = self.chain(t, spec["chain"])
        for i, rule in enumerate(c.rules):
            if rule.obj["handle"] == spec.get("handle"):
                t.chain_refs.subtract(rule.chains)
                t.set_refs.subtract(rule.sets)
                del c.rules[i]
                return
        raise _Refused(_ENOENT, f"rule handle {spec.get('handle')}")

    def _add_set(self, spec: Json, kind: str = "set") -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        obj: Json = {"family": spec["family"], "name": name, "table": spec["table"]}
        type_ = spec["type"]
        obj["type"] = type_[0] if isinstance(type_, list) and len(type_) == 1 else type_
        if kind == "map":
            obj["map"] = spec["map"]
        for key in ("flags", "timeout", "comment"):
            if spec.get(key):
                obj[key] = spec[key]
        old = t.sets.get(name)
        if old is None:
            obj["handle"] = t.handle()
            t.sets[name] = self._mine(_FSet(kind, obj))
        else:
            mine = (kind, obj["type"], obj.get("map"), set(obj.get("flags", ())))
            have = (old.kind, old.obj["type"], old.obj.get("map"), set(old.obj.get("flags", ())))
            if mine != have:
                raise _Refused(_EEXIST, f"{kind} {name} re-declared differently")
        if spec.get("elem"):
            self._add_element(spec)

    def _add_map(self, spec: Json) -> None:
        self._add_set(spec, "map")

    def _flush_set(self, spec: Json, kind: str = "set") -> None:
        t = self.table(spec["family"], spec["table"])
        s = self.named_set(t, spec["name"], kind)
        for elem in s.elems.values():
            t.chain_refs.subtract(elem.chains)
        s.elems.clear()

    def _flush_map(self, spec: Json) -> None:
        self._flush_set(spec, "map")

    def _delete_set(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        s = self.named_set(t, name)
        if t.set_refs[name] > 0:
            raise _Refused(_EBUSY, f"set {name} is still referenced")
        for elem in s.elems.values():
            t.chain_refs.subtract(elem.chains)
        del t.sets[name]

    def _delete_map(self, spec: Json) -> None:
        self._delete_set(spec)

    def _add_element(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        s = self.named_set(t, spec["name"])
        for item in spec["elem"]:
            pair = isinstance(item, list)
            if pair != (s.kind == "map"):
                raise _Refused("Invalid argument", f"element shape does not fit {s.kind}")
            key = _canon(_elem_key(item[0] if pair else item))
            value = _canon(item[1]) if pair else None
            chains = frozenset(_refs(item[1])[0]) if pair else frozenset()
            self._check_targets(t, chains)
            old = s.elems.get(key)
            if old is not None:
                if old.value != value:
                    raise _Refused(_EEXIST, f"element {key} with another value")
                continue
            s.elems[key] = _FElem(json.loads(dumps(item)), value, chains)
            t.chain_refs.update(chains)
            if chains:
                self.edges_added.add((spec["family"], spec["table"]))

    def _delete_element(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        s = self.named_set(t, spec["name"])
        for item in spec["elem"]:
            key = _canon(_elem_key(item[0] if isinstance(item, list) else item))
            old = s.elems.pop(key, None)
            if old is None:
                raise _Refused(_ENOENT, f"element {key}")
            t.chain_refs.subtract(old.chains)

    # the kernel's loop check -------------------------------------------

    def check_loops(self) -> None:
        """Kernel 6.x validates the jump graph reachable from base chains at
        commit: a cycle there is EMLINK ("Too many links"). Unreachable
        cycles (even a chain jumping to itself) are accepted."""
        for key in self.edges_added:
            t = self.tables.get(key)
            if t is not None:
                _check_table_loops(t)


def _check_table_loops(t: _FTable) -> None:
    def successors(c: _FChain) -> set[str]:
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
                raise _Refused(_EMLINK, f"loop through chain {nxt}")
            elif nxt not in done and nxt in t.chains:
                path.add(nxt)
                stack.append((nxt, iter(successors(t.chains[nxt]))))


class FakeBackend:
    """An in-memory nftables with the kernel's refusals, for tests.

    Each commit is applied to a copy-on-write view and kept only if every
    command succeeded (all or nothing), like a netlink batch. Refusals raise
    the same error types as the kernel (NftNotFound/NftExists/NftBusy, or
    NftRejected for EOPNOTSUPP, EMLINK, EINVAL); unlike libnftables they name
    the offending command (`command_index`). Commands it does not model
    raise NotImplementedError rather than being accepted silently.
    """

    def __init__(self) -> None:
        self._tables: dict[_TableKey, _FTable] = {}
        self._next_table_handle = 1
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("FakeBackend already started")
        self._started = True

    def close(self) -> None:
        self._started = False

    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError("FakeBackend not started (or closed)")

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        if not commands:
            return
        self._check_started()
        with self._lock:
            txn = _Txn(self._tables, self._next_table_handle)
            for index, command in enumerate(commands):
                try:
                    for verb, body in command.items():
                        if verb == "metainfo":
                            continue
                        for kind, spec in body.items():
                            txn.apply(verb, kind, spec)
                    if index == len(commands) - 1:
                        txn.check_loops()
                except _Refused as exc:
                    cls = _ERRORS.get(exc.errno_text, NftRejected)
                    raise cls(str(exc), index, command) from None
            self._tables = txn.tables
            self._next_table_handle = txn.next_table_handle

    def run_json(self, command: Mapping[str, Any]) -> Json:
        self._check_started()
        head: list[Json] = [dict(METAINFO)]
        if "list" not in command:
            self.commit([command])
            return {"nftables": []}
        ((what, spec),) = command["list"].items()
        family = (spec or {}).get("family")
        with self._lock:
            tables = [t for (fam, _), t in self._tables.items() if family is None or fam == family]
            if what == "table":
                doc = self._list_table_locked(spec["family"], spec["name"])
                if doc is None:
                    raise NftNotFound(_ENOENT, 0, command)
                return {"nftables": head + doc}
            if what == "ruleset":
                return {"nftables": head + [o for t in tables for o in _listing(t)]}
            if what == "tables":
                return {"nftables": head + [{"table": dict(t.obj)} for t in tables]}
            if what in ("chains", "sets", "maps"):
                missing = "table" in spec and (family, spec["table"]) not in self._tables
                if what == "sets" and missing:
                    raise NftNotFound(_ENOENT, 0, command)
                kind = what[:-1]
                objs = [o for t in tables for o in _listing(t, elems=False) if kind in o]
                return {"nftables": head + objs}
        raise NotImplementedError(f"FakeBackend does not model list {what}")

    def _list_table_locked(self, family: str, table: str) -> list[Json] | None:
        t = self._tables.get((family, table))
        return None if t is None else _listing(t)

    def list_table(self, family: str, table: str) -> Json | None:
        self._check_started()
        with self._lock:
            objects = self._list_table_locked(family, table)
        return None if objects is None else {"nftables": objects}

    def list_table_objects(self, family: str, table: str) -> TableObjects | None:
        self._check_started()
        with self._lock:
            t = self._tables.get((family, table))
            if t is None:
                return None
            return TableObjects.from_listing(family, table, _listing(t, elems=False))

    def delete_tables(self, table: str) -> None:
        commands: list[Json] = []
        for family in FAMILIES:
            ref = {"family": family, "name": table}
            commands += [{"add": {"table": ref}}, {"delete": {"table": dict(ref)}}]
        self.commit(commands)


def _listing(t: _FTable, *, elems: bool = True) -> list[Json]:
    """One table as libnftables 1.0.6 lists it: the table, sets and maps in
    creation order, chains in creation order, then each chain's rules."""
    out: list[Json] = [{"table": dict(t.obj)}]
    for s in t.sets.values():
        obj = json.loads(dumps(s.obj))
        if elems and s.elems:
            obj["elem"] = [json.loads(dumps(e.item)) for e in s.elems.values()]
        out.append({s.kind: obj})
    out += [{"chain": dict(c.obj)} for c in t.chains.values()]
    out += [{"rule": json.loads(dumps(r.obj))} for c in t.chains.values() for r in c.rules]
    return out
