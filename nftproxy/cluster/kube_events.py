"""Events about Services and this Node, posted to the API server (core/v1 Event).

Layer: sources edge (kubernetes client). One job: kube-proxy's event
recorder for the events nftproxy emits: FailedToStartServiceHealthcheck
about a Service (health.py's bind failures), and SyncProxyRulesFailed about
this Node (a refused sync; the Event lives in namespace "default", as
kube-proxy's and the kubelet's Node events do); both wired by cli `run`. Split from sources/kube.py,
which lists these calls in API_CALLS for the RBAC check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from kubernetes.client.exceptions import ApiException

from nftproxy.cluster import rest

__all__ = ["EventRecorder"]

_EVENT_TIMEOUT = (2.0, 5.0)  # connect, read
_API_VERSIONS = {"EndpointSlice": "discovery.k8s.io/v1", "ServiceCIDR": "networking.k8s.io/v1"}
_CLUSTER_SCOPED = frozenset({"Node", "ServiceCIDR"})
"""Events about these live in namespace `default`, as client-go records them."""


class EventRecorder:
    """Posts core/v1 Events about Services (e.g. reason
    FailedToStartServiceHealthcheck) or other objects (`kind`, e.g. the
    Node), as kube-proxy's recorder does.

    `record()` never raises: failures are logged and counted in `failures`.
    A repeat of the same (service, type, reason, message) patches the first
    Event's count and lastTimestamp, as client-go's correlator does, instead
    of creating another. It calls the API synchronously with a short timeout
    (2 s connect, 5 s read); call it off the sync path if that matters.
    """

    def __init__(
        self,
        api_client: Any,
        *,
        host: str,
        component: str = "nftproxy",
        wall_clock: Callable[[], float] = time.time,
        logger: logging.Logger | None = None,
        cache_size: int = 1024,
    ) -> None:
        self.api_client = api_client
        self.host = host
        self.component = component
        self.wall_clock = wall_clock
        self.log = logger or logging.getLogger(__name__)
        self.cache_size = cache_size
        self.failures = 0
        self.posted = 0
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, ...], tuple[str, int]] = OrderedDict()

    def record(
        self,
        *,
        namespace: str,
        name: str,
        reason: str,
        message: str,
        event_type: str = "Warning",
        uid: str = "",
        kind: str = "Service",
    ) -> None:
        """One Event about `kind` namespace/name (event_type Warning or
        Normal). For a Node, `namespace` is only where the Event lives."""
        try:
            self._record(namespace, name, reason, message, event_type, uid, kind)
        except Exception as exc:
            self.failures += 1
            self.log.warning(
                "cannot post event %s for %s %s/%s: %s",
                reason, kind.lower(), namespace, name, exc,
            )

    def _record(
        self,
        namespace: str,
        name: str,
        reason: str,
        message: str,
        type_: str,
        uid: str,
        kind: str,
    ) -> None:
        now = self.wall_clock()
        stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        key = (kind, namespace, name, type_, reason, message)
        with self._lock:
            seen = self._seen.get(key)
        if seen is not None:
            event_name, count = seen
            try:
                _drain(
                    rest.request(
                        self.api_client, "PATCH", _events_path(namespace, event_name),
                        body={"count": count + 1, "lastTimestamp": stamp},
                        content_type="application/merge-patch+json",
                        timeout=_EVENT_TIMEOUT,
                    )
                )  # fmt: skip
                self._remember(key, event_name, count + 1)
                self.posted += 1
                return
            except ApiException as exc:
                if exc.status != 404:  # 404: the Event expired; create a new one
                    raise
        event_name = f"{name}.{int(now * 1e9):x}"
        involved = {"kind": kind, "apiVersion": _API_VERSIONS.get(kind, "v1"), "name": name}
        if kind not in _CLUSTER_SCOPED:
            involved["namespace"] = namespace
        if uid:
            involved["uid"] = uid
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": event_name, "namespace": namespace},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": self.component, "host": self.host},
            "reportingComponent": self.component,
            "reportingInstance": self.host,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        _drain(
            rest.request(
                self.api_client, "POST", _events_path(namespace), body=body, timeout=_EVENT_TIMEOUT
            )
        )
        self._remember(key, event_name, 1)
        self.posted += 1

    def _remember(self, key: tuple[str, ...], event_name: str, count: int) -> None:
        with self._lock:
            self._seen[key] = (event_name, count)
            self._seen.move_to_end(key)
            while len(self._seen) > self.cache_size:
                self._seen.popitem(last=False)


def _events_path(namespace: str, name: str = "") -> str:
    """The core/v1 Events of `namespace`, or one of them."""
    base = f"/api/v1/namespaces/{quote(namespace, safe='')}/events"
    return f"{base}/{quote(name, safe='')}" if name else base


def _drain(response: Any) -> None:
    """Read the (unused) answer so the connection can be reused, and release it."""
    try:
        response.data  # noqa: B018
    finally:
        response.release_conn()
