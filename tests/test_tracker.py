"""Change tracking: what one sync learns from the Service and EndpointSlice
events since the last one (kube-proxy's ServiceChangeTracker,
EndpointsChangeTracker and EndpointSliceCache).

Objects are the API's own JSON (camelCase), built by the small builders
below. Expectations name service ports as kube-proxy prints them
("ns/web:http") and endpoints as "ip:port".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest
from feed import update_service, update_slice

from nftproxy.agent.intake import service_info
from nftproxy.core import convert
from nftproxy.core.model import Endpoint, IPFamily, L4Protocol, NamespacedName, ServicePortName
from nftproxy.core.tracker import (
    KIND_ENDPOINT_SLICES,
    KIND_SERVICES,
    ProxyState,
    SyncGate,
    UpdateResult,
)

NODE = "node-a"
Obj = dict[str, Any]
PortSpec = tuple[str, int, str]  # (name, port, protocol)


# ------------------------------------------------------------------ builders


def service(
    name: str,
    *,
    ns: str = "ns",
    ports: Sequence[PortSpec] = (("http", 80, "TCP"),),
    cluster_ips: Sequence[str] = ("10.96.0.10",),
    type_: str = "ClusterIP",
    etp: str | None = None,
    health_check_node_port: int | None = None,
) -> Obj:
    spec: Obj = {
        "type": type_,
        "clusterIP": cluster_ips[0] if cluster_ips else "",
        "clusterIPs": list(cluster_ips),
        "ports": [
            {"name": n, "port": p, "protocol": proto, "targetPort": p} for n, p, proto in ports
        ],
    }
    if type_ in ("NodePort", "LoadBalancer"):
        for i, port in enumerate(spec["ports"]):
            port["nodePort"] = 30000 + i
    if etp is not None:
        spec["externalTrafficPolicy"] = etp
    if health_check_node_port is not None:
        spec["healthCheckNodePort"] = health_check_node_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": ns, "name": name},
        "spec": spec,
    }


def endpoint(
    ip: str,
    *,
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
    node: str = "node-b",
) -> Obj:
    return {
        "addresses": [ip],
        "conditions": {
            "ready": ready,
            "serving": ready if serving is None else serving,
            "terminating": terminating,
        },
        "nodeName": node,
    }


def eps_slice(
    name: str,
    svc: str,
    endpoints: Sequence[Obj | str],
    *,
    ns: str = "ns",
    family: str = "IPv4",
    ports: Sequence[PortSpec] = (("http", 8080, "TCP"),),
    trigger: str | None = None,
) -> Obj:
    meta: Obj = {
        "namespace": ns,
        "name": name,
        "labels": {"kubernetes.io/service-name": svc},
    }
    if trigger is not None:
        meta["annotations"] = {"endpoints.kubernetes.io/last-change-trigger-time": trigger}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": family,
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
        "endpoints": [endpoint(e) if isinstance(e, str) else e for e in endpoints],
    }


# -------------------------------------------------------------- event steps


@dataclass(frozen=True)
class Event:
    kind: str  # "svc" or "eps"
    previous: Obj | None
    current: Obj | None


def add(obj: Obj) -> Event:
    return Event(_kind(obj), None, obj)


def update(previous: Obj, current: Obj) -> Event:
    return Event(_kind(current), previous, current)


def delete(obj: Obj) -> Event:
    return Event(_kind(obj), obj, None)


def _kind(obj: Obj) -> str:
    return "svc" if obj["kind"] == "Service" else "eps"


def feed(state: ProxyState, events: Sequence[Event]) -> None:
    for event in events:
        if event.kind == "svc":
            update_service(state.service_tracker, event.previous, event.current)
        else:
            update_slice(state.endpoint_tracker, event.previous, event.current, NODE)


def sync(state: ProxyState, events: Sequence[Event]) -> UpdateResult:
    feed(state, events)
    return state.apply()


def names(ports: Any) -> set[str]:
    return {str(p) for p in ports}


def addresses(endpoints: Mapping[ServicePortName, tuple[Endpoint, ...]]) -> dict[str, list[str]]:
    return {str(spn): [ep.address for ep in eps] for spn, eps in endpoints.items()}


def spn(text: str, protocol: str = "TCP") -> ServicePortName:
    base, _, port = text.partition(":")
    namespace, name = base.split("/")
    return ServicePortName(namespace, name, port, L4Protocol(protocol))


# ------------------------------------------------------------------ services

WEB = service("web", ports=(("http", 80, "TCP"), ("https", 443, "TCP")))
WEB_HTTP_8080 = service("web", ports=(("http", 8080, "TCP"), ("https", 443, "TCP")))
WEB_RENAMED = service("web", ports=(("www", 80, "TCP"), ("https", 443, "TCP")))
WEB_EXTERNAL_NAME = {**WEB, "spec": {**WEB["spec"], "type": "ExternalName"}}
HEADLESS = service("headless", cluster_ips=("None",))


@dataclass(frozen=True)
class ServiceCase:
    id: str
    before: tuple[Event, ...]
    events: tuple[Event, ...]
    updated: set[str]
    deleted: set[str] = field(default_factory=set)
    services: set[str] = field(default_factory=lambda: {"ns/web:http", "ns/web:https"})
    changes: int = 1


SERVICE_CASES = [
    ServiceCase(
        "adding a service adds each of its ports",
        before=(),
        events=(add(WEB),),
        updated={"ns/web:http", "ns/web:https"},
    ),
    ServiceCase(
        "changing one port's number re-renders only that port",
        before=(add(WEB),),
        events=(update(WEB, WEB_HTTP_8080),),
        updated={"ns/web:http"},
    ),
    ServiceCase(
        "deleting a service deletes all its ports",
        before=(add(WEB),),
        events=(delete(WEB),),
        updated={"ns/web:http", "ns/web:https"},
        deleted={"ns/web:http", "ns/web:https"},
        services=set(),
    ),
    ServiceCase(
        "adding then deleting before a sync changes nothing at all",
        before=(),
        events=(add(WEB), delete(WEB)),
        updated=set(),
        services=set(),
        changes=0,
    ),
    ServiceCase(
        "updating A to B and back to A before a sync is a no-op",
        before=(add(WEB),),
        events=(update(WEB, WEB_HTTP_8080), update(WEB_HTTP_8080, WEB)),
        updated=set(),
        changes=0,
    ),
    ServiceCase(
        "deleting then re-adding the same service before a sync is a no-op",
        before=(add(WEB),),
        events=(delete(WEB), add(WEB)),
        updated=set(),
        changes=0,
    ),
    ServiceCase(
        "deleting then re-adding with another port number keeps the port, re-rendered",
        before=(add(WEB),),
        events=(delete(WEB), add(WEB_HTTP_8080)),
        updated={"ns/web:http"},
    ),
    ServiceCase(
        "an informer resync of an unchanged service is a no-op",
        before=(add(WEB),),
        events=(update(WEB, WEB),),
        updated=set(),
        changes=0,
    ),
    ServiceCase(
        "renaming a port deletes the old name and adds the new one",
        before=(add(WEB),),
        events=(update(WEB, WEB_RENAMED),),
        updated={"ns/web:http", "ns/web:www"},
        deleted={"ns/web:http"},
        services={"ns/web:www", "ns/web:https"},
    ),
    ServiceCase(
        "turning a service into ExternalName deletes its ports",
        before=(add(WEB),),
        events=(update(WEB, WEB_EXTERNAL_NAME),),
        updated={"ns/web:http", "ns/web:https"},
        deleted={"ns/web:http", "ns/web:https"},
        services=set(),
    ),
    ServiceCase(
        "a headless service has no ports to proxy",
        before=(add(WEB),),
        events=(add(HEADLESS),),
        updated=set(),
        changes=0,
    ),
]


@pytest.mark.parametrize("case", SERVICE_CASES, ids=[c.id for c in SERVICE_CASES])
def test_service_changes(case: ServiceCase) -> None:
    state = ProxyState(IPFamily.IPV4)
    sync(state, case.before)
    feed(state, case.events)
    assert state.pending_service_changes == case.changes
    result = state.apply()
    assert names(result.updated) == case.updated
    assert names(p.name for p in result.deleted_ports) == case.deleted
    assert names(state.services) == case.services
    assert result.service_changes == case.changes
    assert state.pending_service_changes == 0


def test_service_ports_carry_the_converted_values() -> None:
    state = ProxyState(IPFamily.IPV4)
    sync(state, [add(WEB)])
    sync(state, [update(WEB, WEB_HTTP_8080)])
    port = state.services[spn("ns/web:http")]
    assert (port.cluster_ip, port.port) == ("10.96.0.10", 8080)


def test_dual_stack_service_yields_one_port_per_family() -> None:
    dual = service("web", cluster_ips=("10.96.0.10", "fd00::10"))
    v4 = ProxyState(IPFamily.IPV4)
    v6 = ProxyState(IPFamily.IPV6)
    for state in (v4, v6):
        assert names(sync(state, [add(dual)]).updated) == {"ns/web:http"}
    assert v4.services[spn("ns/web:http")].cluster_ip == "10.96.0.10"
    assert v6.services[spn("ns/web:http")].cluster_ip == "fd00::10"


def test_single_stack_service_is_invisible_to_the_other_family() -> None:
    v6 = ProxyState(IPFamily.IPV6)
    assert not update_service(v6.service_tracker, None, WEB)
    assert sync(v6, []) == UpdateResult()
    assert dict(v6.services) == {}


def test_dropping_a_family_deletes_that_family_s_ports_only() -> None:
    dual = service("web", cluster_ips=("10.96.0.10", "fd00::10"))
    v4_only = service("web", cluster_ips=("10.96.0.10",))
    v4, v6 = ProxyState(IPFamily.IPV4), ProxyState(IPFamily.IPV6)
    for state in (v4, v6):
        sync(state, [add(dual)])
    assert sync(v4, [update(dual, v4_only)]).deleted_ports == ()
    assert names(p.name for p in sync(v6, [update(dual, v4_only)]).deleted_ports) == {"ns/web:http"}


def test_update_reports_whether_a_change_is_pending() -> None:
    tracker = ProxyState(IPFamily.IPV4).service_tracker
    assert update_service(tracker, None, WEB)
    assert update_service(tracker, WEB, WEB_HTTP_8080)
    assert not update_service(tracker, WEB_HTTP_8080, None)
    assert tracker.pending == 0


def test_service_problems_are_reported_when_the_event_arrives() -> None:
    bad = service("web", ports=(("http", 80, "TCP"), ("big", 70000, "TCP")))
    state = ProxyState(IPFamily.IPV4)
    _, problems = service_info(NamespacedName("ns", "web"), bad)
    assert [(p.kind, p.obj, p.field) for p in problems] == [
        ("Service", "ns/web", "spec.ports[1].port")
    ]
    feed(state, [add(bad)])
    state.apply()
    assert names(state.services) == {"ns/web:http"}


def test_objects_without_usable_metadata_are_ignored() -> None:
    state = ProxyState(IPFamily.IPV4)
    nameless: Obj = {"kind": "Service", "metadata": {"namespace": "ns"}, "spec": {}}
    assert not update_service(state.service_tracker, None, nameless)
    assert not update_slice(state.endpoint_tracker, None, {"kind": "EndpointSlice"}, NODE)
    assert not update_service(state.service_tracker, None, None)
    assert state.apply() == UpdateResult()


# ----------------------------------------------------------------- endpoints

S1 = eps_slice("web-1", "web", ["10.0.1.1", "10.0.1.2"])
S1_SCALED_UP = eps_slice("web-1", "web", ["10.0.1.1", "10.0.1.2", "10.0.1.3"])
S1_SCALED_DOWN = eps_slice("web-1", "web", ["10.0.1.1"])
S1_EMPTY = eps_slice("web-1", "web", [])
S2_OVERLAP = eps_slice("web-2", "web", ["10.0.1.2", "10.0.1.3"])
S2_DUPLICATE = eps_slice("web-2", "web", ["10.0.1.2"])
S1_DRAINING = eps_slice(
    "web-1",
    "web",
    ["10.0.1.1", endpoint("10.0.1.2", ready=False, serving=True, terminating=True)],
)
S1_GONE_DARK = eps_slice(
    "web-1",
    "web",
    ["10.0.1.1", endpoint("10.0.1.2", ready=False, serving=False, terminating=True)],
)
S1_UNREADY = eps_slice("web-1", "web", [endpoint("10.0.1.1", ready=False)])
S1_READY = eps_slice("web-1", "web", ["10.0.1.1"])
S1_FOR_API = eps_slice("web-1", "api", ["10.0.1.1", "10.0.1.2"])
S1_IPV6 = eps_slice("web-1", "web", ["fd00::1"], family="IPv6")
S1_FQDN = eps_slice("web-1", "web", ["example.com"], family="FQDN")
S1_UNLABELLED = {**S1, "metadata": {"namespace": "ns", "name": "web-1"}}
S1_TWO_PORTS = eps_slice(
    "web-1", "web", ["10.0.1.1"], ports=(("http", 8080, "TCP"), ("dns", 53, "UDP"))
)

BOTH = ["10.0.1.1:8080", "10.0.1.2:8080"]


@dataclass(frozen=True)
class EndpointCase:
    id: str
    before: tuple[Event, ...]
    events: tuple[Event, ...]
    updated: set[str]
    endpoints: dict[str, list[str]]
    stale: dict[str, list[str]] = field(default_factory=dict)
    newly_active: set[str] = field(default_factory=set)
    changes: int = 1


ENDPOINT_CASES = [
    EndpointCase(
        "adding a slice adds its endpoints and activates the port",
        before=(),
        events=(add(S1),),
        updated={"ns/web:http"},
        endpoints={"ns/web:http": BOTH},
        newly_active={"ns/web:http"},
    ),
    EndpointCase(
        "scaling up adds endpoints, nothing goes stale",
        before=(add(S1),),
        events=(update(S1, S1_SCALED_UP),),
        updated={"ns/web:http"},
        endpoints={"ns/web:http": [*BOTH, "10.0.1.3:8080"]},
    ),
    EndpointCase(
        "scaling down makes the removed endpoint stale",
        before=(add(S1),),
        events=(update(S1, S1_SCALED_DOWN),),
        updated={"ns/web:http"},
        endpoints={"ns/web:http": ["10.0.1.1:8080"]},
        stale={"ns/web:http": ["10.0.1.2:8080"]},
    ),
    EndpointCase(
        "deleting the last slice removes the port and makes every endpoint stale",
        before=(add(S1),),
        events=(delete(S1),),
        updated={"ns/web:http"},
        endpoints={},
        stale={"ns/web:http": BOTH},
    ),
    EndpointCase(
        "a slice emptied to no endpoints removes the port",
        before=(add(S1),),
        events=(update(S1, S1_EMPTY),),
        updated={"ns/web:http"},
        endpoints={},
        stale={"ns/web:http": BOTH},
    ),
    EndpointCase(
        "endpoints split across two slices are merged, a duplicate listed once",
        before=(),
        events=(add(S1), add(S2_OVERLAP)),
        updated={"ns/web:http"},
        endpoints={"ns/web:http": [*BOTH, "10.0.1.3:8080"]},
        newly_active={"ns/web:http"},
        changes=2,
    ),
    EndpointCase(
        "removing a slice whose endpoints another slice still lists changes nothing",
        before=(add(S1), add(S2_DUPLICATE)),
        events=(delete(S2_DUPLICATE),),
        updated=set(),
        endpoints={"ns/web:http": BOTH},
    ),
    EndpointCase(
        "an endpoint turning serving-terminating is re-rendered but not stale",
        before=(add(S1),),
        events=(update(S1, S1_DRAINING),),
        updated={"ns/web:http"},
        endpoints={"ns/web:http": BOTH},
    ),
    EndpointCase(
        "an endpoint that stops serving is stale though still listed",
        before=(add(S1),),
        events=(update(S1, S1_GONE_DARK),),
        updated={"ns/web:http"},
        endpoints={"ns/web:http": BOTH},
        stale={"ns/web:http": ["10.0.1.2:8080"]},
    ),
    EndpointCase(
        "a port whose only endpoint turns ready becomes newly active",
        before=(add(S1_UNREADY),),
        events=(update(S1_UNREADY, S1_READY),),
        updated={"ns/web:http"},
        endpoints={"ns/web:http": ["10.0.1.1:8080"]},
        newly_active={"ns/web:http"},
    ),
    EndpointCase(
        "a port with only unready endpoints is listed but not active",
        before=(),
        events=(add(S1_UNREADY),),
        updated={"ns/web:http"},
        endpoints={"ns/web:http": ["10.0.1.1:8080"]},
    ),
    EndpointCase(
        "a slice moved to another service leaves the old one and joins the new one",
        before=(add(S1),),
        events=(update(S1, S1_FOR_API),),
        updated={"ns/web:http", "ns/api:http"},
        endpoints={"ns/api:http": BOTH},
        stale={"ns/web:http": BOTH},
        newly_active={"ns/api:http"},
        changes=2,
    ),
    EndpointCase(
        "a slice moved away and back before a sync is a no-op",
        before=(add(S1),),
        events=(update(S1, S1_FOR_API), update(S1_FOR_API, S1)),
        updated=set(),
        endpoints={"ns/web:http": BOTH},
        changes=0,
    ),
    EndpointCase(
        "a slice that changes family leaves this family's map",
        before=(add(S1),),
        events=(update(S1, S1_IPV6),),
        updated={"ns/web:http"},
        endpoints={},
        stale={"ns/web:http": BOTH},
    ),
    EndpointCase(
        "a slice losing its service-name label leaves the service",
        before=(add(S1),),
        events=(update(S1, S1_UNLABELLED),),
        updated={"ns/web:http"},
        endpoints={},
        stale={"ns/web:http": BOTH},
    ),
    EndpointCase(
        "a slice of the other family is ignored",
        before=(),
        events=(add(S1_IPV6),),
        updated=set(),
        endpoints={},
        changes=0,
    ),
    EndpointCase(
        "an FQDN slice is ignored",
        before=(),
        events=(add(S1_FQDN),),
        updated=set(),
        endpoints={},
        changes=0,
    ),
    EndpointCase(
        "adding then deleting a slice before a sync changes nothing at all",
        before=(),
        events=(add(S1), delete(S1)),
        updated=set(),
        endpoints={},
        changes=0,
    ),
    EndpointCase(
        "scaling up and back down before a sync is a no-op",
        before=(add(S1),),
        events=(update(S1, S1_SCALED_UP), update(S1_SCALED_UP, S1)),
        updated=set(),
        endpoints={"ns/web:http": BOTH},
        changes=0,
    ),
    EndpointCase(
        "deleting then re-adding the same slice before a sync is a no-op",
        before=(add(S1),),
        events=(delete(S1), add(S1)),
        updated=set(),
        endpoints={"ns/web:http": BOTH},
        changes=0,
    ),
    EndpointCase(
        "a slice port added re-renders only the new port",
        before=(add(S1_READY),),
        events=(update(S1_READY, S1_TWO_PORTS),),
        updated={"ns/web:dns"},
        endpoints={"ns/web:http": ["10.0.1.1:8080"], "ns/web:dns": ["10.0.1.1:53"]},
        newly_active={"ns/web:dns"},
    ),
]


@pytest.mark.parametrize("case", ENDPOINT_CASES, ids=[c.id for c in ENDPOINT_CASES])
def test_endpoint_changes(case: EndpointCase) -> None:
    state = ProxyState(IPFamily.IPV4)
    sync(state, case.before)
    feed(state, case.events)
    assert state.pending_endpoint_changes == case.changes
    result = state.apply()
    assert names(result.updated) == case.updated
    assert addresses(state.endpoints) == case.endpoints
    assert addresses(result.stale_endpoints) == case.stale
    assert names(result.newly_active) == case.newly_active
    assert result.endpoint_changes == case.changes
    assert state.pending_endpoint_changes == 0


def test_ipv6_slices_feed_the_ipv6_state() -> None:
    state = ProxyState(IPFamily.IPV6)
    sync(state, [add(S1), add(S1_IPV6)])
    assert addresses(state.endpoints) == {"ns/web:http": ["[fd00::1]:8080"]}


def test_a_local_copy_of_a_duplicate_endpoint_wins() -> None:
    remote = eps_slice("web-1", "web", [endpoint("10.0.1.2", node="node-b")])
    local = eps_slice("web-2", "web", [endpoint("10.0.1.2", node=NODE)])
    for first, second in ((remote, local), (local, remote)):
        state = ProxyState(IPFamily.IPV4)
        sync(state, [add(first), add(second)])
        (only,) = state.endpoints[spn("ns/web:http")]
        assert only.is_local


def test_duplicates_across_slices_resolve_by_slice_name_not_arrival() -> None:
    ready = eps_slice("web-1", "web", ["10.0.1.2"])
    unready = eps_slice("web-2", "web", [endpoint("10.0.1.2", ready=False)])
    for first, second in ((ready, unready), (unready, ready)):
        state = ProxyState(IPFamily.IPV4)
        sync(state, [add(first)])
        sync(state, [add(second)])
        (only,) = state.endpoints[spn("ns/web:http")]
        assert only.ready, "web-1 sorts first, so its copy wins"


def test_endpoint_conditions_are_kept() -> None:
    state = ProxyState(IPFamily.IPV4)
    sync(state, [add(S1_DRAINING)])
    ready, draining = state.endpoints[spn("ns/web:http")]
    assert (ready.ready, draining.ready, draining.serving, draining.terminating) == (
        True,
        False,
        True,
        True,
    )


def test_slice_update_reports_whether_a_change_is_pending() -> None:
    state = ProxyState(IPFamily.IPV4)
    tracker = state.endpoint_tracker

    def update(previous: Obj | None, current: Obj | None) -> bool:
        return update_slice(tracker, previous, current, NODE)

    assert update(None, S1)
    assert update(S1, S1), "the add is still pending"
    state.apply()
    assert not update(S1, S1)
    assert update(S1, S1_FOR_API)
    assert tracker.pending == 2, "leaves web, joins api"
    assert not update(S1_FOR_API, S1)
    assert tracker.pending == 0


T1 = "2024-01-01T00:00:00Z"
T2 = "2024-01-01T00:00:05Z"


def epoch(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_trigger_times_of_every_applied_change_are_reported_per_service() -> None:
    state = ProxyState(IPFamily.IPV4)
    feed(
        state,
        [
            add(eps_slice("web-1", "web", ["10.0.1.1"], trigger=T1)),
            update(
                eps_slice("web-1", "web", ["10.0.1.1"], trigger=T1),
                eps_slice("web-1", "web", ["10.0.1.1", "10.0.1.2"], trigger=T2),
            ),
            add(eps_slice("api-1", "api", ["10.0.2.1"])),
        ],
    )
    result = state.apply()
    assert dict(result.trigger_times) == {NamespacedName("ns", "web"): (epoch(T1), epoch(T2))}
    assert state.apply().trigger_times == {}


def test_a_trigger_time_alone_is_not_a_change() -> None:
    before = eps_slice("web-1", "web", ["10.0.1.1"], trigger=T1)
    after = eps_slice("web-1", "web", ["10.0.1.1"], trigger=T2)
    state = ProxyState(IPFamily.IPV4)
    sync(state, [add(before)])
    assert not update_slice(state.endpoint_tracker, before, after, NODE)
    assert state.apply() == UpdateResult()


def test_a_change_that_cancels_out_reports_no_trigger_time() -> None:
    state = ProxyState(IPFamily.IPV4)
    sync(state, [add(S1), add(S2_DUPLICATE)])
    moved = eps_slice("web-2", "web", ["10.0.1.1"], trigger=T1)
    swapped = eps_slice("web-1", "web", ["10.0.1.2"], trigger=T1)
    result = sync(state, [update(S2_DUPLICATE, moved), update(S1, swapped)])
    assert (result.updated, result.trigger_times, result.endpoint_changes) == (frozenset(), {}, 2)


def test_slice_problems_are_reported_when_the_event_arrives() -> None:
    bad = eps_slice("web-1", "web", ["10.0.1.1", "10.0.1.999"])
    state = ProxyState(IPFamily.IPV4)
    assert [(p.kind, p.obj, p.field) for p in convert.slice_info(bad, NODE)[1]] == [
        ("EndpointSlice", "ns/web-1", "endpoints[1].addresses[0]")
    ]
    sync(state, [add(bad)])
    assert addresses(state.endpoints) == {"ns/web:http": ["10.0.1.1:8080"]}


def test_services_and_endpoints_are_tracked_independently() -> None:
    state = ProxyState(IPFamily.IPV4)
    sync(state, [add(S1)])
    assert dict(state.services) == {}
    result = sync(state, [add(WEB)])
    assert names(result.updated) == {"ns/web:http", "ns/web:https"}
    assert result.newly_active == frozenset()
    result = sync(state, [delete(WEB)])
    assert addresses(state.endpoints) == {"ns/web:http": BOTH}
    assert result.stale_endpoints == {}


def test_maps_are_read_only_views() -> None:
    state = ProxyState(IPFamily.IPV4)
    sync(state, [add(WEB), add(S1)])
    with pytest.raises(TypeError):
        state.services[spn("ns/web:x")] = state.services[spn("ns/web:http")]  # type: ignore[index]
    with pytest.raises(TypeError):
        state.endpoints[spn("ns/web:x")] = ()  # type: ignore[index]


# ------------------------------------------------ health checks and sync gate


def test_health_check_ports_are_those_of_local_policy_load_balancers() -> None:
    lb_local = service("lb", type_="LoadBalancer", etp="Local", health_check_node_port=32000)
    lb_cluster = service("lbc", type_="LoadBalancer", health_check_node_port=32001)
    state = ProxyState(IPFamily.IPV4)
    sync(state, [add(lb_local), add(lb_cluster), add(WEB)])
    assert state.health_check_ports() == {NamespacedName("ns", "lb"): 32000}


def test_local_ready_endpoints_count_distinct_local_ready_ips_per_service() -> None:
    slice_ = eps_slice(
        "web-1",
        "web",
        [
            endpoint("10.0.1.1", node=NODE),
            endpoint("10.0.1.2", node=NODE, ready=False, serving=True, terminating=True),
            endpoint("10.0.1.3", node="node-b"),
        ],
        ports=(("http", 8080, "TCP"), ("dns", 53, "UDP")),
    )
    remote_only = eps_slice("api-1", "api", ["10.0.2.1"])
    state = ProxyState(IPFamily.IPV4)
    sync(state, [add(slice_), add(remote_only)])
    assert state.local_ready_endpoints() == {NamespacedName("ns", "web"): 1}


def test_sync_gate_opens_once_both_kinds_have_synced() -> None:
    gate = SyncGate()
    assert not gate.ready
    gate.mark_synced(KIND_SERVICES)
    gate.mark_synced(KIND_SERVICES)
    assert not gate.ready
    gate.mark_synced(KIND_ENDPOINT_SLICES)
    assert gate.ready


def test_sync_gate_kinds_match_the_sources_constants() -> None:
    from nftproxy.cluster import events

    assert (KIND_SERVICES, KIND_ENDPOINT_SLICES) == (
        events.KIND_SERVICES,
        events.KIND_ENDPOINT_SLICES,
    )


def test_sync_gate_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="nodes"):
        SyncGate().mark_synced("nodes")
