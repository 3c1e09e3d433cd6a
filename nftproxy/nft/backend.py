"""The one seam between nftproxy and nftables: libnftables, or a faithful fake.

Layer: nft edge (the only module that talks to libnftables). One job: apply
one JSON transaction atomically and list what one table holds. Callers: the
proxier (commit, list_table_objects, delete_tables), `dump` and the tests
(list_table); `cli.py` builds the real NftBackend, tests build FakeBackend.

NftBackend keeps ONE long-lived libnftables context, owned by a worker thread
that serves every call over a queue:
- a context is not thread-safe, so calls must be serialised;
- libnftables 1.0.6 opens its netlink socket in `nft_ctx_new()`, so the
  context belongs to the network namespace of the *thread* that created it
  (docs/nft-python-notes.md §1). With `netns=` the worker enters that
  namespace first and never leaves it; the rest of the process stays put;
- long-lived, because freeing a context costs 12-19 ms and a new one must
  re-fetch its cache (nft-incremental-notes.md "Recommendation" 1);
- echo stays off (it costs a second per large transaction); JSON output on.
Full syncs of a large cluster may use `commit(..., fresh=True)`: a temporary
context on the same worker, freed right after, then `malloc_trim(0)` -- its
cache holds hundreds of MB (DESIGN.md §5; nft-python-notes.md §2 "Memory").

Listing on 1.0.6 (measured, 10k chains + 20k rules + a 10k-element map):
`list table` 330-410 ms; `list tables` ~200 ms (it fetches everything);
JSON `list chains/sets/maps` honour "family" but ignore "table" (we filter),
except that `list sets` with a missing "table" fails with ENOENT, which is
how `list_table_objects` detects a missing table; with the *terse* output
flag, sets and maps come without elements and their listing costs < 1 ms,
so one batch [sets(table), maps, chains] costs ~30 ms (the chains dominate).
Several list commands in one batch print one JSON document each.

Known limits:
- command_index is None for kernel errors (libnftables 1.0.6 names no
  command); only JSON parse errors carry it (see nft.errors).
- FakeBackend stores rule expressions and element keys verbatim; the kernel
  lists them in canonical form (`6` comes back as "tcp", prefixes and ranges
  may be merged). Equality with the kernel holds for canonical input only.
- FakeBackend models references, EEXIST/ENOENT/EBUSY and loops reachable
  from base chains, not type checking of expressions, jump depth (16) or
  interval overlap.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeVar

from nftproxy import netns as _netns
from nftproxy.nft.errors import (
    NftBusy,
    NftExists,
    NftNotFound,
    NftRejected,
    NftUnavailable,
    rejection,
)

__all__ = [
    "Backend",
    "BaseChain",
    "ChainInfo",
    "FakeBackend",
    "MapInfo",
    "NftBackend",
    "SetInfo",
    "TableObjects",
    "malloc_trim",
    "tune_malloc",
]

Json = dict[str, Any]
T = TypeVar("T")

_METAINFO: Json = {"metainfo": {"json_schema_version": 1}}
_FAMILIES = ("ip", "ip6")


# --- what a listing shows ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class BaseChain:
    """How a base chain is hooked (priority always an int, as listed)."""

    type: str
    hook: str
    prio: int
    policy: str = "accept"


@dataclass(frozen=True, slots=True)
class ChainInfo:
    name: str
    base: BaseChain | None = None


@dataclass(frozen=True, slots=True)
class SetInfo:
    name: str
    type: tuple[str, ...]
    flags: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True, slots=True)
class MapInfo:
    name: str
    type: tuple[str, ...]
    map: str


@dataclass(frozen=True, slots=True)
class TableObjects:
    """Declarations in one table: what a full sync diffs against. Rules and
    elements are left out on purpose (a full sync rewrites them)."""

    family: str
    table: str
    chains: Mapping[str, ChainInfo]
    sets: Mapping[str, SetInfo]
    maps: Mapping[str, MapInfo]

    @classmethod
    def from_listing(cls, family: str, table: str, objects: Iterable[Json]) -> TableObjects:
        """Pick this table's chains, sets and maps out of listed objects
        (listings of a family show every table of it)."""
        chains: dict[str, ChainInfo] = {}
        sets: dict[str, SetInfo] = {}
        maps: dict[str, MapInfo] = {}
        for item in objects:
            for kind, obj in item.items():
                if kind not in ("chain", "set", "map"):
                    continue
                if obj.get("family") != family or obj.get("table") != table:
                    continue
                name = obj["name"]
                if kind == "chain":
                    base = None
                    if "hook" in obj:
                        base = BaseChain(
                            obj["type"], obj["hook"], int(obj["prio"]), obj.get("policy", "accept")
                        )
                    chains[name] = ChainInfo(name, base)
                elif kind == "set":
                    sets[name] = SetInfo(
                        name,
                        _type_tuple(obj["type"]),
                        tuple(obj.get("flags", ())),
                        obj.get("timeout"),
                    )
                elif kind == "map":
                    maps[name] = MapInfo(name, _type_tuple(obj["type"]), obj["map"])
        return cls(family, table, chains, sets, maps)


def _type_tuple(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


class Backend(Protocol):
    """What the proxier needs from nftables. NftBackend and FakeBackend."""

    def start(self) -> None: ...

    def close(self) -> None: ...

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None: ...

    def run_json(self, command: Mapping[str, Any]) -> Json: ...

    def list_table(self, family: str, table: str) -> Json | None: ...

    def list_table_objects(self, family: str, table: str) -> TableObjects | None: ...

    def delete_tables(self, table: str) -> None: ...


# --- glibc malloc -------------------------------------------------------------

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc() -> bool:
    """Set glibc's malloc thresholds for libnftables' allocation pattern.

    Call once at startup, *before* any context exists: the thresholds only
    steer later allocations, and the context's cache is what must land in
    memory glibc can hand back. Measured with 1.0.6 at 10k services
    (nft-python-notes.md §2 "Memory"): RSS was 997 MB after one full
    transaction and still 268 MB after malloc_trim(0). Fixing
    M_MMAP_THRESHOLD at 4 MiB keeps big buffers (the transaction text,
    output buffers) in mmap, which free() returns at once -- the default
    threshold grows after the first big free and then keeps them on the heap;
    M_TRIM_THRESHOLD 256 MiB stops glibc from trimming the heap top on every
    free between syncs (explicit malloc_trim(0) after full syncs still
    works). nft-incremental-notes.md "Recommendation" 5; the unit may set the
    same values with GLIBC_TUNABLES instead. Returns False if this libc has
    no mallopt or refused a value.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_mmap: bool = mallopt(_M_MMAP_THRESHOLD, 4 * 1024 * 1024) == 1
    ok_trim: bool = mallopt(_M_TRIM_THRESHOLD, 256 * 1024 * 1024) == 1
    return ok_mmap and ok_trim


