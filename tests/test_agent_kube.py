"""The agent against an API server (the fake one, speaking the real protocol,
driven by the real kubernetes client).

Aspects:
- after a burst of 1,000 changes interleaved with a forced 410 Gone and a
  dropped watch connection, the agent's table equals the table one full sync
  of the API's final state builds;
- nothing is programmed before both initial lists are complete;
- after the API server was down (8 s here, 30 s in bench/api_outage.py)
  and came back with a new watch cache (410 for the old resourceVersion), a
  Service and EndpointSlice created then reach the kernel within
  minSyncPeriod + 2 s (the bound here is looser, for a loaded machine), with
  the informers' real backoff.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Iterator
from typing import Any

import kernel
import pytest
from fakeapi import FakeApiServer
from feed import intake
from k8s import endpoint_slice, node, service

from nftproxy.agent.agent import Agent, Source
from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, ClusterEvents
from nftproxy.cluster.kube import KubeSource
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.listing import list_family
from nftproxy.kernel.fake import FakeBackend

NODE = "node-a"
CONFIG = ProxyConfig(
    node_name=NODE,
    cluster_cidrs=("10.244.0.0/16",),
    min_sync_period=0.05,
    sync_period=1.0,
    healthz_bind_address="",
    metrics_bind_address="",
)


def _listing(backend: FakeBackend) -> dict[str, Any]:
    return {
        f: kernel.canonical(
            list_family(backend.list_table, f, CONFIG.table_name)
        )
        for f in ("ip", "ip6")
    }


def _expected(api: FakeApiServer) -> dict[str, Any]:
    """One full sync of the API's current objects, on a fresh fake kernel."""
    backend = FakeBackend()
    backend.start()
    proxier = Proxier(CONFIG, backend)
    events = intake(proxier)
    for obj in api.objects("Node").values():
        events.on_node(obj)
    for obj in api.objects("Service").values():
        events.on_service(None, obj)
    for obj in api.objects("EndpointSlice").values():
        events.on_endpoint_slice(None, obj)
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)
    proxier.sync()
    return _listing(backend)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.create(node(NODE, ["192.168.50.1"]))
        yield server


def _agent(
    api: FakeApiServer,
    backend: FakeBackend,
    sources: list[KubeSource],
    config: ProxyConfig = CONFIG,
    **options: Any,
) -> Agent:
    """An Agent on `backend` fed by a KubeSource on `api` (fast backoff
    unless `options` say otherwise)."""
    client = api.api_client()
    options = {"backoff_initial": 0.05, "backoff_max": 0.2, **options}

    def source_factory(handler: ClusterEvents) -> Source:
        source = KubeSource(client, handler, node_name=NODE, **options)
        sources.append(source)
        return source

    return Agent(config, backend=backend, source_factory=source_factory)


@contextlib.contextmanager
def _synced_agent(
    api: FakeApiServer, config: ProxyConfig = CONFIG, **options: Any
) -> Iterator[tuple[FakeBackend, list[KubeSource]]]:
    """`_agent` started and through its first sync (stopped afterwards):
    its backend and the sources it made."""
    backend = FakeBackend()
    sources: list[KubeSource] = []
    agent = _agent(api, backend, sources, config, **options)
    agent.start()
    try:
        assert agent.synced.wait(30), "no first sync"
        yield backend, sources
    finally:
        agent.stop()


