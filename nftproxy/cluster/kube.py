"""A cluster source that lists and watches the Kubernetes API server.

Layer: sources (edge: the network, through the official `kubernetes`
client's ApiClient, requests sent by cluster/rest.py; imports cluster.events
and cluster.informer only). One job: feed a `ClusterEvents`
handler -- the proxier -- from the API server, the way `FileSource` feeds it
from files. Callers: cli (`nftproxy run`), which builds the client with
`from_config()` and the source with `KubeSource(client, proxier,
node_name=...)`, then `start()`s and finally `stop()`s it.

What is watched, one thread each (kube-proxy's choices):
- v1 Services and discovery.k8s.io/v1 EndpointSlices, all namespaces, with
  kube-proxy's label selector `LABEL_SELECTOR`;
- this node's v1 Node, by `fieldSelector=metadata.name=<node>`;
- networking.k8s.io/v1 ServiceCIDRs when the server serves them (a 404 means
  "not served": retried every `service_cidr_retry` seconds, never an error).

Each thread is an `Informer` (cluster/informer.py): a paged list, then a
watch from its resourceVersion with bookmarks, one re-list on 410 Gone that
delivers only the difference, and backoff on errors that starts over at
every success and never exceeds about a second while the server does not
answer (cluster/retry.py); delivered objects are stripped to what the
proxier reads (`strip_object`).

TLS and credentials: the client verifies the server as client-go does
(cluster/client_tls.py: Python 3.13's VERIFY_X509_STRICT cleared; its files
reloaded when they change, as client-go rotates them); a TLS failure,
401 or 403 is logged once as an ERROR with its cause, counted in
`ResourceStats.error_reasons` and shown in `ResourceStats.failing`, which
/healthz reads (informer.py).

The API server through the `kubernetes` Service's ClusterIP
(`cluster_ip_route`: the client's server is KUBERNETES_PORT's address, so
the ConfigMap's kubernetes-service-host/-port are not set to another): when
it does not answer before the first lists, no rule of this node serves that
ClusterIP yet (a new cluster, a reboot) and none will be written, so it is
one ERROR naming the two ConfigMap keys, the same cause in
`ResourceStats.failing` for /healthz, and DEBUG retries (still every second)
instead of a WARNING per informer.

Handler calls come from the four threads (the handler must be thread-safe,
as `Proxier` is); an exception from the handler is logged and counted, and
the informer goes on.

Known limits: `stop()` cannot interrupt a request still waiting for its
response headers (the threads are daemons; see informer.py for this and
the informers' other limits).
"""

from __future__ import annotations

import contextlib
import copy
import ipaddress
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from random import Random
from typing import Any

from kubernetes.client import ApiClient, Configuration
from kubernetes.config import incluster_config
from kubernetes.config.config_exception import ConfigException

from nftproxy.cluster.client_tls import RotatingTls
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, ClusterEvents, Obj
from nftproxy.cluster.informer import Change, Deliver, Informer, Resource, ResourceStats, Sleep

__all__ = [
    "API_CALLS",
    "LABEL_SELECTOR",
    "ApiCall",
    "KubeSource",
    "api_calls",
    "cluster_ip_route",
    "from_config",
]

LABEL_SELECTOR = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"
"""kube-proxy's selector for Services and EndpointSlices: headless services
have no proxy rules, and services with a service-proxy-name belong to
another proxy."""


# -- RBAC -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One RBAC rule's worth of API use: apiGroup ("" is core), resource, verbs."""

    group: str
    resource: str
    verbs: tuple[str, ...]


API_CALLS: tuple[ApiCall, ...] = (
    ApiCall("", "services", ("list", "watch")),
    ApiCall("discovery.k8s.io", "endpointslices", ("list", "watch")),
    # one Node, but by fieldSelector on the collection: list/watch, not get
    ApiCall("", "nodes", ("list", "watch")),
    # optional: without these verbs (or the resource) ServiceCIDRs are ignored
    ApiCall("networking.k8s.io", "servicecidrs", ("list", "watch")),
    # EventRecorder: create a new Event, patch its count when it repeats
    ApiCall("", "events", ("create", "patch")),
)
"""Every API call this module makes; deploy/'s ClusterRole must grant them."""