def malloc_trim() -> None:
    """glibc malloc_trim(0): give freed heap memory back to the kernel."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --- the real backend ---------------------------------------------------------


def _new_context() -> Any:
    """A libnftables context for the calling thread's netns: JSON out, no echo."""
    try:
        import nftables  # Debian python3-nftables (DESIGN.md §5)
    except ImportError as exc:
        raise NftUnavailable("python module 'nftables' (python3-nftables) not found") from exc
    try:
        ctx = nftables.Nftables()
    except OSError as exc:
        raise NftUnavailable(f"libnftables: {exc}") from exc
    ctx.set_json_output(True)
    ctx.set_echo_output(False)
    return ctx


def _run(ctx: Any, text: str) -> tuple[int, str, str]:
    rc, out, err = ctx.cmd(text)
    return int(rc), str(out), str(err)


def _run_fresh(text: str) -> tuple[int, str, str]:
    ctx = _new_context()
    result = _run(ctx, text)
    del ctx  # the last reference: Nftables.__del__ -> nft_ctx_free(), now
    return result


def _run_terse(ctx: Any, text: str) -> tuple[int, str, str]:
    """Run with the terse flag: sets and maps are listed without elements
    (and, on 1.0.6, their elements are not even fetched: < 1 ms vs 100 ms
    for a 10k-element map)."""
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


def _dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


_Job = tuple[Callable[[Any], Any], "Future[Any]"]


