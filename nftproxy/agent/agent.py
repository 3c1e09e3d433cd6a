"""The node agent: a Proxier kept in sync by a Runner, with health and metrics.

Layer: agent (above proxier; below tools, the only caller). One job: wire the
long-running pieces together and own their start and stop order. The agent
builds no real edge itself: the backend, the cluster source (through
`source_factory`), the sysctl filesystem, conntrack and the interface
address watch (started only when nodePortAddresses restricts node ports;
its readings go to Proxier.on_host_addresses) are parameters, so
tests run the real wiring with FakeBackend and a file source.

Data flow:
- the source feeds the `Intake` (agent/intake.py), which converts every
  object when its event arrives, reports each invalid field once
  (`_invalid_field`: one log line, nftproxy_invalid_fields_total, and
  `on_invalid_field` -- the CLI posts a Kubernetes Event there), and hands
  model values to `_Events`: the Proxier (record only), plus this Node for
  ProxyHealth (/healthz eligibility);
- every recorded change calls `_on_change`: ProxyHealth.queued(), the
  last-queued metric, Runner.kick();
- the Runner calls `_sync` (rate-limited, at least every syncPeriod): a
  refused commit is counted (nftables_sync_failures_total), logged, handed
  to `on_sync_failure` (the CLI posts a Node Event there), and retried by
  the Runner (runner.py: first after max(minSyncPeriod, 1 s), doubling up
  to syncPeriod); nothing here ever raises out of the loop;
- the Proxier checks for drift (agent/drift.py: another process committed
  to nftables) at most once per syncPeriod and then syncs fully;
  `_drift_repaired` logs and counts each such repair
  (nftproxy_drift_repairs_total{reason});
- after each successful commit the Proxier runs the hooks given to it:
  `_after_sync` (health, metrics, table-size gauges, health-check-node-port
  servers, one log line), the conntrack cleanup, and after a full sync
  the kube-proxy marker (agent/marker.py: peers such as Calico's Felix find
  an nftables proxy by kube-proxy's table name; only with `marker`, the
  backend it is written through). All read only the SyncReport.

Stopping (SIGTERM/SIGINT in cli) stops watching, the runner (after a sync in
progress), and the servers, and leaves the rules in place: traffic keeps
flowing while the agent restarts; `nftproxy cleanup` removes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry

from nftproxy.agent.drift import FOREIGN_COMMIT
from nftproxy.agent.heap import AgentHeapPolicy, HeapPolicy
from nftproxy.agent.intake import DUPLICATE_DESTINATION, INVALID_FIELD, Intake, InvalidField
from nftproxy.agent.marker import KubeProxyMarker
from nftproxy.agent.proxier import Proxier
from nftproxy.agent.report import SyncReport
from nftproxy.agent.runner import Runner
from nftproxy.cluster.events import ClusterEvents
from nftproxy.core.config import ProxyConfig
from nftproxy.core.convert import EndpointSliceInfo
from nftproxy.core.model import HostAddresses, NamespacedName, NodeInfo, ServiceInfo
from nftproxy.core.nft.errors import NftError
from nftproxy.core.nft.marker import MarkerBackend
from nftproxy.core.nft.seam import Backend
from nftproxy.kernel.sysctl import SysctlFS, apply_conntrack, enable_route_localnet
from nftproxy.serving.health import (
    BindErrorCallback,
    HealthServer,
    ProxyHealth,
    ServiceHealthServers,
    SourceProblem,
)
from nftproxy.serving.metrics import Metrics

if TYPE_CHECKING:
    from nftproxy.core.conntrack import CleanupResult, FlowFilter

__all__ = ["AddressEdge", "Agent", "ConntrackEdge", "Source", "SourceFactory"]


class Source(Protocol):
    """A cluster source the agent can run: feeds its handler from start()
    (the initial lists, then changes) until stop()."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


SourceFactory = Callable[[ClusterEvents], Source]
InvalidFieldCallback = Callable[[InvalidField], None]
SyncFailureCallback = Callable[[Exception], None]


class ConntrackEdge(Protocol):
    """nftproxy.kernel.conntrack.Conntrack (or FakeConntrack)."""

    def start(self) -> None: ...

    def close(self) -> None: ...

    def apply(self, filters: Sequence[FlowFilter]) -> CleanupResult: ...


class AddressEdge(Protocol):
    """nftproxy.kernel.addresses.AddressWatch (or a fake): hands the host's
    interface addresses to `on_change` once in start(), then on every change."""

    def start(self, on_change: Callable[[HostAddresses], None]) -> None: ...

    def close(self) -> None: ...


