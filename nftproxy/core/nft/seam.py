"""The one seam between nftproxy and nftables: the `Backend` protocol.

Layer: nft (pure; a Protocol, no kernel access). One job: say what the rest
of the program may ask of nftables. Implemented by kernel/libnftables.py
`NftBackend` (the real one) and kernel/fake.py `FakeBackend` (in memory, with
the kernel's refusals; tests/test_backend.py runs both on the same steps).
Used by the proxier and the agent; only `tools/cli.py` builds a real one.

Refusals raise the nft.errors tree (NftNotFound, NftExists, NftBusy, other
NftRejected); a refused commit changed nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from nftproxy.core.nft.commands import Command
from nftproxy.core.nft.listing import TableListing

__all__ = ["Backend"]


class Backend(Protocol):
    """What nftproxy needs of nftables."""

    def start(self) -> None:
        """Get ready (NftUnavailable if nftables cannot be reached)."""

    def close(self) -> None:
        """Release everything; idempotent and final."""

    def generation(self) -> int:
        """The ruleset generation of the namespace: one more for every
        committed transaction of any process (OSError if it cannot be read;
        agent/drift.py)."""

    def commit(self, commands: Sequence[Command], *, fresh: bool = False) -> None:
        """Apply `commands` (core/nft/commands.py) as one atomic transaction;
        nothing for an empty list. `fresh` asks for a throwaway context (a
        hint for large full syncs)."""

    def encoded(self, commands: Sequence[Command]) -> Sequence[Command]:
        """`commands` as `commit` takes them, with what it would first make
        of them (their printed text) made now, in the calling thread:
        a full sync in steps encodes one step while the previous one commits
        (agent/chunked.py)."""

    def run_json(self, command: Mapping[str, Any]) -> dict[str, Any]:
        """Run one JSON command (typically a list) and return the output
        document `{"nftables": [...]}`."""

    def list_table(self, family: str, table: str) -> dict[str, Any] | None:
        """Everything in one table as libnftables lists it, or None."""

    def list_table_objects(self, family: str, table: str) -> TableListing | None:
        """The chains and set/map declarations of one table, or None."""

    def delete_tables(self, table: str) -> None:
        """Delete `ip table` and `ip6 table`, whichever exist; idempotent."""
