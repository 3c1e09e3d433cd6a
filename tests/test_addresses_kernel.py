"""The host's interface addresses over rtnetlink (nftproxy.kernel.addresses),
in a throwaway namespace.

Aspects:
- a reading holds every address of the namespace, per family, sorted,
  loopback included, the local end of a point-to-point address;
- the watch hands on its first reading in start(), then a new reading after
  every address added or removed (IPv4 and IPv6), never one equal to the
  last (a lifetime change is an event, not a change);
- a missing namespace raises AddressesUnavailable and is never created;
  close() is idempotent and ends the watch thread;
- `nftproxy sync` (one-shot) with nodePortAddresses programs the host's
  address that the Node object does not list;
- the cost of a reading at 5, 100 and 1,000 addresses and the latency of an
  event (recorded, not asserted).
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kernel
import pytest
import yaml
from k8s import node, service

from nftproxy.core.model import HostAddresses
from nftproxy.kernel import netns as _netns
from nftproxy.kernel.addresses import AddressesUnavailable, AddressWatch, read_host_addresses
from nftproxy.tools import cli

pytestmark = pytest.mark.kernel

EVENT_TIMEOUT = 10.0  # generous: the machine is shared


def ip(ns: str, *args: str) -> None:
    _netns.exec_in(ns, ["ip", *args])


@pytest.fixture
def link(netns: str) -> str:
    """A veth pair in `netns`, left down (so no IPv6 link-local appears);
    addresses go on d0."""
    ip(netns, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
    return netns


def test_a_reading_holds_every_address_sorted(link: str) -> None:
    ip(link, "addr", "add", "192.0.2.1/24", "dev", "d0")
    ip(link, "addr", "add", "10.0.0.1", "peer", "10.0.0.2/32", "dev", "d0")
    ip(link, "addr", "add", "192.0.2.10/32", "dev", "d1")
    ip(link, "addr", "add", "fd00:9::1/64", "dev", "d0", "nodad")
    ip(link, "addr", "add", "2001:db8::1/64", "dev", "d0", "nodad")
    assert read_host_addresses(link) == HostAddresses(
        ("10.0.0.1", "127.0.0.1", "192.0.2.1", "192.0.2.10"),
        ("::1", "2001:db8::1", "fd00:9::1"),
    )


class Readings:
    """What the watch handed on, in order."""

    def __init__(self) -> None:
        self.all: list[HostAddresses] = []
        self.queue: queue.SimpleQueue[HostAddresses] = queue.SimpleQueue()

    def __call__(self, addresses: HostAddresses) -> None:
        self.all.append(addresses)
        self.queue.put(addresses)

    def next(self) -> HostAddresses:
        return self.queue.get(timeout=EVENT_TIMEOUT)


@pytest.fixture
def watched(link: str) -> Iterator[tuple[str, Readings]]:
    readings = Readings()
    watch = AddressWatch(netns=link)
    watch.start(readings)
    try:
        yield link, readings
    finally:
        watch.close()


def test_the_watch_hands_on_the_first_reading_then_every_change(
    watched: tuple[str, Readings],
) -> None:
    ns, readings = watched
    assert readings.all == [HostAddresses(("127.0.0.1",), ("::1",))], "start() hands one on"
    ip(ns, "addr", "add", "192.0.2.7/32", "dev", "d0")
    assert readings.next() == HostAddresses(("127.0.0.1",), ("::1",))  # the first, queued
    assert readings.next().ipv4 == ("127.0.0.1", "192.0.2.7")
    ip(ns, "addr", "add", "fd00:9::7/128", "dev", "d0", "nodad")
    assert readings.next().ipv6 == ("::1", "fd00:9::7")
    ip(ns, "addr", "del", "192.0.2.7/32", "dev", "d0")
    assert readings.next() == HostAddresses(("127.0.0.1",), ("::1", "fd00:9::7"))


def test_an_event_without_a_change_is_not_handed_on(watched: tuple[str, Readings]) -> None:
    ns, readings = watched
    ip(ns, "addr", "add", "fd00:9::7/128", "dev", "d0", "nodad")
    readings.next()
    readings.next()
    ip(ns, "addr", "change", "fd00:9::7/128", "dev", "d0", "preferred_lft", "0")
    ip(ns, "addr", "add", "192.0.2.8/32", "dev", "d0")  # a marker after the non-change
    assert readings.next().ipv4 == ("127.0.0.1", "192.0.2.8")
    assert all(a != b for a, b in zip(readings.all, readings.all[1:], strict=False))


def test_a_missing_namespace_raises_and_is_never_created() -> None:
    name = kernel.unique_name()
    with pytest.raises(AddressesUnavailable):
        read_host_addresses(name)
    watch = AddressWatch(netns=name)
    with pytest.raises(AddressesUnavailable):
        watch.start(lambda _: None)
    watch.close()
    assert not _netns.exists(name)


def test_close_ends_the_watch_thread_and_is_idempotent(link: str) -> None:
    before = {t.name for t in threading.enumerate()}
    watch = AddressWatch(netns=link)
    watch.start(lambda _: None)
    assert "addresses-watch" in {t.name for t in threading.enumerate()}
    watch.close()
    watch.close()
    assert {t.name for t in threading.enumerate()} <= before


def test_sync_once_programs_a_host_address_the_node_does_not_list(
    link: str, tmp_path: Path
) -> None:
    ip(link, "addr", "add", "192.0.2.1/24", "dev", "d0")
    ip(link, "addr", "add", "192.0.2.99/32", "dev", "d0")  # not in the Node object
    source = tmp_path / "cluster.yaml"
    source.write_text(yaml.safe_dump_all([
        node("node-a", ["192.0.2.1"]),
        service("np", "10.96.0.10", type="NodePort", node_ports=[30080]),
    ]))
    argv = ["sync", "--source", str(source), "--node-name", "node-a",
            "--nodeport-addresses", "192.0.2.0/24", "--table-name", "nftpxaddr"]
    assert _netns.run_in(link, cli.main, argv) == 0
    listed = kernel.nft(link, "list", "set", "ip", "nftpxaddr", "nodeport-ips")
    assert "192.0.2.1" in listed and "192.0.2.99" in listed, listed


# ---- cost ---------------------------------------------------------------------------------


def _fill(ns: str, size: int) -> None:
    lines = [f"addr add 10.{i // 250}.{i % 250}.1/32 dev d0\n" for i in range(size)]
    _netns.exec_in(ns, ["ip", "-batch", "-"], input="".join(lines))


def _one_shot_ms(ns: str, runs: int) -> float:
    """read_host_addresses: thread, namespace, socket and the reading."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        read_host_addresses(ns)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def _event_latency_ms(ns: str, count: int) -> float:
    """Median time from an address added to the new reading handed on."""
    got: queue.SimpleQueue[float] = queue.SimpleQueue()
    watch = AddressWatch(netns=ns)
    watch.start(lambda _: got.put(time.perf_counter()))
    got.get()

    def add(i: int) -> float:
        from pyroute2.iproute import IPRoute

        with IPRoute() as ipr:
            index = ipr.link_lookup(ifname="d0")[0]
            start = time.perf_counter()
            ipr.addr("add", index=index, address=f"192.0.2.{i}", prefixlen=32)
        return got.get(timeout=EVENT_TIMEOUT) - start

    try:
        latencies = [_netns.run_in(ns, add, i) for i in range(1, count + 1)]
    finally:
        watch.close()
    return round(statistics.median(latencies) * 1e3, 2)


def test_costs_of_reading_and_of_events(
    link: str, record_property: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Recorded, not asserted: the numbers in addresses.py. An event costs
    one full reading, so its latency grows with the number of addresses."""
    numbers: dict[str, float] = {}
    for size in (5, 100, 1000):
        _netns.exec_in(link, ["ip", "addr", "flush", "dev", "d0"])
        _fill(link, size)
        numbers[f"one_shot_read_{size}_addresses_ms"] = _one_shot_ms(link, 7)
        numbers[f"event_to_reading_{size}_addresses_ms"] = _event_latency_ms(link, 7)
    for key, value in numbers.items():
        record_property(key, value)
    with capsys.disabled():
        print(f"\ninterface address costs: {numbers}")
