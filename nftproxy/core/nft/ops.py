"""libnftables JSON commands, built and checked in one place.

Layer: nft (pure). One job: turn fragment values into the JSON command
objects of one transaction (`{"add": {"chain": {...}}}` and friends), and
enforce the kernel's limits while doing so (names < 256 bytes, comments
<= 128 bytes: an over-long comment would make the kernel reject the whole
atomic transaction, kubernetes#139515), so no bad object reaches the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nftproxy.core.rules import names
from nftproxy.core.rules.fragment import Chain, CompactChain, Element, Json, Key, Rule, SetDecl

__all__ = ["OpError", "Table"]


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


def _key_json(key: Key) -> Any:
    return key[0] if len(key) == 1 else {"concat": list(key)}


@dataclass(frozen=True, slots=True)
class Table:
    """Command builder for one table (`family` "ip"/"ip6", `name`)."""

    family: str
    name: str

    def _obj(self, **fields: Any) -> dict[str, Any]:
        return {"family": self.family, "table": self.name, **fields}

    def add_table(self) -> Json:
        return {"add": {"table": {"family": self.family, "name": self.name}}}

    def add_chain(self, chain: Chain | CompactChain) -> Json:
        fields = self._obj(name=_check_name(chain.name))
        if chain.hook is not None:
            h = chain.hook
            fields.update(type=h.type, hook=h.hook, prio=h.prio, policy=h.policy)
        return {"add": {"chain": fields}}

    def flush_chain(self, name: str) -> Json:
        return {"flush": {"chain": self._obj(name=name)}}

    def delete_chain(self, name: str) -> Json:
        return {"delete": {"chain": self._obj(name=name)}}

    def add_rule(self, chain: str, rule: Rule) -> Json:
        fields = self._obj(chain=chain, expr=list(rule.expr))
        return {"add": {"rule": _comment(fields, rule.comment)}}

    def add_rules(self, chain: Chain | CompactChain) -> list[Json]:
        return [self.add_rule(chain.name, r) for r in chain.rules]

    def add_set(self, decl: SetDecl) -> Json:
        kind = "map" if decl.map else "set"
        type_: Any = decl.type[0] if len(decl.type) == 1 else list(decl.type)
        fields = self._obj(name=_check_name(decl.name), type=type_)
        if decl.map:
            fields["map"] = decl.map
        if decl.flags:
            fields["flags"] = list(decl.flags)
        if decl.timeout is not None:
            fields["timeout"] = decl.timeout
        return {"add": {kind: _comment(fields, decl.comment)}}

    def flush_set(self, decl: SetDecl) -> Json:
        kind = "map" if decl.map else "set"
        return {"flush": {kind: self._obj(name=decl.name)}}

    def delete_set(self, name: str, *, is_map: bool = False) -> Json:
        return {"delete": {"map" if is_map else "set": self._obj(name=name)}}

    def add_set_elements(self, set_name: str, elems: Sequence[Any]) -> list[Json]:
        """Static elements (already JSON) of a set, as one command."""
        if not elems:
            return []
        return [{"add": {"element": self._obj(name=set_name, elem=list(elems))}}]

    def add_elements(self, set_name: str, elements: Iterable[Element]) -> list[Json]:
        elem = [_element_json(e, with_comment=True) for e in elements]
        return self.add_set_elements(set_name, elem)

    def delete_elements(self, set_name: str, elements: Iterable[Element]) -> list[Json]:
        elem = [_key_json(e.key) for e in elements]
        if not elem:
            return []
        return [{"delete": {"element": self._obj(name=set_name, elem=elem)}}]


def _element_json(e: Element, *, with_comment: bool) -> Any:
    key = _key_json(e.key)
    if with_comment and e.comment:
        key = {"elem": {"val": key, "comment": names.comment(e.comment)}}
    if e.verdict is None:
        return key
    return [key, e.verdict.to_json()]
