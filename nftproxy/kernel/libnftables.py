"""NftBackend: the real `Backend` (core/nft/seam.py), over libnftables.

Layer: kernel edge (the only module that talks to libnftables; its test
double is kernel/fake.py). One job: print one transaction's typed commands
(core/nft/commands.py) with the printer chosen when the backend is built,
apply it atomically, and list what one table holds (`list_table_objects`
-> core/nft/listing.py `TableListing`).
Callers: the proxier (commit, list_table_objects), the agent
(start, close), the CLI (list_table for `dump`, delete_tables for `cleanup`,
find_tables before `sync`, `run` and `cleanup`: core/nft/ownership.py) and
the tests; `cli.py` builds the real NftBackend, tests build FakeBackend.

NftBackend keeps ONE long-lived libnftables context, owned by a worker thread
that serves every call over a queue:
- a context is not thread-safe, so calls must be serialised;
- libnftables 1.0.6 opens its netlink socket in `nft_ctx_new()`, so the
  context belongs to the network namespace of the *thread* that created it
  (docs/nft-python-notes.md §1). With `netns=` the worker enters that
  namespace first and never leaves it; the rest of the process stays put;
- long-lived, because freeing a context is slow and a new one must
  re-fetch its cache (nft-incremental-notes.md "Recommendation" 1);
- echo stays off (it doubles the output of a large transaction); JSON output on.
Full syncs of a large cluster may use `commit(..., fresh=True)`: a temporary
context on the same worker, freed right after, then `malloc_trim(0)` -- its
cache is large (docs/nft-python-notes.md §2 "Memory").

Listing on 1.0.6: `list tables` fetches everything; JSON `list
chains/sets/maps` honour "family" but ignore "table" (we filter), except
that `list sets` with a missing "table" fails with ENOENT, which is how
`list_table_objects` detects a missing table; with the *terse* output
flag, sets and maps come without elements (their elements are not even
fetched), so one batch [sets(table), maps, chains] costs what its chains
cost. Several list commands in one batch print one JSON document each.

Printers (`PRINTERS`): nft's own syntax (core/nft/nfttext.py), the
default, which both userspaces parse whole and in less time
(bench/RESULTS.md, "What moved the numbers"); or JSON (core/nft/jsontext.py),
which only 1.1.x can take (1.0.6's JSON declares no set by typeof and drops
a table's comment): `start()` refuses it on 1.0.6. Every transaction of a
backend goes through its one printer; a refused transaction is sent once,
and the errno in libnftables' text types the error. A table name nft's
syntax cannot say (one of its keywords, such as `mark`) is refused at
start-up (tools/cli.py).

Known limits:
- command_index is None for kernel errors (libnftables 1.0.6 names no
  command); only JSON parse errors carry it (see nft.errors).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

from nftproxy.core.nft import jsontext, nfttext
from nftproxy.core.nft.commands import Command
from nftproxy.core.nft.errors import (
    NftNotFound,
    NftUnavailable,
    rejection,
)
from nftproxy.core.nft.listing import TableListing
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.ownership import FoundTable, our_tables
from nftproxy.core.rules import names
from nftproxy.kernel import netns as _netns
from nftproxy.kernel.nftgen import read_generation
from nftproxy.kernel.nfttables import read_tables

__all__ = [
    "NftBackend",
    "delete_tables_commands",
    "malloc_trim",
    "tune_malloc",
]

_log = logging.getLogger(__name__)

Json = dict[str, Any]
T = TypeVar("T")

FAMILIES = ("ip", "ip6")


# --- glibc malloc -------------------------------------------------------------

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 512 * 1024
_TRIM_THRESHOLD = 256 * 1024 * 1024


def tune_malloc() -> bool:
    """Set glibc's malloc thresholds for libnftables' allocation pattern.

    Call once at startup, *before* any context exists: the thresholds only
    steer later allocations, and the context's cache is what must land in
    memory glibc can hand back (nft-python-notes.md §2 "Memory": without
    this, most of a full transaction's memory stays after malloc_trim(0)).
    A fixed `_MMAP_THRESHOLD` keeps big buffers (the transaction text,
    output buffers) in mmap, which free() returns at once -- the default
    threshold grows after the first big free and then keeps them on the
    heap; it is small enough for the texts of a full sync's overlapping
    steps (agent/chunked.py), which fragmented the heap. `_TRIM_THRESHOLD`
    stops glibc from trimming the heap top on every free between syncs
    (explicit malloc_trim(0) after full syncs still works). The unit may
    set the same values with GLIBC_TUNABLES instead. Returns False if this
    libc has no mallopt or refused a value.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_mmap: bool = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    ok_trim: bool = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    return ok_mmap and ok_trim


def malloc_trim() -> None:
    """glibc malloc_trim(0): give freed heap memory back to the kernel."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --- the real backend ---------------------------------------------------------


def _new_context() -> Any:
    """A libnftables context for the calling thread's netns: JSON out, no echo."""
    try:
        import nftables  # Debian's python3-nftables (docs/userspaces.md)
    except ImportError as exc:
        raise NftUnavailable("python module 'nftables' (python3-nftables) not found") from exc
    try:
        ctx = nftables.Nftables()
    except OSError as exc:
        raise NftUnavailable(f"libnftables: {exc}") from exc
    ctx.set_json_output(True)
    ctx.set_echo_output(False)
    return ctx


PRINTERS: Mapping[str, Callable[[Sequence[Command]], str]] = {
    "nft": nfttext.transaction_text,
    "json": jsontext.transaction_text,
}
"""The two printers of a transaction, by the name a backend is built with."""


class _Encoded(Sequence[Command]):
    """Commands and the text of their transaction (`NftBackend.encoded`)."""

    __slots__ = ("commands", "text")

    def __init__(self, commands: Sequence[Command], text: str) -> None:
        self.commands, self.text = commands, text

    @overload
    def __getitem__(self, index: int) -> Command: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Command]: ...
    def __getitem__(self, index: int | slice) -> Any:
        return self.commands[index]

    def __len__(self) -> int:
        return len(self.commands)


