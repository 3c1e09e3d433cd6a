"""libnftables JSON commands, built and checked in one place.

Layer: nft (pure). One job: turn fragment values into the JSON command
objects of one transaction (`{"add": {"chain": {...}}}` and friends), and
enforce the kernel's limits while doing so (names < 256 bytes, comments
<= 128 bytes: an over-long comment would make the kernel reject the whole
atomic transaction, kubernetes#139515), so no bad object reaches the kernel.
A set element's JSON (and its comment's budget) is core/nft/jsontext.py's:
an add-element command carries the Element values in an `ElementList`.

Set and map declarations come in two dialects (`Table.typeof`), because the
two userspaces nftproxy runs with cannot share one (docs/userspaces.md):
- libnftables 1.1.x (typeof=True): `"type": {"typeof": <key expression>}`,
  and `"map": {"typeof": {"accept": null}}` for verdict maps -- the JSON of
  nft's `typeof ... : verdict`. Declared by `type` instead, 1.1.x records
  each single-datatype key or data part (`verdict` included) in the set's
  userdata as a typeof expression of kind "value", on which nft 1.0.6's
  listing calls a NULL parser: `nft list ruleset`, `nftproxy dump` and the
  agent itself segfault on 1.0.6 (kubernetes#136786).
- libnftables 1.0.6 (typeof=False): `"type": "ipv4_addr"` or a list for a
  concatenation; its JSON input rejects typeof ("Invalid set datatype"),
  and what it writes lists cleanly with 1.1.x.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nftproxy.core.nft.jsontext import ElementList, key_json
from nftproxy.core.nft.listing import expr_text
from nftproxy.core.nft.ownership import TABLE_MARK
from nftproxy.core.rules import names
from nftproxy.core.rules.fragment import (
    SELECTORS,
    Chain,
    Element,
    Json,
    Rule,
    SetDecl,
    in_affinity_table,
    kernel_name,
)

__all__ = ["VERDICT_TYPEOF", "OpError", "Table", "typeof_key"]

VERDICT_TYPEOF: Json = {"typeof": {"accept": None}}
"""The data of a verdict map declared by typeof (a verdict expression): the
same kernel object and userdata as nft's text `typeof ... : verdict`."""


class OpError(ValueError):
    """An object that cannot be expressed within the kernel's limits."""


def _check_name(name: str) -> str:
    if not name or len(name.encode()) >= names.NAME_MAX:
        raise OpError(f"invalid nftables object name {name!r}")
    return name


def _comment(fields: dict[str, Any], comment: str | None) -> dict[str, Any]:
    if comment:
        fields["comment"] = names.comment(comment)
    return fields


def typeof_key(key: tuple[str, ...]) -> Json:
    """The libnftables JSON expression of a key given by selectors."""
    exprs = [SELECTORS[part][0] for part in key]
    return exprs[0] if len(exprs) == 1 else {"concat": exprs}


