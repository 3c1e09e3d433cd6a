"""One transaction of the fake kernel: commands applied, or refused, as the kernel does.

Layer: kernel edge's test double (no kernel; used only by kernel/fake.py).
One job: apply the commands of one libnftables JSON transaction to a
copy-on-write view of the fake's tables (kernel/fake_tables.py), raising
`Refused` with the kernel's errno text where the kernel refuses.
FakeBackend (kernel/fake.py) keeps the view only if the whole transaction
succeeds.

What the kernel (6.x, libnftables 1.0.6; measured in tests/test_backend.py)
refuses, and so does this model:
- ENOENT: a missing table, chain, set, map, element or rule handle; a
  jump/goto (in a rule or a map element) to a missing chain; a lookup of a
  missing set;
- EEXIST: an element re-added with another verdict; a set or map re-declared
  with another type or other flags; a "dynamic" set re-added at all (below);
  a regular chain re-added as a base chain;
- EBUSY: deleting a chain a rule or a map element still jumps to, or a set
  a rule still uses (deleting a chain deletes its own rules first);
- EOPNOTSUPP: a base chain re-hooked; a jump/goto to a base chain;
- EMLINK: a loop reachable from a base chain (checked at the end).
Dynamic sets: libnftables 1.0.6 evaluates a whole batch before sending it,
and marks a set "dynamic" (NFT_SET_EVAL) when a rule of the batch updates it
(`{"set": {"op": "update"|"add", "set": "@s"}}`) and the batch creates it.
A plain JSON `add set` cannot say "dynamic" (nft text and 1.1.x JSON can:
`flags dynamic`, kept apart from the listed flags, which 1.0.6 lists
without it), so re-adding that set later (or
later in the same batch) differs in its flags: EEXIST. A set created in an
earlier transaction than its first update rule stays plain. Binding an
update rule also sets the size of a set without one to 65535 (listed).
Re-declaring a plain set with another timeout (or none) is accepted and
sets (or clears) its timeout.
libnftables 1.1.x (`v11=True`) differs: it also marks an existing set
dynamic when the batch re-adds it with an update rule, so that re-add is
accepted; and it takes declarations by typeof (`"type": {"typeof": ...}`,
verdict maps' data as `{"typeof": <verdict>}`), listed back with the key
expression and `"map": "verdict"`, which 1.0.6's JSON parser refuses
("Invalid set datatype").
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable

from nftproxy.core.rules.fragment import SELECTORS
from nftproxy.kernel.fake_tables import (
    DYNSET_SIZE,
    EBUSY,
    EEXIST,
    EINVAL_TYPE,
    ENOENT,
    EOPNOTSUPP,
    VERDICTS,
    FChain,
    FElem,
    FRule,
    FSet,
    FTable,
    Refused,
    SetKey,
    TableKey,
    canon,
    check_table_loops,
    dynset_refs,
    elem_key,
    refs,
)
from nftproxy.kernel.libnftables import Json, T, dumps

_DATATYPES = {json.dumps(e, sort_keys=True): t for e, t in SELECTORS.values()}
"""A typeof expression's datatype, by its JSON text."""

__all__ = ["Txn"]


