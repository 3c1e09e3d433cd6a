"""Agent-level fuzzing (tests/fuzz_agent.py), a few batches in CI.

Aspects:
- the oracle (fuzz_faults.faults) names exactly the invalid fields convert
  reports, on a few hundred random objects of each kind;
- the Intake, fed the same random writes directly (as the watches would
  deliver them), reports each invalid field once: again only after its
  object lost it and got it back (fixed, deleted -- a Node too -- or hidden
  by a label and shown again), never for an update that kept it;
- what the fuzzer found, pinned: a Node change that arrives while a full
  sync is under way makes the next sync full too (it was lost: the first
  sync's commit cleared the request); an address two Services share (same
  verdict) is named after the owner that wins, after partial syncs too, so
  `dump` never names a deleted Service;
- a running agent fed random valid and invalid Services, EndpointSlices and
  Node updates through the fake API server: after every batch its kernel
  tables equal one full sync of the valid objects, nothing crashed, and every
  invalid field was reported once (`scripts/fuzz_agent.sh` runs it longer).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from feed import intake
from fuzz_agent import CONFIG, Oracle, fuzz
from fuzz_cluster import World, Write
from fuzz_faults import faults, visible
from k8s import endpoint_slice, node, service

from nftproxy.agent.intake import INVALID_FIELD, Intake, InvalidField, service_info
from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core import convert
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools.dump import parse_table


def _convert_fields(kind: str, obj: dict[str, object]) -> set[str]:
    if kind == "Service":
        problems = service_info(convert.service_name(obj), obj)[1]
    elif kind == "EndpointSlice":
        problems = tuple(convert.slice_info(obj, "node-a")[1])
    else:
        problems = tuple(convert.node_info(obj)[1])
    return {p.field for p in problems}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_oracle_names_what_convert_reports(seed: int) -> None:
    world = World(random.Random(seed), hc_ports=[32000 + i for i in range(4)])
    world.initial()
    checked = planted = 0
    for _ in range(400):
        write = world.step()
        if write.obj is None:
            continue
        found = faults(write.kind, write.obj)
        if found is None:
            continue
        assert {path for path, _ in found} == _convert_fields(write.kind, write.obj), write.what
        checked += 1
        planted += len(found)
    assert checked > 200 and planted > 100


@pytest.mark.kernel
def test_random_changes_keep_the_agent_equal_to_one_full_sync() -> None:
    h = fuzz(seed=20261124, batches=10, size=30, services=8)
    assert h.batches == 10
    assert len(h.reports) > 10, "the fuzzer planted too few invalid fields to mean anything"


class _Nowhere:
    """A ProxierEvents target that ignores everything."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


def _deliver(intake: Intake, write: Write, previous: dict[str, Any] | None) -> None:
    """`write` as the watches deliver it: an object leaving the selector is deleted."""
    current = write.obj if write.obj is not None and visible(write.kind, write.obj) else None
    if write.kind == "Node":
        intake.on_node(current)
    elif current is not None or previous is not None:
        handler = intake.on_service if write.kind == "Service" else intake.on_endpoint_slice
        handler(previous, current)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_the_intake_reports_each_invalid_field_once(seed: int) -> None:
    reports: list[InvalidField] = []
    intake = Intake(_Nowhere(), node_name="node-a", report=reports.append)
    world, oracle = World(random.Random(seed), hc_ports=[32000, 32001, 32002]), Oracle()
    last: dict[tuple[str, str], dict[str, Any]] = {}
    for write in [*world.initial(), *(world.step() for _ in range(3000))]:
        key = (write.kind, write.name)
        _deliver(intake, write, last.pop(key, None))
        if write.obj is not None and visible(write.kind, write.obj):
            last[key] = write.obj
        oracle.wrote(write)
    got = Counter((r.problem.kind, r.problem.obj, r.problem.field)
                  for r in reports if r.reason == INVALID_FIELD)  # not duplicate destinations
    assert got == oracle.owed
    assert sum(got.values()) > 100


class _EventDuringCommit(FakeBackend):
    """Runs `during` inside the next commit: an event arriving mid-sync."""

    during: Callable[[], None] | None = None

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        during, self.during = self.during, None
        if during is not None:
            during()
        super().commit(commands, fresh=fresh)


def test_a_node_change_during_a_full_sync_makes_the_next_sync_full() -> None:
    backend = _EventDuringCommit()
    backend.start()
    proxier = Proxier(CONFIG, backend)
    events = intake(proxier)
    events.on_node(node("node-a", ["192.168.50.1"]))
    # a node IP inside the source ranges lets the LB IP in (rules/service.py _firewall_elements)
    events.on_service(None, service("web", "10.96.0.10", type="LoadBalancer", node_ports=[30001],
                                    lb_ips=["1.2.3.4"], source_ranges=["192.168.50.0/24"]))
    events.on_endpoint_slice(None, endpoint_slice("web", ["10.244.0.2"]))
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)
    assert proxier.sync().full
    events.on_node(node("node-a", ["192.168.50.2"]))
    backend.during = lambda: events.on_node(None)  # deleted while that sync commits
    assert proxier.sync().full
    assert proxier.sync().full, "the deletion's full sync was lost"
    ranges = _sets(backend)["firewall-allow"]  # LB IP . proto . port . allowed range
    assert ranges == ["192.168.50.0/24"], "no node IP in the ranges now: no LB IP either"


def _sets(backend: FakeBackend) -> dict[str, list[str]]:
    """The IPv4 table's sets: their elements as text."""
    doc = backend.list_table("ip", CONFIG.table_name) or {"nftables": []}
    return {o["set"]["name"]: [_text(e) for e in o["set"].get("elem", [])]
            for o in doc["nftables"] if "set" in o}


def _text(elem: Any) -> str:
    """An element as text; of a concatenation, its last part (the range)."""
    if isinstance(elem, list):  # a map's element: its key
        return _text(elem[0])
    if isinstance(elem, dict) and "elem" in elem:
        return _text(elem["elem"]["val"])
    if isinstance(elem, dict) and "concat" in elem:
        return _text(elem["concat"][-1])
    if not isinstance(elem, dict):
        return str(elem)
    return f"{elem['prefix']['addr']}/{elem['prefix']['len']}" if "prefix" in elem else str(elem)


def _rejected_by(backend: FakeBackend) -> dict[str, str]:
    """The IPv4 no-endpoints entries, as `dump` names their service port."""
    doc = backend.list_table("ip", CONFIG.table_name)
    assert doc is not None
    view = parse_table(doc, family="ip", table=CONFIG.table_name)
    return {n.text(): s.service for s in view.services for n in s.no_endpoints}


def test_a_shared_address_is_named_after_its_live_owner() -> None:
    backend = FakeBackend()
    backend.start()
    proxier = Proxier(CONFIG, backend)
    events = intake(proxier)
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)
    b = service("b", "10.96.0.11", external_ips=["192.168.99.1"])  # no endpoints: reject
    events.on_service(None, b)
    assert proxier.sync().full
    events.on_service(None, service("a", "10.96.0.10", external_ips=["192.168.99.1"]))
    assert not proxier.sync().full
    assert _rejected_by(backend) == {  # the owner first by name wins the shared key
        "10.96.0.10:80": "ns/a:http", "10.96.0.11:80": "ns/b:http",
        "192.168.99.1:80": "ns/a:http"}  # fmt: skip
    events.on_service(b, None)
    assert not proxier.sync().full
    assert _rejected_by(backend) == {"10.96.0.10:80": "ns/a:http", "192.168.99.1:80": "ns/a:http"}
