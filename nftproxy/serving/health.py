"""Health: /healthz and /livez, and one health server per eTP=Local service.

Layer: edge (HTTP servers through serving.http; imports the core's model
and address only). One job: answer the questions load balancers and the
kubelet ask, with kube-proxy's meaning (upstream-nftables-notes.md §3.3,
§3.4). Caller: agent.py, which tells
`ProxyHealth` when a change is queued and when a sync succeeded, and hands
`ServiceHealthServers.sync()` the health-check node ports and local endpoint
counts after each sync.

- `ProxyHealth`: the state. Unhealthy once a queued change has waited longer
  than `timeout` (2 x syncPeriod) without a successful sync. /healthz also
  needs this node to be eligible: its Node object known, not being deleted,
  not tainted ToBeDeletedByClusterAutoscaler; and no source problem (a TLS
  or auth failure of the API source, `problems_from`) older than `timeout`
  -- the body's "problem" says which (kube-proxy has no such check: its
  healthz only goes stale; /livez ignores problems, a restart does not fix
  a CA or a credential).
- `HealthServer`: serves /healthz and /livez (200 or 503, JSON body with
  lastUpdated/currentTime, nodeEligible on /healthz; any other path 404).
- `ServiceHealthServers`: one server per service with
  externalTrafficPolicy=Local on its healthCheckNodePort, all served by one
  thread (an `HttpServerGroup`); any path answers
  200 when the node has a local ready endpoint and the proxy is healthy,
  else 503, with `X-Load-Balancing-Endpoint-Weight: <local endpoints>`.

Known limits: service health servers listen on every address (dual-stack
"::", or 0.0.0.0 without IPv6), not only on nodePortAddresses as kube-proxy
does. A port that cannot be bound is warned about (and reported through
`on_bind_error`, for an Event) once per service and port, then retried
silently on every sync -- kube-proxy warns on every sync. All service
ports share one `HttpServerGroup` (serving/http.py): one thread blocked in
select() over every port (no polling) plus a short-lived thread per request;
/healthz and /metrics keep one `HttpServer` thread each.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nftproxy.core.address import parse_address
from nftproxy.core.model import NamespacedName, NodeInfo
from nftproxy.core.pmap import PersistentMap
from nftproxy.serving.http import NOT_FOUND, App, HttpEndpoint, HttpServerGroup, Response

__all__ = [
    "HealthServer",
    "HealthStatus",
    "ProxyHealth",
    "ServiceHealthServers",
    "SourceProblem",
    "healthz_response",
    "livez_response",
]

BindErrorCallback = Callable[[NamespacedName, int, OSError], None]


# ---- state ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HealthStatus:
    """One reading of ProxyHealth; times are epoch seconds."""

    healthy: bool
    node_eligible: bool
    last_updated: float
    current_time: float
    problem: str = ""  # why the source cannot list, once that is stale ("" when fine)


@dataclass(frozen=True, slots=True)
class SourceProblem:
    """A failure of the cluster source that waiting does not heal (TLS,
    401, 403): `what` with its cause, `since` on ProxyHealth's monotonic
    clock."""

    what: str
    since: float


class ProxyHealth:
    """kube-proxy's ProxyHealthServer state, without the server.

    `queued()` when a change is recorded (keeps the oldest pending one),
    `updated()` after each successful sync (and once when the loop starts),
    `set_node()` when this node's Node object changes. `clock` gives the
    epoch seconds shown in bodies, `monotonic` measures how long a change
    has waited (a wall-clock step must not flip health).
    """

    def __init__(
        self,
        *,
        timeout: float,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.clock = clock
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._last_updated = 0.0
        self._oldest_queued: float | None = None
        self._node: NodeInfo | None = None
        self._problems: Callable[[], Sequence[SourceProblem]] = tuple

    def problems_from(self, read: Callable[[], Sequence[SourceProblem]]) -> None:
        """Read the source's current problems at each /healthz answer."""
        self._problems = read

    def queued(self) -> None:
        with self._lock:
            if self._oldest_queued is None:
                self._oldest_queued = self.monotonic()

    def updated(self) -> None:
        with self._lock:
            self._oldest_queued = None
            self._last_updated = self.clock()

    def set_node(self, node: NodeInfo | None) -> None:
        with self._lock:
            self._node = node

    def is_healthy(self) -> bool:
        """No change has waited longer than `timeout` (the /livez answer)."""
        with self._lock:
            return self._healthy_locked()

    def _healthy_locked(self) -> bool:
        oldest = self._oldest_queued
        return oldest is None or self.monotonic() - oldest <= self.timeout

    def status(self) -> HealthStatus:
        with self._lock:
            now = self.clock()
            healthy = self._healthy_locked()
            node = self._node
            eligible = node is not None and not node.deleting and not node.to_be_deleted
            # kube-proxy reports "now" as lastUpdated while healthy (old clients
            # compare the two).
            last = now if healthy else self._last_updated
            return HealthStatus(healthy, eligible, last, now, self._stale_problem())

    def _stale_problem(self) -> str:
        """The problems that have lasted longer than `timeout`, as a pending
        change does before it turns /healthz unhealthy: the rules can no
        longer follow the cluster."""
        now = self.monotonic()
        stale = [p.what for p in self._problems() if now - p.since > self.timeout]
        return "; ".join(stale)


def _timestamp(epoch: float) -> str:
    """RFC 3339 in UTC, as Go marshals a time.Time."""
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


_JSON_HEADERS = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}


