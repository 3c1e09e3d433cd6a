"""Which tables are nftproxy's: the mark it writes, and the refusal to touch others.

Layer: nft (pure). One job: the comment every table nftproxy creates
carries (`TABLE_MARK`, written by core/nft/ops.py `Table.add_tables`), the
tables a `--table-name` stands for (`our_tables`: both names of the pair
and their affinity tables, per family), and the decision, from what the
kernel edge found (`FoundTable`, kernel/libnftables.py `find_tables`), that
one of them exists without the mark (`foreign_table`) -- `sync`, `run` and
`cleanup` then touch nothing and say so (`refusal`).

The mark must be the same text every time: the kernel keeps the comment a
table was created with and ignores the one of a later `add table`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nftproxy.core.rules import names

__all__ = ["FAMILIES", "TABLE_MARK", "FoundTable", "foreign_table", "our_tables", "refusal"]

TABLE_MARK = "managed by nftproxy"
"""The comment of every table nftproxy creates."""

FAMILIES = ("ip", "ip6")


@dataclass(frozen=True, slots=True)
class FoundTable:
    """A table that exists: its family, name and comment (None: no comment)."""

    family: str
    name: str
    comment: str | None = None

    @property
    def marked(self) -> bool:
        return self.comment == TABLE_MARK


def our_tables(table: str) -> tuple[tuple[str, str], ...]:
    """(family, name) of every table nftproxy writes for `--table-name table`:
    both names of the pair it switches between (names.table_pair)."""
    return tuple(
        (family, name)
        for family in FAMILIES
        for main in names.table_pair(table)
        for name in (main, names.affinity_table(main))
    )


def foreign_table(found: Iterable[FoundTable]) -> FoundTable | None:
    """The first existing table without nftproxy's mark, or None when every
    one is nftproxy's (or none exists)."""
    return next((t for t in found if not t.marked), None)


def refusal(table: FoundTable) -> str:
    """One line: which table, why it is left alone, and what to do."""
    return (
        f"table {table.family} {table.name} exists and was not created by nftproxy "
        f"(its comment is not {TABLE_MARK!r}); nftproxy never touches another table: "
        "choose another name with --table-name or tableName"
    )
