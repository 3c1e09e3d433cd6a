"""The commands of one table, built from fragment values.

Layer: nft (pure). One job: turn fragment values into the typed commands of
one transaction (core/nft/commands.py), in the table each object lives in
(the main table, or its affinity table: fragment.AFFINITY_TABLE), with
comments as both printers can say them and within the kernel's budget (an
over-long comment would make the kernel reject the whole atomic
transaction, kubernetes#139515).

Sets and maps are declared by typeof, in both printers: the form both
userspaces list cleanly (a set 1.1.x declares by datatype crashes nft
1.0.6's listing, kubernetes#136786).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from nftproxy.core.nft.commands import (
    AddChain,
    AddElements,
    AddRule,
    AddSet,
    AddTable,
    Command,
    DeleteChain,
    DeleteElements,
    DeleteSet,
    DeleteTable,
    FlushChain,
    FlushSet,
    Where,
)
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

__all__ = ["Table", "typeof_key"]


def typeof_key(key: tuple[str, ...]) -> Json:
    """The libnftables JSON expression of a key given by selectors."""
    exprs = [SELECTORS[part][0] for part in key]
    return exprs[0] if len(exprs) == 1 else {"concat": exprs}


def _comment(text: str | None) -> str | None:
    return names.comment(text) if text else None


@dataclass(frozen=True, slots=True)
class Table:
    """Command builder for one family's tables (`family` "ip"/"ip6", `name`)."""

    family: str
    name: str

    @staticmethod
    def declared_typeof(decl: SetDecl) -> str:
        """The key expression `add_set(decl)` declares, as a listing shows it."""
        return expr_text(typeof_key(decl.key))

    @property
    def affinity_table(self) -> str:
        """The name of the family's second table: the chains of the ports
        with ClientIP affinity (fragment.AFFINITY_TABLE)."""
        return names.affinity_table(self.name)

    def table_of(self, name: str) -> str:
        """The table of the object the planner calls `name`."""
        return self.affinity_table if in_affinity_table(name) else self.name

    def _where(self, of: str) -> Where:
        """The table of the object the planner calls `of` (a chain or a
        set; a rule: its chain's)."""
        return Where(self.family, self.table_of(of))

    def add_tables(self) -> list[Command]:
        """Both tables of the family (`add` is idempotent), each marked as
        nftproxy's by its comment (core/nft/ownership.py)."""
        return [
            AddTable(Where(self.family, name), TABLE_MARK)
            for name in (self.name, self.affinity_table)
        ]

    def delete_tables(self) -> list[Command]:
        """Delete both tables of the family, whether they exist or not (an
        `add` before each `delete`: 1.0.6 has no `destroy`)."""
        out: list[Command] = []
        for add in self.add_tables():
            assert isinstance(add, AddTable)
            out += [add, DeleteTable(add.where)]
        return out

    def add_chain(self, chain: Chain) -> Command:
        return AddChain(self._where(chain.name), kernel_name(chain.name), chain.hook)

    def flush_chain(self, name: str) -> Command:
        return FlushChain(self._where(name), kernel_name(name))

    def delete_chain(self, name: str) -> Command:
        return DeleteChain(self._where(name), kernel_name(name))

    def add_rule(self, chain: str, rule: Rule) -> Command:
        if rule.comment:
            rule = replace(rule, comment=names.comment(rule.comment))
        return AddRule(self._where(chain), kernel_name(chain), rule)

    def add_rules(self, chain: Chain) -> list[Command]:
        return [self.add_rule(chain.name, r) for r in chain.rules]

    def add_set(self, decl: SetDecl) -> Command:
        if decl.comment:
            decl = replace(decl, comment=_comment(decl.comment))
        return AddSet(self._where(decl.name), kernel_name(decl.name), decl)

    def flush_set(self, name: str, *, is_map: bool = False) -> Command:
        return FlushSet(self._where(name), kernel_name(name), is_map)

    def delete_set(self, name: str, *, is_map: bool = False) -> Command:
        return DeleteSet(self._where(name), kernel_name(name), is_map)

    def add_set_elements(self, decl: SetDecl) -> list[Command]:
        """A declaration's static elements, as one command."""
        if not decl.elements:
            return []
        elements = tuple(Element(decl.name, (e,)) for e in decl.elements)
        return [AddElements(self._where(decl.name), kernel_name(decl.name), elements)]

    def add_elements(self, set_name: str, elements: Iterable[Element]) -> list[Command]:
        elems = tuple(elements)
        if not elems:
            return []
        return [AddElements(self._where(set_name), kernel_name(set_name), elems)]

    def delete_elements(self, set_name: str, elements: Iterable[Element]) -> list[Command]:
        keys = tuple(e.key for e in elements)
        if not keys:
            return []
        return [DeleteElements(self._where(set_name), kernel_name(set_name), keys)]
