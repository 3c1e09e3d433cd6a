"""Node ports follow the host's interface addresses (nodePortAddresses),
through the Proxier and the Agent, on FakeBackend (no root, no kernel).

Aspects:
- with nodePortAddresses CIDRs, the host's addresses inside them -- also
  ones the Node object does not list -- fill nodeport-ips; an address
  added or removed changes the set at the next sync, which is full;
- a reading that selects the same node-port addresses (an address outside
  the CIDRs, a link-local one) records nothing: no kick, no transaction;
- without nodePortAddresses the readings never matter;
- the Agent starts the address edge only when nodePortAddresses restricts
  node ports, programs the first reading in its first sync, re-programs a
  change within one sync, closes the edge on stop; an edge that cannot
  start is logged and the Node's addresses are used.
The kernel side (readings, events) is tests/test_addresses_kernel.py; real
traffic is tests/test_dataplane.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from feed import intake
from k8s import node, service
from test_agent import wait_for

from nftproxy.agent.agent import Agent
from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, ClusterEvents
from nftproxy.cluster.file import FileSource, WatchedFiles
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import HostAddresses
from nftproxy.kernel.fake import FakeBackend

NODE = "node-a"
TABLE = "nftproxy"
RESTRICTED = ProxyConfig(
    node_name=NODE, table_name=TABLE, nodeport_addresses=("10.0.0.0/8", "fd00:10::/64")
)
NODE_OBJ = node(NODE, ["10.0.0.1", "192.168.0.1", "fd00:10::1"])
HOST = HostAddresses(("10.0.0.1", "10.0.0.7", "127.0.0.1", "192.168.0.1"),
                     ("::1", "fd00:10::1", "fd00:10::7"))


def nodeport_ips(backend: FakeBackend, family: str = "ip") -> list[str]:
    table = backend.list_table(family, TABLE) or {"nftables": []}
    for obj in table["nftables"]:
        body = obj.get("set", {})
        if body.get("name") == "nodeport-ips":
            return list(body.get("elem", []))
    raise AssertionError("no nodeport-ips set")


class Kicks:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    b = FakeBackend()
    b.start()
    yield b
    b.close()


def ready_proxier(config: ProxyConfig, backend: FakeBackend, kicks: Kicks) -> Proxier:
    proxier = Proxier(config, backend, on_change=kicks)
    intake(proxier).on_node(NODE_OBJ)
    intake(proxier).on_synced(KIND_SERVICES)
    intake(proxier).on_synced(KIND_ENDPOINT_SLICES)
    return proxier


# --- the Proxier ---------------------------------------------------------------------


def test_node_ports_follow_the_host_addresses_inside_the_cidrs(backend: FakeBackend) -> None:
    kicks = Kicks()
    proxier = ready_proxier(RESTRICTED, backend, kicks)
    proxier.on_host_addresses(HOST)
    assert proxier.sync().full
    assert nodeport_ips(backend) == ["10.0.0.1", "10.0.0.7"]
    assert nodeport_ips(backend, "ip6") == ["fd00:10::1", "fd00:10::7"]

    before = kicks.count
    proxier.on_host_addresses(HostAddresses(("10.0.0.1", "10.0.0.9"), HOST.ipv6))
    assert kicks.count == before + 1, "an address change must kick a sync"
    report = proxier.sync()
    assert report.full
    assert nodeport_ips(backend) == ["10.0.0.1", "10.0.0.9"], "added and removed"


def test_a_reading_that_selects_the_same_addresses_records_nothing(
    backend: FakeBackend,
) -> None:
    kicks = Kicks()
    proxier = ready_proxier(RESTRICTED, backend, kicks)
    proxier.on_host_addresses(HOST)
    proxier.sync()
    before = kicks.count
    outside = HostAddresses((*HOST.ipv4, "172.16.0.1"), ("fe80::1", *HOST.ipv6))
    proxier.on_host_addresses(outside)
    assert kicks.count == before
    report = proxier.sync()
    assert not report.full and report.ops == 0


def test_without_node_port_addresses_the_readings_never_matter(backend: FakeBackend) -> None:
    kicks = Kicks()
    proxier = ready_proxier(ProxyConfig(node_name=NODE, table_name=TABLE), backend, kicks)
    proxier.sync()
    before = kicks.count
    proxier.on_host_addresses(HOST)
    proxier.on_host_addresses(HostAddresses(("10.0.0.9",), ()))
    assert kicks.count == before
    assert proxier.sync().ops == 0
    assert nodeport_ips(backend) == []


# --- the Agent ------------------------------------------------------------------------


class FakeAddresses:
    """An AddressEdge whose readings the test hands over."""

    def __init__(self, first: HostAddresses, *, fail: OSError | None = None) -> None:
        self.first = first
        self.fail = fail
        self.on_change: Callable[[HostAddresses], None] | None = None
        self.closed = False

    def start(self, on_change: Callable[[HostAddresses], None]) -> None:
        if self.fail is not None:
            raise self.fail
        self.on_change = on_change
        on_change(self.first)

    def change(self, addresses: HostAddresses) -> None:
        assert self.on_change is not None
        self.on_change(addresses)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    objects: list[dict[str, Any]] = [
        NODE_OBJ, service("np", "10.96.0.10", type="NodePort", node_ports=[30080]),
    ]
    path.write_text(yaml.safe_dump_all(objects))
    return path


def make_agent(
    path: Path, config: ProxyConfig, backend: FakeBackend, edge: FakeAddresses
) -> Agent:
    config = replace(config, healthz_bind_address="", metrics_bind_address="",
                     min_sync_period=0.0)

    def source_factory(handler: ClusterEvents) -> WatchedFiles:
        return WatchedFiles(FileSource([path], handler, node_name=NODE, poll_interval=0.01))

    return Agent(config, backend=backend, source_factory=source_factory, host_addresses=edge)


def test_the_agent_programs_the_host_addresses_and_follows_changes(cluster_file: Path) -> None:
    backend, edge = FakeBackend(), FakeAddresses(HOST)
    agent = make_agent(cluster_file, RESTRICTED, backend, edge)
    agent.start()
    try:
        assert agent.synced.wait(5)
        assert nodeport_ips(backend) == ["10.0.0.1", "10.0.0.7"], "first sync: first reading"
        edge.change(HostAddresses(("10.0.0.1", "10.0.0.7", "10.0.0.8"), HOST.ipv6))
        wait_for(lambda: nodeport_ips(backend) == ["10.0.0.1", "10.0.0.7", "10.0.0.8"])
        edge.change(HostAddresses(("10.0.0.8",), HOST.ipv6))
        wait_for(lambda: nodeport_ips(backend) == ["10.0.0.8"])
    finally:
        agent.stop()
    assert edge.closed


def test_without_node_port_addresses_the_agent_reads_none(cluster_file: Path) -> None:
    backend, edge = FakeBackend(), FakeAddresses(HOST)
    agent = make_agent(cluster_file, ProxyConfig(node_name=NODE, table_name=TABLE), backend, edge)
    agent.start()
    try:
        assert agent.synced.wait(5)
    finally:
        agent.stop()
    assert edge.on_change is None, "the edge was started"
    assert not edge.closed


def test_an_edge_that_cannot_start_leaves_the_node_addresses(
    cluster_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FakeBackend()
    edge = FakeAddresses(HOST, fail=OSError("no netlink"))
    agent = make_agent(cluster_file, RESTRICTED, backend, edge)
    with caplog.at_level(logging.ERROR):
        agent.start()
        try:
            assert agent.synced.wait(5)
            assert nodeport_ips(backend) == ["10.0.0.1"], "the Node's address in the CIDR"
        finally:
            agent.stop()
    assert "no netlink" in caplog.text
