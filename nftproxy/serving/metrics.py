"""Prometheus metrics with kube-proxy's names, and the /metrics endpoint.

Layer: edge (prometheus_client, served by serving.http; imports the core's
tracker for the UpdateResult type and address for the bind address). One
job: turn what a sync reports into metrics -- the core never touches a
metric (style.md trap 4). Caller: agent.py, which calls
`record_sync(report)` after each successful commit, `record_failure()` after
a refused one, `record_queued()` on every recorded change, and
`serve(address, health=..., config=...)` at start-up. The metrics address
also answers kube-proxy's /proxyMode ("nftables"), /healthz (the health
address's answer) and /configz (the effective configuration,
serving/configz.py).

Names (upstream-nftables-notes.md §3.2), namespace `kubeproxy`:
sync_proxy_rules_duration_seconds, sync_full_proxy_rules_duration_seconds,
sync_partial_proxy_rules_duration_seconds (buckets `SYNC_BUCKETS`),
sync_proxy_rules_last_timestamp_seconds,
sync_proxy_rules_last_queued_timestamp_seconds,
network_programming_duration_seconds,
sync_proxy_rules_{service,endpoint}_changes_{pending,total},
sync_proxy_rules_no_local_endpoints_total{traffic_policy},
sync_proxy_rules_nftables_sync_failures_total, proxy_healthz_total{code},
proxy_livez_total{code}, conntrack_reconciler_sync_duration_seconds,
conntrack_reconciler_deleted_entries_total. nftproxy's own, namespace
`nftproxy`: sync_transaction_ops (histogram), sync_render_duration_seconds,
sync_commit_duration_seconds, programmed_{chains,rules,sets,elements}
{ip_family}, sync_skipped_total, invalid_fields_total{kind},
drift_repairs_total{reason} (agent/drift.py), conntrack_cleanup_errors_total,
and, with the API server source, the informers' api_synced, api_objects,
api_watch_events_total, api_relists_total {resource}, api_errors_total
{resource,reason}.
Also prometheus_client's process_* (RSS, CPU, fds), as kube-proxy has them.
docs/metrics.md lists them all next to kube-proxy's.

Dual-stack: both families sync in one transaction, so there is no
ip_family label on kube-proxy's names. A dual-stack Service is one change in
each family's tracker: service change counts take the larger family's,
endpoint (per-slice, hence per-family) counts are summed, and the
no-local-endpoints gauges sum the service ports of both families.

Counters also export prometheus_client's `<name>_created` samples.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nftproxy.core.address import parse_address
from nftproxy.core.config import ProxyConfig
from nftproxy.core.tracker import UpdateResult
from nftproxy.serving.configz import configz_response, proxy_mode_response
from nftproxy.serving.health import ProxyHealth, healthz_response
from nftproxy.serving.http import NOT_FOUND, HttpEndpoint, Response

__all__ = ["Metrics", "SyncSummary"]

_KUBEPROXY = "kubeproxy"
_NFTPROXY = "nftproxy"

SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
"""kube-proxy's sync duration buckets: ExponentialBuckets(0.001, 2, 15)."""

NETWORK_PROGRAMMING_BUCKETS = (
    0.25, 0.5,
    *range(1, 60),  # every second below a minute
    *range(60, 120, 5),  # every fifth second below two
    *range(120, 301, 30),  # every half minute up to five
)
"""kube-proxy's network_programming_duration_seconds buckets."""

INVALID_KINDS = ("Service", "EndpointSlice", "Node", "ServiceCIDR")
"""The kinds whose invalid fields are counted, exported at 0 from the start."""