def _run(ctx: Any, text: str) -> tuple[int, str, str]:
    rc, out, err = ctx.cmd(text)
    return int(rc), str(out), str(err)


def _run_fresh(text: str) -> tuple[int, str, str]:
    ctx = _new_context()
    result = _run(ctx, text)
    del ctx  # the last reference: Nftables.__del__ -> nft_ctx_free(), now
    return result


_TYPEOF_PROBE = {
    "nftables": [
        {"add": {"table": {"family": "ip", "name": "nftproxy-typeof-probe"}}},
        {
            "add": {
                "set": {
                    "family": "ip",
                    "table": "nftproxy-typeof-probe",
                    "name": "probe",
                    "type": {"typeof": {"meta": {"key": "l4proto"}}},
                }
            }
        },
    ]
}


def _dry_run(ctx: Any, text: str) -> int:
    """libnftables' rc for `text`, parsed and evaluated, not sent to the kernel."""
    ctx.set_dry_run(True)
    try:
        rc, _, _ = _run(ctx, text)
    finally:
        ctx.set_dry_run(False)
    return rc


def _accepts_typeof(ctx: Any) -> bool:
    """Whether this libnftables' JSON declares sets by typeof: a dry run
    (nothing reaches the kernel); 1.0.6 refuses it as "Invalid set datatype"."""
    return _dry_run(ctx, json.dumps(_TYPEOF_PROBE)) == 0


def _run_terse(ctx: Any, text: str) -> tuple[int, str, str]:
    """Run with the terse flag: sets and maps are listed without elements
    (and, on 1.0.6, their elements are not even fetched)."""
    ctx.set_terse_output(True)
    try:
        return _run(ctx, text)
    finally:
        ctx.set_terse_output(False)


def _documents(out: str) -> Iterator[Json]:
    """The JSON documents in libnftables output: one per list command."""
    decoder = json.JSONDecoder()
    pos, end = 0, len(out)
    while True:
        while pos < end and out[pos].isspace():
            pos += 1
        if pos >= end:
            return
        doc, pos = decoder.raw_decode(out, pos)
        yield doc


def _objects(out: str) -> list[Json]:
    """All listed objects of all documents, without the metainfo headers."""
    return [
        item
        for doc in _documents(out)
        for item in doc.get("nftables", ())
        if "metainfo" not in item
    ]


def dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


def delete_tables_commands(table: str) -> list[Command]:
    """Delete every table nftproxy writes for `table` (both names of the
    pair, their affinity tables, ip and ip6), whether they exist or not
    (ops.Table.delete_tables)."""
    return [
        command
        for family in FAMILIES
        for name in names.table_pair(table)
        for command in Table(family, name).delete_tables()
    ]


def _unavailable(exc: BaseException) -> BaseException:
    if isinstance(exc, NftUnavailable):
        return exc
    return NftUnavailable(f"cannot create a libnftables context: {exc}")


