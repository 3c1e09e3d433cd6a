"""Small HTTP servers: answer GET and HEAD from a function of the path.

Layer: edge (serving; stdlib http.server and sockets only). One job: the
plumbing health.py and metrics.py share -- bind an IPv4 or IPv6 address,
serve it, stop, tell the bound address. What to answer is the caller's
`App`: path (without the query) -> (status, headers, body).

`HttpServerGroup` serves any number of addresses from ONE thread blocked in
select() over every listening socket plus a wake socket (no polling): the
thousands of healthCheckNodePorts of a large cluster cost one thread, not
one each. `HttpServer` is a group of one (/healthz, /metrics). The loop only
accepts; each connection is answered in its own short-lived thread (as
ThreadingHTTPServer does), so a client that connects and sends nothing, or
half a request, holds only its own thread -- never the loop nor another
port -- and at most `request_timeout` seconds per read or write.

Host "" binds every address: dual-stack "::" (IPV6_V6ONLY off), or
0.0.0.0 where the kernel has no IPv6. A host with ":" binds IPv6 (v6-only
as the system default says), any other host IPv4. Request lines are not
logged (one line per probe would drown the sync logs); a client that hangs
up early or times out is a debug line, not a traceback on stderr.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Hashable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar, cast

__all__ = [
    "NOT_FOUND",
    "REQUEST_TIMEOUT",
    "App",
    "HttpEndpoint",
    "HttpServer",
    "HttpServerGroup",
    "Response",
]

Response = tuple[int, Mapping[str, str], bytes]
App = Callable[[str], Response]

NOT_FOUND: Response = (404, {"Content-Type": "text/plain"}, b"404 page not found\n")

# Seconds one read or write of a connection may wait before its thread gives
# up on the client (probes and scrapes send their request at once).
REQUEST_TIMEOUT = 30.0

_log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class HttpServerGroup(Generic[K]):
    """Servers under caller keys, all served by one thread named `name`.

    `add(key, host, port, app)` binds (OSError if the address is taken or
    invalid; port 0: ephemeral) and serves at once; `remove(key)` closes
    that socket before returning (a connect is then refused); `stop()`
    closes every socket and ends the thread, and is safe twice. The thread
    starts with the first `add`. add/remove/stop are called from one thread
    (the owner's); answers run on others.
    """

    def __init__(self, *, name: str, request_timeout: float = REQUEST_TIMEOUT) -> None:
        self.name = name
        self.request_timeout = request_timeout
        self._servers: dict[K, _Server] = {}
        self._loop: _Loop | None = None

    def address(self, key: K) -> tuple[str, int]:
        """The (host, port) bound for `key`; RuntimeError when not served."""
        server = self._servers.get(key)
        if server is None:
            raise RuntimeError(f"{self.name} is not serving {key!r}")
        return _address(server)

    def addresses(self) -> dict[K, tuple[str, int]]:
        """The bound (host, port) of every key (any thread may ask)."""
        return {key: _address(server) for key, server in list(self._servers.items())}

    def add(self, key: K, host: str, port: int, app: App, *, name: str = "") -> None:
        """Serve `app` on host:port under `key` (`name` in debug logs)."""
        if key in self._servers:
            raise ValueError(f"{self.name} already serves {key!r}")
        server = _bind(host, port, app, name or self.name)
        server.request_timeout = self.request_timeout
        if self._loop is None:
            self._loop = _Loop(self.name)
        self._loop.serve(server)
        self._servers[key] = server

    def remove(self, key: K) -> None:
        """Stop serving `key` and close its socket; nothing if not served."""
        server = self._servers.pop(key, None)
        if server is not None and self._loop is not None:
            self._loop.close(server)

    def stop(self) -> None:
        for key in list(self._servers):
            self.remove(key)
        if self._loop is not None:
            self._loop.stop()
            self._loop = None


class HttpServer:
    """`app` served by a thread named `name`, once started on an address.

    The constructor only stores; `start(host, port)` binds (OSError if the
    address is taken or invalid; port 0: ephemeral) and serves; `stop()`
    is safe before, after and twice, and ends at "not started".
    """

    def __init__(self, app: App, *, name: str) -> None:
        self.app = app
        self.name = name
        self._group: HttpServerGroup[None] = HttpServerGroup(name=name)

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); RuntimeError when not started."""
        return self._group.address(None)

    def start(self, host: str, port: int) -> None:
        self._group.add(None, host, port, self.app)

    def stop(self) -> None:
        self._group.stop()


class HttpEndpoint:
    """Base of a class that serves its `app` on one HttpServer (HealthServer,
    Metrics): it starts `self._http`; `address` and `stop()` are shared."""

    def __init__(self, app: App, *, name: str) -> None:
        self._http = HttpServer(app, name=name)

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); RuntimeError when not serving."""
        return self._http.address

    def stop(self) -> None:
        self._http.stop()


class _Loop:
    """One thread blocked in select() over listening servers and a wake
    socket; it accepts, and ThreadingHTTPServer answers in a new thread.

    `_lock` keeps the set of live servers and the loop's handling apart: an
    event the kernel reported for a server that `close()` has since taken
    out is skipped, never accepted on a closed socket.
    """

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._servers: set[_Server] = set()
        self._stopping = False
        self._selector = selectors.DefaultSelector()
        self._wake = socket.socketpair()
        for sock in self._wake:
            sock.setblocking(False)
        self._selector.register(self._wake[0], selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def serve(self, server: _Server) -> None:
        with self._lock:
            self._selector.register(server, selectors.EVENT_READ)
            self._servers.add(server)
        self._nudge()  # a selector other than epoll sees new sockets on its next select()

    def close(self, server: _Server) -> None:
        with self._lock:
            self._servers.discard(server)
            self._selector.unregister(server)
        server.server_close()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._nudge()
        self._thread.join()
        self._selector.close()
        for sock in self._wake:
            sock.close()

    def _nudge(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: wake-ups are waiting already
            self._wake[1].send(b"x")

    def _run(self) -> None:
        while True:
            ready = self._selector.select()
            with self._lock:
                if self._stopping:
                    return
                for key, _ in ready:
                    if key.fileobj is self._wake[0]:
                        self._drain()
                    elif key.fileobj in self._servers:
                        # accepts (timeout 0: returns if the client left) and
                        # starts the connection's thread
                        key.fileobj.handle_request()

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake[0].recv(4096):
                pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    app: App
    name: str
    request_timeout: float | None = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints tracebacks to stderr; a client that hangs up
        # early is not worth more than a debug line.
        _log.debug("%s request failed", self.name, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6
    dual_stack = False

    def server_bind(self) -> None:
        if self.dual_stack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _DualStackServer(_Server6):
    dual_stack = True


class _Handler(BaseHTTPRequestHandler):
    server_version = "nftproxy"

    def setup(self) -> None:
        super().setup()
        # each read and write of this connection waits at most this long
        self.connection.settimeout(cast(_Server, self.server).request_timeout)

    def do_GET(self) -> None:
        self._respond(body=True)

    def do_HEAD(self) -> None:
        self._respond(body=False)

    def _respond(self, *, body: bool) -> None:
        app = cast(_Server, self.server).app
        code, headers, data = app(self.path.partition("?")[0])
        self.send_response(code)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per probe would drown the sync logs


def _address(server: _Server) -> tuple[str, int]:
    host, port = server.server_address[:2]
    return str(host), int(port)


def _bind(host: str, port: int, app: App, name: str) -> _Server:
    """A bound, listening server; OSError if the address is taken or invalid."""
    server: _Server
    if host == "":
        try:
            server = _DualStackServer(("::", port), _Handler)
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            server = _Server(("0.0.0.0", port), _Handler)
    elif ":" in host:
        server = _Server6((host, port), _Handler)
    else:
        server = _Server((host, port), _Handler)
    server.app = app
    server.name = name
    server.timeout = 0  # handle_request() is only called when a client waits
    return server
