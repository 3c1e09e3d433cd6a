"""One small HTTP server: answer GET and HEAD from a function of the path, in a thread.

Layer: edge (serving; stdlib http.server and sockets only). One job: the
plumbing health.py and metrics.py share -- bind an IPv4 or IPv6 address,
serve it from one thread blocked in select() (no polling) plus a thread per
request, stop, tell the bound address. What to answer is the caller's `App`:
path (without the query) -> (status, headers, body).

Host "" binds every address: dual-stack "::" (IPV6_V6ONLY off), or
0.0.0.0 where the kernel has no IPv6. A host with ":" binds IPv6 (v6-only
as the system default says), any other host IPv4. Request lines are not
logged (one line per probe would drown the sync logs); a client that hangs
up early is a debug line, not a traceback on stderr.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

__all__ = ["NOT_FOUND", "App", "HttpEndpoint", "HttpServer", "Response"]

Response = tuple[int, Mapping[str, str], bytes]
App = Callable[[str], Response]

NOT_FOUND: Response = (404, {"Content-Type": "text/plain"}, b"404 page not found\n")

_log = logging.getLogger(__name__)


class HttpServer:
    """`app` served by a thread named `name`, once started on an address.

    The constructor only stores; `start(host, port)` binds (OSError if the
    address is taken or invalid; port 0: ephemeral) and serves; `stop()`
    is safe before, after and twice, and ends at "not started".
    """

    def __init__(self, app: App, *, name: str) -> None:
        self.app = app
        self.name = name
        self._server: _Server | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); RuntimeError when not started."""
        if self._server is None:
            raise RuntimeError(f"{self.name} is not being served")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self, host: str, port: int) -> None:
        server = _bind(host, port, self.app, self.name)
        self._server = server
        self._wake = socket.socketpair()
        self._thread = threading.Thread(
            target=_loop, args=(server, self._wake[0]), name=self.name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._wake is not None and self._thread is not None:
            self._wake[1].send(b"x")
            self._thread.join()
            for sock in self._wake:
                sock.close()
            self._wake = self._thread = None
        if self._server is not None:
            self._server.server_close()
            self._server = None


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


def _loop(server: _Server, wake: socket.socket) -> None:
    with selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ)
        selector.register(wake, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is wake:
                    return
                server.handle_request()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    app: App
    name: str

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
