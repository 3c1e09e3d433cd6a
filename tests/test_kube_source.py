"""KubeSource: the real kubernetes client against a fake API server -> ClusterEvents.

Aspects: the first list is paged and complete, then synced once per kind;
watch events reach the handler with the previously delivered object;
objects are stripped to what the proxier reads, and changes only to
stripped fields are not delivered; kube-proxy's label selector; only this
node's Node; ServiceCIDRs as a full list, ignored when not served;
bookmarks advance the resourceVersion; a stream that ends resumes at once
without a re-list; a dropped connection is retried within a second, server
errors back off exponentially, the backoff starts over after a success, and
a server that ends every watch at once is not hammered; 410 Gone (ERROR
event or HTTP) re-lists once, at once, and delivers only the difference;
the store holds every object packed, and the same object in another key
order is no change (watched or re-listed);
every informer resumes within 2 s of an API server restart; stop()
returns promptly; a burst of 1,000 changes with a 410 and a dropped
connection converges to the server's state. Also the EventRecorder,
api_calls() against the requests actually made, from_config(), and the fake
server itself.

All traffic is on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import fakeapi
import k8s as build
import pytest
from fakeapi import FakeApiServer
from kubernetes import client as k8s_client
from test_store import reversed_keys

from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES, Obj
from nftproxy.cluster.kube import (
    LABEL_SELECTOR,
    KubeSource,
    api_calls,
    from_config,
)
from nftproxy.cluster.kube_events import EventRecorder
from nftproxy.cluster.store import head

NODE = "node-a"
PROXY_NAME = "service.kubernetes.io/service-proxy-name"
HEADLESS = "service.kubernetes.io/headless"
TRIGGER = "endpoints.kubernetes.io/last-change-trigger-time"


# -- helpers ------------------------------------------------------------------------------


def key_of(obj: Obj) -> str:
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]


class Recorder:
    """A ClusterEvents handler that applies events to dicts, and notes every
    `previous` that is not what it was last given, and every no-op update."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.services: dict[str, Obj] = {}
        self.slices: dict[str, Obj] = {}
        self.node: Obj | None = None
        self.node_calls = 0
        self.cidrs: list[Obj] | None = None
        self.cidr_calls = 0
        self.synced: list[str] = []
        self.log: list[tuple[str, str, str]] = []  # (kind, add|update|delete|synced, key)
        self.violations: list[str] = []

    def _apply(self, kind: str, view: dict[str, Obj], prev: Obj | None, cur: Obj | None) -> None:
        obj = cur if cur is not None else prev
        assert obj is not None
        key = key_of(obj)
        with self.lock:
            delivered = view.get(key)
            if kind == "slice" and delivered is not None:  # a metadata-only resource
                delivered = head(delivered)
            if delivered != prev:
                self.violations.append(f"{kind} {key}: previous is not what was delivered")
            if prev is not None and prev == cur:
                self.violations.append(f"{kind} {key}: update without change")
            op = "add" if prev is None else "delete" if cur is None else "update"
            if cur is None:
                view.pop(key, None)
            else:
                view[key] = cur
            self.log.append((kind, op, key))

    def on_service(self, previous: Obj | None, current: Obj | None) -> None:
        self._apply("service", self.services, previous, current)

    def on_endpoint_slice(self, previous: Obj | None, current: Obj | None) -> None:
        self._apply("slice", self.slices, previous, current)

    def on_node(self, node: Obj | None) -> None:
        with self.lock:
            self.node = node
            self.node_calls += 1

    def on_service_cidrs(self, cidrs: Sequence[Obj]) -> None:
        with self.lock:
            self.cidrs = list(cidrs)
            self.cidr_calls += 1

    def on_synced(self, kind: str) -> None:
        with self.lock:
            self.synced.append(kind)
            self.log.append((kind, "synced", ""))

    def since(self, mark: int) -> list[tuple[str, str, str]]:
        with self.lock:
            return self.log[mark:]


