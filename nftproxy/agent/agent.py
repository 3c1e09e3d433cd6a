"""The node agent: a Proxier kept in sync by a Runner, with health and metrics.

Layer: agent (above proxier; below cli, the only caller). One job: wire the
long-running pieces together and own their start and stop order. The
agent builds no real edge itself: the backend, the cluster source (through
`source_factory`), the sysctl filesystem and conntrack are parameters, so
tests run the real wiring with FakeBackend and a file source.

Data flow:
- the source feeds `_Events`, which forwards to the Proxier (record only)
  and tells ProxyHealth about this Node (for /healthz eligibility);
- every recorded change calls `_on_change`: ProxyHealth.queued(), the
  last-queued metric, Runner.kick();
- the Runner calls `_sync` (rate-limited, at least every syncPeriod): a
  refused commit is counted (nftables_sync_failures_total), logged, and
  retried by the Runner (runner.py: first after max(minSyncPeriod, 1 s),
  doubling up to syncPeriod); nothing here ever raises out of the loop;
- after each successful commit the Proxier runs `_after_sync` (health
  updated, metrics, table-size gauges, health-check-node-port servers, one
  log line) and, when conntrack is given, the conntrack cleanup hook.

Stopping (SIGTERM/SIGINT in cli) stops watching, the runner (after a sync in
progress), and the servers, and leaves the rules in place: traffic keeps
flowing while the agent restarts; `nftproxy cleanup` removes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry

from nftproxy.agent.proxier import Proxier, SyncReport
from nftproxy.agent.runner import Runner
from nftproxy.cluster.events import ClusterEvents, Obj
from nftproxy.cluster.file import FileSource
from nftproxy.core import convert
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, NamespacedName
from nftproxy.core.nft.errors import NftError
from nftproxy.kernel.libnftables import Backend
from nftproxy.kernel.sysctl import SysctlFS, apply_conntrack
from nftproxy.serving.health import (
    BindErrorCallback,
    HealthServer,
    ProxyHealth,
    ServiceHealthServers,
)
from nftproxy.serving.metrics import Metrics

if TYPE_CHECKING:
    from nftproxy.kernel.conntrack import CleanupResult, FlowFilter

__all__ = ["Agent", "ConntrackEdge", "Source", "SourceFactory", "WatchedFiles"]

_FAMILIES = (IPFamily.IPV4, IPFamily.IPV6)


class Source(Protocol):
    """A cluster source the agent can run: feeds its handler from start()
    (the initial lists, then changes) until stop()."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


SourceFactory = Callable[[ClusterEvents], Source]


class ConntrackEdge(Protocol):
    """nftproxy.kernel.conntrack.Conntrack (or FakeConntrack)."""

    def start(self) -> None: ...

    def close(self) -> None: ...

    def apply(self, filters: Sequence[FlowFilter]) -> CleanupResult: ...


