"""Health: ProxyHealth state, /healthz and /livez, healthCheckNodePort servers.

Aspects: healthy until a queued change waits longer than the timeout, and
again after a sync; /healthz also needs an eligible node (known, not being
deleted, not tainted by the autoscaler); bodies and headers as kube-proxy's;
service health servers answer 200 only with local endpoints and a healthy
proxy, carry the endpoint weight header, follow sync() (open, close, move
ports), and a port that cannot be bound is a warning plus one callback, not
a crash. All service ports are served by one thread, whatever their number;
a port closed and opened again answers; a stalled client on one service
does not hold up another's answer; stop() closes every port and ends the
thread. HTTP is spoken over 127.0.0.1 ephemeral ports.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from typing import Any

import pytest
from test_http import eventually, refused, threads_named

from nftproxy.core.model import NamespacedName, NodeInfo
from nftproxy.serving.health import (
    HealthServer,
    ProxyHealth,
    ServiceHealthServers,
)

WEB = NamespacedName("ns", "web")
DB = NamespacedName("ns", "db")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def get(url: str) -> tuple[int, Message, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = body.decode()
        return err.code, err.headers, doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- ProxyHealth ----------------------------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def health(clock: FakeClock) -> ProxyHealth:
    h = ProxyHealth(timeout=60.0, clock=clock, monotonic=clock)
    h.updated()
    return h


def test_healthy_until_a_queued_change_waits_longer_than_the_timeout(
    health: ProxyHealth, clock: FakeClock
) -> None:
    clock.now += 1000  # no change queued: idle for ever is healthy
    assert health.is_healthy()
    health.queued()
    clock.now += 60
    assert health.is_healthy()
    health.queued()  # a later change does not reset the oldest one
    clock.now += 1
    assert not health.is_healthy()
    health.updated()
    assert health.is_healthy()


def test_last_updated_is_now_when_healthy_and_the_last_sync_when_not(
    health: ProxyHealth, clock: FakeClock
) -> None:
    synced_at = clock.now
    health.queued()
    clock.now += 10
    assert health.status().last_updated == clock.now
    clock.now += 100
    status = health.status()
    assert not status.healthy
    assert status.last_updated == synced_at
    assert status.current_time == clock.now


@pytest.mark.parametrize(
    ("node", "eligible"),
    [
        (None, False),
        (NodeInfo("n1"), True),
        (NodeInfo("n1", deleting=True), False),
        (NodeInfo("n1", to_be_deleted=True), False),
    ],
    ids=["unknown node", "known node", "node being deleted", "node tainted by the autoscaler"],
)
def test_node_eligibility(health: ProxyHealth, node: NodeInfo | None, eligible: bool) -> None:
    health.set_node(node)
    assert health.status().node_eligible is eligible


# ---- /healthz and /livez -------------------------------------------------------------


@pytest.fixture
def server(health: ProxyHealth) -> Iterator[tuple[HealthServer, list[tuple[str, int]]]]:
    seen: list[tuple[str, int]] = []
    srv = HealthServer(health, "127.0.0.1:0", on_response=lambda e, c: seen.append((e, c)))
    srv.start()
    yield srv, seen
    srv.stop()


def url(srv: HealthServer, path: str) -> str:
    host, port = srv.address
    return f"http://{host}:{port}{path}"


def test_healthz_and_livez_200_with_kube_proxy_bodies_and_headers(
    server: tuple[HealthServer, list[tuple[str, int]]], health: ProxyHealth
) -> None:
    srv, seen = server
    health.set_node(NodeInfo("n1"))
    code, headers, body = get(url(srv, "/healthz"))
    assert code == 200
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert body["nodeEligible"] is True
    assert body["lastUpdated"] == body["currentTime"] == "2023-11-14T22:13:20Z"
    code, headers, body = get(url(srv, "/livez"))
    assert code == 200
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert set(body) >= {"lastUpdated", "currentTime"}
    assert "nodeEligible" not in body
    assert seen == [("healthz", 200), ("livez", 200)]


def test_stale_queued_change_makes_both_503(
    server: tuple[HealthServer, list[tuple[str, int]]], health: ProxyHealth, clock: FakeClock
) -> None:
    srv, seen = server
    health.set_node(NodeInfo("n1"))
    health.queued()
    clock.now += 61
    code, _, body = get(url(srv, "/healthz"))
    assert code == 503
    assert body["healthy"] is False
    assert body["lastUpdated"] != body["currentTime"]
    assert get(url(srv, "/livez"))[0] == 503
    health.updated()
    assert get(url(srv, "/healthz"))[0] == 200
    assert get(url(srv, "/livez"))[0] == 200
    assert seen == [("healthz", 503), ("livez", 503), ("healthz", 200), ("livez", 200)]


def test_ineligible_node_fails_healthz_only(
    server: tuple[HealthServer, list[tuple[str, int]]], health: ProxyHealth
) -> None:
    srv, _ = server
    health.set_node(NodeInfo("n1", deleting=True))
    code, _, body = get(url(srv, "/healthz"))
    assert (code, body["nodeEligible"]) == (503, False)
    assert get(url(srv, "/livez"))[0] == 200


def test_other_paths_are_404(server: tuple[HealthServer, list[tuple[str, int]]]) -> None:
    srv, seen = server
    assert get(url(srv, "/metrics"))[0] == 404
    assert seen == []


def test_health_server_bind_failure_raises_oserror(health: ProxyHealth) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = HealthServer(health, f"127.0.0.1:{port}")
        with pytest.raises(OSError):
            srv.start()
        srv.stop()  # harmless when never started


# ---- healthCheckNodePort servers ----------------------------------------------------


class Healthy:
    def __init__(self) -> None:
        self.value = True

    def __call__(self) -> bool:
        return self.value


@pytest.fixture
def healthy() -> Healthy:
    return Healthy()


@pytest.fixture
def servers(healthy: Healthy) -> Iterator[tuple[ServiceHealthServers, list[Any]]]:
    errors: list[Any] = []
    s = ServiceHealthServers(
        proxy_healthy=healthy, host="127.0.0.1",
        on_bind_error=lambda svc, port, err: errors.append((svc, port, type(err))),
    )
    yield s, errors
    s.stop()


def test_service_server_answers_any_path_with_local_endpoint_count(
    servers: tuple[ServiceHealthServers, list[Any]],
) -> None:
    s, _ = servers
    port = free_port()
    s.sync({WEB: port}, {WEB: 2})
    code, headers, body = get(f"http://127.0.0.1:{port}/anything?x=1")
    assert code == 200
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert body == {
        "service": {"namespace": "ns", "name": "web"},
        "localEndpoints": 2,
        "serviceProxyHealthy": True,
    }


def test_service_server_503_without_local_endpoints_or_when_the_proxy_is_unhealthy(
    servers: tuple[ServiceHealthServers, list[Any]], healthy: Healthy
) -> None:
    s, _ = servers
    port = free_port()
    s.sync({WEB: port}, {})
    code, headers, body = get(f"http://127.0.0.1:{port}/")
    assert (code, headers["X-Load-Balancing-Endpoint-Weight"]) == (503, "0")
    assert body["localEndpoints"] == 0
    s.sync({WEB: port}, {WEB: 1})
    assert get(f"http://127.0.0.1:{port}/")[0] == 200
    healthy.value = False
    code, headers, body = get(f"http://127.0.0.1:{port}/")
    assert (code, body["serviceProxyHealthy"]) == (503, False)
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "1"


def test_servers_follow_the_services(servers: tuple[ServiceHealthServers, list[Any]]) -> None:
    s, _ = servers
    p1, p2, p3 = free_port(), free_port(), free_port()
    s.sync({WEB: p1, DB: p2}, {WEB: 1, DB: 1})
    assert {svc: addr[1] for svc, addr in s.serving().items()} == {WEB: p1, DB: p2}
    s.sync({WEB: p3}, {WEB: 1})  # WEB moved, DB gone
    assert {svc: addr[1] for svc, addr in s.serving().items()} == {WEB: p3}
    for closed in (p1, p2):
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{closed}/", timeout=2)
    assert get(f"http://127.0.0.1:{p3}/")[0] == 200


def test_a_port_in_use_is_a_warning_and_one_callback_then_retried(
    servers: tuple[ServiceHealthServers, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    s, errors = servers
    caplog.set_level(logging.WARNING, logger="nftproxy.serving.health")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ok_port = free_port()
    s.sync({WEB: port, DB: ok_port}, {WEB: 1, DB: 1})
    s.sync({WEB: port, DB: ok_port}, {WEB: 1, DB: 1})
    assert errors == [(WEB, port, OSError)]  # once, not per sync
    assert [r.getMessage() for r in caplog.records] == ["cannot start the service health server"]
    assert set(s.serving()) == {DB}  # the other service is served regardless
    taken.close()
    s.sync({WEB: port, DB: ok_port}, {WEB: 1, DB: 1})
    assert set(s.serving()) == {WEB, DB}
    assert get(f"http://127.0.0.1:{port}/")[0] == 200


def test_a_raising_bind_error_callback_is_logged_not_raised(healthy: Healthy) -> None:
    def boom(svc: NamespacedName, port: int, err: OSError) -> None:
        raise RuntimeError("API down")

    s = ServiceHealthServers(proxy_healthy=healthy, host="127.0.0.1", on_bind_error=boom)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s.sync({WEB: taken.getsockname()[1]}, {})
    assert s.serving() == {}
    s.stop()


def test_many_service_ports_are_served_by_one_thread(
    servers: tuple[ServiceHealthServers, list[Any]],
) -> None:
    s, _ = servers
    before = threading.active_count()
    services = {NamespacedName("ns", f"svc-{i}"): 0 for i in range(50)}  # 0: ephemeral
    s.sync(services, dict.fromkeys(services, 1))
    served = s.serving()
    assert set(served) == set(services)
    for service, (host, port) in served.items():
        code, _, body = get(f"http://{host}:{port}/")
        assert (code, body["service"]["name"]) == (200, service.name)
    # the answers' threads end; the loop thread stays
    assert eventually(lambda: threading.active_count() <= before + 1), threading.enumerate()
    assert threads_named("service-health") == 1


def test_a_port_closed_then_opened_again_answers(
    servers: tuple[ServiceHealthServers, list[Any]],
) -> None:
    s, _ = servers
    port = free_port()
    s.sync({WEB: port, DB: 0}, {WEB: 1})
    s.sync({DB: 0}, {})
    assert refused(port)
    s.sync({WEB: port, DB: 0}, {WEB: 3})
    code, headers, _ = get(f"http://127.0.0.1:{port}/")
    assert (code, headers["X-Load-Balancing-Endpoint-Weight"]) == (200, "3")


def test_a_stalled_client_does_not_hold_up_another_service(
    servers: tuple[ServiceHealthServers, list[Any]],
) -> None:
    s, _ = servers
    s.sync({WEB: 0, DB: 0}, {WEB: 1, DB: 1})
    addresses = s.serving()
    with socket.create_connection(addresses[WEB]) as stalled:
        stalled.sendall(b"GET / HTTP/1.1\r\n")  # and never the rest
        host, port = addresses[DB]
        assert get(f"http://{host}:{port}/")[0] == 200  # get() gives up after 5 s


def test_stop_closes_every_service_port_and_ends_the_thread(healthy: Healthy) -> None:
    s = ServiceHealthServers(proxy_healthy=healthy, host="127.0.0.1")
    s.sync({WEB: 0, DB: 0}, {})
    ports = [port for _, port in s.serving().values()]
    assert threads_named("service-health") == 1
    s.stop()
    assert s.serving() == {}
    assert all(refused(port) for port in ports)
    assert threads_named("service-health") == 0