class NftBackend(_netns.WorkerOwner[Any]):
    """libnftables, in the caller's netns or in a named one (`netns=`).

    `start()` creates the context (NftUnavailable if it cannot); every other
    method may be called from any thread. Use as a context manager or call
    `close()`. Transactions are printed by one printer, chosen when the
    backend is built: nft's syntax (`syntax="nft"`, the default: both
    userspaces parse every command in it) or JSON (`"json"`: libnftables
    1.1.x only, whose JSON declares sets by typeof; start() refuses it on
    1.0.6).
    """

    def __init__(self, *, netns: str | None = None, syntax: str = "nft") -> None:
        if syntax not in PRINTERS:
            raise ValueError(f"syntax {syntax!r}: one of {sorted(PRINTERS)}")
        self._worker = _netns.Worker(netns, _new_context, name="nft", wrap_error=_unavailable)
        self._typeof: bool | None = None
        self.syntax = syntax

    def start(self) -> None:
        super().start()
        if self.syntax == "json" and not self.accepts_typeof():
            self.close()
            raise NftUnavailable("this libnftables' JSON declares no set by typeof (1.0.6): "
                                 "its transactions must be printed in nft's syntax")

    def accepts_typeof(self) -> bool:
        """Whether this libnftables' JSON declares sets by typeof: True for
        1.1.x, False for 1.0.6 (probed once)."""
        if self._typeof is None:
            self._typeof = self._call(_accepts_typeof)
        return self._typeof

    def parses_table_name(self, name: str) -> bool:
        """Whether nft's syntax can say `name` as a table name (a dry run:
        nothing reaches the kernel). It cannot when the name is one of nft's
        keywords (`mark`, `ip`, `eq` ...; the list grows with the version),
        so such a table cannot be programmed by the nft printer."""
        return self._call(lambda ctx: _dry_run(ctx, f"add table ip {name}")) == 0

    def generation(self) -> int:
        """The ruleset generation of the backend's namespace (kernel/nftgen.py)."""
        return self._call(lambda _ctx: read_generation())

    def close(self) -> None:
        """Free the context, stop the worker, give memory back. Idempotent."""
        super().close()
        malloc_trim()

    def _call(self, fn: Callable[[Any], T]) -> T:
        return self._worker.call(fn)

    def commit(self, commands: Sequence[Command], *, fresh: bool = False) -> None:
        """Apply `commands` as ONE atomic transaction (one libnftables call).

        Nothing happens for an empty list. `fresh=True` runs it on a
        temporary context that is freed afterwards (large full syncs). Raises
        an NftRejected subclass when libnftables refuses; then nothing was
        applied. A refusal is sent once: its errno text types it.
        """
        if not commands:
            return
        text = commands.text if isinstance(commands, _Encoded) else self.printed(commands)
        rc, err = self._send(text, fresh=fresh)
        if rc != 0:
            raise rejection(err.strip(), commands, first_index=1 if self.syntax == "json" else 0)

    def _send(self, text: str, *, fresh: bool) -> tuple[int, str]:
        """One libnftables call: rc and the error text."""
        if fresh:
            rc, _, err = self._call(lambda _ctx: _run_fresh(text))
            malloc_trim()
        else:
            rc, _, err = self._call(lambda ctx: _run(ctx, text))
        return rc, err

    def encoded(self, commands: Sequence[Command]) -> Sequence[Command]:
        """`commands` with their transaction's text, which `commit` sends."""
        return _Encoded(commands, self.printed(commands))

    def printed(self, commands: Sequence[Command]) -> str:
        """The transaction's text, from this backend's printer."""
        return PRINTERS[self.syntax](commands)

    def run_json(self, command: Mapping[str, Any]) -> Json:
        """Run one JSON command (typically `{"list": {...}}`) and return the
        parsed output as one `{"nftables": [...]}` document (metainfo first,
        once, when libnftables printed any)."""
        text = jsontext.document_text([command])
        rc, out, err = self._call(lambda ctx: _run(ctx, text))
        if rc != 0:
            raise rejection(err.strip(), [command])
        items = [item for doc in _documents(out) for item in doc.get("nftables", ())]
        head = items[:1] if items and "metainfo" in items[0] else []
        return {"nftables": head + [item for item in items if "metainfo" not in item]}

    def list_table(self, family: str, table: str) -> Json | None:
        """`{"nftables": [table, sets/maps, chains, rules]}` as libnftables
        lists them (metainfo left out), or None if there is no such table."""
        try:
            doc = self.run_json({"list": {"table": {"family": family, "name": table}}})
        except NftNotFound:
            return None
        return {"nftables": [item for item in doc["nftables"] if "metainfo" not in item]}

    def list_table_objects(self, family: str, table: str) -> TableListing | None:
        """Chain, set and map declarations of one table, or None if there is
        no such table; one batch of terse list commands, no rule dump."""
        batch = [
            {"list": {"sets": {"family": family, "table": table}}},  # ENOENT: no table
            {"list": {"maps": {"family": family}}},
            {"list": {"chains": {"family": family}}},
        ]
        text = jsontext.document_text(batch)
        rc, out, err = self._call(lambda ctx: _run_terse(ctx, text))
        if rc != 0:
            error = rejection(err.strip(), batch)
            if isinstance(error, NftNotFound):
                return None
            raise error
        return TableListing.from_json(family, table, _objects(out))

    def find_tables(self, table: str) -> list[FoundTable]:
        """Which of the tables nftproxy writes for `table` (main and
        affinity, ip and ip6; core/nft/ownership.py) exist, each with its
        comment: one netlink dump of the tables (kernel/nfttables.py), since
        libnftables 1.0.6's JSON lists no table comment and its text lists
        every rule with it."""
        wanted = set(our_tables(table))
        try:
            found = self._call(lambda _ctx: read_tables())
        except OSError as exc:
            raise NftUnavailable(f"cannot list the nftables tables: {exc}") from exc
        return [
            FoundTable(family, name, comment)
            for family, name, comment in found
            if (family, name) in wanted
        ]

    def delete_tables(self, table: str) -> None:
        """Delete `ip <table>` and `ip6 <table>`, whichever exist, in one
        transaction; nothing else. `add` before `delete` makes it idempotent
        (1.0.6 has no `destroy`; nft-python-notes.md §2)."""
        self.commit(delete_tables_commands(table))
