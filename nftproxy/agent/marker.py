"""Keeping nftproxy's kube-proxy marker (core/nft/marker.py) on the node.

Layer: agent (imports the core; reaches nftables only through
`MarkerBackend`). One job: create the marker where it is missing, say once
when a table of kube-proxy's stands in its place, and remove it again.
`ensure` runs after each full sync of the agent (`on_sync`: the first one
at start-up, then hourly and after another process committed, such as
`kube-proxy --cleanup` deleting the marker: agent/drift.py) and after
`nftproxy sync`; `remove` runs in `nftproxy cleanup`. Callers:
agent/agent.py, tools/cli.py.

The marker is not service state: it goes in a small transaction of its
own, sent only when something is missing. In the agent that transaction is
counted as nftproxy's own (`committing`: Proxier.committing_aside), so the
drift check does not take it for another process's commit and sync fully
again. `ensure` logs a failure and returns; it never stops a sync.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from nftproxy.agent.report import SyncReport
from nftproxy.core.nft.commands import Command
from nftproxy.core.nft.errors import NftError
from nftproxy.core.nft.marker import (
    FAMILIES,
    MARKER_TABLE,
    MarkerBackend,
    ensure_commands,
    foreign_notice,
    marker_only,
    marker_tables,
    removal_commands,
)
from nftproxy.core.nft.ownership import FoundTable

__all__ = ["KubeProxyMarker", "Removal"]


@dataclass(frozen=True, slots=True)
class Removal:
    """What `KubeProxyMarker.remove` did, per family."""

    deleted: tuple[str, ...] = ()
    """Marker tables deleted."""
    adopted: tuple[str, ...] = ()
    """Marker tables kube-proxy has written into: only the marker chain went."""
    foreign: tuple[FoundTable, ...] = ()
    """Tables of the name that are not nftproxy's: left."""

    def lines(self) -> list[str]:
        """What `nftproxy cleanup` prints about it."""
        out = [f"deleted table {f} {MARKER_TABLE} (nftproxy's marker)" for f in self.deleted]
        out += [
            f"kept table {f} {MARKER_TABLE}: kube-proxy's rules are in it now "
            "(only nftproxy's marker chain deleted)"
            for f in self.adopted
        ]
        out += [
            f"left table {t.family} {MARKER_TABLE}: not nftproxy's (comment {t.comment!r})"
            for t in self.foreign
        ]
        return out


class KubeProxyMarker:
    """The marker of one node (both families). `committing` wraps the
    marker's own commit (the agent's drift accounting; nothing by default)."""

    def __init__(
        self,
        backend: MarkerBackend,
        *,
        committing: Callable[[Sequence[Command]], AbstractContextManager[object]] = nullcontext,
        log: logging.Logger | None = None,
    ) -> None:
        self.backend = backend
        self.committing = committing
        self.log = log or logging.getLogger(__name__)
        self._foreign: set[str] = set()
        """Families whose foreign table was logged, while it stays."""

    def on_sync(self, report: SyncReport) -> None:
        """Post-commit hook: the marker is checked after each full sync."""
        if report.full:
            self.ensure()

    def ensure(self) -> tuple[str, ...]:
        """Write what is missing of the marker: the families written (none
        when it is whole, where kube-proxy's table stands, or on failure)."""
        try:
            found = marker_tables(self.backend.find_tables(MARKER_TABLE))
            commands: list[Command] = []
            written: list[str] = []
            for family in FAMILIES:
                table = found.get(family)
                self._note(family, table)
                listing = (
                    self.backend.list_table_objects(family, MARKER_TABLE)
                    if table is not None and table.marked
                    else None
                )
                if missing := ensure_commands(family, table, listing):
                    commands += missing
                    written.append(family)
            if commands:
                with self.committing(commands):
                    self.backend.commit(commands)
        except NftError as exc:
            self.log.warning("cannot write nftproxy's kube-proxy marker; retrying after the "
                             "next full sync", extra={"error": str(exc)})
            return ()
        if written:
            self.log.info("kube-proxy marker written", extra={
                "tables": ", ".join(f"{f} {MARKER_TABLE}" for f in written)})
        return tuple(written)

    def _note(self, family: str, table: FoundTable | None) -> None:
        """Say once that a table not nftproxy's holds the marker's place."""
        if table is None or table.marked:
            self._foreign.discard(family)
        elif family not in self._foreign:
            self._foreign.add(family)
            self.log.warning(foreign_notice(table))

    def remove(self) -> Removal:
        """Delete nftproxy's marker, in one transaction; NftError if the
        tables cannot be read or the deletion is refused."""
        found = marker_tables(self.backend.find_tables(MARKER_TABLE))
        commands: list[Command] = []
        deleted: list[str] = []
        adopted: list[str] = []
        for family in FAMILIES:
            table = found.get(family)
            if table is None or not table.marked:
                continue
            listing = self.backend.list_table_objects(family, MARKER_TABLE)
            if gone := removal_commands(family, table, listing):
                commands += gone
                (deleted if listing is not None and marker_only(listing) else adopted).append(
                    family)
        if commands:
            self.backend.commit(commands)
        foreign = tuple(t for f in FAMILIES if (t := found.get(f)) is not None and not t.marked)
        return Removal(tuple(deleted), tuple(adopted), foreign)
