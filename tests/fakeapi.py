"""A fake Kubernetes API server that speaks real HTTP on 127.0.0.1.

Layer: tests. One job: let the real `kubernetes` client (and so
nftproxy.cluster.kube) talk to something with the API server's list/watch
semantics, the way kopf tests against `kmock`. Tests mutate the cluster
through Python methods and break things on purpose: expire history (old
resourceVersions answer 410), end, drop or 410 the open watches, make
requests fail.

What it serves (JSON only):
- GET collections, all namespaces or one (`/api/v1/services`,
  `/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices`), with `limit` /
  `continue` paging over a consistent snapshot, `labelSelector` (`k`, `!k`,
  `k=v`, `k==v`, `k!=v`) and `fieldSelector` (`metadata.name`,
  `metadata.namespace`, `=`/`==`/`!=`); items carry no kind/apiVersion,
  as the real server's typed lists.
- GET `watch=true`: a chunked stream of newline-delimited events, one event
  per chunk. Starting after `resourceVersion` (replayed from the event log;
  "" or "0" means "from now", no synthetic ADDED events); `timeoutSeconds`;
  BOOKMARKs every `bookmark_interval` when `allowWatchBookmarks=true`. An
  object entering or leaving a watch's selectors is sent as ADDED/DELETED,
  as the real watch cache does. A too-old resourceVersion gets an ERROR
  event with a 410 Status (modern servers) or, with `gone_as_http=True`,
  an HTTP 410 response (older ones).
- GET/POST/PATCH (JSON merge patch) of single objects, for Events.
- `/api`, `/api/v1`, `/apis`, `/apis/<group>/<version>` discovery.
  ServiceCIDRs are served only when `serve_service_cidrs=True`; otherwise
  their paths answer 404 like a server without networking.k8s.io/v1
  servicecidrs.
- Outages: `stop()` closes the listening socket and every open connection
  (watches are cut, idle keep-alive connections closed, so new requests are
  refused); `start()` again serves on the same port with the same objects
  and resourceVersions, and with `forget_history=True` answers any
  resourceVersion from before the outage (watch or continue token) with
  410, like a real API server whose watch cache is new after a restart.

TLS: with `tls=ServerTls(cert_file, key_file, ca_file)` it serves HTTPS
(the handshake runs in the request's thread, so a client that rejects the
certificate does not block the server) and `api_client()` trusts `ca_file`.

One resourceVersion counter for all resources, as etcd has.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import copy
import errno
import itertools
import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s_client

__all__ = ["RESOURCES", "FakeApiServer", "Request", "ResourceType", "ServerTls"]

Object = dict[str, Any]
_Key = tuple[str, str, str]  # resource plural, namespace, name


@dataclass(frozen=True)
class ResourceType:
    plural: str
    kind: str
    group: str  # "" for the core group
    version: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


RESOURCES = {
    r.plural: r
    for r in (
        ResourceType("services", "Service", "", "v1", True),
        ResourceType("endpointslices", "EndpointSlice", "discovery.k8s.io", "v1", True),
        ResourceType("nodes", "Node", "", "v1", False),
        ResourceType("servicecidrs", "ServiceCIDR", "networking.k8s.io", "v1", False),
        ResourceType("events", "Event", "", "v1", True),
    )
}
_BY_KIND = {r.kind: r for r in RESOURCES.values()}


@dataclass(frozen=True)
class Request:
    """One request as the server saw it."""

    method: str
    path: str
    query: Mapping[str, str]
    resource: str = ""  # plural, "" for discovery
    verb: str = ""  # list | watch | get | create | patch | discovery
    authorization: str = ""  # the Authorization header as sent

    @property
    def watch(self) -> bool:
        return self.verb == "watch"


@dataclass
class _Entry:
    rv: int
    resource: str
    type: str  # ADDED | MODIFIED | DELETED
    old: Object | None
    new: Object | None


@dataclass
class _Watcher:
    resource: str
    gone: bool = False
    drop: bool = False
    drop_partial: bool = False
    end: bool = False
    bookmark: bool = False


@dataclass
class _Failure:
    remaining: int
    resource: str | None
    status: int | None  # None: close the connection without answering
    watch_only: bool
    retry_after: int | None = None  # the Retry-After header, seconds
    continued_only: bool = False  # only a list request for a later page (`continue`)


@dataclass
class _Snapshot:
    rv: int
    items: list[Object]


@dataclass
class _State:
    """Everything guarded by FakeApiServer._cond."""

    rv: int = 1000
    compacted: int = 0
    objects: dict[_Key, Object] = field(default_factory=dict)
    log: list[_Entry] = field(default_factory=list)
    log_rvs: list[int] = field(default_factory=list)
    watchers: list[_Watcher] = field(default_factory=list)
    snapshots: dict[int, _Snapshot] = field(default_factory=dict)
    failures: list[_Failure] = field(default_factory=list)
    connections: set[socket.socket] = field(default_factory=set)
    paused: bool = False
    stopping: bool = False


@dataclass(frozen=True)
class ServerTls:
    """PEM files for HTTPS: the server's certificate (chain) and key, and
    the CA clients should trust."""

    cert_file: str
    key_file: str
    ca_file: str
    client_ca_file: str | None = None  # set: clients must present a certificate it signed

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.client_ca_file)
        return context


class FakeApiServer:
    """Start with `with FakeApiServer() as api:`; `api.api_client()` talks to it."""

    def __init__(
        self,
        *,
        serve_service_cidrs: bool = True,
        gone_as_http: bool = False,
        bookmark_interval: float | None = None,
        max_watch_seconds: float | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self.tls = tls
        self.serve_service_cidrs = serve_service_cidrs
        self.gone_as_http = gone_as_http
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self.requests: list[Request] = []
        self._cond = threading.Condition()
        self._s = _State()
        self._uids = itertools.count(1)
        self._snapshot_ids = itertools.count(1)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port = 0  # chosen at the first start, kept across restarts

    # -- lifecycle -----------------------------------------------------------------

    def start(self, *, forget_history: bool = False) -> None:
        """Serve; again after stop(), on the same port, with the same objects
        and resourceVersions. `forget_history`: every resourceVersion from
        before answers 410, like a restarted API server's new watch cache
        (the resourceVersion moves on by one, as other writers move it on
        during a real outage)."""
        if self._httpd is not None:
            raise RuntimeError("FakeApiServer already started")
        server = self

        class Handler(_Handler):
            api = server

        with self._cond:
            self._s.stopping = False
            if forget_history:
                self._s.rv += 1
        if forget_history:
            self.expire_history()
        httpd = _bind(self._port, Handler)
        httpd.tls_context = self.tls.server_context() if self.tls is not None else None
        self._port = int(httpd.server_address[1])
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, args=(0.05,), name="fakeapi", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving: cut open watches, close every connection, refuse new
        ones. Idempotent; start() serves again."""
        with self._cond:
            self._s.stopping = True
            self._cond.notify_all()
            connections, self._s.connections = self._s.connections, set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(5)
        self._httpd, self._thread = None, None

    def __enter__(self) -> FakeApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Also while stopped (a restart serves on the same port)."""
        scheme = "https" if self.tls is not None else "http"
        if self._httpd is not None:  # (vmtests' LanApiServer binds elsewhere)
            host, port = self._httpd.server_address[:2]
            return f"{scheme}://{host!s}:{port}"
        assert self._port, "start() first"
        return f"{scheme}://127.0.0.1:{self._port}"

    def write_kubeconfig(self, path: Any) -> str:
        """A kubeconfig at `path` pointing at this (plain HTTP) server, no
        credentials; returns the path as text."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))
        return str(path)

    def api_client(self) -> Any:
        """A real kubernetes ApiClient pointed at this server (no proxy)."""
        config = k8s_client.Configuration(host=self.url, no_proxy="127.0.0.1")
        if self.tls is not None:
            config.ssl_ca_cert = self.tls.ca_file
        return k8s_client.ApiClient(configuration=config)

    # -- the cluster, as tests change it ------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._s.rv

    def create(self, obj: Mapping[str, Any]) -> Object:
        """Add an object (its kind names the resource); KeyError if it exists."""
        with self._cond:
            return self._store(obj, must_exist=False)

    def update(self, obj: Mapping[str, Any]) -> Object:
        """Replace an object (uid kept); KeyError if it does not exist."""
        with self._cond:
            return self._store(obj, must_exist=True)

    def apply(self, obj: Mapping[str, Any]) -> Object:
        """Create or update."""
        with self._cond:
            return self._store(obj, must_exist=None)

    def delete(self, kind: str, name: str, namespace: str = "") -> None:
        rtype = _BY_KIND[kind]
        key = (rtype.plural, namespace if rtype.namespaced else "", name)
        with self._cond:
            old = self._s.objects.pop(key)
            self._s.rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._s.rv)
            self._append(_Entry(self._s.rv, rtype.plural, "DELETED", old, gone))

    def get(self, kind: str, name: str, namespace: str = "") -> Object | None:
        rtype = _BY_KIND[kind]
        with self._cond:
            obj = self._s.objects.get((rtype.plural, namespace if rtype.namespaced else "", name))
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, kind: str) -> dict[str, Object]:
        """Current objects of a kind by "namespace/name" (or "name")."""
        plural = _BY_KIND[kind].plural
        with self._cond:
            return {
                f"{ns}/{name}" if ns else name: copy.deepcopy(obj)
                for (res, ns, name), obj in self._s.objects.items()
                if res == plural
            }

    # -- breaking things -------------------------------------------------------------

    def expire_history(self) -> None:
        """Compact: a list or watch from any resourceVersion before now gets 410."""
        with self._cond:
            self._s.compacted = self._s.rv
            self._s.snapshots.clear()

    def force_gone(self) -> None:
        """Send every open watch an ERROR event with a 410 Status and end it."""
        self._flag_watchers(lambda w: setattr(w, "gone", True))

    def drop_watches(self, *, partial: bool = False) -> None:
        """Cut every open watch's connection mid-stream (after half an event if
        `partial`), without the chunked terminator."""

        def drop(w: _Watcher) -> None:
            w.drop = True
            w.drop_partial = partial

        self._flag_watchers(drop)

    def end_watches(self) -> None:
        """End every open watch cleanly, as timeoutSeconds would."""
        self._flag_watchers(lambda w: setattr(w, "end", True))

    def bookmark(self) -> None:
        """Send a BOOKMARK now to every watch that allowed them."""
        self._flag_watchers(lambda w: setattr(w, "bookmark", True))

    def pause_watches(self) -> None:
        """Hold back events from open and new watches (they stay connected)."""
        with self._cond:
            self._s.paused = True

    def resume_watches(self) -> None:
        with self._cond:
            self._s.paused = False
            self._cond.notify_all()

    def fail_requests(
        self,
        count: int,
        *,
        resource: str | None = None,
        status: int | None = 503,
        watch_only: bool = False,
        retry_after: int | None = None,
        continued_only: bool = False,
    ) -> None:
        """Fail the next `count` matching requests with `status` (None: close
        the connection without an answer), with a Retry-After header if
        `retry_after` is given; `continued_only`: only requests for a list's
        later pages match."""
        with self._cond:
            self._s.failures.append(
                _Failure(count, resource, status, watch_only, retry_after, continued_only)
            )

    def clear_failures(self) -> None:
        """Forget the failures fail_requests() asked for and not yet served."""
        with self._cond:
            self._s.failures.clear()

    def watchers(self, resource: str) -> int:
        """Open watches of `resource` not already told to end."""
        with self._cond:
            return sum(
                1 for w in self._s.watchers
                if w.resource == resource and not (w.gone or w.drop or w.end)
            )

    def wait_watchers(self, resource: str, count: int = 1, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.watchers(resource) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {count} watch(es) of {resource}")
            time.sleep(0.005)

    def requests_of(self, resource: str, verb: str | None = None) -> list[Request]:
        return [r for r in list(self.requests) if r.resource == resource and verb in (None, r.verb)]

    def _track(self, conn: socket.socket, open_: bool) -> None:
        """Note a connection (closed at once while stopped) or forget it."""
        with self._cond:
            if not open_:
                self._s.connections.discard(conn)
            elif self._s.stopping:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            else:
                self._s.connections.add(conn)

    # -- internals (call with self._cond held) ------------------------------------------

    def _flag_watchers(self, fn: Callable[[_Watcher], None]) -> None:
        with self._cond:
            for w in self._s.watchers:
                fn(w)
            self._cond.notify_all()

    def _store(self, obj: Mapping[str, Any], *, must_exist: bool | None) -> Object:
        rtype = _BY_KIND[obj["kind"]]
        new = copy.deepcopy(dict(obj))
        meta = new.setdefault("metadata", {})
        if rtype.namespaced:
            meta.setdefault("namespace", "default")
        else:
            meta.pop("namespace", None)
        key = (rtype.plural, meta.get("namespace", ""), meta["name"])
        old = self._s.objects.get(key)
        if must_exist is True and old is None:
            raise KeyError(key)
        if must_exist is False and old is not None:
            raise KeyError(f"{key} exists")
        self._s.rv += 1
        new["apiVersion"] = rtype.api_version
        meta["resourceVersion"] = str(self._s.rv)
        if old is not None:
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
        else:
            meta["uid"] = f"00000000-0000-0000-0000-{next(self._uids):012d}"
            meta["creationTimestamp"] = "2024-01-01T00:00:00Z"
        self._s.objects[key] = new
        self._append(_Entry(self._s.rv, rtype.plural, "MODIFIED" if old else "ADDED", old, new))
        return copy.deepcopy(new)

    def _append(self, entry: _Entry) -> None:
        self._s.log.append(entry)
        self._s.log_rvs.append(entry.rv)
        self._cond.notify_all()

    def _take_failure(self, resource: str, watch: bool, continued: bool) -> _Failure | None:
        with self._cond:
            for f in self._s.failures:
                wanted = (f.resource in (None, resource) and (watch or not f.watch_only)
                          and (continued or not f.continued_only))
                if f.remaining > 0 and wanted:
                    f.remaining -= 1
                    return f
        return None


# -- selectors --------------------------------------------------------------------------


class BadRequest(Exception):
    pass


Predicate = Callable[[Mapping[str, Any]], bool]


def label_selector(text: str) -> Predicate:
    """`k`, `!k`, `k=v`, `k==v`, `k!=v`, comma-joined (set-based forms: BadRequest)."""
    terms: list[tuple[str, str, str]] = []  # (key, op, value); op: exists|absent|=|!=
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "(" in term or " in " in term or " notin " in term:
            raise BadRequest(f"unsupported label selector {term!r}")
        if "!=" in term:
            k, v = term.split("!=", 1)
            terms.append((k.strip(), "!=", v.strip()))
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            terms.append((k.strip(), "=", v.strip()))
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "absent", ""))
        else:
            terms.append((term, "exists", ""))

    def match(obj: Mapping[str, Any]) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        for k, op, v in terms:
            ok = {
                "exists": k in labels,
                "absent": k not in labels,
                "=": labels.get(k) == v,
                "!=": labels.get(k) != v,
            }[op]
            if not ok:
                return False
        return True

    return match