class Sleeps:
    """An injected sleep: records (thread, seconds) and waits at most 20 ms."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append((threading.current_thread().name, seconds))
        time.sleep(min(seconds, 0.02))

    def of(self, resource: str) -> list[float]:
        return [s for name, s in self.calls if name == f"nftproxy-kube-{resource}"]


def wait_until(check: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.005)


def labelled(obj: dict[str, Any], **labels: str) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"].setdefault("labels", {}).update(labels)
    return out


def svc(name: str, ip: str = "10.96.0.10", port: int = 80, **kw: Any) -> dict[str, Any]:
    return build.service(name, ip, ports=(("http", port, "TCP"),), **kw)


def synced(rec: Recorder) -> bool:
    return {KIND_SERVICES, KIND_ENDPOINT_SLICES} <= set(rec.synced)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


Start = Callable[..., tuple[KubeSource, Recorder, Sleeps]]


@pytest.fixture
def start() -> Iterator[Start]:
    """start(api, **KubeSource options) -> (source, recorder, sleeps), started
    and synced; every source is stopped at teardown."""
    sources: list[KubeSource] = []

    def run(server: FakeApiServer, *, wait: bool = True, **kw: Any) -> tuple[
        KubeSource, Recorder, Sleeps
    ]:
        rec, sleeps = Recorder(), Sleeps()
        options: dict[str, Any] = {"node_name": NODE, "sleep": sleeps, "random": lambda: 0.5}
        options.update(kw)
        source = KubeSource(server.api_client(), rec, **options)
        sources.append(source)
        source.start()
        if wait:
            wait_until(lambda: synced(rec), what="initial sync")
        return source, rec, sleeps

    yield run
    for source in sources:
        source.stop()


def watches(api: FakeApiServer, resource: str) -> list[fakeapi.Request]:
    return api.requests_of(resource, "watch")


def lists(api: FakeApiServer, resource: str) -> list[fakeapi.Request]:
    return api.requests_of(resource, "list")


def watch_count(api: FakeApiServer, resource: str, count: int) -> Callable[[], bool]:
    """A check: at least `count` watch requests of `resource` were made."""
    return lambda: len(watches(api, resource)) >= count


# -- listing -------------------------------------------------------------------------------


def test_first_list_is_paged_complete_and_then_synced_once(
    api: FakeApiServer, start: Start
) -> None:
    for i in range(1200):
        api.create(svc(f"s{i:04}", f"10.96.{i // 250}.{i % 250 + 1}"))
    rv = api.resource_version
    source, rec, _ = start(api)

    assert len(rec.services) == 1200
    pages = lists(api, "services")
    assert [p.query["limit"] for p in pages] == ["500", "500", "500"]
    assert "continue" not in pages[0].query
    assert all("continue" in p.query for p in pages[1:])
    api.wait_watchers("services")
    assert watches(api, "services")[0].query["resourceVersion"] == str(rv)
    service_log = [op for kind, op, _ in rec.log if kind in ("service", KIND_SERVICES)]
    assert service_log == ["add"] * 1200 + ["synced"]
    assert rec.synced.count(KIND_SERVICES) == 1
    assert rec.synced.count(KIND_ENDPOINT_SLICES) == 1
    assert source.stats["services"].lists == 1
    assert source.stats["services"].objects == 1200


def test_a_first_list_is_delivered_page_by_page_and_a_failed_page_repeats_nothing(
    api: FakeApiServer,
) -> None:
    for i in range(1200):
        api.create(svc(f"s{i:04}", f"10.96.{i // 250}.{i % 250 + 1}"))
    api.fail_requests(1, resource="services", status=None, continued_only=True)  # page 2
    rec = Recorder()
    asked: list[int] = []  # at each delivered service: list requests made so far
    on_service = rec.on_service

    def noting(previous: Obj | None, current: Obj | None) -> None:
        asked.append(len(lists(api, "services")))
        on_service(previous, current)

    rec.on_service = noting  # type: ignore[method-assign]
    source = KubeSource(api.api_client(), rec, node_name=NODE, sleep=Sleeps(),
                        random=lambda: 0.5)
    source.start()
    try:
        wait_until(lambda: synced(rec), what="initial sync")
    finally:
        source.stop()
    # the first page's 500 adds came while its second page was asked for at most
    assert max(asked[:500]) <= 2
    assert min(asked[500:]) >= 3  # that page cut off, then the list again from its start
    service_log = [op for kind, op, _ in rec.log if kind in ("service", KIND_SERVICES)]
    assert service_log == ["add"] * 1200 + ["synced"]  # the re-list adds only the rest
    assert sorted(rec.services) == [f"ns/s{i:04}" for i in range(1200)]
    assert rec.violations == []
    assert source.stats["services"].lists == 1
    assert source.stats["services"].errors == 1


def test_the_next_page_is_asked_for_while_a_page_is_delivered(api: FakeApiServer) -> None:
    for i in range(1200):
        api.create(svc(f"s{i:04}", f"10.96.{i // 250}.{i % 250 + 1}"))
    rec = Recorder()
    asked_meanwhile: list[int] = []
    on_service = rec.on_service

    def noting(previous: Obj | None, current: Obj | None) -> None:
        if not asked_meanwhile:  # the first page's first add waits for page 2's request
            with contextlib.suppress(AssertionError):
                wait_until(lambda: len(lists(api, "services")) >= 2, timeout=5.0)
            asked_meanwhile.append(len(lists(api, "services")))
        on_service(previous, current)

    rec.on_service = noting  # type: ignore[method-assign]
    source = KubeSource(api.api_client(), rec, node_name=NODE)
    source.start()
    try:
        wait_until(lambda: synced(rec), what="initial sync")
    finally:
        source.stop()
    assert asked_meanwhile == [2]
    assert len(rec.services) == 1200
    assert [p.query["limit"] for p in lists(api, "services")] == ["500", "500", "500"]


def test_each_complete_list_and_its_delivery_run_inside_the_listing_bracket(
    api: FakeApiServer,
) -> None:
    for i in range(3):
        api.create(svc(f"s{i}", f"10.96.0.{i + 1}"))
    rec = Recorder()
    open_in: dict[str, int] = {}  # informer thread -> open brackets

    @contextlib.contextmanager
    def listing() -> Iterator[None]:
        thread = threading.current_thread().name
        with rec.lock:
            open_in[thread] = open_in.get(thread, 0) + 1
            rec.log.append(("listing", "open", thread))
        yield
        with rec.lock:
            open_in[thread] -= 1
            rec.log.append(("listing", "closed", thread))

    services_thread = "nftproxy-kube-services"
    inside: list[bool] = []
    on_service = rec.on_service

    def noting(previous: Obj | None, current: Obj | None) -> None:
        inside.append(open_in.get(threading.current_thread().name, 0) == 1)
        on_service(previous, current)

    rec.on_service = noting  # type: ignore[method-assign]
    source = KubeSource(api.api_client(), rec, node_name=NODE, listing=listing)
    source.start()
    try:
        wait_until(lambda: synced(rec), what="initial sync")
        # every informer watching: its list bracket closed (the ServiceCIDRs'
        # list may still be in flight when Services and slices are synced)
        for resource in ("services", "endpointslices", "nodes", "servicecidrs"):
            api.wait_watchers(resource)
        api.create(svc("watched", "10.96.0.9"))  # a watch event: no bracket
        wait_until(lambda: any(k.endswith("/watched") for k in rec.services), what="watch event")
    finally:
        source.stop()
    assert inside == [True, True, True, False]
    with rec.lock:
        brackets = [(op, t) for kind, op, t in rec.log if kind == "listing"]
    assert brackets.count(("open", services_thread)) == 1
    assert brackets.count(("closed", services_thread)) == 1
    assert len(brackets) == 2 * len(source.stats)  # one per resource, every one closed


def test_watch_requests_carry_bookmarks_timeout_and_selector(
    api: FakeApiServer, start: Start
) -> None:
    start(api)
    for resource in ("services", "endpointslices"):
        api.wait_watchers(resource)
        (w,) = watches(api, resource)
        assert w.query["allowWatchBookmarks"] == "true"
        assert w.query["timeoutSeconds"] == "450"  # 300 + 300 * random()
        assert w.query["labelSelector"] == LABEL_SELECTOR
        assert lists(api, resource)[0].query["labelSelector"] == LABEL_SELECTOR


# -- events ---------------------------------------------------------------------------------


def test_watch_events_reach_the_handler_with_the_stored_previous(
    api: FakeApiServer, start: Start
) -> None:
    api.create(svc("web"))
    api.create(build.endpoint_slice("web", ["10.0.0.1"]))
    _, rec, _ = start(api)
    mark = len(rec.log)

    api.update(svc("web", port=8080))
    api.create(svc("db"))
    api.update(build.endpoint_slice("web", ["10.0.0.1", "10.0.0.2"]))
    api.delete("Service", "web", "ns")
    wait_until(lambda: len(rec.since(mark)) == 4)

    assert [e for e in rec.since(mark) if e[0] == "service"] == [  # threads: per-kind order
        ("service", "update", "ns/web"),
        ("service", "add", "ns/db"),
        ("service", "delete", "ns/web"),
    ]
    assert ("slice", "update", "ns/web-ipv4") in rec.since(mark)
    assert rec.violations == []
    assert set(rec.services) == {"ns/db"}
    assert len(rec.slices["ns/web-ipv4"]["endpoints"]) == 2


def test_objects_are_stripped_to_what_the_proxier_reads(
    api: FakeApiServer, start: Start
) -> None:
    service = svc("lb", type="LoadBalancer", lb_ips=["192.0.2.1"])
    service["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": "{}"}
    service["metadata"]["managedFields"] = [{"manager": "kubectl", "operation": "Apply"}]
    service["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    api.create(service)
    eps = build.endpoint_slice("lb", ["10.0.0.1"])
    eps["metadata"]["annotations"] = {TRIGGER: "2024-01-01T00:00:00Z", "other": "x"}
    api.create(eps)
    node = build.node(NODE, ["192.168.0.10"])
    node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    node["status"]["capacity"] = {"cpu": "4"}
    api.create(node)
    _, rec, _ = start(api)
    wait_until(lambda: rec.node is not None)

    got = rec.services["ns/lb"]
    assert set(got["metadata"]) == {"name", "namespace", "uid"}
    assert got["status"] == {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}}
    assert got["spec"] == service["spec"]
    assert (got["kind"], got["apiVersion"]) == ("Service", "v1")
    assert rec.slices["ns/lb-ipv4"]["metadata"]["annotations"] == {TRIGGER: "2024-01-01T00:00:00Z"}
    assert (rec.slices["ns/lb-ipv4"]["kind"], rec.slices["ns/lb-ipv4"]["apiVersion"]) == (
        "EndpointSlice", "discovery.k8s.io/v1")
    assert rec.node is not None
    assert rec.node["status"] == {"addresses": node["status"]["addresses"]}

    # a change only to stripped fields is not delivered
    mark = len(rec.log)
    service["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    service["metadata"]["managedFields"].append({"manager": "controller"})
    api.update(service)
    api.create(svc("marker"))
    wait_until(lambda: ("service", "add", "ns/marker") in rec.since(mark))
    assert rec.since(mark) == [("service", "add", "ns/marker")]


def test_label_selector_filters_like_kube_proxy(api: FakeApiServer, start: Start) -> None:
    api.create(labelled(svc("headless"), **{HEADLESS: ""}))
    api.create(labelled(svc("other-proxy"), **{PROXY_NAME: "cilium"}))
    api.create(labelled(build.endpoint_slice("headless", ["10.0.0.9"]), **{HEADLESS: ""}))
    api.create(svc("mine"))
    _, rec, _ = start(api)
    assert set(rec.services) == {"ns/mine"}
    assert rec.slices == {}
    mark = len(rec.log)

    api.update(labelled(svc("mine"), **{PROXY_NAME: "cilium"}))  # leaves us: a delete
    api.update(svc("other-proxy"))  # label dropped: an add
    wait_until(lambda: len(rec.since(mark)) == 2)
    assert rec.since(mark) == [
        ("service", "delete", "ns/mine"),
        ("service", "add", "ns/other-proxy"),
    ]
    assert rec.violations == []


def test_only_this_node_is_watched(api: FakeApiServer, start: Start) -> None:
    api.create(build.node(NODE, ["192.168.0.10"]))
    api.create(build.node("node-b", ["192.168.0.11"]))
    _, rec, _ = start(api)
    wait_until(lambda: rec.node is not None)
    assert rec.node is not None and rec.node["metadata"]["name"] == NODE
    assert {r.query.get("fieldSelector") for r in api.requests_of("nodes")} == {
        f"metadata.name={NODE}"
    }
    api.wait_watchers("nodes")
    calls = rec.node_calls

    api.update(build.node("node-b", ["192.168.0.12"], zone="b"))
    api.update(build.node(NODE, ["192.168.0.10"], zone="a"))
    wait_until(lambda: rec.node_calls == calls + 1)
    assert rec.node is not None
    assert rec.node["metadata"]["labels"]["topology.kubernetes.io/zone"] == "a"

    api.delete("Node", NODE)
    wait_until(lambda: rec.node_calls == calls + 2)
    assert rec.node is None


class Lingering(Recorder):
    """On the first object it is given, of either kind, waits (at most
    `linger` s) for an object of the other kind; then takes 2 ms per
    object, so two deliveries at once would alternate."""

    def __init__(self, linger: float) -> None:
        super().__init__()
        self.linger = linger
        self.started = {"service": threading.Event(), "slice": threading.Event()}

    def _apply(self, kind: str, view: dict[str, Obj], prev: Obj | None, cur: Obj | None) -> None:
        other = "slice" if kind == "service" else "service"
        first = not self.started[kind].is_set()
        self.started[kind].set()
        if first:
            self.started[other].wait(self.linger)
        time.sleep(0.002)
        super()._apply(kind, view, prev, cur)


def test_two_lists_are_delivered_one_after_the_other_not_interleaved(
    api: FakeApiServer,
) -> None:
    """A list's changes go to the handler as one batch while the other
    informers' deliveries wait: two informer threads alternating object by
    object on the handler's locks cost ~4 s of a 45,000-service start on
    Python 3.11 (bench/RESULTS.md, fifteenth pass)."""
    for i in range(20):
        api.create(svc(f"s{i:02}", f"10.96.0.{i + 1}"))
        api.create(build.endpoint_slice(f"s{i:02}", [f"10.0.0.{i + 1}"]))
    rec = Lingering(linger=0.5)
    source = KubeSource(api.api_client(), rec, node_name=NODE, random=lambda: 0.5)
    source.start()
    try:
        wait_until(lambda: synced(rec), what="initial sync")
    finally:
        source.stop()
    kinds = [kind for kind, op, _ in rec.log if op == "add"]
    assert sorted(kinds) == ["service"] * 20 + ["slice"] * 20
    runs = [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]
    assert len(runs) == 2, f"the two lists' deliveries interleaved: {kinds}"


class NodeFirst(Recorder):
    """Notes how many times the Node was delivered when each kind is synced."""

    def __init__(self) -> None:
        super().__init__()
        self.node_calls_at_synced: dict[str, int] = {}

    def on_synced(self, kind: str) -> None:
        with self.lock:
            self.node_calls_at_synced[kind] = self.node_calls
        super().on_synced(kind)


def test_the_lists_are_synced_only_once_the_node_is_in(api: FakeApiServer) -> None:
    """The Node's list failing once (it comes back after the backoff, after
    the Services and EndpointSlices lists): on_synced waits for it, so the
    first sync -- a full one -- sees the Node, and no second full sync
    follows it (bench/agentrun: two full syncs at start under load)."""
    api.create(build.node(NODE, ["192.168.0.10"]))
    api.create(svc("web"))
    api.fail_requests(1, resource="nodes")
    rec = NodeFirst()
    source = KubeSource(api.api_client(), rec, node_name=NODE, backoff_initial=0.3,
                        random=lambda: 0.5)
    source.start()
    try:
        wait_until(lambda: synced(rec), what="initial sync")
        assert len(lists(api, "nodes")) == 2  # the failed one, then the one that counted
        assert rec.node_calls_at_synced == {KIND_SERVICES: 1, KIND_ENDPOINT_SLICES: 1}
    finally:
        source.stop()


def test_the_lists_are_synced_without_a_node_that_cannot_be_listed(
    api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    api.create(svc("web"))
    api.fail_requests(1000, resource="nodes")
    rec = NodeFirst()
    source = KubeSource(api.api_client(), rec, node_name=NODE, node_wait=0.3,
                        random=lambda: 0.5)
    started = time.monotonic()
    source.start()
    try:
        with caplog.at_level(logging.WARNING):
            wait_until(lambda: synced(rec), what="initial sync")
        assert time.monotonic() - started >= 0.3
        assert rec.node_calls_at_synced == {KIND_SERVICES: 0, KIND_ENDPOINT_SLICES: 0}
        assert "was not listed within" in caplog.text
    finally:
        source.stop()


def test_service_cidrs_are_delivered_as_a_full_list(api: FakeApiServer, start: Start) -> None:
    def cidr(name: str, *cidrs: str) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                "metadata": {"name": name}, "spec": {"cidrs": list(cidrs)}}

    api.create(cidr("kubernetes", "10.96.0.0/16", "fd00:10:96::/112"))
    _, rec, _ = start(api)
    wait_until(lambda: rec.cidr_calls == 1)
    assert [c["spec"]["cidrs"] for c in rec.cidrs or []] == [["10.96.0.0/16", "fd00:10:96::/112"]]

    api.create(cidr("extra", "10.97.0.0/16"))
    wait_until(lambda: rec.cidr_calls == 2)
    assert [c["metadata"]["name"] for c in rec.cidrs or []] == ["extra", "kubernetes"]
    api.delete("ServiceCIDR", "kubernetes")
    wait_until(lambda: rec.cidr_calls == 3)
    assert [c["metadata"]["name"] for c in rec.cidrs or []] == ["extra"]


def test_service_cidrs_not_served_are_ignored_and_asked_for_rarely(start: Start) -> None:
    with FakeApiServer(serve_service_cidrs=False) as api:
        api.create(svc("web"))
        source, rec, sleeps = start(api)
        wait_until(lambda: len(sleeps.of("servicecidrs")) >= 1)
        assert sleeps.of("servicecidrs")[0] == pytest.approx(630.0)  # 600 s, jittered
        assert lists(api, "servicecidrs")  # asked, got 404
        stats = source.stats["servicecidrs"]
        assert (stats.served, stats.errors) == (False, 0)
        assert rec.cidr_calls == 0
        assert set(rec.services) == {"ns/web"}
        source.stop()


# -- resourceVersions, stream ends, errors ----------------------------------------------------


def test_bookmarks_advance_the_resource_version(api: FakeApiServer, start: Start) -> None:
    api.create(svc("web"))
    source, rec, _ = start(api)
    api.wait_watchers("services")
    for i in range(5):  # other resources move the shared resourceVersion
        api.create(build.node(f"other-{i}", ["192.168.1.1"]))
    target = api.resource_version
    api.bookmark()
    wait_until(lambda: source.stats["services"].resource_version == str(target))
    assert source.stats["services"].bookmarks >= 1

    api.expire_history()  # anything before `target` would now be 410
    api.end_watches()
    wait_until(lambda: len(watches(api, "services")) == 2)
    assert watches(api, "services")[1].query["resourceVersion"] == str(target)
    api.create(svc("after"))
    wait_until(lambda: "ns/after" in rec.services)
    assert (source.stats["services"].lists, source.stats["services"].relists) == (1, 0)


def test_stream_end_resumes_from_the_last_resource_version_without_relisting(
    api: FakeApiServer, start: Start
) -> None:
    source, rec, sleeps = start(api)
    api.wait_watchers("services")
    api.create(svc("one"))
    wait_until(lambda: "ns/one" in rec.services)
    last = api.resource_version

    api.end_watches()  # as the server's timeoutSeconds would
    wait_until(lambda: len(watches(api, "services")) == 2)
    assert watches(api, "services")[1].query["resourceVersion"] == str(last)
    api.create(svc("two"))
    wait_until(lambda: "ns/two" in rec.services)
    stats = source.stats["services"]
    assert (stats.lists, stats.relists, stats.watches, stats.errors) == (1, 0, 2, 0)
    assert sleeps.of("services") == []  # the watch had events: no backoff
    assert rec.violations == []


def _outage(api: FakeApiServer, failures: int) -> None:
    """Cut the open watches (half an event, then no answer) and fail the next
    `failures` watch requests with 503."""
    api.fail_requests(failures, resource="services", status=503, watch_only=True)
    api.drop_watches(partial=True)


def test_a_dropped_connection_is_retried_soon_and_server_errors_back_off_exponentially(
    api: FakeApiServer, start: Start
) -> None:
    source, rec, sleeps = start(api)
    api.wait_watchers("services")
    api.create(svc("before"))
    wait_until(lambda: "ns/before" in rec.services)
    last = api.resource_version

    _outage(api, 3)
    api.create(svc("during"))
    wait_until(lambda: "ns/during" in rec.services)

    # the cut: no answer, at most unreachable_max (1 s); then the 503s, a new
    # kind of failure: 0.8 s doubling; all times the jitter 1 - 0.5 * 0.5
    assert sleeps.of("services") == pytest.approx([0.6, 0.6, 1.2, 2.4])
    service_watches = watches(api, "services")
    assert [w.query["resourceVersion"] for w in service_watches[1:]] == [str(last)] * 4
    stats = source.stats["services"]
    assert (stats.lists, stats.relists, stats.errors) == (1, 0, 4)
    assert rec.violations == []


def test_backoff_starts_over_after_a_success(api: FakeApiServer, start: Start) -> None:
    _, _, sleeps = start(api)
    for count in (5, 9):  # a round: the open watch is cut, 3 answer 503, the 4th is open
        api.wait_watchers("services")
        _outage(api, 3)
        wait_until(watch_count(api, "services", count))
    assert sleeps.of("services") == pytest.approx([0.6, 0.6, 1.2, 2.4] * 2)


def test_retry_after_is_obeyed(api: FakeApiServer, start: Start) -> None:
    # a restarted API server answers 429 with Retry-After: 1 until its cache is ready
    api.fail_requests(3, resource="services", status=429, retry_after=1)
    source, rec, sleeps = start(api, wait=False)
    wait_until(lambda: synced(rec), what="initial sync")
    assert sleeps.of("services") == [1.0, 1.0, 1.0]  # not 0.6, 1.2, 2.4
    assert source.stats["services"].errors == 3


def test_no_answer_is_retried_at_most_every_unreachable_max(
    api: FakeApiServer, start: Start
) -> None:
    source, rec, sleeps = start(api)
    api.wait_watchers("services")
    api.stop()  # the watch is cut, then every connection is refused
    wait_until(lambda: len(sleeps.of("services")) >= 8)
    api.start()
    api.create(svc("after"))
    wait_until(lambda: "ns/after" in rec.services)
    # 0.8 s, then capped at 1 s, however long it lasts; times the jitter 0.75
    assert sleeps.of("services")[:8] == pytest.approx([0.6] + [0.75] * 7)
    assert source.stats["services"].lists == 1  # history kept: no re-list


def test_a_watch_the_server_ends_is_resumed_at_once(api: FakeApiServer, start: Start) -> None:
    source, _, sleeps = start(api)
    api.wait_watchers("services")
    api.end_watches()  # at once, no event: still a normal end
    wait_until(watch_count(api, "services", 2))
    api.wait_watchers("services")
    assert sleeps.of("services") == []
    assert source.stats["services"].errors == 0


def test_a_server_that_ends_every_watch_at_once_is_not_hammered(start: Start) -> None:
    with FakeApiServer(max_watch_seconds=0.0) as api:
        _, _, sleeps = start(api)
        wait_until(watch_count(api, "services", 5))
        # the first such end goes on at once; a loop of them backs off
        assert sleeps.of("services")[:3] == pytest.approx([0.6, 1.2, 2.4])
        assert len(lists(api, "services")) == 1  # and no re-list


def test_a_410_after_failures_relists_once_and_at_once(api: FakeApiServer, start: Start) -> None:
    source, rec, sleeps = start(api)
    api.wait_watchers("services")
    api.pause_watches()  # the source misses the change below
    api.create(svc("missed"))
    api.expire_history()
    _outage(api, 2)  # ... and its re-watch after these failures is too old: 410
    wait_until(lambda: "ns/missed" in rec.services, what="the re-list")
    api.resume_watches()
    api.wait_watchers("services")
    stats = source.stats["services"]
    assert (stats.lists, stats.relists, stats.errors) == (2, 1, 3)
    assert sleeps.of("services") == pytest.approx([0.6, 0.6, 1.2])  # none for the 410
    assert rec.violations == []


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["ERROR event", "HTTP 410"])
def test_gone_relists_and_delivers_only_the_difference(start: Start, gone_as_http: bool) -> None:
    with FakeApiServer(gone_as_http=gone_as_http) as api:
        for name in "abcdf":
            api.create(svc(name))
        source, rec, _ = start(api)
        api.wait_watchers("services")
        mark = len(rec.log)

        api.pause_watches()  # the source misses everything below
        api.delete("Service", "b", "ns")
        api.update(svc("c", port=8080))  # a real change
        d = api.get("Service", "d", "ns")
        assert d is not None
        d["status"] = {"conditions": [{"type": "X"}]}
        d["metadata"]["managedFields"] = [{"manager": "m"}]
        api.update(d)  # only stripped fields: not an update
        api.create(svc("e"))
        api.expire_history()
        if gone_as_http:
            api.drop_watches()  # the re-watch from the old resourceVersion gets HTTP 410
        else:
            api.force_gone()
        api.resume_watches()

        wait_until(lambda: source.stats["services"].relists == 1, what="relist")
        wait_until(lambda: len(rec.since(mark)) >= 3)
        time.sleep(0.05)
        assert sorted(rec.since(mark)) == [
            ("service", "add", "ns/e"),
            ("service", "delete", "ns/b"),
            ("service", "update", "ns/c"),
        ]
        assert set(rec.services) == {"ns/a", "ns/c", "ns/d", "ns/e", "ns/f"}
        assert rec.synced.count(KIND_SERVICES) == 1
        assert rec.synced.count(KIND_ENDPOINT_SLICES) == 1
        assert rec.violations == []
        source.stop()


def test_the_store_is_packed_and_key_order_is_no_change(api: FakeApiServer, start: Start) -> None:
    for name in "ab":
        api.create(svc(name))
    api.create(build.endpoint_slice("a", ["10.0.0.1"]))
    source, rec, _ = start(api)
    api.wait_watchers("services")
    for informer in source._informers:  # every object is held as bytes, none as a dict
        held = [data for _, data in informer.store.items()]
        assert all(isinstance(data, bytes) for data in held), informer.res.name
        assert len(held) == informer.stats.objects
    mark = len(rec.log)

    a = api.get("Service", "a", "ns")
    assert a is not None
    api.update(reversed_keys(a))  # a watch event: the same object in another key order
    api.create(svc("marker"))
    wait_until(lambda: ("service", "add", "ns/marker") in rec.since(mark))
    api.pause_watches()
    b = api.get("Service", "b", "ns")
    assert b is not None
    api.update(reversed_keys(b))  # seen by the re-list only
    api.create(svc("c"))
    api.expire_history()
    api.force_gone()
    api.resume_watches()
    wait_until(lambda: source.stats["services"].relists == 1, what="relist")
    wait_until(lambda: ("service", "add", "ns/c") in rec.since(mark))
    api.update(svc("b", port=8080))  # previous: b as first delivered
    wait_until(lambda: ("service", "update", "ns/b") in rec.since(mark))

    assert rec.since(mark) == [
        ("service", "add", "ns/marker"),
        ("service", "add", "ns/c"),
        ("service", "update", "ns/b"),
    ]
    assert rec.violations == []


OUTAGE = 4.0  # long enough for the old backoff (0.8 s doubling) to reach 3.2 s steps


def test_every_informer_resumes_within_2s_of_an_api_server_restart(
    api: FakeApiServer, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    resources = ("services", "endpointslices", "nodes", "servicecidrs")
    api.create(build.node(NODE, ["192.168.0.10"]))
    source, _, _ = start(api, sleep=None)  # real waits, default backoff
    for resource in resources:
        api.wait_watchers(resource)
    caplog.set_level(logging.DEBUG, logger="nftproxy.cluster.kube")

    api.stop()
    time.sleep(OUTAGE)
    api.start(forget_history=True)  # a new watch cache: the old resourceVersion gets 410
    back = time.monotonic()
    resumed: dict[str, float] = {}

    def relisted() -> bool:
        for r in resources:
            if r not in resumed and source.stats[r].lists == 2:
                resumed[r] = time.monotonic() - back
        return len(resumed) == len(resources)

    wait_until(relisted, timeout=30, what="every informer's re-list")
    assert max(resumed.values()) < 3.0, resumed  # 2 s, and some slack for a loaded machine
    for resource in resources:
        stats = source.stats[resource]
        assert (stats.lists, stats.relists) == (2, 1), resource  # exactly one re-list
        own = [r for r in caplog.records if r.getMessage().startswith(f"{resource}: ")]
        warnings = [r for r in own if r.levelno == logging.WARNING]
        recovered = [r for r in own if "recovered after" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # not one per retry
        assert len(recovered) == 1 and recovered[0].levelno == logging.INFO
        assert stats.errors > 2  # it did retry meanwhile
    noise = [r for r in caplog.records if r.name.startswith("urllib3") and r.levelno >= 30]
    assert noise == []  # urllib3 does not retry (and warn) underneath


def test_stop_returns_promptly_while_watching(api: FakeApiServer, start: Start) -> None:
    source, _, _ = start(api)
    for resource in ("services", "endpointslices", "nodes", "servicecidrs"):
        api.wait_watchers(resource)
    t0 = time.monotonic()
    source.stop()
    assert time.monotonic() - t0 < 1.0
    assert not [t for t in threading.enumerate() if t.name.startswith("nftproxy-kube-")]


def test_stop_interrupts_a_backoff_wait(api: FakeApiServer, start: Start) -> None:
    api.fail_requests(100, resource="services", status=500)
    source, _, _ = start(api, wait=False, sleep=None, backoff_initial=20.0, backoff_max=60.0)
    wait_until(lambda: source.stats["services"].errors == 1)
    t0 = time.monotonic()
    source.stop()
    assert time.monotonic() - t0 < 1.0


def test_a_handler_exception_is_counted_and_the_watch_goes_on(
    api: FakeApiServer, start: Start
) -> None:
    source, rec, _ = start(api)
    api.wait_watchers("services")
    original = rec.on_service

    def boom(previous: Obj | None, current: Obj | None) -> None:
        if current is not None and current["metadata"]["name"] == "bad":
            raise RuntimeError("handler bug")
        original(previous, current)

    rec.on_service = boom  # type: ignore[method-assign]
    api.create(svc("bad"))
    api.create(svc("good"))
    wait_until(lambda: "ns/good" in rec.services)
    assert source.stats["services"].handler_errors == 1


# -- convergence ----------------------------------------------------------------------------


def _selected(obj: Obj) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return HEADLESS not in labels and PROXY_NAME not in labels


def _view(objs: Mapping[str, Obj], fields: Sequence[str]) -> dict[str, Any]:
    return {
        k: (o["metadata"].get("labels") or {}, [o.get(f) for f in fields])
        for k, o in objs.items()
        if _selected(o)
    }


def test_a_burst_with_a_410_and_a_dropped_connection_converges(start: Start) -> None:
    rng = random.Random(20240601)
    with FakeApiServer(bookmark_interval=0.05) as api:
        for i in range(100):
            api.create(svc(f"s{i}", port=1000 + i))
            api.create(build.endpoint_slice(f"s{i}", [f"10.1.0.{i + 1}"]))
        source, rec, _ = start(api)
        api.wait_watchers("services")
        api.wait_watchers("endpointslices")

        def rewatched(count: int) -> None:  # so the next fault hits live streams
            for resource in ("services", "endpointslices"):
                wait_until(watch_count(api, resource, count))
                api.wait_watchers(resource)

        names = [f"s{i}" for i in range(150)]
        for step in range(1000):
            if step % 20 == 0:
                time.sleep(0.002)  # let the source run alongside
            if step == 300:
                api.expire_history()
                api.force_gone()
            if step == 600:
                rewatched(2)
                api.drop_watches(partial=True)
            if step == 750:
                rewatched(3)
                api.pause_watches()  # the source falls behind...
            if step == 800:
                api.expire_history()
                api.drop_watches()  # ...so its re-watch is too old: 410 again
                api.resume_watches()
            name = rng.choice(names)
            kind = rng.choice(["Service", "EndpointSlice"])
            current = api.get(kind, name if kind == "Service" else f"{name}-ipv4", "ns")
            op = rng.random()
            if current is None:
                new = (svc(name, port=rng.randrange(1, 65535)) if kind == "Service"
                       else build.endpoint_slice(name, [f"10.2.{rng.randrange(250)}.1"]))
                api.create(new)
            elif op < 0.15:
                api.delete(kind, current["metadata"]["name"], "ns")
            elif op < 0.3:  # toggle "belongs to another proxy"
                labels = current["metadata"].setdefault("labels", {})
                if PROXY_NAME in labels:
                    del labels[PROXY_NAME]
                else:
                    labels[PROXY_NAME] = "other"
                api.update(current)
            elif op < 0.45:  # a change the proxier does not see
                current["status"] = {"conditions": [{"type": "T", "status": str(step)}]}
                api.update(current)
            elif kind == "Service":
                current["spec"]["ports"][0]["port"] = rng.randrange(1, 65535)
                api.update(current)
            else:
                current["endpoints"][0]["addresses"] = [f"10.3.{rng.randrange(250)}.1"]
                api.update(current)

        def converged() -> bool:
            with rec.lock:
                services = _view(rec.services, ["spec"])
                slices = _view(rec.slices, ["endpoints", "ports"])
            return services == _view(api.objects("Service"), ["spec"]) and slices == _view(
                api.objects("EndpointSlice"), ["endpoints", "ports"]
            )

        wait_until(converged, timeout=30, what="convergence")
        assert rec.violations == []
        for resource in ("services", "endpointslices"):
            stats = source.stats[resource]
            assert (stats.relists, stats.errors) == (2, 2)
        assert rec.synced.count(KIND_SERVICES) == 1
        source.stop()


# -- events, RBAC, config -----------------------------------------------------------------------


def test_event_recorder_posts_and_aggregates_repeats(api: FakeApiServer) -> None:
    recorder = EventRecorder(api.api_client(), host=NODE, wall_clock=lambda: 1_700_000_000.0)
    reason = "FailedToStartServiceHealthcheck"
    recorder.record(namespace="ns", name="web", reason=reason, message="port 30000 in use")
    recorder.record(namespace="ns", name="web", reason=reason, message="port 30000 in use")
    recorder.record(namespace="ns", name="db", reason=reason, message="port 30001 in use")

    events = sorted(api.objects("Event").values(), key=lambda e: e["involvedObject"]["name"])
    assert [(e["involvedObject"]["name"], e["count"]) for e in events] == [("db", 1), ("web", 2)]
    web = events[1]
    assert web["involvedObject"]["kind"] == "Service"
    assert (web["type"], web["reason"], web["source"]["host"]) == ("Warning", reason, NODE)
    assert web["lastTimestamp"].startswith("2023-11-14T22:13:20")
    assert [r.verb for r in api.requests_of("events")] == ["create", "patch", "create"]
    assert (recorder.posted, recorder.failures) == (3, 0)


def test_event_recorder_never_raises(api: FakeApiServer) -> None:
    api.fail_requests(1, resource="events", status=500)
    recorder = EventRecorder(api.api_client(), host=NODE)
    recorder.record(namespace="ns", name="web", reason="R", message="m")
    nowhere = k8s_client.ApiClient(k8s_client.Configuration(host="http://127.0.0.1:9"))
    EventRecorder(nowhere, host=NODE).record(namespace="ns", name="web", reason="R", message="m")
    assert recorder.failures == 1


def test_api_calls_cover_every_request_the_source_makes(api: FakeApiServer, start: Start) -> None:
    api.create(svc("web"))
    source, _, _ = start(api)
    api.wait_watchers("servicecidrs")
    recorder = EventRecorder(api.api_client(), host=NODE)
    recorder.record(namespace="ns", name="web", reason="R", message="m")
    recorder.record(namespace="ns", name="web", reason="R", message="m")
    source.stop()

    allowed = {(c.group, c.resource, v) for c in api_calls() for v in c.verbs}
    made = {
        (fakeapi.RESOURCES[r.resource].group, r.resource, r.verb)
        for r in api.requests
        if r.resource
    }
    assert made <= allowed
    assert made == allowed  # and nothing granted goes unused


def test_from_config_reads_a_kubeconfig_and_leaves_the_default_alone(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
        "current-context": "fake",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    default_host = k8s_client.Configuration.get_default_copy().host

    for client in (from_config(str(path)), _with_env(monkeypatch, path)):
        response: Any = k8s_client.CoreV1Api(client).list_node(_preload_content=False)
        assert json.loads(response.data)["kind"] == "NodeList"
    assert k8s_client.Configuration.get_default_copy().host == default_host


def _with_env(monkeypatch: pytest.MonkeyPatch, path: Path) -> Any:
    """from_config(None) outside a pod: $KUBECONFIG."""
    monkeypatch.setenv("KUBECONFIG", str(path))
    return from_config(None)


# -- the fake itself ------------------------------------------------------------------------------


def _watch_body(api: FakeApiServer, rv: int, seconds: int = 1) -> list[dict[str, Any]]:
    response: Any = k8s_client.CoreV1Api(api.api_client()).list_service_for_all_namespaces(
        watch=True, resource_version=str(rv), timeout_seconds=seconds,
        label_selector=LABEL_SELECTOR, _preload_content=False,
    )
    return list(fakeapi.iter_events(response.data))


def test_fake_watch_replays_after_a_resource_version_and_follows_the_selector(
    api: FakeApiServer,
) -> None:
    api.create(svc("a"))
    rv = api.resource_version
    api.update(labelled(svc("a"), **{PROXY_NAME: "x"}))
    api.update(svc("a"))
    api.create(labelled(svc("never"), **{HEADLESS: ""}))
    api.delete("Service", "a", "ns")
    events = _watch_body(api, rv)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("DELETED", "a"), ("ADDED", "a"), ("DELETED", "a"),
    ]
    api.expire_history()
    (gone,) = _watch_body(api, rv)
    assert (gone["type"], gone["object"]["code"]) == ("ERROR", 410)


def test_fake_pages_are_a_consistent_snapshot(api: FakeApiServer) -> None:
    for i in range(5):
        api.create(svc(f"s{i}"))
    core = k8s_client.CoreV1Api(api.api_client())

    def page(**kw: Any) -> dict[str, Any]:
        response: Any = core.list_service_for_all_namespaces(
            limit=2, _preload_content=False, **kw
        )
        body: dict[str, Any] = json.loads(response.data)
        return body

    first = page()
    api.delete("Service", "s4", "ns")
    api.create(svc("s5"))
    second = page(_continue=first["metadata"]["continue"])
    third = page(_continue=second["metadata"]["continue"])
    names = [i["metadata"]["name"] for p in (first, second, third) for i in p["items"]]
    assert names == ["s0", "s1", "s2", "s3", "s4"]
    assert "continue" not in third["metadata"]
    assert "kind" not in first["items"][0]
