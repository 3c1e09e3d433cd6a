"""How a full sync in steps is cut (core/render.py `chunks`): sorted, whole
service ports, about `min_endpoints` endpoints each, never more than
MAX_CHUNKS chunks, both families' endpoints counted."""

from __future__ import annotations

import itertools

from builders import endpoint, service_port

from nftproxy.core.model import IPFamily, ServicePort
from nftproxy.core.render import MAX_CHUNKS, chunks
from nftproxy.core.tracker import StateSnapshot


def _state(family: IPFamily, ports: dict[ServicePort, int]) -> StateSnapshot:
    services = {p.name: p for p in ports}
    endpoints = {
        p.name: tuple(endpoint(f"10.{i}.0.{j + 1}") for j in range(n))
        for i, (p, n) in enumerate(ports.items())
    }
    return StateSnapshot(family, services, endpoints)


PORTS = {service_port(f"s{i:03}", cluster_ip=f"10.96.0.{i + 1}"): 3 for i in range(12)}


def test_chunks_are_sorted_whole_ports_of_about_min_endpoints() -> None:
    got = list(chunks([_state(IPFamily.IPV4, PORTS)], 7))
    assert [len(c) for c in got] == [3, 3, 3, 3]  # 9 endpoints reach 7
    assert sorted(p for c in got for p in c) == sorted(p.name for p in PORTS)
    flat = [sorted(c) for c in got]
    assert all(a[-1] < b[0] for a, b in itertools.pairwise(flat))


def test_a_port_without_endpoints_counts_one_and_families_add_up() -> None:
    empty = {service_port("lonely", cluster_ip="10.96.1.1"): 0}
    assert list(chunks([_state(IPFamily.IPV4, empty)], 1)) == [frozenset(p.name for p in empty)]
    both = [_state(IPFamily.IPV4, PORTS), _state(IPFamily.IPV6, PORTS)]
    assert [len(c) for c in chunks(both, 12)] == [2] * 6  # 3 + 3 endpoints per port


def test_never_more_than_max_chunks() -> None:
    many = {service_port(f"s{i:04}", cluster_ip=f"10.96.{i // 250}.{i % 250 + 1}"): 1
            for i in range(MAX_CHUNKS * 4)}
    got = list(chunks([_state(IPFamily.IPV4, many)], 1))
    assert len(got) == MAX_CHUNKS
    assert all(len(c) == 4 for c in got)