def field_selector(text: str) -> Predicate:
    """`metadata.name` and `metadata.namespace` with `=`, `==`, `!=`."""
    terms: list[tuple[str, bool, str]] = []  # (metadata field, negated, value)
    for term in filter(None, (t.strip() for t in text.split(","))):
        negate = "!=" in term
        k, v = (s.strip() for s in term.replace("!=", "=").replace("==", "=").split("=", 1))
        if k not in ("metadata.name", "metadata.namespace"):
            raise BadRequest(f'field label not supported: "{k}"')
        terms.append((k.split(".", 1)[1], negate, v))

    def match(obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        return all((meta.get(f, "") == v) != negate for f, negate, v in terms)

    return match


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = _merge_patch(result.get(k), v)
    return result


def _status(code: int, reason: str, message: str) -> Object:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _gone_status(rv: str) -> Object:
    return _status(410, "Expired", f"too old resource version: {rv}")


# -- HTTP --------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    tls_context: ssl.SSLContext | None = None

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        if self.tls_context is not None:  # handshake at the first read, in the handler's thread
            conn = self.tls_context.wrap_socket(
                conn, server_side=True, do_handshake_on_connect=False
            )
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a cut connection is no news
            super().handle_error(request, client_address)


def _bind(port: int, handler: type[BaseHTTPRequestHandler]) -> _Server:
    """A server on 127.0.0.1:`port` (0: any); a restart waits up to 5 s for
    the port to be free."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return _Server(("127.0.0.1", port), handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass(frozen=True)
class _Route:
    rtype: ResourceType
    namespace: str | None  # None: all namespaces / cluster-scoped
    name: str | None


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.api._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.api._track(self.connection, False)

    # -- dispatch ----------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        body = self._read_body()
        discovery = self._discovery(url.path)
        route = self._route(url.path) if discovery is None else None
        verb = _verb(method, route, query)
        api = self.api
        api.requests.append(
            Request(method, url.path, query, route.rtype.plural if route else "", verb,
                    self.headers.get("Authorization") or "")
        )  # fmt: skip
        if discovery is not None:
            self._send_json(200, discovery)
            return
        if route is None or (route.rtype.plural == "servicecidrs" and not api.serve_service_cidrs):
            msg = "the server could not find the requested resource"
            self._send_json(404, _status(404, "NotFound", msg))
            return
        failure = api._take_failure(route.rtype.plural, verb == "watch", "continue" in query)
        if failure is not None:
            if failure.status is None:
                self._abort()
            else:
                status = _status(failure.status, "ServiceUnavailable", "injected failure")
                after = failure.retry_after
                headers = {"Retry-After": str(after)} if after is not None else {}
                self._send_json(failure.status, status, headers)
            return
        try:
            if verb == "watch":
                self._watch(route, query)
            elif verb == "list":
                self._list(route, query)
            elif verb == "get":
                self._get(route)
            elif verb == "create":
                self._create(route, body)
            elif verb == "patch":
                self._patch(route, body)
            else:
                self._send_json(405, _status(405, "MethodNotAllowed", f"{method} not allowed"))
        except BadRequest as exc:
            self._send_json(400, _status(400, "BadRequest", str(exc)))

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _discovery(self, path: str) -> Object | None:
        api = self.api
        served = [
            r for r in RESOURCES.values()
            if r.plural != "servicecidrs" or api.serve_service_cidrs
        ]
        path = path.rstrip("/")
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups = sorted({(r.group, r.version) for r in served if r.group})
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                        "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v},
                    }
                    for g, v in groups
                ],
            }
        for gv_path in {r.prefix for r in served}:
            if path == gv_path:
                resources = [r for r in served if r.prefix == gv_path]
                return {
                    "kind": "APIResourceList",
                    "apiVersion": "v1",
                    "groupVersion": resources[0].api_version,
                    "resources": [
                        {
                            "name": r.plural,
                            "singularName": r.kind.lower(),
                            "namespaced": r.namespaced,
                            "kind": r.kind,
                            "verbs": ["create", "get", "list", "patch", "watch"],
                        }
                        for r in resources
                    ],
                }
        return None

    def _route(self, path: str) -> _Route | None:
        for rtype in RESOURCES.values():
            if not path.startswith(rtype.prefix + "/"):
                continue
            parts = path[len(rtype.prefix) + 1 :].strip("/").split("/")
            namespace: str | None = None
            if rtype.namespaced and len(parts) >= 3 and parts[0] == "namespaces":
                namespace, parts = parts[1], parts[2:]
            if parts[0] != rtype.plural or len(parts) > 2:
                continue
            return _Route(rtype, namespace, parts[1] if len(parts) == 2 else None)
        return None

    # -- verbs ---------------------------------------------------------------------------

    def _filter(self, route: _Route, query: Mapping[str, str]) -> Predicate:
        labels = label_selector(query.get("labelSelector", ""))
        fields = field_selector(query.get("fieldSelector", ""))
        ns = route.namespace

        def match(obj: Mapping[str, Any]) -> bool:
            if ns is not None and obj["metadata"].get("namespace") != ns:
                return False
            return labels(obj) and fields(obj)

        return match

    def _list(self, route: _Route, query: Mapping[str, str]) -> None:
        api = self.api
        match = self._filter(route, query)
        limit = int(query.get("limit") or 0)
        token = query.get("continue", "")
        with api._cond:
            if token:
                snap_id, offset = json.loads(base64.b64decode(token))
                snap = api._s.snapshots.get(snap_id)
                if snap is None:
                    self._send_json(410, _status(410, "Expired", "continue token expired"))
                    return
            else:
                plural = route.rtype.plural
                items = [
                    o for (res, _, _), o in sorted(api._s.objects.items())
                    if res == plural and match(o)
                ]
                snap_id, offset = next(api._snapshot_ids), 0
                snap = _Snapshot(api._s.rv, items)
            end = offset + limit if limit else len(snap.items)
            page = snap.items[offset:end]
            meta: Object = {"resourceVersion": str(snap.rv)}
            if end < len(snap.items):
                api._s.snapshots[snap_id] = snap
                meta["continue"] = base64.b64encode(json.dumps([snap_id, end]).encode()).decode()
            else:
                api._s.snapshots.pop(snap_id, None)
        items_out = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in page]
        self._send_json(
            200,
            {
                "kind": f"{route.rtype.kind}List",
                "apiVersion": route.rtype.api_version,
                "metadata": meta,
                "items": items_out,
            },
        )

    def _get(self, route: _Route) -> None:
        assert route.name is not None
        obj = self.api.get(route.rtype.kind, route.name, route.namespace or "")
        if obj is None:
            msg = f"{route.rtype.plural} {route.name!r} not found"
            self._send_json(404, _status(404, "NotFound", msg))
        else:
            self._send_json(200, obj)

    def _create(self, route: _Route, body: bytes) -> None:
        obj = json.loads(body)
        obj["kind"] = route.rtype.kind
        if route.rtype.namespaced:
            obj.setdefault("metadata", {})["namespace"] = route.namespace or "default"
        try:
            created = self.api.create(obj)
        except KeyError:
            self._send_json(409, _status(409, "AlreadyExists", "already exists"))
            return
        self._send_json(201, created)

    def _patch(self, route: _Route, body: bytes) -> None:
        api = self.api
        assert route.name is not None
        with api._cond:
            current = api.get(route.rtype.kind, route.name, route.namespace or "")
            if current is None:
                self._send_json(404, _status(404, "NotFound", f"{route.name!r} not found"))
                return
            patched = _merge_patch(current, json.loads(body))
            patched["kind"] = route.rtype.kind
            result = api.update(patched)
        self._send_json(200, result)

    def _watch(self, route: _Route, query: Mapping[str, str]) -> None:
        api = self.api
        rv_text = query.get("resourceVersion", "")
        match = self._filter(route, query)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        limits = [float(query["timeoutSeconds"])] if query.get("timeoutSeconds") else []
        if api.max_watch_seconds is not None:
            limits.append(api.max_watch_seconds)
        deadline = time.monotonic() + min(limits) if limits else None
        watcher = _Watcher(route.rtype.plural)
        with api._cond:
            since = int(rv_text) if rv_text not in ("", "0") else api._s.rv
            too_old = since < api._s.compacted
            if too_old and api.gone_as_http:
                self._send_json(410, _gone_status(rv_text))
                return
            pos = bisect.bisect_right(api._s.log_rvs, since)
            if not too_old:
                api._s.watchers.append(watcher)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if too_old:
            self._event({"type": "ERROR", "object": _gone_status(rv_text)})
            self._end_chunks()
            return
        try:
            self._stream(route, watcher, match, pos, since, deadline, bookmarks)
        except OSError:  # the client went away
            self.close_connection = True
        finally:
            with api._cond:
                if watcher in api._s.watchers:
                    api._s.watchers.remove(watcher)

    def _stream(
        self,
        route: _Route,
        w: _Watcher,
        match: Predicate,
        pos: int,
        seen_rv: int,
        deadline: float | None,
        bookmarks: bool,
    ) -> None:
        api = self.api
        interval = api.bookmark_interval if bookmarks else None
        next_bookmark = time.monotonic() + interval if interval else None
        while True:
            with api._cond:
                while True:
                    s = api._s
                    now = time.monotonic()
                    due = next_bookmark is not None and now >= next_bookmark
                    timed_out = deadline is not None and now >= deadline
                    if (
                        s.stopping or w.gone or w.drop or w.end or w.bookmark or due or timed_out
                        or (not s.paused and pos < len(s.log))
                    ):
                        break
                    waits = [t - now for t in (deadline, next_bookmark) if t is not None]
                    api._cond.wait(min(waits) if waits else None)
                gone, drop, partial, end = w.gone, w.drop, w.drop_partial, w.end
                stopping = s.stopping
                # a cut or expired stream loses what it had not sent yet
                cut = gone or drop or stopping
                entries = [] if s.paused or cut else s.log[pos:]
                pos += len(entries)
                if entries:
                    seen_rv = entries[-1].rv
                send_bookmark = bookmarks and (w.bookmark or due)
                w.bookmark = False
            for e in entries:
                event = _translate(e, route.rtype.plural, match)
                if event is not None:
                    self._event(event)
            if drop or stopping:
                if partial:
                    self._chunk(b'{"type":"MODIFIED","object":{"kind":')
                self._abort()
                return
            if gone:
                self._event({"type": "ERROR", "object": _gone_status(str(seen_rv))})
                self._end_chunks()
                return
            if send_bookmark:
                self._event(
                    {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": route.rtype.kind,
                            "apiVersion": route.rtype.api_version,
                            "metadata": {"resourceVersion": str(seen_rv)},
                        },
                    }
                )
                if interval:
                    next_bookmark = time.monotonic() + interval
            if end or (deadline is not None and time.monotonic() >= deadline):
                self._end_chunks()
                return

    # -- wire ---------------------------------------------------------------------------

    def _send_json(self, code: int, body: Object, headers: Mapping[str, str] | None = None
                   ) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, event: Object) -> None:
        self._chunk(json.dumps(event).encode() + b"\n")

    def _end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _abort(self) -> None:
        """Close the connection with no (further) answer."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def _verb(method: str, route: _Route | None, query: Mapping[str, str]) -> str:
    if route is None:
        return "discovery"
    if method == "GET":
        if route.name is not None:
            return "get"
        return "watch" if query.get("watch") in ("true", "1") else "list"
    return {"POST": "create", "PATCH": "patch"}.get(method, method.lower())


def _translate(entry: _Entry, plural: str, match: Predicate) -> Object | None:
    """The event a watch with `match` sees for a log entry, if any."""
    if entry.resource != plural:
        return None
    was = entry.old is not None and match(entry.old)
    if entry.type == "DELETED":
        return {"type": "DELETED", "object": entry.new} if was else None
    now = entry.new is not None and match(entry.new)
    if now:
        return {"type": "MODIFIED" if was else "ADDED", "object": entry.new}
    if was:
        return {"type": "DELETED", "object": entry.new}
    return None


def iter_events(raw: bytes) -> Iterator[Object]:
    """Parse a watch body (tests of the fake itself)."""
    for line in raw.splitlines():
        if line.strip():
            yield json.loads(line)