class Txn:
    """One transaction over a copy-on-write view of the fake's tables.

    `evaluated`: the sets the batch's rules update (dynset_targets), which
    the batch creates dynamic.
    """

    def __init__(
        self,
        tables: dict[TableKey, FTable],
        next_table_handle: int,
        evaluated: frozenset[SetKey] = frozenset(),
        *,
        v11: bool = False,
    ) -> None:
        self.tables = dict(tables)
        self.next_table_handle = next_table_handle
        self.evaluated = evaluated
        self.v11 = v11
        self.edges_added: set[TableKey] = set()
        self._own: set[int] = set()  # ids of objects copied (or made) in this txn

    def _mine(self, obj: T) -> T:
        self._own.add(id(obj))
        return obj

    def table(self, family: str, name: str) -> FTable:
        key = (family, name)
        t = self.tables.get(key)
        if t is None:
            raise Refused(ENOENT, f"table {family} {name}")
        if id(t) not in self._own:
            t = self._mine(
                FTable(
                    dict(t.obj),
                    dict(t.chains),
                    dict(t.sets),
                    Counter(t.chain_refs),
                    Counter(t.set_refs),
                    t.next_handle,
                    t.comment,
                )
            )
            self.tables[key] = t
        return t

    def chain(self, t: FTable, name: str) -> FChain:
        c = t.chains.get(name)
        if c is None:
            raise Refused(ENOENT, f"chain {name}")
        if id(c) not in self._own:
            c = t.chains[name] = self._mine(FChain(dict(c.obj), list(c.rules)))
        return c

    def named_set(self, t: FTable, name: str, kind: str | None = None) -> FSet:
        s = t.sets.get(name)
        if s is None or (kind is not None and s.kind != kind):
            raise Refused(ENOENT, f"{kind or 'set'} {name}")
        if id(s) not in self._own:
            s = t.sets[name] = self._mine(FSet(s.kind, dict(s.obj), dict(s.elems), s.dynamic))
        return s

    # verbs -------------------------------------------------------------

    def apply(self, verb: str, kind: str, spec: Json) -> None:
        handler = getattr(self, f"_{verb}_{kind}", None)
        if handler is None:
            raise NotImplementedError(f"FakeBackend does not model {verb} {kind}")
        handler(spec)

    def _add_table(self, spec: Json) -> None:
        # The comment is the one the table was created with: the kernel
        # ignores the comment of an `add` of an existing table.
        key = (spec["family"], spec["name"])
        if key not in self.tables:
            obj = {"family": key[0], "name": key[1], "handle": self.next_table_handle}
            self.next_table_handle += 1
            self.tables[key] = self._mine(FTable(obj, comment=spec.get("comment") or None))

    def _create_table(self, spec: Json) -> None:
        if (spec["family"], spec["name"]) in self.tables:
            raise Refused(EEXIST, f"table {spec['family']} {spec['name']} exists (create)")
        self._add_table(spec)

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
            if spec.get("comment"):
                obj["comment"] = spec["comment"]
            t.chains[name] = self._mine(FChain(obj))
        elif base and not old.is_base:
            # nf_tables_updchain checks a policy before the hook (kernel 6.18)
            errno_text = EOPNOTSUPP if "policy" in spec else EEXIST
            raise Refused(errno_text, f"regular chain {name} re-added as a base chain")
        elif base:
            have = (old.obj["type"], old.obj["hook"], old.obj["prio"])
            if have != (spec["type"], spec["hook"], spec["prio"]):
                raise Refused(EOPNOTSUPP, f"base chain {name} re-hooked")
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
            raise Refused(EBUSY, f"chain {name} is still referenced")
        del t.chains[name]

    def _clear_rules(self, t: FTable, c: FChain) -> None:
        for rule in c.rules:
            t.chain_refs.subtract(rule.chains)
            t.set_refs.subtract(rule.sets)
        c.rules.clear()

    def _check_targets(self, t: FTable, targets: Iterable[str]) -> None:
        for target in targets:
            dest = t.chains.get(target)
            if dest is None:
                raise Refused(ENOENT, f"jump/goto to missing chain {target}")
            if dest.is_base:
                raise Refused(EOPNOTSUPP, f"jump/goto to base chain {target}")

    def _add_rule(self, spec: Json, *, insert: bool = False) -> None:
        if any(k in spec for k in ("handle", "index", "position")):
            raise NotImplementedError("FakeBackend does not model rule positions")
        t = self.table(spec["family"], spec["table"])
        c = self.chain(t, spec["chain"])
        chains, sets = refs(spec["expr"])
        self._check_targets(t, chains)
        for name in sets:
            if name not in t.sets:
                raise Refused(ENOENT, f"lookup of missing set @{name}")
        obj = {k: spec[k] for k in ("family", "table", "chain")}
        obj["handle"] = t.handle()
        obj["expr"] = json.loads(dumps(spec["expr"]))
        if "comment" in spec:
            obj["comment"] = spec["comment"]
        rule = FRule(obj, frozenset(chains), frozenset(sets))
        if insert:
            c.rules.insert(0, rule)
        else:
            c.rules.append(rule)
        t.chain_refs.update(rule.chains)
        t.set_refs.update(rule.sets)
        if rule.chains or rule.sets:
            self.edges_added.add((spec["family"], spec["table"]))
        for name in dynset_refs(spec["expr"]):
            if "size" not in t.sets[name].obj:
                self.named_set(t, name).obj["size"] = DYNSET_SIZE

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
        raise Refused(ENOENT, f"rule handle {spec.get('handle')}")

    def _add_set(self, spec: Json, kind: str = "set") -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        obj: Json = {"family": spec["family"], "name": name, "table": spec["table"]}
        type_ = spec["type"]
        obj["type"] = type_[0] if isinstance(type_, list) and len(type_) == 1 else type_
        if kind == "map":
            obj["map"] = self._data_type(spec["map"])
        if isinstance(type_, dict) and not self.v11:
            raise Refused(EINVAL_TYPE, f"{kind} {name}: typeof in JSON (libnftables 1.0.6)")
        says_dynamic = "dynamic" in spec.get("flags", ())
        flags = [f for f in spec.get("flags", ()) if f != "dynamic"]
        if flags:
            obj["flags"] = flags
        for key in ("timeout", "size", "comment"):
            if spec.get(key):
                obj[key] = spec[key]
        old = t.sets.get(name)
        evaluated = (spec["family"], spec["table"], name) in self.evaluated
        if old is None:
            obj["handle"] = t.handle()
            t.sets[name] = self._mine(FSet(kind, obj, dynamic=evaluated or says_dynamic))
        elif old.dynamic and not (says_dynamic or (self.v11 and evaluated)):
            raise Refused(EEXIST, f"dynamic {kind} {name} re-added without 'dynamic'")
        else:
            mine = (kind, obj["type"], obj.get("map"), set(obj.get("flags", ())))
            have = (old.kind, old.obj["type"], old.obj.get("map"), set(old.obj.get("flags", ())))
            if mine != have:
                raise Refused(EEXIST, f"{kind} {name} re-declared differently")
            self._retime(t, name, obj.get("timeout"))
        if spec.get("elem"):
            self._add_element(spec)

    def _data_type(self, data: object) -> object:
        """A map's data type as listed: a typeof verdict lists as "verdict"."""
        if not isinstance(data, dict):
            return data
        if not self.v11:
            raise Refused(EINVAL_TYPE, "typeof map data in JSON (libnftables 1.0.6)")
        typeof = data.get("typeof")
        if isinstance(typeof, dict) and set(typeof) <= VERDICTS:
            return "verdict"
        parts = typeof.get("concat", [typeof]) if isinstance(typeof, dict) else []
        types = [_DATATYPES.get(json.dumps(p, sort_keys=True)) for p in parts]
        if not types or None in types:
            raise NotImplementedError(f"FakeBackend does not model map data {data}")
        return types  # 1.1.x lists a concatenated value as a list

    def _retime(self, t: FTable, name: str, timeout: int | None) -> None:
        """A re-added set takes the new default timeout, or none (kernel 6.x)."""
        if t.sets[name].obj.get("timeout") != timeout:
            obj = self.named_set(t, name).obj
            obj.pop("timeout", None)
            if timeout is not None:
                obj["timeout"] = timeout

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
            raise Refused(EBUSY, f"set {name} is still referenced")
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
                raise Refused("Invalid argument", f"element shape does not fit {s.kind}")
            key = canon(elem_key(item[0] if pair else item))
            value = canon(item[1]) if pair else None
            chains = frozenset(refs(item[1])[0]) if pair else frozenset()
            self._check_targets(t, chains)
            old = s.elems.get(key)
            if old is not None:
                if old.value != value:
                    raise Refused(EEXIST, f"element {key} with another value")
                continue
            s.elems[key] = FElem(json.loads(dumps(item)), value, chains)
            t.chain_refs.update(chains)
            if chains:
                self.edges_added.add((spec["family"], spec["table"]))

    def _delete_element(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        s = self.named_set(t, spec["name"])
        for item in spec["elem"]:
            key = canon(elem_key(item[0] if isinstance(item, list) else item))
            old = s.elems.pop(key, None)
            if old is None:
                raise Refused(ENOENT, f"element {key}")
            t.chain_refs.subtract(old.chains)

    # the kernel's loop check -------------------------------------------

    def check_loops(self) -> None:
        """Kernel 6.x validates the jump graph reachable from base chains at
        commit: a cycle there is EMLINK ("Too many links"). Unreachable
        cycles (even a chain jumping to itself) are accepted."""
        for key in self.edges_added:
            t = self.tables.get(key)
            if t is not None:
                check_table_loops(t)