class WatchedFiles:
    """A FileSource as a Source: load() on start (SourceError if a file is
    missing or malformed), then watch() in a thread until stop()."""

    def __init__(self, source: FileSource) -> None:
        self.source = source
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.source.load()
        self._thread = threading.Thread(
            target=self.source.watch, args=(self._stop,), name="file-source", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class _Events:
    """The handler sources feed: the Proxier's, plus this Node for health."""

    def __init__(self, proxier: Proxier, health: ProxyHealth) -> None:
        self.proxier = proxier
        self.health = health

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        self.proxier.on_service(previous, current)

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        self.proxier.on_endpoint_slice(previous, current)

    def on_node(self, node: Obj | None) -> None:
        self.health.set_node(convert.node_info(node)[0] if node is not None else None)
        self.proxier.on_node(node)

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        self.proxier.on_service_cidrs(cidrs)

    def on_synced(self, kind: str) -> None:
        self.proxier.on_synced(kind)


class Agent:
    """Everything `nftproxy run` runs. The constructor builds the pure
    pieces (Proxier, Runner, ProxyHealth, Metrics, servers unbound); start()
    does the I/O, stop() undoes it and leaves the rules.

    `clock` is monotonic (scheduling, health ageing), `wall_clock` epoch
    (metric timestamps, health bodies). `service_health_host` "" serves
    health-check node ports on every address. `trim_memory` (malloc_trim
    with the real backend) runs after full syncs.
    """

    def __init__(
        self,
        config: ProxyConfig,
        *,
        backend: Backend,
        source_factory: SourceFactory,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sysctl_fs: SysctlFS | None = None,
        conntrack: ConntrackEdge | None = None,
        on_bind_error: BindErrorCallback | None = None,
        service_health_host: str = "",
        trim_memory: Callable[[], None] | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.source_factory = source_factory
        self.sysctl_fs = sysctl_fs
        self.conntrack = conntrack
        self.trim_memory = trim_memory
        self.log = log or logging.getLogger(__name__)
        self.metrics = Metrics(registry, clock=wall_clock)
        self.health = ProxyHealth(
            timeout=2 * config.sync_period, clock=wall_clock, monotonic=clock
        )
        self.proxier = Proxier(config, backend, hooks=[self._after_sync], clock=clock)
        self.runner = Runner(
            self._sync,
            min_interval=config.min_sync_period,
            max_interval=config.sync_period,
            retry_interval=max(config.min_sync_period, 1.0),
            clock=clock,
            name="sync",
            log=self.log,
        )
        self.proxier.set_change_callback(self._on_change)
        self.healthz = (
            HealthServer(
                self.health, config.healthz_bind_address, on_response=self.metrics.record_response
            )
            if config.healthz_bind_address
            else None
        )
        self.service_health = ServiceHealthServers(
            proxy_healthy=self.health.is_healthy,
            host=service_health_host,
            on_bind_error=on_bind_error,
        )
        self.events = _Events(self.proxier, self.health)
        self.source: Source | None = None
        self.synced = threading.Event()
        """Set after the first successful sync (for tests and readiness)."""
        self._pending = (0, 0)

    # ---- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Set up the node and start everything. Raises what the backend or
        the source raise at start (e.g. SourceError); call stop() anyway."""
        self.metrics.mark_started()
        if self.sysctl_fs is not None:
            apply_conntrack(self.config.conntrack, self.sysctl_fs, log=self.log)
        self.backend.start()
        self._start_conntrack()
        self.health.updated()  # kube-proxy marks healthy when its loop starts
        self._serve("health", self._start_healthz)
        if self.config.metrics_bind_address:
            address = self.config.metrics_bind_address
            self._serve("metrics", lambda: self.metrics.serve(address))
        self.metrics.pending_from(self._pending_changes)
        self.runner.start()
        self.source = self.source_factory(self.events)
        self.source.start()
        self.log.info(
            "agent started",
            extra={"node": self.config.node_name, "table": self.config.table_name},
        )

    def _start_healthz(self) -> None:
        if self.healthz is not None:
            self.healthz.start()

    def _serve(self, what: str, start: Callable[[], None]) -> None:
        try:
            start()
        except (OSError, ValueError) as exc:  # the proxy still works without it
            self.log.error("cannot serve %s; continuing without it", what,
                           extra={"error": str(exc)})

    def _start_conntrack(self) -> None:
        if self.conntrack is None:
            return
        from nftproxy.kernel.conntrack import conntrack_hook  # the edge may be absent

        try:
            self.conntrack.start()
        except OSError as exc:
            self.log.warning("conntrack cleanup disabled: %s", exc)
            self.conntrack = None
            return

        def on_result(result: CleanupResult) -> None:
            self.metrics.record_conntrack(result.seconds, deleted=result.deleted)

        self.proxier.hooks.append(
            conntrack_hook(self.conntrack, log=self.log, on_result=on_result)
        )

    def stop(self) -> None:
        """Stop watching, syncing and serving; leave the rules. Idempotent."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("source", self.source.stop if self.source is not None else _nothing),
            ("runner", self.runner.stop),
            ("service health servers", self.service_health.stop),
            ("health server", self.healthz.stop if self.healthz is not None else _nothing),
            ("metrics server", self.metrics.stop),
            ("conntrack", self.conntrack.close if self.conntrack is not None else _nothing),
            ("backend", self.backend.close),
        ]
        for what, step in steps:
            try:
                step()
            except Exception:  # keep stopping the rest
                self.log.exception("stopping the %s failed", what)
        self.source = None
        self.log.info("agent stopped; rules left in place")

    def run(self, stop: threading.Event) -> None:
        """start(), wait for `stop`, stop()."""
        try:
            self.start()
            stop.wait()
        finally:
            self.stop()

    # ---- the loop -----------------------------------------------------------------

    def _on_change(self) -> None:
        if self.proxier.gate.ready:  # as upstream: nothing is "queued" before the lists
            self.health.queued()
        self.metrics.record_queued()
        self.runner.kick()

    def _sync(self) -> None:
        """The Runner's function; raising makes the Runner retry."""
        try:
            report = self.proxier.sync()
        except NftError as exc:
            self.metrics.record_failure()
            self.log.error("sync failed; retrying with a full sync", extra={"error": str(exc)})
            raise
        except Exception:
            self.metrics.record_failure()
            self.log.exception("sync failed unexpectedly; retrying with a full sync")
            self.proxier.request_full_sync()
            raise
        if report.skipped:
            self.metrics.record_sync(report)
            self.log.debug("sync skipped", extra={"reason": report.skipped})

    def _after_sync(self, report: SyncReport) -> None:
        """Post-commit hook: runs in the sync thread after every successful commit."""
        self.health.updated()
        self.metrics.record_sync(report)
        self._record_tables()
        ports: dict[NamespacedName, int] = {}
        local: dict[NamespacedName, int] = {}
        for fam in report.families:
            ports.update(fam.state.health_check_ports())
            for svc, count in fam.state.local_ready_endpoints().items():
                # A dual-stack pod is one endpoint per family: count it once.
                local[svc] = max(local.get(svc, 0), count)
        self.service_health.sync(ports, local)
        self._log_sync(report)
        if report.full and self.trim_memory is not None:
            self.trim_memory()
        self.synced.set()

    def _record_tables(self) -> None:
        for family in _FAMILIES:
            table = self.proxier.table_state(family)
            self.metrics.record_table(
                family.value,
                chains=len(table.chains),
                rules=sum(c.size for c in table.chains.values()),
                sets=len(table.sets),
                elements=len(table.index.claims),
            )

    def _log_sync(self, report: SyncReport) -> None:
        fields = {
            "full": report.full,
            "ops": report.ops,
            "services": max((f.update.service_changes for f in report.families), default=0),
            "endpoints": sum(f.update.endpoint_changes for f in report.families),
            "updated": len(report.updated),
            "render_ms": round(report.render_seconds * 1000, 1),
            "commit_ms": round(report.commit_seconds * 1000, 1),
            "ms": round(report.total_seconds * 1000, 1),
        }
        level = logging.INFO if report.full or report.ops else logging.DEBUG
        self.log.log(level, "synced", extra=fields)

    def _pending_changes(self) -> tuple[int, int]:
        """(services, endpoint slices) with pending changes, read at scrape
        time. The trackers are read without the proxier's lock: a concurrent
        event can change a dict mid-count, so retry, then keep the last value."""
        for _ in range(3):
            try:
                states = [self.proxier.proxy_state(f) for f in _FAMILIES]
                self._pending = (
                    max(s.pending_service_changes for s in states),
                    sum(s.pending_endpoint_changes for s in states),
                )
                break
            except RuntimeError:
                continue
        return self._pending


def _nothing() -> None:
    pass
