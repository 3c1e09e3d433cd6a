"""The proxier: event handlers that record, and sync() that programs.

Layer: agent (orchestration; imports the core, and the kernel only through
the core's Backend protocol). One job: drive a sync as a pipeline of named
steps over values:

  drift     -- at most once per drift period: did another process commit
               since our last commit? then this sync is full (agent/drift.py)
  snapshot  -- under the lock: apply the trackers, decide full or partial,
               take the node and the ServiceCIDRs (a frozen `SyncInput`)
  render    -- pure (core/render.py): desired fragments per family
  listing   -- full syncs only: what our tables hold in the kernel
  stage     -- pure (core/nft/plan.py): one ordered transaction per family
  commit    -- one backend.commit() for both families; record on success.
               But a full sync of more than one chunk of ~`fresh_chunk`
               endpoints is built in steps into a table no hook reaches,
               then switched to in one transaction (agent/chunked.py):
               memory follows the chunk, not the cluster, and traffic sees
               the old ruleset or the new one. A refused step makes the
               next sync full and deletes what the build left
  report    -- a `SyncReport` of plain values, handed to the hooks; its
               figures about every service are kept per applied change
               (agent/tallies.py), so a sync without change costs nothing

Event handlers take model values (agent/intake.py converts) and only record;
sync() is the only path that writes to the kernel. Callers: the agent's
runner, the CLI (`sync`) and the demo.

Full vs partial: a full sync (startup, after any failed commit, after a node
or ServiceCIDR change or a change of the node-port addresses the host's
interfaces give, after another process committed to nftables when drift
detection is on, and every config.full_sync_period) lists our tables
and rewrites everything; otherwise only the service ports the trackers marked
changed are re-rendered, and a sync with no change sends nothing.

What a sync does to process-wide state (the garbage collector, malloc) is
not decided here: a `HeapPolicy` given to the constructor (agent/heap.py)
brackets the build and commit of a transaction and hears when a sync is
done (after its hooks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

from nftproxy.agent.chunked import Build, Chunked, Records, run_steps
from nftproxy.agent.drift import DriftWatch, drift_reason
from nftproxy.agent.heap import HeapPolicy, NoHeapPolicy
from nftproxy.agent.report import (
    FamilyInput,
    FamilySync,
    PlannedSync,
    PostCommitHook,
    SyncInput,
    SyncReport,
    TableSizes,
)
from nftproxy.agent.tallies import HealthTally, NoLocalTally
from nftproxy.core.config import ProxyConfig
from nftproxy.core.convert import EndpointSliceInfo
from nftproxy.core.model import (
    HostAddresses,
    IPFamily,
    NamespacedName,
    NodeInfo,
    ServiceInfo,
)
from nftproxy.core.nft.commands import Command
from nftproxy.core.nft.errors import NftBusy, NftError
from nftproxy.core.nft.listing import TableListing, list_family_objects
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.plan import Staged, TableState, stage_full, stage_gc, stage_partial
from nftproxy.core.nft.seam import Backend
from nftproxy.core.render import RenderedFamily, render_changed, render_full
from nftproxy.core.rules.names import table_pair
from nftproxy.core.rules.skeleton import nodeport_ips
from nftproxy.core.tracker import ProxyState, SyncGate

__all__ = ["Proxier"]

FAMILIES = (IPFamily.IPV4, IPFamily.IPV6)
FRESH_CHUNK_ENDPOINTS = 2000
"""Endpoints per transaction of a full sync in steps (see above)."""


class _Inputs:
    """Everything recorded by the event handlers besides the trackers."""

    node: NodeInfo | None = None
    host_addresses: HostAddresses | None = None
    service_cidrs: tuple[str, ...] = ()
    need_full: bool = True


@dataclass
class _Family:
    state: ProxyState
    table: TableState
    no_local: NoLocalTally = field(default_factory=NoLocalTally)


class Proxier:
    """Event handlers (intake.ProxierEvents) and sync().

    `hooks` run after every successful commit, in order, with the SyncReport;
    `on_change` is called (outside the lock) after every recorded change.
    `drift_check_period` (None: off) turns on agent/drift.py's check;
    `on_drift(reason)` hears of every full sync it forced, once committed.
    """

    def __init__(
        self,
        config: ProxyConfig,
        backend: Backend,
        *,
        hooks: Sequence[PostCommitHook] = (),
        on_change: Callable[[], None] = lambda: None,
        heap: HeapPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
        drift_check_period: float | None = None,
        on_drift: Callable[[str], None] = lambda _: None,
        fresh_chunk: int = FRESH_CHUNK_ENDPOINTS,
    ) -> None:
        self.config = config
        self.backend = backend
        self._hooks = tuple(hooks)
        self._on_change = on_change
        self._heap = heap or NoHeapPolicy()
        self.clock = clock
        self.log = log or logging.getLogger(__name__)
        self._gate = SyncGate()
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._inputs = _Inputs()
        self._families = {
            f: _Family(ProxyState(f), TableState(f, Table(f.nft_family, config.table_name)))
            for f in FAMILIES
        }
        self._health = HealthTally(FAMILIES)
        self._defer_deletes = False
        self._last_full = float("-inf")
        self._fresh_chunk = fresh_chunk
        self._live: str | None = None
        """Which of the table pair (names.table_pair) is hooked, as last listed or switched to."""
        self._drift = DriftWatch(  # reads nothing unless drift_check_period is set
            lambda: self.backend.generation(),
            period=drift_check_period,
            clock=clock,
            log=self.log,
        )
        self._on_drift = on_drift

    # ---- event handlers: record only -------------------------------------------

    def on_service(
        self, name: NamespacedName, previous: ServiceInfo | None, current: ServiceInfo | None
    ) -> None:
        with self._lock:
            pending = [
                fam.state.service_tracker.update(
                    name,
                    previous.ports(f) if previous is not None else {},
                    current.ports(f) if current is not None else {},
                )
                for f, fam in self._families.items()
            ]
        if any(pending):
            self._on_change()

    def on_endpoint_slice(self, key: NamespacedName, current: EndpointSliceInfo | None) -> None:
        with self._lock:
            pending = [
                fam.state.endpoint_tracker.update(key, current) for fam in self._families.values()
            ]
        if any(pending):
            self._on_change()

    def on_node(self, node: NodeInfo | None) -> None:
        with self._lock:
            if node == self._inputs.node:
                return
            self._inputs.node = node
            self._inputs.need_full = True
        self._on_change()

    def on_host_addresses(self, addresses: HostAddresses) -> None:
        """The host's interface addresses (kernel/addresses.py). Only a change
        of the node-port addresses they select makes the next sync full."""
        with self._lock:
            before = self._node()
            self._inputs.host_addresses = addresses
            after = self._node()
            if all(
                nodeport_ips(f, self.config, before) == nodeport_ips(f, self.config, after)
                for f in FAMILIES
            ):
                return
            self._inputs.need_full = True
        self._on_change()

    def on_service_cidrs(self, cidrs: tuple[str, ...]) -> None:
        with self._lock:
            if cidrs == self._inputs.service_cidrs:
                return
            self._inputs.service_cidrs = cidrs
            self._inputs.need_full = True
        self._on_change()

    def on_synced(self, kind: str) -> None:
        with self._lock:
            self._gate.mark_synced(kind)
        self._on_change()

    def request_full_sync(self) -> None:
        with self._lock:
            self._inputs.need_full = True

    def committing_aside(self, commands: Sequence[Command]) -> AbstractContextManager[None]:
        """Wrap the commit of `commands` a post-commit hook makes of its own
        (the kube-proxy marker, agent/marker.py), so that the drift check
        counts it as ours rather than another process's."""
        return self._drift.committing(commands)

    # ---- views ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Both initial lists are complete (before that, sync() programs nothing)."""
        with self._lock:
            return self._gate.ready

    def pending_changes(self) -> tuple[int, int]:
        """(services, endpoint slices) with changes not yet synced."""
        with self._lock:
            states = [fam.state for fam in self._families.values()]
            return (
                max(s.pending_service_changes for s in states),
                sum(s.pending_endpoint_changes for s in states),
            )

    def node(self) -> NodeInfo:
        """This node as the rules see it: the Node object, with --node-ip first."""
        with self._lock:
            return self._node()

    def table_state(self, family: IPFamily) -> TableState:
        """The planner's record of one table (tests and benchmarks)."""
        return self._families[family].table

    def _node(self) -> NodeInfo:
        return self.config.node_view(self._inputs.node, self._inputs.host_addresses)

    # ---- sync -------------------------------------------------------------------

    def sync(self) -> SyncReport:
        """One sync; raises NftError after a refused commit (the next sync is full)."""
        with self._sync_lock:
            return self._sync()

    def plan_full(self) -> PlannedSync:
        """The full transaction a first sync would send, and what it was
        rendered from, without looking at or touching the kernel (`sync
        --dry-run`)."""
        with self._sync_lock:
            snapshot = self._snapshot(force_full=True)
            staged = self._stage(self._render(snapshot), listings={})
            commands = tuple(c for s in staged.values() for c in s.commands)
            return PlannedSync(snapshot, commands)

    def _sync(self) -> SyncReport:
        start = self.clock()
        if not self.ready:
            return SyncReport(full=False, ops=0, skipped="waiting for the initial list")
        drifted = self._drift.changed()
        snapshot = self._snapshot(force_full=drifted, take_full_request=True)
        try:
            self._collect_garbage()
            listings = self._list_tables() if snapshot.full else {}
            drift = self._drift_reason(listings) if drifted else ""
            build = self._chunked().build(snapshot, self._live) if snapshot.full else None
            if build is not None:
                ops, render_s, commit_s = self._build_steps(build)
            else:
                ops, render_s, commit_s = self._build(snapshot, listings)
        except BaseException:
            if snapshot.full:  # the request it took is still to be done
                self.request_full_sync()
            raise
        report = self._report(snapshot, ops, render_s, commit_s, self.clock() - start)
        self._run_hooks(report)
        if drift:  # after the hooks: whoever hears of the repair sees the sync recorded
            self._drift.repaired()
            self._on_drift(drift)
        self._heap.settled(snapshot.full)
        return report

    def _build(
        self, snapshot: SyncInput, listings: Mapping[IPFamily, TableListing | None]
    ) -> tuple[int, float, float]:
        """Render, stage and commit one transaction: (ops, render s, commit s)."""
        t_render = self.clock()
        with self._heap.building(snapshot.full):
            rendered = self._render(snapshot)
            staged = self._stage(rendered, listings)
            t_commit = self.clock()
            ops = self._commit(staged, rendered, full=snapshot.full)
        return ops, t_commit - t_render, self.clock() - t_commit

    def _chunked(self) -> Chunked:
        def stage(
            tables: Mapping[IPFamily, TableState],
            rendered: Mapping[IPFamily, RenderedFamily],
            listings: Mapping[IPFamily, TableListing | None],
            records: Records,
        ) -> dict[IPFamily, Staged]:
            return self._stage(rendered, listings, records, tables=tables)

        return Chunked(self.config, self._fresh_chunk, stage)

    def _build_steps(self, build: Build) -> tuple[int, float, float]:
        """A full sync in steps (agent/chunked.py), each its own transaction;
        once the switch is committed the built tables are ours. A build cut
        short is deleted (nothing of it was ever hooked)."""
        try:
            with self._heap.building(True), self._drift.committing_steps():
                out = run_steps(build.steps, self._take_step, self.clock)
        except BaseException:
            self._delete_tables(build.tables.values())
            raise
        for family, fam in self._families.items():
            fam.table.take(build.tables[family])
            fam.table.table = build.tables[family].table
        self._live = build.target
        self._last_full = self.clock()
        return out

    def _delete_tables(self, tables: Iterable[TableState]) -> None:
        """Delete the tables of a full sync that failed where nothing was
        live, so that it leaves none. Best effort: a leftover is also
        deleted by the next build in steps, and by `cleanup`."""
        commands = [c for t in tables for c in t.table.delete_tables()]
        try:
            with self._drift.committing(commands):
                self.backend.commit(commands)
        except NftError as exc:
            self.log.warning("deleting the tables of a failed full sync failed: %s", exc)

    def _snapshot(self, *, force_full: bool = False, take_full_request: bool = False) -> SyncInput:
        """Step 1: apply the trackers and freeze what the sync works from. A
        sync takes the full-sync request here: one made from now on (a Node
        event during a full sync) is for the next sync."""
        with self._lock:
            full = (
                force_full
                or self._inputs.need_full
                or self.clock() - self._last_full >= self.config.full_sync_period
            )
            if full and take_full_request:
                self._inputs.need_full = False
            families = {
                f: FamilyInput(fam.state.apply(), fam.state.snapshot())
                for f, fam in self._families.items()
            }
            self._tally_health(families, full=full)
            return SyncInput(full, self._node(), self._inputs.service_cidrs, families)

    def _tally_health(self, families: Mapping[IPFamily, FamilyInput], *, full: bool) -> None:
        """Keep the report's health figures: whole maps on a full sync, else
        only the ports this apply() updated (a sync without change: nothing)."""
        states = {f: inp.state for f, inp in families.items()}
        if full:
            self._health.rebuild(states)
        else:
            self._health.update(states, {f: inp.update.updated for f, inp in families.items()})

    def _drift_reason(self, listings: Mapping[IPFamily, TableListing | None]) -> str:
        """What the listing shows that the record does not (before the commit)."""
        return drift_reason({f: fam.table for f, fam in self._families.items()}, listings)

    def _render(self, snapshot: SyncInput) -> dict[IPFamily, RenderedFamily]:
        """Step 2 (pure)."""
        out: dict[IPFamily, RenderedFamily] = {}
        for family, inp in snapshot.families.items():
            if snapshot.full:
                out[family] = render_full(
                    inp.state, self.config, snapshot.node, snapshot.service_cidrs
                )
            else:
                out[family] = render_changed(
                    inp.state, self.config, snapshot.node, inp.update.updated
                )
        return out

    def _list_tables(self) -> dict[IPFamily, TableListing | None]:
        """Step 3 (full syncs only): what our live tables hold in the kernel
        (each family's main and affinity tables). The live name is the one
        of the pair whose tables are hooked (`_live`); the records follow it."""
        objects = self.backend.list_table_objects
        found = {
            name: {f: list_family_objects(objects, f.nft_family, name) for f in FAMILIES}
            for name in table_pair(self.config.table_name)
        }
        self._live = next(
            (n for n, listings in found.items() if any(t and t.hooked for t in listings.values())),
            None,
        )
        name = self._live or self.config.table_name
        for fam in self._families.values():
            fam.table.table = replace(fam.table.table, name=name)
        return found[name]

    def _stage(
        self,
        rendered: Mapping[IPFamily, RenderedFamily],
        listings: Mapping[IPFamily, TableListing | None],
        records: Records | None = None,
        *,
        tables: Mapping[IPFamily, TableState] | None = None,
    ) -> dict[IPFamily, Staged]:
        """Step 4 (pure): the transaction of each family; `records`: the
        fragments' compact records where already made; `tables`: the
        records to stage against (a build's; default: the live tables')."""
        out: dict[IPFamily, Staged] = {}
        for family, r in rendered.items():
            table = tables[family] if tables else self._families[family].table
            if r.full:
                out[family] = stage_full(
                    table,
                    listings.get(family),
                    r.desired(),
                    defer_deletes=self._defer_deletes,
                )
            else:
                out[family] = stage_partial(
                    table,
                    r.fragments,
                    records=records.get(family) if records else None,
                    defer_deletes=self._defer_deletes,
                )
        return out

    def _commit(
        self,
        staged: Mapping[IPFamily, Staged],
        rendered: Mapping[IPFamily, RenderedFamily],
        *,
        full: bool,
    ) -> int:
        """Step 5: one atomic commit (`_send`); returns the number of commands."""
        ops = self._send(staged, rendered, fresh=full)
        if full:
            self._last_full = self.clock()
            self._live = next(iter(self._families.values())).table.table.name
        return ops

    def _send(
        self,
        staged: Mapping[IPFamily, Staged],
        rendered: Mapping[IPFamily, RenderedFamily],
        *,
        fresh: bool,
    ) -> int:
        """One transaction of both families' commands, recorded once accepted."""
        ops = self._commit_staged(staged, [c for s in staged.values() for c in s.commands], fresh)
        self._record(staged, rendered)
        return ops

    def _take_step(
        self, staged: Mapping[IPFamily, Staged], rendered: Mapping[IPFamily, RenderedFamily]
    ) -> Callable[[], int]:
        """One step of a full sync, taken in order: recorded (ahead of the
        kernel: agent/chunked.py) and encoded here; its commit is returned,
        to run in another thread while the next step is staged."""
        self._record(staged, rendered)
        commands = self.backend.encoded([c for s in staged.values() for c in s.commands])
        return lambda: self._commit_staged(staged, commands, fresh=False)

    def _commit_staged(
        self,
        staged: Mapping[IPFamily, Staged],
        commands: Sequence[Command],
        fresh: bool,
    ) -> int:
        """Commit `commands` (both families' of `staged`) as one transaction
        (`fresh`: a throwaway context); a refusal asks for a full sync,
        raises. Returns the number of commands. Touches no record."""
        try:
            # A full sync of a large cluster fills a libnftables cache of
            # hundreds of MB: use a context freed right after (docs/architecture.md, "Edges").
            with self._drift.committing(commands):
                self.backend.commit(commands, fresh=fresh)
        except NftBusy:
            if not self._defer_deletes:
                # Kernels < 6.2 notice a lost vmap reference asynchronously:
                # delete chains in a later transaction from now on (as upstream).
                self.log.info("kernel refused same-transaction chain deletes; deferring them")
                self._defer_deletes = True
            self.request_full_sync()
            raise
        except NftError:
            self.request_full_sync()
            raise
        return len(commands)

    def _record(
        self, staged: Mapping[IPFamily, Staged], rendered: Mapping[IPFamily, RenderedFamily]
    ) -> None:
        """Record a transaction in the tables' state and the no-local tallies."""
        for s in staged.values():
            s.commit()
        for family, r in rendered.items():
            self._families[family].no_local.record(r)

    def _collect_garbage(self) -> None:
        """Delete the chains and sets earlier commits left flushed (EBUSY)."""
        gcs = [
            stage_gc(fam.table)
            for fam in self._families.values()
            if fam.table.stale_chains or fam.table.stale_sets
        ]
        commands = [c for s in gcs for c in s.commands]
        if not commands:
            return
        try:
            with self._drift.committing(commands):
                self.backend.commit(commands)
        except NftError as exc:
            self.log.warning("deleting stale chains failed, next sync is full: %s", exc)
            self.request_full_sync()
            return
        for s in gcs:
            s.commit()

    def _report(
        self, snapshot: SyncInput, ops: int, render_s: float, commit_s: float, total_s: float
    ) -> SyncReport:
        """Step 6: what the sync did, as values."""
        families = tuple(self._family_report(f, snapshot.families[f]) for f in FAMILIES)
        return SyncReport(
            full=snapshot.full,
            ops=ops,
            families=families,
            render_seconds=render_s,
            commit_seconds=commit_s,
            total_seconds=total_s,
            health_check_ports=self._health.health_check_ports,
            local_endpoints=self._health.local_endpoints,
        )

    def _family_report(self, family: IPFamily, inp: FamilyInput) -> FamilySync:
        fam = self._families[family]
        table = fam.table
        return FamilySync(
            family,
            inp.update,
            inp.state,
            no_local_internal=fam.no_local.internal,
            no_local_external=fam.no_local.external,
            table=TableSizes(
                chains=len(table.chains),
                rules=table.rule_count,
                sets=len(table.sets),
                elements=len(table.index),
            ),
        )

    def _run_hooks(self, report: SyncReport) -> None:
        for hook in self._hooks:
            try:
                hook(report)
            except Exception:  # a hook must never break syncing
                self.log.exception("post-sync hook %s failed", getattr(hook, "__name__", hook))
