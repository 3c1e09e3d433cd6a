"""The report's whole-state figures, kept per changed port (agent/tallies.py).

Aspects:
- property: over random histories of Service and EndpointSlice events (both
  families), with syncs in between (mostly partial, some full), every
  report's health_check_ports and local_endpoints equal the full computation
  over the maps that sync rendered from (local endpoints of the services
  with a health check port), and an earlier report keeps its values;
- cost: a sync reads only the ports it applied (none when nothing changed),
  never the whole maps;
- the no-local gauges and the table sizes a partial sync reports equal a
  full recount.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from feed import intake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k8s import endpoint_slice, node, service

from nftproxy.agent import tallies
from nftproxy.agent.proxier import Proxier
from nftproxy.agent.report import SyncReport
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import NamespacedName
from nftproxy.core.tracker import StateSnapshot
from nftproxy.kernel.fake import FakeBackend

NODE = "node-a"
CONFIG = ProxyConfig(node_name=NODE, cluster_cidrs=("10.244.0.0/16", "fd00:244::/56"),
                     table_name="nftproxy", full_sync_period=3600.0)
SERVICES = ("web", "api", "dns")
PORTS = (("http", 80, "TCP"), ("dns", 53, "UDP"))
IPS = {"IPv4": ("10.244.0.1", "10.244.0.2", "10.244.1.3"),
       "IPv6": ("fd00:244::1", "fd00:244::2")}
CLUSTER_IPS = {"web": ("10.96.0.1", "fd00:96::1"), "api": ("10.96.0.2", "fd00:96::2"),
               "dns": ("10.96.0.3", "fd00:96::3")}
Obj = dict[str, Any]


def expected(report: SyncReport) -> tuple[dict[NamespacedName, int], dict[NamespacedName, int]]:
    """The report's figures computed from the whole maps it was rendered
    from: the later family's port wins, the larger count wins; local
    endpoints only for the services the health server answers for."""
    ports: dict[NamespacedName, int] = {}
    local: dict[NamespacedName, int] = {}
    for fam in report.families:
        state: StateSnapshot = fam.state
        ports.update(state.health_check_ports())
        for svc, count in state.local_ready_endpoints().items():
            local[svc] = max(local.get(svc, 0), count)
    return ports, {svc: count for svc, count in local.items() if svc in ports}


# --- random histories ------------------------------------------------------------------


@st.composite
def services(draw: st.DrawFn, name: str) -> Obj:
    families = draw(st.sampled_from([(0,), (1,), (0, 1), (1, 0)]))
    ports = draw(st.lists(st.sampled_from(PORTS), unique=True, min_size=1, max_size=2))
    kind = draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]))
    return service(
        name, [CLUSTER_IPS[name][i] for i in families], ports=ports, type=kind,
        node_ports=[30001, 30002] if kind != "ClusterIP" else [],
        lb_ips=["192.0.2.1"] if kind == "LoadBalancer" else [],
        etp=draw(st.sampled_from(["Cluster", "Local"])),
        health_check_node_port=draw(st.sampled_from([0, 32001, 32002])),
    )


@st.composite
def slices(draw: st.DrawFn, name: str) -> Obj:
    family = draw(st.sampled_from(["IPv4", "IPv6"]))
    endpoints = [
        {"ip": ip, "nodeName": draw(st.sampled_from([NODE, "node-b"])),
         "ready": draw(st.booleans()), "serving": True}
        for ip in draw(st.lists(st.sampled_from(IPS[family]), unique=True, max_size=3))
    ]
    ports = draw(st.lists(st.sampled_from(PORTS), unique=True, min_size=1, max_size=2))
    owner = draw(st.sampled_from(SERVICES))
    return endpoint_slice(owner, endpoints, name=name, ports=ports, family=family)


@st.composite
def events(draw: st.DrawFn) -> tuple[str, str, Obj | None]:
    """(kind, name, new object or None for a delete); kind "sync" or "full" syncs."""
    what = draw(st.sampled_from(["svc", "svc", "eps", "eps", "eps", "sync", "sync", "full"]))
    if what in ("sync", "full"):
        return what, "", None
    if what == "svc":
        name = draw(st.sampled_from(SERVICES))
        gone = draw(st.integers(0, 5)) == 0
        return what, name, None if gone else draw(services(name))
    name = draw(st.sampled_from(["s1", "s2", "s3", "s4"]))
    return what, name, None if draw(st.integers(0, 5)) == 0 else draw(slices(name))


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    b = FakeBackend()
    b.start()
    try:
        yield b
    finally:
        b.close()


def synced_proxier(backend: FakeBackend) -> tuple[Proxier, Any]:
    proxier = Proxier(CONFIG, backend)
    feed = intake(proxier, NODE)
    feed.on_node(node(NODE, ["192.168.50.1", "fd00:50::1"]))
    feed.on_synced(KIND_SERVICES)
    feed.on_synced(KIND_ENDPOINT_SLICES)
    return proxier, feed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=st.lists(events(), max_size=30))
def test_every_report_equals_the_full_computation(
    history: list[tuple[str, str, Obj | None]],
) -> None:
    backend = FakeBackend()
    backend.start()
    try:
        proxier, feed = synced_proxier(backend)
        current: dict[tuple[str, str], Obj] = {}
        reports: list[tuple[SyncReport, dict[Any, int], dict[Any, int]]] = []
        for kind, name, obj in [*history, ("sync", "", None)]:
            if kind in ("sync", "full"):
                if kind == "full":
                    proxier.request_full_sync()
                report = proxier.sync()
                ports, local = expected(report)
                assert dict(report.health_check_ports) == ports
                assert dict(report.local_endpoints) == local
                reports.append((report, ports, local))
                continue
            previous = current.pop((kind, name), None)
            if obj is not None:
                current[(kind, name)] = obj
            if kind == "svc":
                feed.on_service(previous, obj)
            else:
                feed.on_endpoint_slice(previous, obj)
        for report, ports, local in reports:  # later syncs changed no earlier report
            assert dict(report.health_check_ports) == ports
            assert dict(report.local_endpoints) == local
    finally:
        backend.close()


# --- cost --------------------------------------------------------------------------------


def _web(i: int) -> tuple[Obj, Obj]:
    svc = service(f"web{i}", f"10.96.1.{i + 1}", type="LoadBalancer", node_ports=[30100 + i],
                  lb_ips=[f"192.0.2.{i + 1}"], etp="Local", health_check_node_port=32100 + i)
    eps = endpoint_slice(f"web{i}", [(f"10.244.0.{i + 1}", NODE), (f"10.244.1.{i + 1}", "x")])
    return svc, eps


def test_a_sync_reads_only_the_ports_it_applied(
    backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    for whole_map in ("health_check_ports", "local_ready_endpoints"):
        monkeypatch.setattr(StateSnapshot, whole_map, _forbidden)
    read: list[object] = []
    set_port = tallies._FamilyHealth.set_port

    def counting(self: Any, spn: Any, *args: Any) -> None:
        read.append(spn)
        set_port(self, spn, *args)

    monkeypatch.setattr(tallies._FamilyHealth, "set_port", counting)
    proxier, feed = synced_proxier(backend)
    objects = [_web(i) for i in range(40)]
    for svc, eps in objects:
        feed.on_service(None, svc)
        feed.on_endpoint_slice(None, eps)
    first = proxier.sync()
    assert first.full and len(first.health_check_ports) == 40
    assert len(read) == 40  # one port each, IPv4 only
    read.clear()
    assert proxier.sync().ops == 0
    assert read == []
    svc, eps = objects[7]
    moved = endpoint_slice("web7", [("10.244.0.8", "x"), ("10.244.1.8", "x")])
    feed.on_endpoint_slice(eps, moved)
    report = proxier.sync()
    assert not report.full and len(read) == 1
    assert NamespacedName("ns", "web7") not in report.local_endpoints
    assert len(report.local_endpoints) == 39 and len(report.health_check_ports) == 40


def test_a_served_service_counts_the_local_endpoints_of_a_port_it_lacks(
    backend: FakeBackend,
) -> None:
    """As kube-proxy's LocalReadyEndpoints: every port of the service's
    endpoints counts, a slice's port name the Service does not have too --
    whether the Service needs a health server before or after the slice
    comes, on partial and full syncs alike."""
    web = NamespacedName("ns", "web")
    proxier, feed = synced_proxier(backend)
    plain = service("web", "10.96.0.1")
    served = service("web", "10.96.0.1", type="LoadBalancer", node_ports=[30100],
                     lb_ips=["192.0.2.1"], etp="Local", health_check_node_port=32100)
    other = endpoint_slice("web", [("10.244.0.5", NODE), ("10.244.0.6", "node-b")],
                           ports=[("metrics", 9100, "TCP")])
    feed.on_service(None, plain)
    feed.on_endpoint_slice(None, other)
    assert web not in proxier.sync().local_endpoints  # no health server for it
    feed.on_service(plain, served)
    assert proxier.sync().local_endpoints.get(web) == 1
    proxier.request_full_sync()
    assert proxier.sync().local_endpoints.get(web) == 1
    moved = endpoint_slice("web", [("10.244.0.5", "node-b")], ports=[("metrics", 9100, "TCP")])
    feed.on_endpoint_slice(other, moved)
    assert web not in proxier.sync().local_endpoints
    feed.on_service(served, plain)
    feed.on_endpoint_slice(moved, other)
    assert web not in proxier.sync().local_endpoints


def _forbidden(self: object) -> Mapping[NamespacedName, int]:
    raise AssertionError("a sync read the whole map")


# --- gauges and sizes ----------------------------------------------------------------------


def test_partial_syncs_report_the_counts_a_full_sync_reports(backend: FakeBackend) -> None:
    proxier, feed = synced_proxier(backend)
    objects = {i: _web(i) for i in range(6)}
    for svc, eps in objects.values():
        feed.on_service(None, svc)
        feed.on_endpoint_slice(None, eps)
    proxier.sync()

    def move(i: int, eps: Obj | None) -> None:
        feed.on_endpoint_slice(objects[i][1], eps)
        if eps is None:
            feed.on_service(objects[i][0], None)
        else:
            objects[i] = (objects[i][0], eps)

    remote = [("10.244.9.9", "x")]
    # (changes, then the eTP=Local ports without a local endpoint)
    steps: list[tuple[dict[int, Obj | None], int]] = [
        ({1: endpoint_slice("web1", remote), 4: endpoint_slice("web4", remote)}, 2),
        ({4: _web(4)[1], 2: None}, 1),
        ({1: None}, 0),
    ]
    for changes, without_local in steps:
        for i, new in changes.items():
            move(i, new)
        partial = proxier.sync()
        proxier.request_full_sync()
        full = proxier.sync()
        assert not partial.full and full.full and full.ops > 0
        assert partial.families[0].no_local_external == without_local
        assert [f.no_local_external for f in partial.families] == [
            f.no_local_external for f in full.families]
        # a partial sync writes what a full sync writes: the same table
        assert [f.table for f in partial.families] == [f.table for f in full.families]