def _json(code: int, body: Mapping[str, Any], **headers: str) -> Response:
    data = json.dumps(body).encode() + b"\n"
    return code, {**_JSON_HEADERS, **headers}, data


def livez_response(status: HealthStatus) -> Response:
    body = {
        "lastUpdated": _timestamp(status.last_updated),
        "currentTime": _timestamp(status.current_time),
        "healthy": status.healthy,
    }
    return _json(200 if status.healthy else 503, body)


def healthz_response(status: HealthStatus) -> Response:
    ok = status.healthy and status.node_eligible and not status.problem
    body: dict[str, Any] = {
        "lastUpdated": _timestamp(status.last_updated),
        "currentTime": _timestamp(status.current_time),
        "nodeEligible": status.node_eligible,
        "healthy": status.healthy and not status.problem,
    }
    if status.problem:
        body["problem"] = status.problem
    return _json(200 if ok else 503, body)


# ---- /healthz and /livez ------------------------------------------------------------


class HealthServer(HttpEndpoint):
    """/healthz and /livez for `health` on `address` ('IP:PORT', port 0 =
    ephemeral). `on_response(endpoint, code)` counts answers (metrics)."""

    def __init__(
        self,
        health: ProxyHealth,
        address: str,
        *,
        on_response: Callable[[str, int], None] | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.health = health
        self.bind_address = address
        self.on_response = on_response
        self.log = log or logging.getLogger(__name__)
        super().__init__(self._app, name="healthz")

    def start(self) -> None:
        """Bind and serve; raises OSError (or ValueError for a bad address)."""
        self._http.start(*parse_address(self.bind_address))
        self.log.info("serving /healthz and /livez", extra={"address": self.bind_address})

    def _app(self, path: str) -> Response:
        status = self.health.status()
        if path == "/healthz":
            endpoint, response = "healthz", healthz_response(status)
        elif path == "/livez":
            endpoint, response = "livez", livez_response(status)
        else:
            return NOT_FOUND
        if self.on_response is not None:
            self.on_response(endpoint, response[0])
        return response


# ---- healthCheckNodePort servers ---------------------------------------------------


class ServiceHealthServers:
    """One HTTP server per service on its healthCheckNodePort, all served
    by one thread named "service-health".

    `proxy_healthy` is ProxyHealth.is_healthy (sync freshness only, as
    upstream). `host` "" listens on every address. `on_bind_error(service,
    port, error)` is called once per failing (service, port), e.g. to
    record a FailedToStartServiceHealthcheck Event.
    """

    def __init__(
        self,
        *,
        proxy_healthy: Callable[[], bool],
        host: str = "",
        on_bind_error: BindErrorCallback | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.proxy_healthy = proxy_healthy
        self.host = host
        self.on_bind_error = on_bind_error
        self.log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()  # guards _local against request threads
        self._local: Mapping[NamespacedName, int] = {}
        self._group: HttpServerGroup[NamespacedName] = HttpServerGroup(name="service-health")
        self._ports: dict[NamespacedName, int] = {}  # served now
        self._failed: dict[NamespacedName, int] = {}

    def sync(
        self,
        ports: Mapping[NamespacedName, int],
        local_endpoints: Mapping[NamespacedName, int],
    ) -> None:
        """Serve exactly `ports`; answer with `local_endpoints` (absent = 0).
        A PersistentMap (what the sync reports) is kept as it is: it cannot
        change; any other mapping is copied."""
        local = (
            local_endpoints if isinstance(local_endpoints, PersistentMap) else dict(local_endpoints)
        )
        with self._lock:
            self._local = local
        for service, port in list(self._ports.items()):
            if ports.get(service) != port:
                self.log.info(
                    "closing service health server",
                    extra={"service": str(service), "port": port},
                )
                self._group.remove(service)
                del self._ports[service]
        for service in list(self._failed):
            if ports.get(service) != self._failed[service]:
                del self._failed[service]
        for service, port in sorted(ports.items()):
            if service not in self._ports:
                self._open(service, port)

    def _open(self, service: NamespacedName, port: int) -> None:
        try:
            self._group.add(
                service, self.host, port, self._app_for(service), name=f"health-{service}"
            )
        except OSError as exc:
            if self._failed.get(service) != port:
                self._failed[service] = port
                self.log.warning(
                    "cannot start the service health server",
                    extra={"service": str(service), "port": port, "error": str(exc)},
                )
                self._report(service, port, exc)
            return
        self._failed.pop(service, None)
        self._ports[service] = port
        self.log.info("serving service health", extra={"service": str(service), "port": port})

    def _report(self, service: NamespacedName, port: int, exc: OSError) -> None:
        if self.on_bind_error is None:
            return
        try:
            self.on_bind_error(service, port, exc)
        except Exception:  # an event recorder must not break syncing
            self.log.exception("reporting a health server bind failure failed")

    def _app_for(self, service: NamespacedName) -> App:
        def app(path: str) -> Response:
            with self._lock:
                count = self._local.get(service, 0)
            healthy = self.proxy_healthy()
            body = {
                "service": {"namespace": service.namespace, "name": service.name},
                "localEndpoints": count,
                "serviceProxyHealthy": healthy,
            }
            code = 200 if count > 0 and healthy else 503
            return _json(code, body, **{"X-Load-Balancing-Endpoint-Weight": str(count)})

        return app

    def serving(self) -> dict[NamespacedName, tuple[str, int]]:
        """The bound address of every running server."""
        return self._group.addresses()

    def stop(self) -> None:
        """Close every server (the agent's shutdown)."""
        self._group.stop()
        self._ports.clear()
        self._failed.clear()