def api_calls() -> tuple[ApiCall, ...]:
    """`API_CALLS`: what the RBAC ClusterRole must allow (checked by a test)."""
    return API_CALLS


# -- client ---------------------------------------------------------------------------


def from_config(kubeconfig: str | None = None) -> Any:
    """A `kubernetes.client.ApiClient`: `kubeconfig` if given, else the in-cluster
    service account, else the default kubeconfig ($KUBECONFIG, ~/.kube/config).

    Uses a private Configuration (the client's global default is untouched)
    and turns on TCP keepalive, so a watch through an idle-dropping load
    balancer fails instead of hanging; TLS is verified as client-go does
    (cluster/client_tls.py). Raises the client's ConfigException when no
    configuration is found.
    """
    configuration = Configuration()
    in_cluster = False
    if kubeconfig is None:
        load_in_cluster: Any = incluster_config.load_incluster_config  # untyped
        try:
            load_in_cluster(client_configuration=configuration)
            in_cluster = True
        except ConfigException:  # not in a pod (no service host or token)
            pass
    if not in_cluster:
        # imported only here: the loader brings requests, requests-oauthlib and
        # oauthlib, whose memory a pod, configured in-cluster, never needs
        from kubernetes.config import kube_config

        load: Any = kube_config.load_kube_config  # untyped
        # $KUBECONFIG is read now: the client reads it once, when imported
        path = kubeconfig or os.environ.get("KUBECONFIG") or None
        load(config_file=path, client_configuration=configuration, persist_config=False)
    if hasattr(configuration, "keep_alive"):  # kubernetes >= 37
        configuration.keep_alive = True
    return _client(configuration)


def _client(configuration: Any) -> Any:
    """The one place an ApiClient is built: its urllib3 pool verifies TLS
    with the context `client_tls` builds from the configured CA, client
    certificate and key, and builds again when those files change."""
    client = ApiClient(configuration=configuration)
    RotatingTls.install(configuration, client.rest_client.pool_manager)
    return client


# -- the source -----------------------------------------------------------------------


