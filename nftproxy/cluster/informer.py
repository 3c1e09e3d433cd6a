"""One informer: list, then watch, one API resource as raw JSON, and deliver every change.

Layer: sources (edge: the network, through the official `kubernetes`
client; imports cluster.events, api_errors, retry and store only). One job:
keep one resource's objects in a store and hand each change to a `Deliver`
callback, the way client-go's informers do, but over raw JSON. Caller:
cluster/kube.py (`KubeSource` runs one `Informer` per resource, each in its
own thread).

The loop, over raw JSON: paged list (limit 500, `continue`) -> watch from
the list's resourceVersion with bookmarks and a random server timeout of
300-600 s, a client read timeout 30 s above it -> when the stream ends
normally (the server's timeout, or it closed it), watch again at once from
the last resourceVersion seen (objects and bookmarks): that is not an
error -> on 410 Gone (an ERROR event with code 410, or an HTTP 410), list
again, exactly once, and deliver the difference: deletes, adds, and updates
only for objects that really changed.

Recovery after an outage (retry.py): a failed request waits on client-go's
reflector backoff, jittered, starting over at every success; while there is
no answer at all (refused, reset, timed out) the wait is capped at
`unreachable_max` (1 s), so an informer resumes within about a second of
the server listening again. A 410 re-lists at once; only a loop of 410s or
of watches that end at once backs off. One WARNING per outage, one INFO
when it ends; an outage whose cause the source knows (`Unreachable`) is the
source's one ERROR instead.

Why raw JSON, not the client's models or `watch.Watch` (kubernetes 37.0.2,
docs/nft-python-notes.md section 5): the pydantic models cost several times
the time and memory of `json.loads`;
`Watch(deserialize=False)` never advances its resourceVersion and raises
KeyError on ERROR events; `Watch()` retries a 410 with the same
resourceVersion; `SharedInformer` sends no bookmarks, has no read timeout
and re-delivers every object after a re-list. So requests go through
cluster/rest.py (the client's ApiClient, not its pydantic-validated API
methods, whose first calls cost memory and time the agent has no use for)
and return the urllib3 response, and this module parses the
newline-delimited events itself.

Delivered objects are stripped to what the proxier reads (`strip_object`):
metadata keeps name, namespace, uid, labels, deletionTimestamp and only the
`endpoints.kubernetes.io/last-change-trigger-time` annotation (no
managedFields, no resourceVersion); status is dropped except Service
`status.loadBalancer` and Node `status.addresses`. So a status heartbeat or
a label-free metadata touch is not delivered as an update. `previous` in
on_service/on_endpoint_slice always equals the object this source
delivered last for that key (for a metadata-only resource, EndpointSlices:
its kind, apiVersion and metadata).

The store keeps each stripped object packed as canonical JSON bytes
(cluster/store.py: a fraction of what the same objects take as dicts),
and of an EndpointSlice (`Resource.metadata_only`) only a digest of that
form and its head; a change is a difference of stored forms. Only what is
delivered is decoded: `previous`, a re-list's changes as the callback reads
them, and the read-only Mapping view of the store `deliver` is given. The
first list is delivered page by page as it arrives (500 objects at a time,
the objects as listed and stripped, never packed and decoded again): at
10,000 Services x 10 endpoints that is 20,000 decodes fewer before the
first sync, and no list-long buffer of packed objects.

Known limits: a list or watch request that has not yet received its
response headers cannot be interrupted by `abort()` (the bounded connect and
read timeouts apply); a server whose address drops packets (no refusal) is
found again only by the kernel's SYN retransmits, within the connect
timeout, not within a second; there is no periodic re-list (the
proxier's full sync plays that role); the watch-list mode
(`sendInitialEvents`) is not used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import urllib3
from kubernetes.client.exceptions import ApiException

from nftproxy.cluster import rest
from nftproxy.cluster.api_errors import classify, describe, retry_after
from nftproxy.cluster.events import Obj
from nftproxy.cluster.retry import Retry
from nftproxy.cluster.store import Change, PackedStore, difference, pack, unpack, unpacked

__all__ = [
    "ERROR_REASONS",
    "SEVERE_REASONS",
    "Change",
    "Deliver",
    "Informer",
    "Resource",
    "ResourceStats",
    "Sleep",
    "Unreachable",
    "strip_object",
]

_TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
_KEPT_ANNOTATIONS = frozenset({_TRIGGER_TIME})
_KEPT_METADATA = ("name", "namespace", "uid", "labels", "deletionTimestamp")

_PAGE_SIZE = 500
_WATCH_TIMEOUT = (300, 600)  # server-side timeoutSeconds, drawn uniformly per watch
_READ_MARGIN = 30.0  # the client read timeout exceeds the server's timeout by this
_CONNECT_TIMEOUT = 10.0
_LIST_READ_TIMEOUT = 60.0
_SHORT_WATCH = 1.0  # a watch ending sooner than this without events made no progress


# -- stripping ------------------------------------------------------------------------


def strip_object(kind: str, obj: Mapping[str, Any], api_version: str = "") -> dict[str, Any]:
    """The parts of an API object the proxier needs, with kind/apiVersion set.

    Keeps top-level fields other than metadata and status (spec, or an
    EndpointSlice's addressType/endpoints/ports); metadata name, namespace,
    uid, labels, deletionTimestamp and the trigger-time annotation; status
    only for Service (loadBalancer) and Node (addresses).
    """
    out: dict[str, Any] = {
        k: v for k, v in obj.items() if k not in ("metadata", "status", "kind", "apiVersion")
    }
    out["kind"] = kind
    out["apiVersion"] = api_version or str(obj.get("apiVersion", ""))
    meta = obj.get("metadata") or {}
    kept = {k: meta[k] for k in _KEPT_METADATA if meta.get(k) is not None}
    annotations = {
        k: v for k, v in (meta.get("annotations") or {}).items() if k in _KEPT_ANNOTATIONS
    }
    if annotations:
        kept["annotations"] = annotations
    out["metadata"] = kept
    status = obj.get("status") or {}
    keep = {"Service": "loadBalancer", "Node": "addresses"}.get(kind)
    if keep is not None and keep in status:
        out["status"] = {keep: status[keep]}
    return out


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


# -- counters -------------------------------------------------------------------------


ERROR_REASONS = ("unreachable", "tls", "unauthorized", "forbidden", "http", "stream", "internal")
"""Why a request failed: no answer; the TLS handshake (a certificate not
verified); HTTP 401; HTTP 403; another HTTP error; a bad body or an ERROR
event; a bug."""

SEVERE_REASONS = frozenset({"tls", "unauthorized", "forbidden"})
"""Failures that waiting does not heal: an ERROR, and /healthz reports them."""


@dataclass
class ResourceStats:
    """Counters of one informer, for metrics (written by its thread only)."""

    resource: str
    lists: int = 0  # complete lists (all pages)
    relists: int = 0  # lists caused by 410 Gone
    watches: int = 0  # watch requests answered
    events: int = 0  # ADDED/MODIFIED/DELETED events received
    bookmarks: int = 0
    errors: int = 0  # failed requests and broken streams (each one backs off)
    error_reasons: dict[str, int] = field(  # `errors` by ERROR_REASONS
        default_factory=lambda: dict.fromkeys(ERROR_REASONS, 0))
    # the cause of a TLS or auth failure (or of no answer through the ClusterIP
    # before the first list), until the server answers
    failing: str = ""
    failing_since: float = 0.0  # clock() of the first such failure in a row
    handler_errors: int = 0  # exceptions raised by the ClusterEvents handler
    objects: int = 0  # objects held now
    resource_version: str = ""  # last resourceVersion seen
    synced: bool = False  # the first list is complete
    served: bool = True  # False while the server answers 404 (ServiceCIDRs)


# -- what an informer is given --------------------------------------------------------


Sleep = Callable[[float], object]


@dataclass(frozen=True, slots=True)
class Resource:
    name: str  # plural, as in RBAC
    kind: str
    api_version: str
    path: str  # the collection, e.g. /api/v1/services (all namespaces)
    label_selector: str | None = None
    field_selector: str | None = None
    optional: bool = False  # 404 means "not served", not an error
    metadata_only: bool = False  # the store keeps a digest and the metadata (store.py)


class Deliver(Protocol):
    def __call__(self, changes: Sequence[Change], store: Mapping[str, Obj], first: bool) -> None:
        ...


class Unreachable(Protocol):
    """What to say when the server does not answer before the first list
    completes, when the cause is known (kube.py: the API server only
    through the `kubernetes` Service's ClusterIP, which no rule serves yet)."""

    @property
    def problem(self) -> str:
        """The cause and its fix on one line, for /healthz."""
        ...

    def say(self, resource: str, cause: str) -> None:
        """Log it: one ERROR for all informers."""
        ...


# -- one informer ---------------------------------------------------------------------


class _Gone(Exception):
    """410: the resourceVersion is too old; list again."""


class _WatchError(Exception):
    """An ERROR event other than 410, or a malformed event."""


class _Stopped(Exception):
    pass


# no HTTP answer: refused, reset, timed out, cut mid-stream (kubernetes turns
# TLS errors into ApiException(status=0), an answered failure)
_UNREACHABLE = (urllib3.exceptions.HTTPError, OSError)
_ANSWERED = (ValueError, _WatchError)  # a bad body or an ERROR event


class Informer:
    """List, then watch, one resource into `store`; deliver every change."""

    def __init__(
        self,
        res: Resource,
        api_client: Any,
        deliver: Deliver,
        *,
        stopping: threading.Event,
        sleep: Sleep,
        clock: Callable[[], float],
        random: Callable[[], float],
        backoff: tuple[float, float],
        unreachable_max: float,
        not_served_retry: float,
        log: logging.Logger,
        listing: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        unreachable: Unreachable | None = None,
    ) -> None:
        self.res = res
        self.unreachable = unreachable
        self.listing = listing
        self.api_client = api_client
        self.deliver = deliver
        self.stopping = stopping
        self.sleep = sleep
        self.clock = clock
        self.random = random
        self.not_served_retry = not_served_retry
        self.log = log
        self.stats = ResourceStats(res.name)
        self.store = PackedStore(metadata_only=res.metadata_only)
        self._lock = threading.Lock()
        self._response: Any = None
        self.retry = Retry(
            res.name,
            initial=backoff[0],
            cap=backoff[1],
            unreachable_max=unreachable_max,
            clock=clock,
            random=random,
            log=log,
        )

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        need_list = True
        while not self.stopping.is_set():
            try:
                if need_list:
                    with self.listing():
                        self._list()
                    need_list = False
                delay = self._watch()
            except _Stopped:
                break
            except Exception as exc:
                if self.stopping.is_set():
                    break
                need_list, delay = self._after(exc, need_list)
            if delay > 0 and not self.stopping.is_set():
                self.sleep(delay)

    def _after(self, exc: Exception, need_list: bool) -> tuple[bool, float]:
        """(list next?, delay) after a failed list or watch."""
        if isinstance(exc, _Gone):
            self.log.info("%s: %s; listing again", self.res.name, exc)
            self.stats.relists += 1
            return True, self.retry.stall()
        if isinstance(exc, ApiException):
            if exc.status in (403, 404) and self.res.optional:
                self._answered()
                return True, self._not_served(exc.status)
            reason, what = classify(exc)
            return need_list, self._failed(what, reason, retry_after=retry_after(exc))
        if isinstance(exc, _UNREACHABLE):
            return need_list, self._failed(describe(exc), "unreachable")
        reason = "stream"
        if not isinstance(exc, _ANSWERED):  # a bug; keep the informer alive
            self.log.exception("%s: informer failed", self.res.name)
            reason = "internal"
        return need_list, self._failed(describe(exc), reason)

    def _failed(self, cause: str, reason: str, *, retry_after: float | None = None) -> float:
        stats = self.stats
        stats.errors += 1
        stats.error_reasons[reason] = stats.error_reasons.get(reason, 0) + 1
        severe = reason in SEVERE_REASONS
        known = self.unreachable if reason == "unreachable" and not stats.synced else None
        if severe or known is not None:
            if not stats.failing:
                stats.failing_since = self.clock()
            stats.failing = cause if known is None else known.problem
        if known is not None:
            known.say(self.res.name, cause)
        return self.retry.failed(cause, unreachable=reason == "unreachable",
                                 retry_after=retry_after, severe=severe,
                                 explained=known is not None)

    def _answered(self) -> None:
        """The server answered (a list completed, a watch opened, an optional
        resource said "not served"): the retry schedule starts over and a
        TLS or auth failure is over."""
        self.retry.succeeded()
        self.stats.failing = ""

    def _not_served(self, status: int) -> float:
        """404 (or 403) for an optional resource: forget it, ask again rarely."""
        if self.stats.served:
            why = "not served by the API server" if status == 404 else "forbidden (RBAC)"
            log = self.log.info if status == 404 else self.log.warning
            log("%s: %s; checking again every %.0fs", self.res.name, why, self.not_served_retry)
        self.stats.served = False
        if len(self.store):  # it was served before: its objects are gone
            old, self.store = self.store, PackedStore(metadata_only=self.res.metadata_only)
            self.stats.objects = 0
            self._deliver(difference(old, self.store, {}), first=False)
        return self.not_served_retry * (1.0 + 0.1 * self.random())

    # -- list ---------------------------------------------------------------------------

    def _list(self) -> None:
        """List every page, then deliver. The next page is asked for (in a
        helper thread) as soon as a page names it, while this one is stripped,
        packed and delivered. A list into an empty store (the first one) is
        delivered page by page as the pages come -- the last page's adds with
        `first` -- so its objects are decoded once and never all held at
        once, packed or decoded; a list into a store that holds objects is
        delivered at its end as the difference."""
        res = self.res
        streaming = not len(self.store)
        fresh = self.store if streaming else PackedStore(metadata_only=res.metadata_only)
        current: dict[str, bytes] = {}  # the packed objects, until delivered
        page: list[Change] = []  # streaming: the adds of the page in hand
        with ThreadPoolExecutor(1, thread_name_prefix=f"nftproxy-list-{res.name}") as ahead:
            body = self._page(None)
            while True:
                meta = body.get("metadata") or {}
                cont = meta.get("continue") or None
                following = ahead.submit(self._page, cont) if cont is not None else None
                page += self._take(fresh, body.get("items") or (), None if streaming else current)
                if following is None:
                    rv = str(meta.get("resourceVersion") or "")
                    break
                if page:
                    self._deliver(page, first=False)
                    page = []
                body = following.result()
        self.stats.lists += 1
        self._answered()
        if not self.stats.served:
            self.log.info("%s: served again", res.name)
            self.stats.served = True
        old, self.store = self.store, fresh
        self.stats.objects = len(fresh)
        self.stats.resource_version = rv
        first = not self.stats.synced
        self.stats.synced = True
        self._deliver(page if streaming else difference(old, fresh, current), first=first)

    def _page(self, cont: str | None) -> Any:
        """One page of the list, decoded: the first (`cont` None) or the one
        `cont` names."""
        response = self._get(
            (_CONNECT_TIMEOUT, _LIST_READ_TIMEOUT), ("limit", _PAGE_SIZE), ("continue", cont)
        )
        with self._tracking(response):
            return json.loads(response.data)

    def _take(
        self, store: PackedStore, items: Sequence[Mapping[str, Any]],
        current: dict[str, bytes] | None,
    ) -> list[Change]:
        """Strip, pack and store a page's `items` (all of them, or none if one
        fails). A re-list keeps their packed forms in `current`, for its
        difference, and returns nothing; a first list returns the adds (and
        changes) to deliver, each object as stripped."""
        packed = [self._packed(item) for item in items]
        changes: list[Change] = []
        for key, obj, data in packed:
            value = store.value(obj, data)
            before = store.put(key, value)
            if current is not None:
                current[key] = data
            elif before != value:
                changes.append((unpacked(store.kept(before)), obj))
        return changes

    def _packed(self, item: Mapping[str, Any]) -> tuple[str, Obj, bytes]:
        """A listed object's key, its stripped form, and that form packed."""
        obj = strip_object(self.res.kind, item, self.res.api_version)
        return _key(obj), obj, pack(obj)

    def _get(self, timeout: rest.Timeout, *query: rest.QueryParam) -> Any:
        """GET the resource's collection with its selectors and `query`."""
        res = self.res
        return rest.request(
            self.api_client, "GET", res.path, timeout=timeout,
            query=(("labelSelector", res.label_selector),
                   ("fieldSelector", res.field_selector), *query),
        )  # fmt: skip

    # -- watch --------------------------------------------------------------------------

    def _watch(self) -> float:
        """One watch request, to its end; the delay before the next one: none
        after a normal end (the server's timeout), a stall's after a watch
        that ended at once with no event."""
        res = self.res
        timeout = int(_WATCH_TIMEOUT[0] + (_WATCH_TIMEOUT[1] - _WATCH_TIMEOUT[0]) * self.random())
        try:
            response = self._get(
                (_CONNECT_TIMEOUT, timeout + _READ_MARGIN),
                ("watch", True),
                ("resourceVersion", self.stats.resource_version or None),
                ("allowWatchBookmarks", True),
                ("timeoutSeconds", timeout),
            )
        except ApiException as exc:
            if exc.status == 410:  # servers before the ERROR-event convention
                raise _Gone(f"watch expired (HTTP 410 {exc.reason})") from exc
            raise
        self.stats.watches += 1
        self._answered()
        started = self.clock()
        received = 0
        try:
            with self._tracking(response):
                pending = b""
                for chunk in response.stream(None, decode_content=True):
                    if self.stopping.is_set():
                        raise _Stopped
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.strip():
                            self._on_event(json.loads(line))
                            received += 1
                            self.retry.progress()
        finally:
            lasted = self.clock() - started >= _SHORT_WATCH
            if lasted:
                self.retry.progress()
        if received or lasted:
            return 0.0
        self.log.debug("%s: the watch ended at once with no event", res.name)
        return self.retry.stall()

    def _on_event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code, message = obj.get("code"), obj.get("message", "")
            if code == 410:
                raise _Gone(f"watch expired (410 {obj.get('reason', '')}: {message})")
            raise _WatchError(f"watch ERROR {code} {obj.get('reason', '')}: {message}")
        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
        elif kind in ("ADDED", "MODIFIED", "DELETED"):
            self.stats.events += 1
            self._apply(kind, obj)
        else:
            raise _WatchError(f"unknown watch event type {kind!r}")
        if rv:
            self.stats.resource_version = rv

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        current = strip_object(self.res.kind, obj, self.res.api_version)
        key = _key(current)
        if kind == "DELETED":
            gone = self.store.kept(self.store.pop(key))
            if gone is None:
                return
            change: Change = (unpack(gone), None)
        else:
            value = self.store.value(current, pack(current))
            previous = self.store.put(key, value)
            if previous == value:
                return  # only stripped fields changed (status, managedFields, ...)
            change = (unpacked(self.store.kept(previous)), current)
        self.stats.objects = len(self.store)
        self._deliver([change], first=False)

    def _deliver(self, changes: Sequence[Change], *, first: bool) -> None:
        try:
            self.deliver(changes, self.store.view, first)
        except Exception:
            self.stats.handler_errors += 1
            self.log.exception("%s: the event handler failed", self.res.name)

    # -- stopping -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _tracking(self, response: Any) -> Iterator[None]:
        """Make `response` abortable by stop(); afterwards release (or, if not
        read to the end, close) its connection."""
        with self._lock:
            if self.stopping.is_set():
                response.close()
                response.release_conn()
                raise _Stopped
            self._response = response
        clean = False
        try:
            yield
            clean = True
        finally:
            with self._lock:
                self._response = None
            if not clean:
                response.close()
            response.release_conn()

    def abort(self) -> None:
        """From another thread: make a read blocked on the open response return."""
        with self._lock:
            response = self._response
        if response is None:
            return
        try:
            response.shutdown()  # urllib3 >= 2.3: thread-safe SHUT_RD
            return
        except (AttributeError, ValueError, RuntimeError, OSError):
            pass
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