class _ContextThread:
    """The thread that owns a libnftables context and runs jobs on it."""

    def __init__(self, netns: str | None) -> None:
        self._netns = netns
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # no job may queue up behind the stop
        self._stopped = False

    def start(self) -> None:
        ready: Future[None] = Future()
        name = f"nft-{self._netns}" if self._netns else "nft"
        self._thread = threading.Thread(target=self._serve, args=(ready,), name=name, daemon=True)
        self._thread.start()
        try:
            ready.result()
        except BaseException:
            self._thread.join()
            raise

    def _serve(self, ready: Future[None]) -> None:
        try:
            if self._netns is not None:
                try:
                    _netns.enter(self._netns)
                except OSError as exc:
                    raise NftUnavailable(f"cannot enter netns {self._netns!r}: {exc}") from exc
            ctx = _new_context()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn(ctx))
            except BaseException as exc:
                future.set_exception(exc)
            del job, fn, future
        del ctx  # freed on the thread that made it

    def call(self, fn: Callable[[Any], T]) -> T:
        future: Future[T] = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("NftBackend closed")
            self._jobs.put((fn, future))
        return future.result()

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._jobs.put(None)
        if self._thread is not None:
            self._thread.join()


class NftBackend:
    """libnftables, in the caller's netns or in a named one (`netns=`).

    `start()` creates the context (NftUnavailable if it cannot); every other
    method may be called from any thread. Use as a context manager or call
    `close()`.
    """

    def __init__(self, *, netns: str | None = None) -> None:
        self._netns = netns
        self._worker: _ContextThread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> NftBackend:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        with self._lock:
            if self._worker is not None:
                raise RuntimeError("NftBackend already started")
            worker = _ContextThread(self._netns)
            worker.start()
            self._worker = worker

    def close(self) -> None:
        """Free the context, stop the worker, give memory back. Idempotent."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
            malloc_trim()

    def _call(self, fn: Callable[[Any], T]) -> T:
        worker = self._worker
        if worker is None:
            raise RuntimeError("NftBackend not started (or closed)")
        return worker.call(fn)

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        """Apply `commands` as ONE atomic transaction (one libnftables call).

        Nothing happens for an empty list. `fresh=True` runs it on a
        temporary context that is freed afterwards (large full syncs). Raises
        an NftRejected subclass when libnftables refuses; then nothing was
        applied.
        """
        if not commands:
            return
        text = _dumps({"nftables": [_METAINFO, *commands]})
        if fresh:
            rc, _, err = self._call(lambda _ctx: _run_fresh(text))
            malloc_trim()
        else:
            rc, _, err = self._call(lambda ctx: _run(ctx, text))
        if rc != 0:
            raise rejection(err.strip(), commands, first_index=1)

    def run_json(self, command: Mapping[str, Any]) -> Json:
        """Run one JSON command (typically `{"list": {...}}`) and return the
        parsed output as one `{"nftables": [...]}` document (metainfo first,
        once, when libnftables printed any)."""
        text = _dumps({"nftables": [command]})
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

    def list_table_objects(self, family: str, table: str) -> TableObjects | None:
        """Chain, set and map declarations of one table, or None if there is
        no such table; one batch of terse list commands, no rule dump."""
        batch = [
            {"list": {"sets": {"family": family, "table": table}}},  # ENOENT: no table
            {"list": {"maps": {"family": family}}},
            {"list": {"chains": {"family": family}}},
        ]
        text = _dumps({"nftables": batch})
        rc, out, err = self._call(lambda ctx: _run_terse(ctx, text))
        if rc != 0:
            error = rejection(err.strip(), batch)
            if isinstance(error, NftNotFound):
                return None
            raise error
        return TableObjects.from_listing(family, table, _objects(out))

    def delete_tables(self, table: str) -> None:
        """Delete `ip <table>` and `ip6 <table>`, whichever exist, in one
        transaction; nothing else. `add` before `delete` makes it idempotent
        (1.0.6 has no `destroy`; nft-python-notes.md §2)."""
        commands: list[Json] = []
        for family in _FAMILIES:
            ref = {"family": family, "name": table}
            commands += [{"add": {"table": ref}}, {"delete": {"table": dict(ref)}}]
        self.commit(commands)


# --- the fake -----------------------------------------------------------------


def _refs(node: Any) -> tuple[set[str], set[str]]:
    """(chains jumped/goto'd to, sets looked up as "@name") anywhere in JSON."""
    chains: set[str] = set()
    sets: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key in ("jump", "goto") and isinstance(value, dict) and "target" in value:
                    chains.add(value["target"])
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and item.startswith("@"):
            sets.add(item[1:])
    return chains, sets


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _elem_key(item: Any) -> Any:
    if isinstance(item, dict) and "elem" in item and isinstance(item["elem"], dict):
        return item["elem"].get("val")
    return item


@dataclass
class _FRule:
    obj: Json
    chains: frozenset[str]
    sets: frozenset[str]


@dataclass
class _FChain:
    obj: Json
    rules: list[_FRule] = field(default_factory=list)

    @property
    def is_base(self) -> bool:
        return "hook" in self.obj


@dataclass
class _FElem:
    item: Any  # as given: key, {"elem": {"val": key, ...}} or [key, value]
    value: str | None  # canonical map value
    chains: frozenset[str]


@dataclass
class _FSet:
    kind: str  # "set" | "map"
    obj: Json
    elems: dict[str, _FElem] = field(default_factory=dict)


@dataclass
class _FTable:
    obj: Json
    chains: dict[str, _FChain] = field(default_factory=dict)
    sets: dict[str, _FSet] = field(default_factory=dict)
    chain_refs: Counter[str] = field(default_factory=Counter)
    set_refs: Counter[str] = field(default_factory=Counter)
    next_handle: int = 1

    def handle(self) -> int:
        self.next_handle += 1
        return self.next_handle - 1


_TableKey = tuple[str, str]

_ENOENT = "No such file or directory"
_EEXIST = "File exists"
_EBUSY = "Device or resource busy"
_EOPNOTSUPP = "Operation not supported"
_EMLINK = "Too many links"
_ERRORS: dict[str, type[NftRejected]] = {
    _ENOENT: NftNotFound,
    _EEXIST: NftExists,
    _EBUSY: NftBusy,
}


class _Refused(Exception):
    def __init__(self, errno_text: str, what: str) -> None:
        super().__init__(f"Could not process rule: {errno_text} (fake: {what})")
        self.errno_text = errno_text


class _Txn:
    """One transaction over a copy-on-write view of the fake's tables."""

    def __init__(self, tables: dict[_TableKey, _FTable], next_table_handle: int) -> None:
        self.tables = dict(tables)
        self.next_table_handle = next_table_handle
        self.edges_added: set[_TableKey] = set()
        self._own: set[int] = set()  # ids of objects copied (or made) in this txn

    def _mine(self, obj: T) -> T:
        self._own.add(id(obj))
        return obj

    def table(self, family: str, name: str) -> _FTable:
        key = (family, name)
        t = self.tables.get(key)
        if t is None:
            raise _Refused(_ENOENT, f"table {family} {name}")
        if id(t) not in self._own:
            t = self._mine(
                _FTable(
                    dict(t.obj),
                    dict(t.chains),
                    dict(t.sets),
                    Counter(t.chain_refs),
                    Counter(t.set_refs),
                    t.next_handle,
                )
            )
            self.tables[key] = t
        return t

    def chain(self, t: _FTable, name: str) -> _FChain:
        c = t.chains.get(name)
        if c is None:
            raise _Refused(_ENOENT, f"chain {name}")
        if id(c) not in self._own:
            c = t.chains[name] = self._mine(_FChain(dict(c.obj), list(c.rules)))
        return c

    def named_set(self, t: _FTable, name: str, kind: str | None = None) -> _FSet:
        s = t.sets.get(name)
        if s is None or (kind is not None and s.kind != kind):
            raise _Refused(_ENOENT, f"{kind or 'set'} {name}")
        if id(s) not in self._own:
            s = t.sets[name] = self._mine(_FSet(s.kind, dict(s.obj), dict(s.elems)))
        return s

    # verbs -------------------------------------------------------------

    def apply(self, verb: str, kind: str, spec: Json) -> None:
        handler = getattr(self, f"_{verb}_{kind}", None)
        if handler is None:
            raise NotImplementedError(f"FakeBackend does not model {verb} {kind}")
        handler(spec)

    def _add_table(self, spec: Json) -> None:
        key = (spec["family"], spec["name"])
        if key not in self.tables:
            obj = {"family": key[0], "name": key[1], "handle": self.next_table_handle}
            self.next_table_handle += 1
            self.tables[key] = self._mine(_FTable(obj))

    def _flush_table(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["name"])
        for name in list(t.chains):
            self._clear_rules(t, self.chain(t, name))

    def _delete_table(self, spec: Json) -> None:
        self.table(spec["family"], spec["name"])
        del self.tables[(spec["family"], spec["name"])]

    def _add_chain(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        # 1.0.6 JSON: a non-integer prio silently makes a regular chain.
        base = "hook" in spec and "type" in spec and isinstance(spec.get("prio"), int)
        old = t.chains.get(name)
        if old is None:
            obj: Json = {"family": spec["family"], "table": spec["table"], "name": name}
            obj["handle"] = t.handle()
            if base:
                obj.update(type=spec["type"], hook=spec["hook"], prio=spec["prio"])
                obj["policy"] = spec.get("policy", "accept")
            t.chains[name] = self._mine(_FChain(obj))
        elif base and not old.is_base:
            # nf_tables_updchain checks a policy before the hook (kernel 6.18)
            errno_text = _EOPNOTSUPP if "policy" in spec else _EEXIST
            raise _Refused(errno_text, f"regular chain {name} re-added as a base chain")
        elif base:
            have = (old.obj["type"], old.obj["hook"], old.obj["prio"])
            if have != (spec["type"], spec["hook"], spec["prio"]):
                raise _Refused(_EOPNOTSUPP, f"base chain {name} re-hooked")
            if "policy" in spec:
                self.chain(t, name).obj["policy"] = spec["policy"]

    def _flush_chain(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        self._clear_rules(t, self.chain(t, spec["name"]))

    def _delete_chain(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        self._clear_rules(t, self.chain(t, name))
        if t.chain_refs[name] > 0:
            raise _Refused(_EBUSY, f"chain {name} is still referenced")
        del t.chains[name]

    def _clear_rules(self, t: _FTable, c: _FChain) -> None:
        for rule in c.rules:
            t.chain_refs.subtract(rule.chains)
            t.set_refs.subtract(rule.sets)
        c.rules.clear()

    def _check_targets(self, t: _FTable, targets: Iterable[str]) -> None:
        for target in targets:
            dest = t.chains.get(target)
            if dest is None:
                raise _Refused(_ENOENT, f"jump/goto to missing chain {target}")
            if dest.is_base:
                raise _Refused(_EOPNOTSUPP, f"jump/goto to base chain {target}")

    def _add_rule(self, spec: Json, *, insert: bool = False) -> None:
        if any(k in spec for k in ("handle", "index", "position")):
            raise NotImplementedError("FakeBackend does not model rule positions")
        t = self.table(spec["family"], spec["table"])
        c = self.chain(t, spec["chain"])
        chains, sets = _refs(spec["expr"])
        self._check_targets(t, chains)
        for name in sets:
            if name not in t.sets:
                raise _Refused(_ENOENT, f"lookup of missing set @{name}")
        obj = {k: spec[k] for k in ("family", "table", "chain")}
        obj["handle"] = t.handle()
        obj["expr"] = json.loads(_dumps(spec["expr"]))
        if "comment" in spec:
            obj["comment"] = spec["comment"]
        rule = _FRule(obj, frozenset(chains), frozenset(sets))
        if insert:
            c.rules.insert(0, rule)
        else:
            c.rules.append(rule)
        t.chain_refs.update(rule.chains)
        t.set_refs.update(rule.sets)
        if rule.chains or rule.sets:
            self.edges_added.add((spec["family"], spec["table"]))

    def _insert_rule(self, spec: Json) -> None:
        self._add_rule(spec, insert=True)

    def _delete_rule(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        c = self.chain(t, spec["chain"])
        for i, rule in enumerate(c.rules):
            if rule.obj["handle"] == spec.get("handle"):
                t.chain_refs.subtract(rule.chains)
                t.set_refs.subtract(rule.sets)
                del c.rules[i]
                return
        raise _Refused(_ENOENT, f"rule handle {spec.get('handle')}")

    def _add_set(self, spec: Json, kind: str = "set") -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        obj: Json = {"family": spec["family"], "name": name, "table": spec["table"]}
        type_ = spec["type"]
        obj["type"] = type_[0] if isinstance(type_, list) and len(type_) == 1 else type_
        if kind == "map":
            obj["map"] = spec["map"]
        for key in ("flags", "timeout", "comment"):
            if spec.get(key):
                obj[key] = spec[key]
        old = t.sets.get(name)
        if old is None:
            obj["handle"] = t.handle()
            t.sets[name] = self._mine(_FSet(kind, obj))
        else:
            mine = (kind, obj["type"], obj.get("map"), set(obj.get("flags", ())))
            have = (old.kind, old.obj["type"], old.obj.get("map"), set(old.obj.get("flags", ())))
            if mine != have:
                raise _Refused(_EEXIST, f"{kind} {name} re-declared differently")
        if spec.get("elem"):
            self._add_element(spec)

    def _add_map(self, spec: Json) -> None:
        self._add_set(spec, "map")

    def _flush_set(self, spec: Json, kind: str = "set") -> None:
        t = self.table(spec["family"], spec["table"])
        s = self.named_set(t, spec["name"], kind)
        for elem in s.elems.values():
            t.chain_refs.subtract(elem.chains)
        s.elems.clear()

    def _flush_map(self, spec: Json) -> None:
        self._flush_set(spec, "map")

    def _delete_set(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        name = spec["name"]
        s = self.named_set(t, name)
        if t.set_refs[name] > 0:
            raise _Refused(_EBUSY, f"set {name} is still referenced")
        for elem in s.elems.values():
            t.chain_refs.subtract(elem.chains)
        del t.sets[name]

    def _delete_map(self, spec: Json) -> None:
        self._delete_set(spec)

    def _add_element(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        s = self.named_set(t, spec["name"])
        for item in spec["elem"]:
            pair = isinstance(item, list)
            if pair != (s.kind == "map"):
                raise _Refused("Invalid argument", f"element shape does not fit {s.kind}")
            key = _canon(_elem_key(item[0] if pair else item))
            value = _canon(item[1]) if pair else None
            chains = frozenset(_refs(item[1])[0]) if pair else frozenset()
            self._check_targets(t, chains)
            old = s.elems.get(key)
            if old is not None:
                if old.value != value:
                    raise _Refused(_EEXIST, f"element {key} with another value")
                continue
            s.elems[key] = _FElem(json.loads(_dumps(item)), value, chains)
            t.chain_refs.update(chains)
            if chains:
                self.edges_added.add((spec["family"], spec["table"]))

    def _delete_element(self, spec: Json) -> None:
        t = self.table(spec["family"], spec["table"])
        s = self.named_set(t, spec["name"])
        for item in spec["elem"]:
            key = _canon(_elem_key(item[0] if isinstance(item, list) else item))
            old = s.elems.pop(key, None)
            if old is None:
                raise _Refused(_ENOENT, f"element {key}")
            t.chain_refs.subtract(old.chains)

    # the kernel's loop check -------------------------------------------

    def check_loops(self) -> None:
        """Kernel 6.x validates the jump graph reachable from base chains at
        commit: a cycle there is EMLINK ("Too many links"). Unreachable
        cycles (even a chain jumping to itself) are accepted."""
        for key in self.edges_added:
            t = self.tables.get(key)
            if t is not None:
                _check_table_loops(t)


def _check_table_loops(t: _FTable) -> None:
    def successors(c: _FChain) -> set[str]:
        out: set[str] = set()
        for rule in c.rules:
            out |= rule.chains
            for name in rule.sets:
                s = t.sets.get(name)
                if s is not None and s.kind == "map":
                    for elem in s.elems.values():
                        out |= elem.chains
        return out

    done: set[str] = set()
    for root in (name for name, c in t.chains.items() if c.is_base):
        path: set[str] = set()
        stack: list[tuple[str, Iterator[str]]] = [(root, iter(successors(t.chains[root])))]
        path.add(root)
        while stack:
            name, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.discard(name)
                done.add(name)
            elif nxt in path:
                raise _Refused(_EMLINK, f"loop through chain {nxt}")
            elif nxt not in done and nxt in t.chains:
                path.add(nxt)
                stack.append((nxt, iter(successors(t.chains[nxt]))))


class FakeBackend:
    """An in-memory nftables with the kernel's refusals, for tests.

    Each commit is applied to a copy-on-write view and kept only if every
    command succeeded (all or nothing), like a netlink batch. Refusals raise
    the same error types as the kernel (NftNotFound/NftExists/NftBusy, or
    NftRejected for EOPNOTSUPP, EMLINK, EINVAL); unlike libnftables they name
    the offending command (`command_index`). Commands it does not model
    raise NotImplementedError rather than being accepted silently.
    """

    def __init__(self) -> None:
        self._tables: dict[_TableKey, _FTable] = {}
        self._next_table_handle = 1
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("FakeBackend already started")
        self._started = True

    def close(self) -> None:
        self._started = False

    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError("FakeBackend not started (or closed)")

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        if not commands:
            return
        self._check_started()
        with self._lock:
            txn = _Txn(self._tables, self._next_table_handle)
            for index, command in enumerate(commands):
                try:
                    for verb, body in command.items():
                        if verb == "metainfo":
                            continue
                        for kind, spec in body.items():
                            txn.apply(verb, kind, spec)
                    if index == len(commands) - 1:
                        txn.check_loops()
                except _Refused as exc:
                    cls = _ERRORS.get(exc.errno_text, NftRejected)
                    raise cls(str(exc), index, command) from None
            self._tables = txn.tables
            self._next_table_handle = txn.next_table_handle

    def run_json(self, command: Mapping[str, Any]) -> Json:
        self._check_started()
        head: list[Json] = [dict(_METAINFO)]
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
                    raise NftNotFound(_ENOENT, 0, command)
                return {"nftables": head + doc}
            if what == "ruleset":
                return {"nftables": head + [o for t in tables for o in _listing(t)]}
            if what == "tables":
                return {"nftables": head + [{"table": dict(t.obj)} for t in tables]}
            if what in ("chains", "sets", "maps"):
                missing = "table" in spec and (family, spec["table"]) not in self._tables
                if what == "sets" and missing:
                    raise NftNotFound(_ENOENT, 0, command)
                kind = what[:-1]
                objs = [o for t in tables for o in _listing(t, elems=False) if kind in o]
                return {"nftables": head + objs}
        raise NotImplementedError(f"FakeBackend does not model list {what}")

    def _list_table_locked(self, family: str, table: str) -> list[Json] | None:
        t = self._tables.get((family, table))
        return None if t is None else _listing(t)

    def list_table(self, family: str, table: str) -> Json | None:
        self._check_started()
        with self._lock:
            objects = self._list_table_locked(family, table)
        return None if objects is None else {"nftables": objects}

    def list_table_objects(self, family: str, table: str) -> TableObjects | None:
        self._check_started()
        with self._lock:
            t = self._tables.get((family, table))
            if t is None:
                return None
            return TableObjects.from_listing(family, table, _listing(t, elems=False))

    def delete_tables(self, table: str) -> None:
        commands: list[Json] = []
        for family in _FAMILIES:
            ref = {"family": family, "name": table}
            commands += [{"add": {"table": ref}}, {"delete": {"table": dict(ref)}}]
        self.commit(commands)


def _listing(t: _FTable, *, elems: bool = True) -> list[Json]:
    """One table as libnftables 1.0.6 lists it: the table, sets and maps in
    creation order, chains in creation order, then each chain's rules."""
    out: list[Json] = [{"table": dict(t.obj)}]
    for s in t.sets.values():
        obj = json.loads(_dumps(s.obj))
        if elems and s.elems:
            obj["elem"] = [json.loads(_dumps(e.item)) for e in s.elems.values()]
        out.append({s.kind: obj})
    out += [{"chain": dict(c.obj)} for c in t.chains.values()]
    out += [{"rule": json.loads(_dumps(r.obj))} for c in t.chains.values() for r in c.rules]
    return out