class KubeSource:
    """Lists and watches Services, EndpointSlices, this Node and ServiceCIDRs
    and feeds `handler`; `start()` spawns one thread per resource, `stop()`
    ends and joins them.

    `api_client` is a `kubernetes.client.ApiClient` (see `from_config`); the
    informers use a copy of it without urllib3's own retries.
    `node_name` selects the Node; empty: no Node is watched. The first lists
    of Services and EndpointSlices are declared synced only once the Node's
    first list is in, or `node_wait` seconds have passed (one WARNING), so
    the first sync sees the Node. Seams for tests:
    `clock` (monotonic seconds), `sleep(seconds)` (default: a wait that
    `stop()` interrupts), `random()` in [0, 1) for timeouts and jitter, and
    the backoff: `backoff_initial` doubling to `backoff_max` after HTTP
    errors, at most `unreachable_max` between attempts while the server does
    not answer at all (so an informer resumes within about a second of the
    server being back; informer.py and retry.py say why). The informers
    deliver one batch at a time (a page of a first list, a re-list's
    changes, a watch event), never interleaved object by object. `listing()`
    brackets every complete list, its delivery included (the agent pauses
    its garbage collector: agent/heap.py). `environ` (default os.environ)
    gives KUBERNETES_PORT, the `kubernetes` Service's address. `stats` maps
    resource name -> ResourceStats.
    """

    def __init__(
        self,
        api_client: Any,
        handler: ClusterEvents,
        *,
        node_name: str,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep | None = None,
        random: Callable[[], float] | None = None,
        backoff_initial: float = 0.8,
        backoff_max: float = 30.0,
        unreachable_max: float = 1.0,
        service_cidr_retry: float = 600.0,
        node_wait: float = 10.0,
        logger: logging.Logger | None = None,
        listing: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.api_client = _without_retries(api_client)
        route = cluster_ip_route(self.api_client.configuration.host,
                                 os.environ if environ is None else environ)
        self._unreachable = _ThroughClusterIp(route, logger or logging.getLogger(__name__)) \
            if route else None
        self.listing = listing
        self.handler = handler
        self.node_name = node_name
        self.clock = clock
        self.random = random or Random().random
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.unreachable_max = unreachable_max
        self.service_cidr_retry = service_cidr_retry
        self.log = logger or logging.getLogger(__name__)
        self.node_wait = node_wait
        self._stopping = threading.Event()
        self._node_listed = threading.Event()
        self._delivering = threading.Lock()
        self.sleep: Sleep = sleep or self._stopping.wait
        self._informers = [self._informer(r, d) for r, d in self._resources()]
        self.stats: Mapping[str, ResourceStats] = {i.res.name: i.stats for i in self._informers}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Spawn the informer threads (daemons); the first lists start at once."""
        if self._threads:
            raise RuntimeError("KubeSource already started")
        self._stopping.clear()
        self._node_listed.clear()
        if not self.node_name:
            self._node_listed.set()
        for informer in self._informers:
            t = threading.Thread(
                target=informer.run, name=f"nftproxy-kube-{informer.res.name}", daemon=True
            )
            self._threads.append(t)
            t.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the threads: set the stop event, shut down open streams so a
        blocked read returns, join (each for at most `timeout` seconds)."""
        self._stopping.set()
        self._node_listed.set()  # a list waiting for the Node gives up
        for informer in self._informers:
            informer.abort()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self.log.warning("%s did not stop within %.1fs", t.name, timeout)
        self._threads = []

    # -- wiring ---------------------------------------------------------------------

    def _resources(self) -> Iterator[tuple[Resource, Deliver]]:
        yield (
            Resource(
                "services", "Service", "v1",
                "/api/v1/services",
                label_selector=LABEL_SELECTOR,
            ),
            self._pairs(lambda: self.handler.on_service, KIND_SERVICES),
        )
        yield (
            Resource(
                "endpointslices", "EndpointSlice", "discovery.k8s.io/v1",
                "/apis/discovery.k8s.io/v1/endpointslices",
                label_selector=LABEL_SELECTOR,
                metadata_only=True,  # a gone slice's name and labels are all the proxier reads
            ),
            self._pairs(lambda: self.handler.on_endpoint_slice, KIND_ENDPOINT_SLICES),
        )
        if self.node_name:
            yield (
                Resource(
                    "nodes", "Node", "v1",
                    "/api/v1/nodes",
                    field_selector=f"metadata.name={self.node_name}",
                ),
                self._deliver_node,
            )
        yield (
            Resource(
                "servicecidrs", "ServiceCIDR", "networking.k8s.io/v1",
                "/apis/networking.k8s.io/v1/servicecidrs",
                optional=True,
            ),
            self._deliver_service_cidrs,
        )

    def _informer(self, res: Resource, deliver: Deliver) -> Informer:
        return Informer(
            res,
            self.api_client,
            deliver,
            stopping=self._stopping,
            sleep=lambda s: self.sleep(s),
            clock=self.clock,
            random=self.random,
            backoff=(self.backoff_initial, self.backoff_max),
            unreachable_max=self.unreachable_max,
            not_served_retry=self.service_cidr_retry,
            log=self.log,
            listing=self.listing,
            unreachable=self._unreachable,
        )

    def _pairs(self, method: Callable[[], Callable[[Obj | None, Obj | None], None]],
               kind: str) -> Deliver:
        """Per-object delivery (the handler method is looked up at each call),
        then on_synced(kind) after the first list -- once this Node's first
        list is in too (`_await_node`). One batch (a page of a first list,
        a re-list's difference, a watch event) at a time across the
        informers: two first lists delivered at once would alternate object
        by object on the handler's locks (the Proxier's, the runner's, the
        metrics'), which slows a large start (bench/RESULTS.md, "What moved
        the numbers")."""

        def deliver(changes: Sequence[Change], store: Mapping[str, Obj], first: bool) -> None:
            fn = method()
            with self._delivering:
                for previous, current in changes:
                    fn(previous, current)
            if first:
                self._await_node(kind)
                self.handler.on_synced(kind)

        return deliver

    def _await_node(self, kind: str) -> None:
        """Hold `kind`'s on_synced until this Node's first list was delivered
        (at most `node_wait` s): the first sync is a full one, and one made
        without the Node (its addresses, zone, podCIDR) is followed at once
        by a second full sync when the Node arrives."""
        if not self._node_listed.wait(self.node_wait):
            self.log.warning("%s: the Node %s was not listed within %.0fs; syncing without it",
                             kind, self.node_name, self.node_wait)

    def _deliver_node(self, changes: Sequence[Change], store: Mapping[str, Obj],
                      first: bool) -> None:
        if changes or first:
            self.handler.on_node(store.get(self.node_name))
        if first:
            self._node_listed.set()

    def _deliver_service_cidrs(self, changes: Sequence[Change], store: Mapping[str, Obj],
                               first: bool) -> None:
        if changes or first:
            self.handler.on_service_cidrs([store[k] for k in sorted(store)])


def cluster_ip_route(host: str, environ: Mapping[str, str]) -> str:
    """"IP:PORT" when the client's server URL `host` is the `kubernetes`
    Service's ClusterIP, which the kubelet gives every pod as
    KUBERNETES_PORT ("tcp://10.96.0.1:443"), else "". The ConfigMap's
    kubernetes-service-host/-port replace only KUBERNETES_SERVICE_HOST/PORT,
    so the two differ once they are set."""
    service = urllib.parse.urlsplit(environ.get("KUBERNETES_PORT", ""))
    server = urllib.parse.urlsplit(host if "//" in host else f"https://{host}")
    try:
        same = (
            service.hostname is not None
            and server.hostname is not None
            and ipaddress.ip_address(service.hostname) == ipaddress.ip_address(server.hostname)
            and service.port == (server.port or (80 if server.scheme == "http" else 443))
        )
    except ValueError:  # a name, or a malformed port: not the ClusterIP
        return ""
    if not same:
        return ""
    return f"[{service.hostname}]:{service.port}" if ":" in str(service.hostname) \
        else f"{service.hostname}:{service.port}"


class _ThroughClusterIp:
    """The informers' `Unreachable` when the API server is the `kubernetes`
    Service's ClusterIP: before the first lists no rule of this node serves
    it (after a reboot), so waiting does not help; said in one ERROR."""

    def __init__(self, route: str, log: logging.Logger) -> None:
        self.route = route
        self.log = log
        self.problem = (
            f"no answer from the API server through the kubernetes Service's ClusterIP "
            f"{route}, which nftproxy has not programmed yet: set kubernetes-service-host "
            f"and kubernetes-service-port in the nftproxy ConfigMap"
        )
        self._lock = threading.Lock()
        self._said = False

    def say(self, resource: str, cause: str) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        self.log.error(
            "cannot reach the API server: it is configured as the kubernetes Service's "
            "ClusterIP %s, and this node has no rule for that Service yet (nftproxy needs "
            "the API server to write it; kube-proxy's rules are gone after a reboot). Set "
            "`kubernetes-service-host` and `kubernetes-service-port` in the ConfigMap "
            "kube-system/nftproxy to the API server's own address (deploy/README.md, "
            "\"The API server address\"), then `kubectl -n kube-system rollout restart "
            "ds/nftproxy`. Still retrying (%s: %s)",
            self.route, resource, cause,
        )


def _without_retries(api_client: Any) -> Any:
    """A client like `api_client` (a copy of its configuration and default
    headers) whose requests urllib3 does not retry: the informers retry
    themselves, with backoff and one log line per outage, while urllib3 would
    retry a refused connection three times at once and log a WARNING for
    each, every second of an outage."""
    configuration = copy.deepcopy(api_client.configuration)
    configuration.retries = False
    client = _client(configuration)
    client.default_headers.update(api_client.default_headers)
    return client
