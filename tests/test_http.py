"""The one HTTP server health and metrics share (nftproxy.serving.http).

Aspects: GET answers with the app's status, headers and body (the query
is not part of the path the app sees); HEAD sends the headers and no body;
the bound address is known only while serving; stop() is harmless before
start and twice; a taken port is an OSError from start(); host "" serves
every address. HTTP is spoken over loopback ephemeral ports.
"""

from __future__ import annotations

import http.client
import socket

import pytest

from nftproxy.serving.http import NOT_FOUND, HttpServer, Response


def echo(path: str) -> Response:
    if path == "/missing":
        return NOT_FOUND
    return 200, {"Content-Type": "text/plain", "X-Path": path}, path.encode()


def request(method: str, host: str, port: int, path: str) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.getheader("X-Path") or "", response.read()
    finally:
        conn.close()


def test_get_and_head_answer_from_the_app() -> None:
    server = HttpServer(echo, name="test")
    server.start("127.0.0.1", 0)
    try:
        host, port = server.address
        assert request("GET", host, port, "/a?b=c") == (200, "/a", b"/a")
        assert request("HEAD", host, port, "/a") == (200, "/a", b"")
        assert request("GET", host, port, "/missing")[0] == 404
    finally:
        server.stop()


def test_the_address_is_known_only_while_serving() -> None:
    server = HttpServer(echo, name="test")
    server.stop()  # before start: harmless
    with pytest.raises(RuntimeError):
        _ = server.address
    server.start("127.0.0.1", 0)
    assert server.address[0] == "127.0.0.1"
    server.stop()
    server.stop()
    with pytest.raises(RuntimeError):
        _ = server.address


def test_a_taken_port_is_an_oserror_from_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = HttpServer(echo, name="test")
        with pytest.raises(OSError):
            server.start("127.0.0.1", taken.getsockname()[1])
        server.stop()


def test_an_empty_host_serves_every_address() -> None:
    server = HttpServer(echo, name="test")
    server.start("", 0)
    try:
        _host, port = server.address
        assert request("GET", "127.0.0.1", port, "/v4")[0] == 200
        if socket.has_ipv6 and server.address[0] == "::":
            assert request("GET", "::1", port, "/v6")[0] == 200
    finally:
        server.stop()