OPS_BUCKETS = (0, 1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


class FamilyReport(Protocol):
    @property
    def update(self) -> UpdateResult: ...

    @property
    def no_local_internal(self) -> int: ...

    @property
    def no_local_external(self) -> int: ...


class SyncSummary(Protocol):
    """What record_sync reads of a proxier.SyncReport."""

    @property
    def full(self) -> bool: ...

    @property
    def ops(self) -> int: ...

    @property
    def families(self) -> Sequence[FamilyReport]: ...

    @property
    def render_seconds(self) -> float: ...

    @property
    def commit_seconds(self) -> float: ...

    @property
    def total_seconds(self) -> float: ...

    @property
    def skipped(self) -> str: ...


class WatchStats(Protocol):
    """What watch_from reads of one informer (cluster.informer.ResourceStats)."""

    @property
    def relists(self) -> int: ...

    @property
    def events(self) -> int: ...

    @property
    def error_reasons(self) -> Mapping[str, int]: ...

    @property
    def objects(self) -> int: ...

    @property
    def synced(self) -> bool: ...


class _WatchCollector(Collector):
    """nftproxy_api_* per watched resource, read from the informers' own
    counters at each scrape (no cost per event)."""

    def __init__(self, read: Callable[[], Mapping[str, WatchStats]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        stats = self.read()
        labels = ["resource"]
        families: list[tuple[GaugeMetricFamily | CounterMetricFamily,
                             Callable[[WatchStats], float]]] = [
            (GaugeMetricFamily(f"{_NFTPROXY}_api_synced",
                               "1 once the first list of the resource is complete",
                               labels=labels), lambda s: float(s.synced)),
            (GaugeMetricFamily(f"{_NFTPROXY}_api_objects",
                               "Objects of the resource held by its informer",
                               labels=labels), lambda s: s.objects),
            (CounterMetricFamily(f"{_NFTPROXY}_api_watch_events",
                                 "Watch events (added, modified, deleted) received",
                                 labels=labels), lambda s: s.events),
            (CounterMetricFamily(f"{_NFTPROXY}_api_relists",
                                 "Lists repeated after 410 Gone", labels=labels),
             lambda s: s.relists),
        ]
        for family, value in families:
            for resource, one in sorted(stats.items()):
                family.add_metric([resource], value(one))
            yield family
        errors = CounterMetricFamily(
            f"{_NFTPROXY}_api_errors",
            "Failed list or watch requests and broken watch streams, by reason (unreachable, "
            "tls, unauthorized, forbidden, http, stream, internal)",
            labels=["resource", "reason"])
        for resource, one in sorted(stats.items()):
            for reason, count in sorted(one.error_reasons.items()):
                errors.add_metric([resource, reason], count)
        yield errors


class Metrics(HttpEndpoint):
    """Every metric of nftproxy, registered in `registry` (a fresh one when
    None: never the process-wide default). `clock` gives epoch seconds."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.time,
        log: logging.Logger | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.clock = clock
        self.log = log or logging.getLogger(__name__)
        self.start_time = -math.inf
        self._health: ProxyHealth | None = None
        self._configz: Response | None = None
        super().__init__(self._app, name="metrics")
        r = self.registry
        ProcessCollector(registry=r)  # process_* (RSS, CPU, fds), as kube-proxy exports

        def histogram(name: str, doc: str, buckets: Sequence[float], ns: str) -> Histogram:
            return Histogram(name, doc, namespace=ns, registry=r, buckets=buckets)

        kp = _KUBEPROXY
        self.sync_duration = histogram(
            "sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds",
            SYNC_BUCKETS, kp)
        self.sync_full_duration = histogram(
            "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs", SYNC_BUCKETS, kp)
        self.sync_partial_duration = histogram(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs", SYNC_BUCKETS, kp)
        self.last_sync = Gauge(
            "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced", namespace=kp, registry=r)
        self.last_queued = Gauge(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued", namespace=kp, registry=r)
        self.network_programming = histogram(
            "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            NETWORK_PROGRAMMING_BUCKETS, kp)
        self.service_changes_pending = Gauge(
            "sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes",
            namespace=kp, registry=r)
        self.service_changes = Counter(
            "sync_proxy_rules_service_changes_total", "Cumulative proxy rules Service changes",
            namespace=kp, registry=r)
        self.endpoint_changes_pending = Gauge(
            "sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes",
            namespace=kp, registry=r)
        self.endpoint_changes = Counter(
            "sync_proxy_rules_endpoint_changes_total", "Cumulative proxy rules Endpoint changes",
            namespace=kp, registry=r)
        self.no_local_endpoints = Gauge(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            ["traffic_policy"], namespace=kp, registry=r)
        self.sync_failures = Counter(
            "sync_proxy_rules_nftables_sync_failures_total",
            "Cumulative proxy nftables sync failures", namespace=kp, registry=r)
        self.healthz = Counter(
            "proxy_healthz_total", "Cumulative proxy healthz HTTP status",
            ["code"], namespace=kp, registry=r)
        self.livez = Counter(
            "proxy_livez_total", "Cumulative proxy livez HTTP status",
            ["code"], namespace=kp, registry=r)
        self.conntrack_duration = histogram(
            "conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds", SYNC_BUCKETS, kp)
        self.conntrack_deleted = Counter(
            "conntrack_reconciler_deleted_entries_total",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            namespace=kp, registry=r)

        nf = _NFTPROXY
        self.ops = histogram(
            "sync_transaction_ops", "nftables commands sent per successful sync",
            OPS_BUCKETS, nf)
        self.render_duration = histogram(
            "sync_render_duration_seconds", "Time spent rendering and planning per sync",
            SYNC_BUCKETS, nf)
        self.commit_duration = histogram(
            "sync_commit_duration_seconds", "Time spent committing the transaction per sync",
            SYNC_BUCKETS, nf)
        self.programmed = {
            kind: Gauge(
                f"programmed_{kind}", f"{kind.capitalize()} in nftproxy's table, as last committed",
                ["ip_family"], namespace=nf, registry=r)
            for kind in ("chains", "rules", "sets", "elements")
        }
        self.skipped = Counter(
            "sync_skipped_total", "Syncs skipped (initial lists not complete yet)",
            namespace=nf, registry=r)
        self.invalid_fields = Counter(
            "invalid_fields_total",
            "Invalid fields skipped in API objects (each reported once per object)",
            ["kind"], namespace=nf, registry=r)
        for kind in INVALID_KINDS:
            # a series that exists at 0 lets increase() see a kind's first invalid object
            self.invalid_fields.labels(kind)
        self.drift_repairs = Counter(
            "drift_repairs_total",
            "Full syncs forced because another process changed nftables, by what the "
            "listing showed (table, chains, sets, foreign_commit)",
            ["reason"], namespace=nf, registry=r)
        self.conntrack_errors = Counter(
            "conntrack_cleanup_errors_total",
            "Failed conntrack dumps and deletes during cleanup", namespace=nf, registry=r)

    # ---- recording ------------------------------------------------------------

    def mark_started(self) -> None:
        """Trigger times before this moment are not observed: they measure
        how long this agent was not running, not programming latency."""
        self.start_time = self.clock()

    def record_queued(self) -> None:
        self.last_queued.set(self.clock())

    def record_sync(self, report: SyncSummary) -> None:
        """A successful sync (or a skipped one, only counted)."""
        if report.skipped:
            self.skipped.inc()
            return
        now = self.clock()
        self.sync_duration.observe(report.total_seconds)
        (self.sync_full_duration if report.full else self.sync_partial_duration).observe(
            report.total_seconds
        )
        self.render_duration.observe(report.render_seconds)
        self.commit_duration.observe(report.commit_seconds)
        self.ops.observe(report.ops)
        self.last_sync.set(now)
        families = report.families
        self.service_changes.inc(max((f.update.service_changes for f in families), default=0))
        self.endpoint_changes.inc(sum(f.update.endpoint_changes for f in families))
        self.no_local_endpoints.labels("internal").set(sum(f.no_local_internal for f in families))
        self.no_local_endpoints.labels("external").set(sum(f.no_local_external for f in families))
        for f in families:
            for times in f.update.trigger_times.values():
                for t in times:
                    if t >= self.start_time:
                        self.network_programming.observe(max(0.0, now - t))

    def record_invalid_field(self, kind: str) -> None:
        """One invalid field skipped in an object of `kind` (Service, ...)."""
        self.invalid_fields.labels(kind).inc()

    def watch_from(self, read: Callable[[], Mapping[str, WatchStats]]) -> None:
        """Export the API informers' counters (resource -> stats, read at
        every scrape) as nftproxy_api_*; call once."""
        self.registry.register(_WatchCollector(read))

    def record_failure(self) -> None:
        self.sync_failures.inc()

    def record_pending(self, *, services: int, endpoints: int) -> None:
        self.service_changes_pending.set(services)
        self.endpoint_changes_pending.set(endpoints)

    def pending_from(self, fn: Callable[[], tuple[int, int]]) -> None:
        """Read (services, endpoints) pending from `fn` at every scrape
        instead of record_pending (no cost per event)."""
        self.service_changes_pending.set_function(lambda: fn()[0])
        self.endpoint_changes_pending.set_function(lambda: fn()[1])

    def record_table(
        self, family: str, *, chains: int, rules: int, sets: int, elements: int
    ) -> None:
        """What one family's table holds after a commit (`family` IPv4/IPv6)."""
        counts = {"chains": chains, "rules": rules, "sets": sets, "elements": elements}
        for kind, value in counts.items():
            self.programmed[kind].labels(family).set(value)

    def record_response(self, endpoint: str, code: int) -> None:
        """A /healthz or /livez answer (HealthServer's on_response)."""
        counter = self.healthz if endpoint == "healthz" else self.livez
        counter.labels(str(code)).inc()

    def record_conntrack(self, seconds: float, *, deleted: int, errors: int = 0) -> None:
        self.conntrack_duration.observe(seconds)
        if deleted:
            self.conntrack_deleted.inc(deleted)
        if errors:
            self.conntrack_errors.inc(errors)

    def record_drift_repair(self, reason: str) -> None:
        """A full sync forced by agent/drift.py committed."""
        self.drift_repairs.labels(reason).inc()

    # ---- serving --------------------------------------------------------------

    def serve(
        self,
        address: str,
        *,
        health: ProxyHealth | None = None,
        config: ProxyConfig | None = None,
    ) -> None:
        """Serve /metrics and /proxyMode on 'IP:PORT' (port 0: ephemeral) in
        a thread, as kube-proxy's metrics server does; also /healthz (the
        health address's answer) with `health` and /configz with `config`.
        OSError if it cannot bind."""
        host, port = parse_address(address)
        self._health = health
        self._configz = configz_response(config) if config is not None else None
        # "" is 0.0.0.0 here: /metrics is not dual-stack unless asked for "::"
        self._http.start(host or "0.0.0.0", port)
        self.log.info("serving /metrics", extra={"address": address})

    def _app(self, path: str) -> Response:
        if path == "/metrics":
            return 200, {"Content-Type": CONTENT_TYPE_LATEST}, generate_latest(self.registry)
        if path == "/proxyMode":
            return proxy_mode_response()
        if path == "/healthz" and self._health is not None:
            # not counted in proxy_healthz_total: kube-proxy counts its health server only
            return healthz_response(self._health.status())
        if path == "/configz" and self._configz is not None:
            return self._configz
        return NOT_FOUND
