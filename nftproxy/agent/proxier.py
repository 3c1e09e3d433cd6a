"""The proxier: event handlers that record, and sync() that programs.

Layer: proxier (orchestration; imports the core and the nft edge through the
Backend protocol). One job: drive a sync as a short list of named steps --
apply trackers -> render changed fragments -> plan -> commit -> post-commit
hooks (conntrack, health, metrics). Event handlers only record; sync() is the
only path that writes to the kernel. Called by the runner (agent), the CLI
(`sync --once`) and the demo.

Full vs partial: a full sync (startup, after any failed commit, after a node
or ServiceCIDR change, and every config.full_sync_period) lists our tables
and rewrites everything; otherwise only the service ports the trackers marked
changed are re-rendered, and a sync with no change sends nothing.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nftproxy.cluster.events import Obj
from nftproxy.core import convert
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, NodeInfo, ServicePortName, family_of
from nftproxy.core.nft.errors import NftBusy, NftError
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.plan import (
    SKELETON,
    KernelSet,
    KernelTable,
    Owner,
    Staged,
    TableState,
    stage_full,
    stage_gc,
    stage_partial,
)
from nftproxy.core.rules.detect import local_detector
from nftproxy.core.rules.fragment import BaseHook, Fragment
from nftproxy.core.rules.service import RenderContext, render_service_port
from nftproxy.core.rules.skeleton import render_skeleton
from nftproxy.core.tracker import ProxyState, SyncGate, UpdateResult
from nftproxy.kernel.libnftables import TableObjects

__all__ = ["Backend", "Proxier", "SyncReport"]

FAMILIES = (IPFamily.IPV4, IPFamily.IPV6)


class Backend(Protocol):
    """What the proxier needs of the kernel edge (nft.backend.NftBackend and
    nft.fake.FakeBackend both provide it)."""

    def commit(self, commands: Sequence[Mapping[str, object]], *, fresh: bool = False) -> None: ...

    def list_table_objects(self, family: str, table: str) -> TableObjects | None: ...


def kernel_table(objs: TableObjects | None) -> KernelTable | None:
    """The planner's view of a listing: chain hooks and set declarations."""
    if objs is None:
        return None
    chains = {
        name: BaseHook(c.base.type, c.base.hook, c.base.prio, c.base.policy) if c.base else None
        for name, c in objs.chains.items()
    }
    sets = {n: KernelSet(n, s.type, None, s.flags, s.timeout) for n, s in objs.sets.items()}
    sets.update({n: KernelSet(n, m.type, m.map) for n, m in objs.maps.items()})
    return KernelTable(chains, sets)


@dataclass(frozen=True)
class FamilySync:
    family: IPFamily
    update: UpdateResult
    state: ProxyState
    no_local_internal: int = 0
    no_local_external: int = 0


@dataclass(frozen=True)
class SyncReport:
    """What one sync did, for logs, metrics, conntrack and health hooks."""

    full: bool
    ops: int
    families: tuple[FamilySync, ...] = ()
    render_seconds: float = 0.0
    commit_seconds: float = 0.0
    total_seconds: float = 0.0
    skipped: str = ""

    @property
    def updated(self) -> frozenset[ServicePortName]:
        out: set[ServicePortName] = set()
        for f in self.families:
            out |= f.update.updated
        return frozenset(out)


PostCommitHook = Callable[[SyncReport], None]


@dataclass
class _Inputs:
    """Everything recorded by the event handlers besides the trackers."""

    node_obj: Obj | None = None
    service_cidrs: tuple[str, ...] = ()
    need_full: bool = True


@dataclass
class _Family:
    state: ProxyState
    table: TableState
    no_local: dict[ServicePortName, tuple[bool, bool]] = field(default_factory=dict)


