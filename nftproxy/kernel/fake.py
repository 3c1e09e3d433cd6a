"""FakeBackend: an in-memory `Backend` (core/nft/seam.py) with the kernel's refusals.

Layer: kernel edge's test double (no kernel). One job: the Backend seam over
the fake tables of kernel/fake_tables.py -- each commit is one transaction
(kernel/fake_txn.py), kept only if every command succeeds -- and listings
in libnftables 1.0.6's JSON shapes, so proxier, agent and planner tests run
without root. `FakeBackend(version="1.1")` stands beside libnftables 1.1.x
instead: it takes declarations by typeof (core/nft/ops.py) and lists them
so, and lists the "dynamic" flag; objects stay in 1.0.6's listing order.
The refusals it models (ENOENT, EEXIST incl. a re-added "dynamic" set,
EBUSY, EOPNOTSUPP, EMLINK) are listed in kernel/fake_txn.py and checked
step by step against the real kernel in tests/test_backend.py.

Known limits: rule expressions and element keys are stored verbatim (the
kernel lists them in canonical form), and expression types, jump depth and
interval overlaps are not modelled.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.ownership import FoundTable, our_tables
from nftproxy.kernel.fake_tables import (
    ENOENT,
    FTable,
    Refused,
    TableKey,
    dynset_targets,
    listing,
)
from nftproxy.kernel.fake_text import parse_declarations
from nftproxy.kernel.fake_txn import Txn
from nftproxy.kernel.libnftables import METAINFO, Json, delete_tables_commands

__all__ = ["FakeBackend"]


class FakeBackend:
    """An in-memory nftables with the kernel's refusals, for tests.

    Each commit is applied to a copy-on-write view and kept only if every
    command succeeded (all or nothing), like a netlink batch. Refusals raise
    the same error types as the kernel (NftNotFound/NftExists/NftBusy, or
    NftRejected for EOPNOTSUPP, EMLINK, EINVAL); unlike libnftables they name
    the offending command (`command_index`). Commands it does not model
    raise NotImplementedError rather than being accepted silently.
    """

    def __init__(self, *, version: str = "1.0.6") -> None:
        if version not in ("1.0.6", "1.1"):
            raise ValueError(f"FakeBackend models libnftables 1.0.6 or 1.1, not {version}")
        self._v11 = version == "1.1"
        self._tables: dict[TableKey, FTable] = {}
        self._next_table_handle = 1
        self._generation = 1
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("FakeBackend already started")
        self._started = True

    def close(self) -> None:
        self._started = False

    def accepts_typeof(self) -> bool:
        """As libnftables 1.1.x (True) or 1.0.6 (the default); a property
        of the model, so it needs no start() (dry runs plan with a fake that
        is never started)."""
        return self._v11

    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError("FakeBackend not started (or closed)")

    def declare(self, texts: Sequence[str]) -> None:
        """nft text declarations (kernel/fake_text.py), as one transaction."""
        if texts:
            self._apply(parse_declarations(list(texts), v11=self._v11), text=True)

    def encoded(self, commands: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
        return commands  # the model applies commands, not text

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        if commands:
            self._apply(commands)

    def _apply(self, commands: Sequence[Mapping[str, Any]], *, text: bool = False) -> None:
        self._check_started()
        with self._lock:
            txn = Txn(
                self._tables,
                self._next_table_handle,
                dynset_targets(commands),
                v11=self._v11,
                text=text,
            )
            for index, command in enumerate(commands):
                try:
                    for verb, body in command.items():
                        if verb == "metainfo":
                            continue
                        for kind, spec in body.items():
                            txn.apply(verb, kind, spec)
                    if index == len(commands) - 1:
                        txn.check_loops()
                except Refused as exc:
                    raise exc.as_error(index, command) from None
            self._tables = txn.tables
            self._next_table_handle = txn.next_table_handle
            self._generation += 1

    def generation(self) -> int:
        """As the kernel's: one more for every commit that was kept."""
        self._check_started()
        with self._lock:
            return self._generation

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
                    raise Refused(ENOENT, "no such table").as_error(0, command)
                return {"nftables": head + doc}
            if what == "ruleset":
                return {"nftables": head + [o for t in tables for o in self._listing(t)]}
            if what == "tables":
                return {"nftables": head + [{"table": dict(t.obj)} for t in tables]}
            if what in ("chains", "sets", "maps"):
                missing = "table" in spec and (family, spec["table"]) not in self._tables
                if what == "sets" and missing:
                    raise Refused(ENOENT, "no such table").as_error(0, command)
                kind = what[:-1]
                objs = [o for t in tables for o in self._listing(t, elems=False) if kind in o]
                return {"nftables": head + objs}
        raise NotImplementedError(f"FakeBackend does not model list {what}")

    def _list_table_locked(self, family: str, table: str) -> list[Json] | None:
        t = self._tables.get((family, table))
        return None if t is None else self._listing(t)

    def _listing(self, t: FTable, *, elems: bool = True) -> list[Json]:
        return listing(t, elems=elems, dynamic_flag=self._v11)

    def list_table(self, family: str, table: str) -> Json | None:
        self._check_started()
        with self._lock:
            objects = self._list_table_locked(family, table)
        return None if objects is None else {"nftables": objects}

    def list_table_objects(self, family: str, table: str) -> TableListing | None:
        self._check_started()
        with self._lock:
            t = self._tables.get((family, table))
            if t is None:
                return None
            return TableListing.from_json(family, table, self._listing(t, elems=False))

    def find_tables(self, table: str) -> list[FoundTable]:
        """As NftBackend.find_tables: which of the tables nftproxy writes
        for `table` exist, with the comment each was created with."""
        self._check_started()
        with self._lock:
            return [
                FoundTable(family, name, t.comment)
                for family, name in our_tables(table)
                if (t := self._tables.get((family, name))) is not None
            ]

    def delete_tables(self, table: str) -> None:
        self.commit(delete_tables_commands(table))
