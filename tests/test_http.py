"""The one HTTP server health and metrics share (nftproxy.serving.http).

Aspects: GET answers with the app's status, headers and body (the query
is not part of the path the app sees); HEAD sends the headers and no body;
the bound address is known only while serving; stop() is harmless before
start and twice; a taken port is an OSError from start(); host "" serves
every address. A group serves many keys from one thread, started by the
first add: each key its own app; a removed key's socket is closed (connect
refused) and the key can be added again; a client that sends nothing or
half a request holds up neither its port nor another, and is dropped after
the request timeout; stop() closes every port and ends the thread. HTTP is
spoken over loopback ephemeral ports.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from nftproxy.serving.http import NOT_FOUND, App, HttpServer, HttpServerGroup, Response


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


# ---- many servers, one thread ------------------------------------------------------


def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether `condition` holds within `timeout` seconds (generous: the
    machine is shared)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def refused(port: int) -> bool:
    """Whether a connect to 127.0.0.1:`port` is refused (nothing listens)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def threads_named(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def answering(key: str) -> App:
    """An app answering 200 with `key` in X-Path, whatever the path."""
    return lambda path: (200, {"X-Path": key}, b"")


def test_a_group_serves_each_key_with_its_own_app_from_one_thread() -> None:
    group: HttpServerGroup[str] = HttpServerGroup(name="group")
    assert threads_named("group") == 0  # nothing to serve yet: no thread
    try:
        for key in ("a", "b", "c"):
            group.add(key, "127.0.0.1", 0, answering(key))
        assert threads_named("group") == 1
        for key, (host, port) in group.addresses().items():
            assert request("GET", host, port, "/") == (200, key, b"")
        with pytest.raises(ValueError):
            group.add("a", "127.0.0.1", 0, echo)
    finally:
        group.stop()


@pytest.fixture
def group() -> Iterator[HttpServerGroup[str]]:
    """Keys "a" and "b" serving `echo` on loopback ephemeral ports."""
    serving: HttpServerGroup[str] = HttpServerGroup(name="group")
    try:
        for key in ("a", "b"):
            serving.add(key, "127.0.0.1", 0, echo)
        yield serving
    finally:
        serving.stop()


def test_a_removed_key_refuses_connections_and_can_be_added_again(
    group: HttpServerGroup[str],
) -> None:
    port = group.address("a")[1]
    group.remove("a")
    group.remove("a")  # gone already: nothing
    assert refused(port)
    with pytest.raises(RuntimeError):
        group.address("a")
    assert request("GET", *group.address("b"), "/b")[0] == 200
    group.add("a", "127.0.0.1", port, echo)
    assert request("GET", "127.0.0.1", port, "/again") == (200, "/again", b"/again")


def test_a_stalled_client_holds_up_neither_its_port_nor_another(
    group: HttpServerGroup[str],
) -> None:
    a, b = group.address("a"), group.address("b")
    with socket.create_connection(a) as silent, socket.create_connection(a) as half:
        half.sendall(b"GET /half HTTP/1.1\r\nHost: x")  # no end of headers
        assert request("GET", *b, "/b")[0] == 200  # request() gives up after 5 s
        assert request("GET", *a, "/a")[0] == 200
        silent.settimeout(0)  # still open: not answered, not closed
        with pytest.raises(BlockingIOError):
            silent.recv(1)


def test_a_stalled_client_is_dropped_after_the_request_timeout() -> None:
    group: HttpServerGroup[str] = HttpServerGroup(name="group", request_timeout=0.2)
    try:
        group.add("a", "127.0.0.1", 0, echo)
        with socket.create_connection(group.address("a")) as silent:
            silent.settimeout(10)
            assert silent.recv(1) == b""  # the server closed it
    finally:
        group.stop()


def test_stop_closes_every_port_and_ends_the_thread(group: HttpServerGroup[str]) -> None:
    ports = [port for _, port in group.addresses().values()]
    group.stop()
    assert group.addresses() == {}
    assert all(refused(port) for port in ports)
    assert threads_named("group") == 0
    group.stop()  # twice: harmless
    group.add("a", "127.0.0.1", 0, echo)  # and it serves again (the fixture stops it)
    assert request("GET", *group.address("a"), "/")[0] == 200