class _Events:
    """What the Intake feeds: the Proxier's handlers, plus this Node for health."""

    def __init__(self, proxier: Proxier, health: ProxyHealth) -> None:
        self.proxier = proxier
        self.health = health

    def on_service(
        self, name: NamespacedName, previous: ServiceInfo | None, current: ServiceInfo | None
    ) -> None:
        self.proxier.on_service(name, previous, current)

    def on_endpoint_slice(self, key: NamespacedName, current: EndpointSliceInfo | None) -> None:
        self.proxier.on_endpoint_slice(key, current)

    def on_node(self, node: NodeInfo | None) -> None:
        self.health.set_node(node)
        self.proxier.on_node(node)

    def on_service_cidrs(self, cidrs: tuple[str, ...]) -> None:
        self.proxier.on_service_cidrs(cidrs)

    def on_synced(self, kind: str) -> None:
        self.proxier.on_synced(kind)


class Agent:
    """Everything `nftproxy run` runs. The constructor builds the pure
    pieces (Proxier, Runner, ProxyHealth, Metrics, servers unbound); start()
    does the I/O, stop() undoes it and leaves the rules.

    `clock` is monotonic (scheduling, health ageing), `wall_clock` epoch
    (metric timestamps, health bodies). `service_health_host` "" serves
    health-check node ports on every address. `heap` decides what a sync
    does to the garbage collector and malloc (agent/heap.py; default: the
    agent's policy without malloc_trim). `hooks` run after each
    successful commit, after the agent's own. `marker` (None: none is
    written) is what the kube-proxy marker is written through when
    config.kube_proxy_marker is on (the CLI passes its NftBackend).
    `on_invalid_field` hears of every invalid field once, after it was
    logged and counted; `on_sync_failure` of every failed sync, with the
    error.
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
        host_addresses: AddressEdge | None = None,
        on_bind_error: BindErrorCallback | None = None,
        on_invalid_field: InvalidFieldCallback | None = None,
        on_sync_failure: SyncFailureCallback | None = None,
        service_health_host: str = "",
        heap: HeapPolicy | None = None,
        hooks: Sequence[Callable[[SyncReport], None]] = (),
        marker: MarkerBackend | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.source_factory = source_factory
        self.sysctl_fs = sysctl_fs
        self.conntrack = conntrack
        self.host_addresses = host_addresses
        self.on_invalid_field = on_invalid_field
        self.on_sync_failure = on_sync_failure
        self.log = log or logging.getLogger(__name__)
        self.metrics = Metrics(registry, clock=wall_clock)
        self.health = ProxyHealth(
            timeout=2 * config.sync_period, clock=wall_clock, monotonic=clock
        )
        self._conntrack_cleanup: Callable[[SyncReport], None] | None = None
        self.kube_proxy_marker: KubeProxyMarker | None = None
        self.proxier = Proxier(
            config,
            backend,
            hooks=[self._after_sync, self._clean_conntrack, self._keep_marker, *hooks],
            on_change=self._on_change,
            heap=heap or AgentHeapPolicy(),
            clock=clock,
            drift_check_period=config.sync_period,
            on_drift=self._drift_repaired,
        )
        if marker is not None and config.kube_proxy_marker:
            self.kube_proxy_marker = KubeProxyMarker(
                marker, committing=self.proxier.committing_aside, log=self.log
            )
        self.runner = Runner(
            self._sync,
            min_interval=config.min_sync_period,
            max_interval=config.sync_period,
            retry_interval=max(config.min_sync_period, 1.0),
            clock=clock,
            name="sync",
            log=self.log,
        )
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
        self.events = Intake(
            _Events(self.proxier, self.health),
            node_name=config.node_name,
            report=self._invalid_field,
            allow_external_ips=config.allow_service_external_ips,
        )
        """The ClusterEvents handler sources feed (raw objects in)."""
        self.source: Source | None = None
        self.synced = threading.Event()
        """Set after the first successful sync (for tests and readiness)."""

    # ---- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Set up the node and start everything. Raises what the backend or
        the source raise at start (e.g. SourceError); call stop() anyway."""
        self.metrics.mark_started()
        if self.sysctl_fs is not None:
            apply_conntrack(self.config.conntrack, self.sysctl_fs, log=self.log)
            if self.config.localhost_nodeports:  # never touched otherwise
                enable_route_localnet(self.sysctl_fs, log=self.log)
        self.backend.start()
        self._start_conntrack()
        self._start_host_addresses()
        self.health.updated()  # kube-proxy marks healthy when its loop starts
        self._serve("health", self._start_healthz)
        if self.config.metrics_bind_address:
            address = self.config.metrics_bind_address
            self._serve("metrics", lambda: self.metrics.serve(
                address, health=self.health, config=self.config))
        self.metrics.pending_from(self.proxier.pending_changes)
        self.runner.start()
        self.source = self.source_factory(self.events)
        stats = getattr(self.source, "stats", None)  # the API source's informers
        if isinstance(stats, Mapping):
            self.metrics.watch_from(lambda: stats)
            self.health.problems_from(lambda: _source_problems(stats))
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
            if self.config.bind_address_hard_fail:  # kube-proxy's bindAddressHardFail
                raise OSError(f"cannot serve {what}: {exc}") from exc
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
            self.metrics.record_conntrack(
                result.seconds, deleted=result.deleted, errors=result.errors
            )

        self._conntrack_cleanup = conntrack_hook(self.conntrack, log=self.log, on_result=on_result)

    def _start_host_addresses(self) -> None:
        """Node ports restricted by nodePortAddresses follow the host's
        interface addresses; without that restriction none are read."""
        edge, self.host_addresses = self.host_addresses, None
        if edge is None or not self.config.nodeport_addresses_restricted:
            return
        try:
            edge.start(self.proxier.on_host_addresses)
        except OSError as exc:
            self.log.error("cannot read interface addresses; node ports restricted by "
                           "nodePortAddresses use the Node's addresses: %s", exc)
            return
        self.host_addresses = edge

    def stop(self) -> None:
        """Stop watching, syncing and serving; leave the rules. Idempotent."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("source", self.source.stop if self.source is not None else _nothing),
            ("address watch",
             self.host_addresses.close if self.host_addresses is not None else _nothing),
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
        self.metrics.record_queued()
        # As upstream: nothing is "queued", and no sync is asked for, before
        # both lists are in (the last list's on_synced kicks). A kick before
        # would run a skipped sync and spend the runner's burst, delaying the
        # first real sync by minSyncPeriod.
        if self.proxier.ready:
            self.health.queued()
            self.runner.kick()

    def _invalid_field(self, invalid: InvalidField) -> None:
        """The one stream every invalid field (and every destination another
        Service won) goes through, once each."""
        self.log.warning("%s: %s", _SAID.get(invalid.reason, invalid.reason), invalid)
        self.metrics.record_invalid_field(invalid.problem.kind)
        if self.on_invalid_field is not None:
            try:
                self.on_invalid_field(invalid)
            except Exception:  # reporting must never stop the intake
                self.log.exception("reporting an invalid field failed")

    def _sync(self) -> None:
        """The Runner's function; raising makes the Runner retry."""
        try:
            report = self.proxier.sync()
        except NftError as exc:
            self.metrics.record_failure()
            self.log.error("sync failed; retrying with a full sync", extra={"error": str(exc)})
            self._sync_failed(exc)
            raise
        except Exception as exc:
            self.metrics.record_failure()
            self.log.exception("sync failed unexpectedly; retrying with a full sync")
            self.proxier.request_full_sync()
            self._sync_failed(exc)
            raise
        if report.skipped:
            self.metrics.record_sync(report)
            self.log.debug("sync skipped", extra={"reason": report.skipped})

    def _sync_failed(self, error: Exception) -> None:
        """Tell `on_sync_failure` (the CLI posts a Node Event) why a sync failed."""
        if self.on_sync_failure is not None:
            try:
                self.on_sync_failure(error)
            except Exception:  # reporting must never stop syncing
                self.log.exception("reporting a failed sync failed")

    def _drift_repaired(self, reason: str) -> None:
        """Another process had changed nftables; a full sync rewrote our
        tables (agent/drift.py). Counted by what the listing showed."""
        self.metrics.record_drift_repair(reason)
        level = logging.INFO if reason == FOREIGN_COMMIT else logging.WARNING
        self.log.log(level, "nftables changed by another process; full sync repaired it",
                     extra={"reason": reason})

    def _after_sync(self, report: SyncReport) -> None:
        """Post-commit hook: runs in the sync thread after every successful commit."""
        self.health.updated()
        self.metrics.record_sync(report)
        for fam in report.families:
            t = fam.table
            self.metrics.record_table(
                fam.family.value, chains=t.chains, rules=t.rules, sets=t.sets, elements=t.elements
            )
        self.service_health.sync(report.health_check_ports, report.local_endpoints)
        self._log_sync(report)
        self.synced.set()

    def _clean_conntrack(self, report: SyncReport) -> None:
        if self._conntrack_cleanup is not None:
            self._conntrack_cleanup(report)

    def _keep_marker(self, report: SyncReport) -> None:
        if self.kube_proxy_marker is not None:
            self.kube_proxy_marker.on_sync(report)

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


_SAID = {INVALID_FIELD: "skipped invalid field", DUPLICATE_DESTINATION: "duplicate destination"}
"""How the log line names each kind of report."""


def _nothing() -> None:
    pass


def _source_problems(stats: Mapping[str, object]) -> list[SourceProblem]:
    """The API informers' TLS or auth failures (ResourceStats.failing, since
    on the source's monotonic clock, the agent's in production)."""
    return [
        SourceProblem(f"{name}: {failing}", float(getattr(one, "failing_since", 0.0)))
        for name, one in sorted(stats.items())
        if (failing := getattr(one, "failing", ""))
    ]
