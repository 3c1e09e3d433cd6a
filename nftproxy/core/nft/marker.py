"""The kube-proxy marker: a table peers find when they look for kube-proxy's.

Layer: nft (pure: decides and builds commands, touches nothing). One job:
what nftproxy writes so that a tool which detects kube-proxy's nftables
mode by its table sees an nftables proxy on this node, and what it removes
again. Calico Felix's `nftablesMode: Auto` lists the chains of `ip
kube-proxy`, then `ip6 kube-proxy`, and picks nftables when one of them has
a chain (calico#11629); nftproxy's own tables have another name.

- The marker is `ip kube-proxy` and `ip6 kube-proxy`, created only where no
  table of that name exists (`create table`: the kernel refuses the whole
  transaction if one appeared meanwhile), with nftproxy's ownership mark
  (core/nft/ownership.py), holding one regular chain, MARKER_CHAIN, with no
  rule and no hook: no packet reaches it, and no object in it is named like
  kube-proxy's, so nothing reads it as kube-proxy's rules.
- A table of that name without the mark is kube-proxy's own (comment
  KUBE_PROXY_COMMENT) or someone else's: it is never written, flushed or
  deleted (`ensure_commands`, `removal_commands` give nothing for it).
- kube-proxy's start over the marker works: its `add table` keeps the
  table (and the mark: the kernel keeps a table's first comment), and its
  syncs delete only stale chains named like its service chains (with a
  `/`, which MARKER_CHAIN has not); `kube-proxy --cleanup` deletes the
  table, and nftproxy creates it again (agent/marker.py).
- Removal (`nftproxy cleanup`) deletes a marked table that holds only the
  marker chain; one kube-proxy has written into keeps its rules and loses
  only the marker chain.

Callers: agent/marker.py `KubeProxyMarker`, over a `MarkerBackend`
(NftBackend and FakeBackend as they are). docs/ruleset.md shows the marker
in a listing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from nftproxy.core.nft.commands import AddChain, AddTable, Command, DeleteChain, DeleteTable, Where
from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.ownership import FAMILIES, TABLE_MARK, FoundTable

__all__ = [
    "FAMILIES",
    "KUBE_PROXY_COMMENT",
    "MARKER_CHAIN",
    "MARKER_COMMENT",
    "MARKER_TABLE",
    "MarkerBackend",
    "create_commands",
    "ensure_commands",
    "foreign_notice",
    "marker_only",
    "marker_tables",
    "removal_commands",
]

MARKER_TABLE = "kube-proxy"
"""kube-proxy's nftables table name, the one peers look for."""

MARKER_CHAIN = "nftproxy-marker"
"""The marker's one chain: regular, without rules."""

MARKER_COMMENT = (
    "nftproxy serves this node's Services. No rules, no hook: a marker for tools "
    "that look for kube-proxy (docs/ruleset.md)"
)
"""The marker chain's comment (at most 128 bytes, libnftables' limit)."""

KUBE_PROXY_COMMENT = "rules for kube-proxy"
"""The comment kube-proxy's nftables mode gives its table."""


class MarkerBackend(Protocol):
    """What the marker needs of nftables: NftBackend has it as it is."""

    def find_tables(self, table: str) -> list[FoundTable]:
        """The tables nftproxy would write for the name `table` that exist
        (`table` itself among them), each with its comment."""

    def list_table_objects(self, family: str, table: str) -> TableListing | None:
        """The chains and sets of one table, or None when it does not exist."""

    def commit(self, commands: Sequence[Command], *, fresh: bool = False) -> None:
        """`commands` as one transaction (an NftError if refused)."""


def marker_tables(found: Iterable[FoundTable]) -> dict[str, FoundTable]:
    """By family, the tables named MARKER_TABLE among `found`."""
    return {t.family: t for t in found if t.name == MARKER_TABLE and t.family in FAMILIES}


def _where(family: str) -> Where:
    return Where(family, MARKER_TABLE)


def create_commands(family: str) -> tuple[Command, ...]:
    """The marker of `family`, created where no table of its name exists."""
    return (AddTable(_where(family), TABLE_MARK, create=True), _chain(family))


def _chain(family: str) -> Command:
    return AddChain(_where(family), MARKER_CHAIN, comment=MARKER_COMMENT)


def ensure_commands(
    family: str, table: FoundTable | None, listing: TableListing | None
) -> tuple[Command, ...]:
    """What makes `family`'s marker whole: nothing when the table is not
    nftproxy's, or is and holds the marker chain. `listing` is the table's
    as listed after `table` was found (None: gone since)."""
    if table is None or (table.marked and listing is None):
        return create_commands(family)
    if not table.marked or listing is None or MARKER_CHAIN in listing.chains:
        return ()
    return (_chain(family),)


def marker_only(listing: TableListing) -> bool:
    """Whether a marker table holds the marker chain and nothing else (no
    chain or set kube-proxy wrote into it since)."""
    return set(listing.chains) <= {MARKER_CHAIN} and not listing.sets


def removal_commands(
    family: str, table: FoundTable, listing: TableListing | None
) -> tuple[Command, ...]:
    """What removes nftproxy's marker of `family`: the table when it holds
    the marker chain alone, the chain alone when kube-proxy has written
    into the table since, nothing when the table is not nftproxy's."""
    if not table.marked or listing is None:
        return ()
    if marker_only(listing):
        return (DeleteTable(_where(family)),)
    if MARKER_CHAIN in listing.chains:
        return (DeleteChain(_where(family), MARKER_CHAIN),)
    return ()


def foreign_notice(table: FoundTable) -> str:
    """One line: the kube-proxy table found is not nftproxy's, and is left."""
    said = "no comment" if table.comment is None else f"comment {table.comment!r}"
    whose = "kube-proxy's own" if table.comment == KUBE_PROXY_COMMENT else "not nftproxy's"
    return (
        f"table {table.family} {MARKER_TABLE} exists ({said}): {whose}, left untouched; "
        "kube-proxy's leftover rules conflict with nftproxy's, remove them with "
        "`kube-proxy --cleanup` (deploy/README.md); nftproxy's marker replaces the "
        "table once it is gone"
    )
