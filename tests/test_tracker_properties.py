"""Properties of change tracking, over random event histories.

The informer contract: every event's `previous` is the object last delivered
for that key. Whatever the order of events and wherever the syncs fall, the
maps must end up as if the final objects had been listed once, and each sync
must report exactly the service ports whose value changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from random import Random
from typing import Any

from feed import update_service, update_slice
from hypothesis import given, settings
from hypothesis import strategies as st

from nftproxy.core.model import Endpoint, IPFamily, ServicePort, ServicePortName
from nftproxy.core.tracker import ProxyState, UpdateResult

NODE = "node-a"
NAMESPACE = "ns"
SERVICES = ("web", "api")
SLICES = ("s1", "s2", "s3")
PORTS = (("http", 80, "TCP"), ("dns", 53, "UDP"), ("", 8080, "TCP"))
IPV4 = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
IPV6 = ("fd00::1", "fd00::2")
Obj = dict[str, Any]


# ---------------------------------------------------------------- strategies


@st.composite
def services(draw: st.DrawFn, name: str) -> Obj:
    ports = draw(st.lists(st.sampled_from(PORTS), unique=True, max_size=3))
    families = draw(st.sampled_from([("10.96.0.1",), ("fd00:96::1",), ("10.96.0.1", "fd00:96::1")]))
    spec: Obj = {
        "type": draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"])),
        "clusterIPs": list(families),
        "ports": [
            {"name": n, "port": p + draw(st.integers(0, 1)), "protocol": proto}
            for n, p, proto in ports
        ],
        "externalTrafficPolicy": draw(st.sampled_from(["Cluster", "Local"])),
        "internalTrafficPolicy": draw(st.sampled_from(["Cluster", "Local"])),
        "healthCheckNodePort": 32000,
    }
    return {"kind": "Service", "metadata": {"namespace": NAMESPACE, "name": name}, "spec": spec}


@st.composite
def endpoints(draw: st.DrawFn, ips: tuple[str, ...]) -> Obj:
    ready = draw(st.booleans())
    entry: Obj = {
        "addresses": [draw(st.sampled_from(ips))],
        "conditions": {
            "ready": ready,
            "serving": draw(st.booleans()) if not ready else True,
            "terminating": draw(st.booleans()) if not ready else False,
        },
        "nodeName": draw(st.sampled_from([NODE, "node-b"])),
    }
    if draw(st.booleans()):
        entry["hints"] = {"forZones": [{"name": "zone-a"}]}
    return entry


@st.composite
def slices(draw: st.DrawFn, name: str, family: IPFamily) -> Obj:
    """Mostly of the state's family (the other family's must be ignored), with
    few addresses and ports so that slices overlap and endpoints recur."""
    other = IPFamily.IPV6 if family is IPFamily.IPV4 else IPFamily.IPV4
    address_type = draw(st.sampled_from([family, family, family, other])).value
    ips = IPV4 if address_type == "IPv4" else IPV6
    ports = draw(st.just([PORTS[0]]) | st.lists(st.sampled_from(PORTS), unique=True, max_size=2))
    meta: Obj = {
        "namespace": NAMESPACE,
        "name": name,
        "labels": {
            "kubernetes.io/service-name": draw(st.sampled_from(["web", "web", "web", "api"]))
        },
    }
    if draw(st.booleans()):
        second = draw(st.integers(0, 59))
        meta["annotations"] = {
            "endpoints.kubernetes.io/last-change-trigger-time": f"2024-01-01T00:00:{second:02d}Z"
        }
    return {
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": address_type,
        "ports": [{"name": n, "port": p + 1000, "protocol": proto} for n, p, proto in ports],
        "endpoints": draw(st.lists(endpoints(ips), max_size=4)),
    }


@dataclass(frozen=True)
class Step:
    """Set the object of one key (None: delete it); or, with key None, sync."""

    key: tuple[str, str] | None
    obj: Obj | None = None


@st.composite
def steps(draw: st.DrawFn, family: IPFamily) -> Step:
    choice = draw(st.integers(0, 9))
    deleted = draw(st.integers(0, 5)) == 0
    if choice <= 1:
        return Step(None)
    if choice <= 2:
        name = draw(st.sampled_from(SERVICES))
        return Step(("svc", name), None if deleted else draw(services(name)))
    name = draw(st.sampled_from(SLICES))
    return Step(("eps", name), None if deleted else draw(slices(name, family)))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[IPFamily, list[Step]]:
    """A family and a history of events (with syncs) for a state of that family."""
    family = draw(st.sampled_from([IPFamily.IPV4, IPFamily.IPV6]))
    return family, draw(st.lists(steps(family), max_size=40))


# ------------------------------------------------------------------- helpers


def deliver(
    state: ProxyState, key: tuple[str, str], previous: Obj | None, current: Obj | None
) -> None:
    if key[0] == "svc":
        update_service(state.service_tracker, previous, current)
    else:
        update_slice(state.endpoint_tracker, previous, current, NODE)


@dataclass(frozen=True)
class Snapshot:
    services: dict[ServicePortName, ServicePort]
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]]

    @staticmethod
    def of(state: ProxyState) -> Snapshot:
        return Snapshot(dict(state.services), dict(state.endpoints))

    def changed_since(self, old: Snapshot) -> set[ServicePortName]:
        keys = (
            self.services.keys()
            | old.services.keys()
            | self.endpoints.keys()
            | old.endpoints.keys()
        )
        return {
            k
            for k in keys
            if self.services.get(k) != old.services.get(k)
            or self.endpoints.get(k) != old.endpoints.get(k)
        }


def check_result(result: UpdateResult, old: Snapshot, new: Snapshot) -> None:
    """Every part of the result follows from the two snapshots."""
    assert set(result.updated) == new.changed_since(old)
    assert {p.name for p in result.deleted_ports} == old.services.keys() - new.services.keys()
    for spn in old.endpoints.keys() | new.endpoints.keys():
        before, after = old.endpoints.get(spn, ()), new.endpoints.get(spn, ())
        serving_after = {(e.ip, e.port): e.serving for e in after}
        expected_stale = tuple(
            e
            for e in before
            if (e.ip, e.port) not in serving_after
            or (e.serving and not serving_after[(e.ip, e.port)])
        )
        assert result.stale_endpoints.get(spn, ()) == expected_stale
        usable_before = any(e.ready or e.serving for e in before)
        usable_after = any(e.ready or e.serving for e in after)
        assert (spn in result.newly_active) == (not usable_before and usable_after)
    assert {spn.service for spn in new.changed_since(old)} >= set(result.trigger_times)


def listed_once(
    family: IPFamily, objects: Mapping[tuple[str, str], Obj], rng: Random
) -> ProxyState:
    """A fresh state fed the objects as adds, in an arbitrary order (a list
    has no meaningful order), and synced once."""
    fresh = ProxyState(family)
    items = list(objects.items())
    rng.shuffle(items)
    for key, obj in items:
        deliver(fresh, key, None, obj)
    fresh.apply()
    return fresh


# ---------------------------------------------------------------- properties


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(), rng=st.randoms(use_true_random=False))
def test_any_history_ends_as_if_the_final_objects_were_listed_once(
    scenario: tuple[IPFamily, list[Step]], rng: Random
) -> None:
    family, history = scenario
    state = ProxyState(family)
    objects: dict[tuple[str, str], Obj] = {}
    snapshot = Snapshot.of(state)
    for step in [*history, Step(None)]:
        if step.key is None:
            result = state.apply()
            new = Snapshot.of(state)
            check_result(result, snapshot, new)
            assert (state.pending_service_changes, state.pending_endpoint_changes) == (0, 0)
            snapshot = new
            continue
        previous = objects.pop(step.key, None)
        if step.obj is not None:
            objects[step.key] = step.obj
        if previous is not None or step.obj is not None:
            deliver(state, step.key, previous, step.obj)

    fresh = listed_once(family, objects, rng)
    assert dict(state.services) == dict(fresh.services)
    assert dict(state.endpoints) == dict(fresh.endpoints)
    assert state.health_check_ports() == fresh.health_check_ports()
    assert state.local_ready_endpoints() == fresh.local_ready_endpoints()


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios())
def test_resyncs_change_nothing(scenario: tuple[IPFamily, list[Step]]) -> None:
    family, history = scenario
    state = ProxyState(family)
    objects: dict[tuple[str, str], Obj] = {}
    for step in history:
        if step.key is None:
            continue
        previous = objects.pop(step.key, None)
        if step.obj is not None:
            objects[step.key] = step.obj
        if previous is not None or step.obj is not None:
            deliver(state, step.key, previous, step.obj)
    state.apply()
    for key, obj in objects.items():
        deliver(state, key, obj, obj)
    assert (state.pending_service_changes, state.pending_endpoint_changes) == (0, 0)
    assert state.apply() == UpdateResult()


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios())
def test_endpoint_tuples_are_sorted_unique_and_non_empty(
    scenario: tuple[IPFamily, list[Step]],
) -> None:
    family, history = scenario
    state = ProxyState(family)
    objects: dict[tuple[str, str], Obj] = {}
    for step in history:
        if step.key is None:
            state.apply()
            continue
        previous = objects.pop(step.key, None)
        if step.obj is not None:
            objects[step.key] = step.obj
        if previous is not None or step.obj is not None:
            deliver(state, step.key, previous, step.obj)
    state.apply()
    for eps in state.endpoints.values():
        assert eps
        assert list(eps) == sorted(eps)
        assert len({(e.ip, e.port) for e in eps}) == len(eps)