def _wait(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the agent")
        time.sleep(0.05)


def _burst(api: FakeApiServer, rng: random.Random, count: int) -> None:
    for _ in range(count):
        i = rng.randrange(60)
        name = f"s{i}"
        roll = rng.random()
        if roll < 0.2:
            for kind in ("Service", "EndpointSlice"):
                key = f"{name}-ipv4" if kind == "EndpointSlice" else name
                if api.get(kind, key, "ns") is not None:
                    api.delete(kind, key, "ns")
            continue
        if roll < 0.5:
            api.apply(
                service(
                    name,
                    f"10.96.0.{i + 1}",
                    type=rng.choice(["ClusterIP", "NodePort"]),
                    node_ports=[30000 + i],
                )
            )
        ips = rng.sample(
            [f"10.244.{n}.{h}" for n in (0, 1) for h in range(2, 12)], rng.randrange(4)
        )
        api.apply(
            endpoint_slice(
                name, [(ip, NODE if ".0." in ip else "node-b") for ip in ips], family="IPv4"
            )
        )


def test_agent_converges_after_a_burst_with_a_410_and_a_dropped_connection(
    api: FakeApiServer,
) -> None:
    rng = random.Random(1)
    _burst(api, rng, 200)
    with _synced_agent(api) as (backend, sources):
        _burst(api, rng, 300)
        api.wait_watchers("services")  # the 410 goes to open watches only
        api.force_gone()
        _wait(lambda: sources[0].stats["services"].relists >= 1)  # the 410 was seen
        _burst(api, rng, 200)
        api.drop_watches()
        _burst(api, rng, 300)
        expected = _expected(api)
        _wait(lambda: _listing(backend) == expected)


def test_a_slice_deleted_in_an_outage_leaves_the_kernel_after_the_relist(
    api: FakeApiServer,
) -> None:
    """The relist finds the slice gone: the proxier is told with what the
    informer kept of it (its metadata only) and drops its endpoints."""
    for name, ip, ep in (("web", "10.96.0.10", "10.244.0.5"), ("db", "10.96.0.11", "10.244.0.6")):
        api.create(service(name, ip))
        api.create(endpoint_slice(name, [(ep, NODE)], family="IPv4"))
    with _synced_agent(api) as (backend, sources):
        _wait(lambda: _listing(backend) == _expected(api))
        before = _listing(backend)
        api.stop()
        api.delete("EndpointSlice", "web-ipv4", "ns")  # no watch sees it
        api.start(forget_history=True)  # the watch's resourceVersion is gone: a relist
        expected = _expected(api)
        assert expected != before
        _wait(lambda: _listing(backend) == expected)
        assert sources[0].stats["endpointslices"].lists == 2


def test_nothing_is_programmed_before_both_lists_complete(api: FakeApiServer) -> None:
    api.create(service("web", "10.96.0.10"))
    api.create(endpoint_slice("web", ["10.244.0.2"]))
    api.fail_requests(4, resource="endpointslices", status=500)
    backend = FakeBackend()
    agent = _agent(api, backend, [])
    agent.start()
    try:
        time.sleep(0.3)
        assert backend.list_table("ip", CONFIG.table_name) is None, "programmed before synced"
        assert agent.synced.wait(30)
        assert "10.96.0.10" in str(backend.list_table("ip", CONFIG.table_name))
    finally:
        agent.stop()


OUTAGE = 8.0


def test_a_change_after_an_api_outage_reaches_the_kernel_within_min_sync_plus_2s(
    api: FakeApiServer,
) -> None:
    config = dataclasses.replace(CONFIG, min_sync_period=1.0, sync_period=30.0)
    api.create(service("web", "10.96.0.10"))
    api.create(endpoint_slice("web", [("10.244.0.2", NODE)], family="IPv4"))
    # the real backoff (0.8 s doubling to 30 s); a fixed jitter for a repeatable test
    with _synced_agent(api, config, backoff_initial=0.8, backoff_max=30.0,
                       random=lambda: 0.5) as (backend, sources):
        for resource in ("services", "endpointslices", "nodes"):
            api.wait_watchers(resource)
        api.stop()
        time.sleep(OUTAGE)
        api.start(forget_history=True)  # a new watch cache: the old resourceVersion gets 410
        back = time.monotonic()
        api.create(service("after", "10.96.0.20"))
        api.create(endpoint_slice("after", [("10.244.0.3", NODE)], family="IPv4"))
        _wait(lambda: "10.244.0.3" in str(backend.list_table("ip", config.table_name)), 60)
        took = time.monotonic() - back
        # minSyncPeriod + 2 s, and slack for a loaded machine; the precise figure:
        # bench/api_outage.py
        assert took < config.min_sync_period + 2.0 + 3.0, f"{took:.1f}s"
        assert sources[0].stats["services"].relists == 1
        _wait(lambda: _listing(backend) == _expected(api))