@dataclass(frozen=True, slots=True)
class Table:
    """Command builder for one table (`family` "ip"/"ip6", `name`);
    `typeof`: declare sets and maps by typeof (libnftables 1.1.x)."""

    family: str
    name: str
    typeof: bool = False

    def declares_typeof(self, decl: SetDecl) -> bool:
        """Whether `add_set(decl)` declares by typeof (else by datatype, or
        in text: `declares_in_text`)."""
        return self.typeof and bool(decl.key) and (decl.map in (None, "verdict") or bool(decl.data))

    def declares_in_text(self, decl: SetDecl) -> bool:
        """Whether `decl` must be declared by `declare_text` before the JSON
        transaction that uses it: libnftables 1.0.6's JSON cannot say an
        integer key (measured: "unqualified type integer", "variable sized
        data types"; only nft text's typeof can)."""
        return not self.typeof and decl.text_only

    def declared_typeof(self, decl: SetDecl) -> str | None:
        """The key expression `add_set(decl)` declares, as a listing shows
        it (listing.expr_text), or None when it declares by datatype."""
        return expr_text(typeof_key(decl.key)) if self.declares_typeof(decl) else None

    @property
    def affinity_table(self) -> str:
        """The name of the family's second table: the chains of the ports
        with ClientIP affinity (fragment.AFFINITY_TABLE)."""
        return names.affinity_table(self.name)

    def table_of(self, name: str) -> str:
        """The table of the object the planner calls `name`."""
        return self.affinity_table if in_affinity_table(name) else self.name

    def _obj(self, of: str, /, **fields: Any) -> dict[str, Any]:
        """`fields` in the table of the object the planner calls `of` (a
        chain or a set; a rule: its chain's)."""
        return {"family": self.family, "table": self.table_of(of), **fields}

    def _named(self, name: str, /, **fields: Any) -> dict[str, Any]:
        return self._obj(name, name=kernel_name(name), **fields)

    def add_tables(self) -> list[Json]:
        """Both tables of the family (`add` is idempotent), each marked as
        nftproxy's by its comment (core/nft/ownership.py)."""
        return [
            {"add": {"table": {"family": self.family, "name": name, "comment": TABLE_MARK}}}
            for name in (self.name, self.affinity_table)
        ]

    def marked_tables_text(self) -> str:
        """Both tables of the family in nft text, marked: what a batch of
        `declare_text` declarations starts with (plan.py `_add_set`)."""
        return "\n".join(
            f'add table {self.family} {name} {{ comment "{TABLE_MARK}"; }}'
            for name in (self.name, self.affinity_table)
        )

    def delete_tables(self) -> list[Json]:
        """Delete both tables of the family, whether they exist or not (an
        `add` before each `delete`: 1.0.6 has no `destroy`)."""
        out: list[Json] = []
        for add in self.add_tables():
            spec = add["add"]["table"]
            out += [add, {"delete": {"table": {"family": spec["family"], "name": spec["name"]}}}]
        return out

    def add_chain(self, chain: Chain) -> Json:
        fields = self._named(_check_name(chain.name))
        if chain.hook is not None:
            h = chain.hook
            fields.update(type=h.type, hook=h.hook, prio=h.prio, policy=h.policy)
        return {"add": {"chain": fields}}

    def flush_chain(self, name: str) -> Json:
        return {"flush": {"chain": self._named(name)}}

    def delete_chain(self, name: str) -> Json:
        return {"delete": {"chain": self._named(name)}}

    def add_rule(self, chain: str, rule: Rule) -> Json:
        fields = self._obj(chain, chain=kernel_name(chain), expr=list(rule.expr))
        return {"add": {"rule": _comment(fields, rule.comment)}}

    def add_rules(self, chain: Chain) -> list[Json]:
        return [self.add_rule(chain.name, r) for r in chain.rules]

    def add_set(self, decl: SetDecl) -> Json:
        kind = "map" if decl.map else "set"
        type_: Any = decl.type[0] if len(decl.type) == 1 else list(decl.type)
        data: Any = decl.map
        if self.declares_in_text(decl):
            raise OpError(f"{decl.name}: libnftables 1.0.6 declares it in text only")
        if self.declares_typeof(decl):
            type_ = {"typeof": typeof_key(decl.key)}
            data = {"typeof": typeof_key(decl.data)} if decl.data else decl.map and VERDICT_TYPEOF
        fields = self._named(_check_name(decl.name), type=type_)
        if data:
            fields["map"] = data
        if decl.flags:
            fields["flags"] = list(decl.flags)
        if decl.timeout is not None:
            fields["timeout"] = decl.timeout
        if decl.size is not None:
            fields["size"] = decl.size
        return {"add": {kind: _comment(fields, decl.comment)}}

    def declare_text(self, decl: SetDecl) -> str:
        """`decl` as nft text (`add table ...`, then `add map ... { typeof
        ...; }`), for `declares_in_text` declarations; idempotent like any `add`."""
        kind = "map" if decl.map else "set"
        typeof = " . ".join(decl.key)
        if decl.data:
            typeof += " : " + " . ".join(decl.data)
        body = [f"typeof {typeof}"]
        if decl.flags:
            body.append("flags " + ", ".join(decl.flags))
        if decl.timeout is not None:
            body.append(f"timeout {decl.timeout}s")
        if decl.size is not None:
            body.append(f"size {decl.size}")
        if decl.comment:
            body.append(f'comment "{names.comment(decl.comment)}"')
        name, table = kernel_name(_check_name(decl.name)), self.table_of(decl.name)
        head = f"add table {self.family} {table}"
        return f"{head}\nadd {kind} {self.family} {table} {name} {{ {'; '.join(body)}; }}"

    def flush_set(self, name: str, *, is_map: bool = False) -> Json:
        return {"flush": {"map" if is_map else "set": self._named(name)}}

    def delete_set(self, name: str, *, is_map: bool = False) -> Json:
        return {"delete": {"map" if is_map else "set": self._named(name)}}

    def add_set_elements(self, set_name: str, elems: Sequence[Any]) -> list[Json]:
        """Static elements (already JSON) of a set, as one command."""
        if not elems:
            return []
        return [{"add": {"element": self._named(set_name, elem=list(elems))}}]

    def add_elements(self, set_name: str, elements: Iterable[Element]) -> list[Json]:
        elem = ElementList(elements, with_comment=True)
        if not elem:
            return []
        return [{"add": {"element": self._named(set_name, elem=elem)}}]

    def delete_elements(self, set_name: str, elements: Iterable[Element]) -> list[Json]:
        elem = [key_json(e.key) for e in elements]
        if not elem:
            return []
        return [{"delete": {"element": self._named(set_name, elem=elem)}}]