@contextlib.contextmanager
def _gc_paused(pause: bool) -> Iterator[None]:
    """Pause the cyclic GC while a full sync renders: it allocates millions
    of acyclic objects, and the collections they trigger cost ~40% of the
    render time at 10,000 services (measured 5.2 s -> 3.4 s)."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Proxier:
    """Event handlers (the ClusterEvents protocol) and sync()."""

    def __init__(
        self,
        config: ProxyConfig,
        backend: Backend,
        *,
        hooks: Sequence[PostCommitHook] = (),
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.hooks = list(hooks)
        self.clock = clock
        self.log = log or logging.getLogger("nftproxy.agent.proxier")
        self.gate = SyncGate()
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._inputs = _Inputs()
        self._families = {
            f: _Family(
                ProxyState(f, config.node_name),
                TableState(f, Table(f.nft_family, config.table_name)),
            )
            for f in FAMILIES
        }
        self._defer_deletes = False
        self._last_full = float("-inf")
        self._changed: Callable[[], None] = lambda: None

    # ---- event handlers: record only -------------------------------------

    def set_change_callback(self, fn: Callable[[], None]) -> None:
        """Called (outside the lock) after every recorded change: the runner's kick."""
        self._changed = fn

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        with self._lock:
            pending = [
                f.state.service_tracker.update(previous, current) for f in self._families.values()
            ]
        if any(pending):
            self._changed()

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        with self._lock:
            pending = [
                f.state.endpoint_tracker.update(previous, current) for f in self._families.values()
            ]
        if any(pending):
            self._changed()

    def on_node(self, node: Obj | None) -> None:
        with self._lock:
            if node == self._inputs.node_obj:
                return
            self._inputs.node_obj = node
            self._inputs.need_full = True
        self._changed()

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        found: list[str] = []
        for obj in cidrs:
            values, problems = convert.service_cidrs(obj)
            found += values
            for p in problems:
                self.log.warning("skipping invalid field: %s", p)
        with self._lock:
            if tuple(sorted(found)) == self._inputs.service_cidrs:
                return
            self._inputs.service_cidrs = tuple(sorted(found))
            self._inputs.need_full = True
        self._changed()

    def on_synced(self, kind: str) -> None:
        with self._lock:
            self.gate.mark_synced(kind)
        self._changed()

    def request_full_sync(self) -> None:
        with self._lock:
            self._inputs.need_full = True

    # ---- views --------------------------------------------------------------

    def node(self) -> NodeInfo:
        """This node as the rules see it: the Node object, with --node-ip first."""
        obj = self._inputs.node_obj
        info = convert.node_info(obj)[0] if obj is not None else None
        base = info or NodeInfo(self.config.node_name)
        flags = self.config.node_ips
        v4 = tuple(ip for ip in flags if family_of(ip) is IPFamily.IPV4)
        v6 = tuple(ip for ip in flags if family_of(ip) is IPFamily.IPV6)
        return NodeInfo(
            name=base.name or self.config.node_name,
            ipv4=v4 + tuple(ip for ip in base.ipv4 if ip not in v4),
            ipv6=v6 + tuple(ip for ip in base.ipv6 if ip not in v6),
            labels=base.labels,
            pod_cidrs=base.pod_cidrs,
            deleting=base.deleting,
            to_be_deleted=base.to_be_deleted,
        )

    def table_state(self, family: IPFamily) -> TableState:
        return self._families[family].table

    def proxy_state(self, family: IPFamily) -> ProxyState:
        return self._families[family].state

    # ---- sync ----------------------------------------------------------------

    def sync(self) -> SyncReport:
        """One sync; raises NftError after a refused commit (the next sync is full)."""
        with self._sync_lock:
            return self._sync()

    def plan_full(self) -> list[Mapping[str, object]]:
        """The full transaction a first sync would send, without looking at or
        touching the kernel (`sync --dry-run`)."""
        with self._lock:
            updates = {f: fam.state.apply() for f, fam in self._families.items()}
        self._log_problems(updates)
        staged = self._stage(True, updates, listing=False)
        return [c for s in staged.values() for c in s.commands]

    def _log_problems(self, updates: Mapping[IPFamily, UpdateResult]) -> None:
        seen: set[str] = set()
        for update in updates.values():
            for problem in update.problems:
                text = str(problem)
                if text not in seen:
                    seen.add(text)
                    self.log.warning("skipped invalid field: %s", text)

    def _sync(self) -> SyncReport:
        start = self.clock()
        with self._lock:
            if not self.gate.ready:
                return SyncReport(full=False, ops=0, skipped="waiting for the initial list")
            updates = {f: fam.state.apply() for f, fam in self._families.items()}
            full = self._inputs.need_full or start - self._last_full >= self.config.full_sync_period
        self._log_problems(updates)
        self._collect_garbage()
        t_render = self.clock()
        with _gc_paused(full):
            staged = self._stage(full, updates, listing=full)
        t_commit = self.clock()
        commands = [c for s in staged.values() for c in s.commands]
        self._commit(commands, staged, full=full)
        end = self.clock()
        report = SyncReport(
            full=full,
            ops=len(commands),
            families=tuple(self._family_report(f, updates[f]) for f in FAMILIES),
            render_seconds=t_commit - t_render,
            commit_seconds=end - t_commit,
            total_seconds=end - start,
        )
        self._run_hooks(report)
        return report

    def _commit(
        self, commands: list[Mapping[str, object]], staged: Mapping[IPFamily, Staged], *, full: bool
    ) -> None:
        try:
            # A full sync of a large cluster fills a libnftables cache of
            # hundreds of MB: use a context freed right after (DESIGN.md §5).
            self.backend.commit(commands, fresh=full)
        except NftBusy:
            if self._defer_deletes:
                raise
            # Kernels < 6.2 notice a lost vmap reference asynchronously: delete
            # chains in a later transaction from now on (upstream does the same).
            self.log.info("kernel refused same-transaction chain deletes; deferring them")
            self._defer_deletes = True
            self.request_full_sync()
            raise
        except NftError:
            with self._lock:
                self._inputs.need_full = True
            raise
        for s in staged.values():
            s.commit()
        if full:
            with self._lock:
                self._inputs.need_full = False
            self._last_full = self.clock()
            # The committed state just built lives until the next full sync:
            # keep the cyclic GC from re-scanning it on every collection
            # (0.3-0.4 s per full pass at 10,000 services; bench/RESULTS.md).
            gc.collect()
            gc.freeze()

    def _collect_garbage(self) -> None:
        gcs = [
            stage_gc(fam.table)
            for fam in self._families.values()
            if fam.table.stale_chains or fam.table.stale_sets
        ]
        commands = [c for s in gcs for c in s.commands]
        if not commands:
            return
        try:
            self.backend.commit(commands)
        except NftError as exc:
            self.log.warning("deleting stale chains failed, next sync is full: %s", exc)
            self.request_full_sync()
            return
        for s in gcs:
            s.commit()

    def _stage(
        self, full: bool, updates: Mapping[IPFamily, UpdateResult], *, listing: bool
    ) -> dict[IPFamily, Staged]:
        node = self.node()
        out: dict[IPFamily, Staged] = {}
        for family, fam in self._families.items():
            ctx = RenderContext(
                family, self.config, node, local_detector(family, self.config, node)
            )
            if full:
                desired = self._render_all(fam, ctx)
                kernel = (
                    kernel_table(
                        self.backend.list_table_objects(family.nft_family, self.config.table_name)
                    )
                    if listing
                    else None
                )
                out[family] = stage_full(
                    fam.table, kernel, desired, defer_deletes=self._defer_deletes
                )
            else:
                changed = self._render_changed(fam, ctx, updates[family].updated)
                out[family] = stage_partial(fam.table, changed, defer_deletes=self._defer_deletes)
        return out

    def _skeleton(self, ctx: RenderContext) -> Fragment:
        cidrs = tuple(c for c in self._inputs.service_cidrs if family_of(c) is ctx.family)
        return render_skeleton(ctx.family, self.config, ctx.node, cidrs)

    def _render_port(
        self, fam: _Family, spn: ServicePortName, ctx: RenderContext
    ) -> Fragment | None:
        port = fam.state.services.get(spn)
        if port is None:
            fam.no_local.pop(spn, None)
            return None
        rendered = render_service_port(port, fam.state.endpoints.get(spn, ()), ctx)
        fam.no_local[spn] = (rendered.internal_dropped, rendered.external_dropped)
        return rendered.fragment

    def _render_all(self, fam: _Family, ctx: RenderContext) -> dict[Owner, Fragment]:
        fam.no_local.clear()
        desired: dict[Owner, Fragment] = {SKELETON: self._skeleton(ctx)}
        for spn in fam.state.services:
            fragment = self._render_port(fam, spn, ctx)
            if fragment is not None:
                desired[spn] = fragment
        return desired

    def _render_changed(
        self, fam: _Family, ctx: RenderContext, updated: frozenset[ServicePortName]
    ) -> dict[Owner, Fragment | None]:
        return {spn: self._render_port(fam, spn, ctx) for spn in sorted(updated)}

    def _family_report(self, family: IPFamily, update: UpdateResult) -> FamilySync:
        fam = self._families[family]
        internal = sum(1 for i, _ in fam.no_local.values() if i)
        external = sum(1 for _, e in fam.no_local.values() if e)
        return FamilySync(family, update, fam.state, internal, external)

    def _run_hooks(self, report: SyncReport) -> None:
        for hook in self.hooks:
            try:
                hook(report)
            except Exception:  # a hook must never break syncing
                self.log.exception("post-sync hook %s failed", getattr(hook, "__name__", hook))
