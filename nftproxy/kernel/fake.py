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

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from nftproxy.core.nft.commands import Command
from nftproxy.core.nft.errors import NftUnavailable
from nftproxy.core.nft.jsontext import METAINFO
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
from nftproxy.kernel.fake_text import parse_transaction
from nftproxy.kernel.fake_txn import Txn
from nftproxy.kernel.libnftables import PRINTERS, Json, delete_tables_commands

__all__ = ["FakeBackend"]


def _without_set_comment(command: Json) -> Json:
    """As libnftables' JSON parser reads it: a set's or map's comment is dropped."""
    add = command.get("add")
    if isinstance(add, dict) and len(add) == 1:
        ((kind, spec),) = add.items()
        if kind in ("set", "map") and "comment" in spec:
            return {"add": {kind: {k: v for k, v in spec.items() if k != "comment"}}}
    return command


class FakeBackend:
    """An in-memory nftables with the kernel's refusals, for tests.

    Each commit is applied to a copy-on-write view and kept only if every
    command succeeded (all or nothing), like a netlink batch. Refusals raise
    the same error types as the kernel (NftNotFound/NftExists/NftBusy, or
    NftRejected for EOPNOTSUPP, EMLINK, EINVAL); unlike libnftables they name
    the offending command (`command_index`). Commands it does not model
    raise NotImplementedError rather than being accepted silently.
    """

    def __init__(self, *, version: str = "1.0.6", syntax: str = "nft") -> None:
        if version not in ("1.0.6", "1.1"):
            raise ValueError(f"FakeBackend models libnftables 1.0.6 or 1.1, not {version}")
        if syntax not in PRINTERS:
            raise ValueError(f"syntax {syntax!r}: one of {sorted(PRINTERS)}")
        self._v11 = version == "1.1"
        self.syntax = syntax
        self._print = PRINTERS[syntax]
        self._tables: dict[TableKey, FTable] = {}
        self._next_table_handle = 1
        self._generation = 1
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("FakeBackend already started")
        if self.syntax == "json" and not self._v11:
            raise NftUnavailable("libnftables 1.0.6's JSON declares no set by typeof")
        self._started = True

    def close(self) -> None:
        self._started = False

    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError("FakeBackend not started (or closed)")

    def encoded(self, commands: Sequence[Command]) -> Sequence[Command]:
        return commands  # printed when committed, as sent

    def commit(self, commands: Sequence[Command], *, fresh: bool = False) -> None:
        """Print `commands` as NftBackend would, read the text back, apply it."""
        if commands:
            self._apply(self._read(self._print(commands)))

    def _read(self, text: str) -> list[Mapping[str, Any]]:
        """The JSON commands of a printed transaction: libnftables JSON as
        parsed, nft's syntax as kernel/fake_text.py reads it."""
        if self.syntax == "json":
            objects: list[Json] = json.loads(text)["nftables"]
            return [_without_set_comment(o) for o in objects if "metainfo" not in o]
        return list(parse_transaction(text, v11=self._v11))

    def _apply(self, commands: Sequence[Mapping[str, Any]]) -> None:
        self._check_started()
        with self._lock:
            txn = Txn(
                self._tables,
                self._next_table_handle,
                dynset_targets(commands),
                v11=self._v11,
            )
            for index, command in enumerate(commands):
                try:
                    for verb, body in command.items():
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
            self._apply([command])
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
