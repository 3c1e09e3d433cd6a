"""The proxier's decisions, on FakeBackend and a fake clock (no root, no kernel).

Aspects:
- nothing is programmed before both initial lists; the first sync is full;
- a change re-renders only what changed (partial); no change sends nothing;
- a partial sync writes what a full sync of the same cluster writes;
- a refused commit leaves the planner's state and the kernel untouched (but
  for the maps libnftables 1.0.6 declares in nft text just before it: empty,
  unreferenced), and the next sync is full and repairs;
- EBUSY (kernels < 6.2 refuse to delete a chain whose map element goes in the
  same transaction): the deletes are deferred, the chains left flushed, and
  a later transaction deletes them;
- the periodic full sync; a node or ServiceCIDR change makes the next sync
  full, an identical node does not;
- every invalid field is reported once, when its event arrives, and the
  other services are programmed;
- the SyncReport is made of values: later syncs do not change it;
- hooks get the report, and a failing hook does not break syncing;
- the heap policy brackets each build and commit, and hears of each
  finished sync after its hooks.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from feed import initial_list, intake
from k8s import endpoint_slice, node, service
from kernel import canonical

from nftproxy.agent import chunked
from nftproxy.agent.intake import Intake, InvalidField
from nftproxy.agent.proxier import Proxier
from nftproxy.agent.report import SyncReport
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, NamespacedName
from nftproxy.core.nft.commands import DeleteChain, DeleteElements
from nftproxy.core.nft.errors import NftBusy, NftRejected
from nftproxy.core.nft.jsontext import command_json
from nftproxy.core.nft.listing import list_family, list_family_objects, live_name
from nftproxy.core.rules.fragment import CompactFragment, Fragment, compact, kernel_name
from nftproxy.core.rules.names import table_pair
from nftproxy.kernel.fake import FakeBackend

NODE = "node-a"
CONFIG = ProxyConfig(
    node_name=NODE, cluster_cidrs=("10.244.0.0/16",), table_name="nftproxy",
    full_sync_period=3600.0,
)
WEB = service("web", "10.96.0.10", type="NodePort", node_ports=[30080])
WEB_EPS = endpoint_slice("web", [("10.244.0.11", NODE), ("10.244.1.12", "node-b")])
DNS = service("dns", "10.96.0.53", ports=[("dns", 53, "UDP")])
DNS_EPS = endpoint_slice("dns", ["10.244.0.21"], ports=[("dns", 53, "UDP")])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recording(FakeBackend):
    """FakeBackend that keeps every transaction it was sent (refused ones too)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[list[Mapping[str, Any]]] = []
        self.refuse_next: NftRejected | None = None

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        if commands:
            self.sent.append(list(commands))
        if self.refuse_next is not None and commands:
            error, self.refuse_next = self.refuse_next, None
            raise error
        super().commit(commands, fresh=fresh)


class OldKernel(Recording):
    """A kernel < 6.2: deleting a chain in the transaction that deletes the
    map element jumping to it fails with EBUSY (the reference goes away
    asynchronously); the same delete in a later transaction works."""

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        kinds = {type(c) for c in commands}
        if DeleteChain in kinds and DeleteElements in kinds:
            self.sent.append(list(commands))
            raise NftBusy("Could not process rule: Device or resource busy")
        super().commit(commands, fresh=fresh)


def listing(backend: FakeBackend) -> str:
    """Our tables of both families by content (each family's main and
    affinity tables; handles and listing order ignored), of whichever name
    of the pair is live."""
    live = live_name(backend.list_table_objects, CONFIG.table_name)
    return json.dumps(
        [
            canonical(list_family(backend.list_table, f, live))
            for f in ("ip", "ip6")
        ],
        sort_keys=True,
    )


@contextlib.contextmanager
def started(backend: FakeBackend) -> Iterator[FakeBackend]:
    backend.start()
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def backend() -> Iterator[Recording]:
    with started(Recording()) as b:
        assert isinstance(b, Recording)
        yield b


@pytest.fixture
def clock() -> Clock:
    return Clock()


def feed(proxier: Proxier, problems: list[InvalidField] | None = None) -> Intake:
    """The agent's intake in front of the proxier (raw objects in)."""
    return intake(proxier, NODE, problems)


def listed(proxier: Proxier, *objects: dict[str, Any]) -> Intake:
    """Feed the node, `objects` and the end of both initial lists."""
    events = feed(proxier)
    initial_list(events, [node(NODE, ["192.168.50.1"], pod_cidrs=["10.244.0.0/24"]), *objects])
    return events


def full_table_of(*objects: dict[str, Any]) -> str:
    """What one full sync of `objects` builds from scratch."""
    with started(Recording()) as fresh:
        proxier = Proxier(CONFIG, fresh)
        listed(proxier, *objects)
        assert proxier.sync().full
        return listing(fresh)


# --- full and partial -----------------------------------------------------------------


def test_nothing_is_programmed_before_both_lists(backend: Recording, clock: Clock) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    events = feed(proxier)
    events.on_service(None, WEB)
    events.on_synced(KIND_SERVICES)
    report = proxier.sync()
    assert report.skipped == "waiting for the initial list"
    assert backend.sent == []
    events.on_synced(KIND_ENDPOINT_SLICES)
    assert proxier.sync().full


def test_first_sync_is_full_then_only_what_changed(backend: Recording, clock: Clock) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    events = listed(proxier, WEB, WEB_EPS, DNS, DNS_EPS)
    first = proxier.sync()
    assert first.full and first.ops > 0
    moved = endpoint_slice("web", [("10.244.0.11", NODE), ("10.244.1.13", "node-b")])
    events.on_endpoint_slice(WEB_EPS, moved)
    second = proxier.sync()
    assert not second.full
    web = {spn.service for spn in second.updated}
    assert web == {NamespacedName("ns", "web")}
    assert 0 < second.ops < first.ops
    assert listing(backend) == full_table_of(WEB, moved, DNS, DNS_EPS)


def _dispatch_targets(backend: FakeBackend) -> dict[str, str]:
    """service-ips / service-nodeports of the ip table: key text -> the
    verdict (`goto <chain>`, `drop`, ...)."""
    doc = backend.list_table("ip", CONFIG.table_name)
    assert doc is not None
    out = {}
    for item in doc["nftables"]:
        found = item.get("map", {})
        if found.get("name") in ("service-ips", "service-nodeports"):
            for key, verdict in found.get("elem", []):
                val = key["elem"]["val"] if "elem" in key else key
                ((kind, body),) = verdict.items()
                target = f" {body['target']}" if isinstance(body, dict) else ""
                out[json.dumps(val.get("concat", val))] = kind + target
    return out


def test_a_partial_sync_writes_what_a_full_sync_writes(
    backend: Recording, clock: Clock
) -> None:
    """Each shared destination is a goto to the chooser of its endpoint
    count, whichever sync wrote it: a third endpoint moves web's two
    destinations to the choosers of 3 in a partial sync, which adds them
    (their first user) and deletes the choosers of 2 (their last); the
    table is then the one a full sync of the same cluster builds."""
    proxier = Proxier(CONFIG, backend, clock=clock)
    events = listed(proxier, WEB, WEB_EPS, DNS, DNS_EPS)
    assert proxier.sync().full
    web, web_np, dns = ('["10.96.0.10", "tcp", 80]', '["tcp", 30080]', '["10.96.0.53", "udp", 53]')
    assert _dispatch_targets(backend) == {
        web: "goto dispatch-tcp-2", web_np: "goto dispatch-nodeport-tcp-2",
        dns: "goto dispatch-udp-1"}
    three = endpoint_slice("web", [("10.244.0.11", NODE), ("10.244.1.12", "node-b"),
                                   ("10.244.1.13", "node-b")])
    events.on_endpoint_slice(WEB_EPS, three)
    assert not proxier.sync().full
    assert _dispatch_targets(backend) == {
        web: "goto dispatch-tcp-3", web_np: "goto dispatch-nodeport-tcp-3",
        dns: "goto dispatch-udp-1"}
    chains = _chains(backend)
    assert {"dispatch-tcp-3", "dispatch-nodeport-tcp-3", "dispatch-udp-1"} <= chains
    assert not {"dispatch-tcp-2", "dispatch-nodeport-tcp-2"} & chains
    assert listing(backend) == full_table_of(WEB, three, DNS, DNS_EPS)


def test_no_change_sends_nothing(backend: Recording, clock: Clock) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    events = listed(proxier, WEB, WEB_EPS)
    proxier.sync()
    sent = len(backend.sent)
    events.on_service(WEB, WEB)  # an informer resync
    report = proxier.sync()
    assert (report.full, report.ops) == (False, 0)
    assert len(backend.sent) == sent


# --- refusals ---------------------------------------------------------------------


def test_a_refused_commit_changes_nothing_and_the_next_sync_is_full(
    backend: Recording, clock: Clock
) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    events = listed(proxier, WEB, WEB_EPS)
    proxier.sync()
    before_kernel = listing(backend)
    before_state = dict(proxier.table_state(IPFamily.IPV4).fragments)
    backend.refuse_next = NftRejected("Could not process rule: Invalid argument")
    events.on_service(None, DNS)
    events.on_endpoint_slice(None, DNS_EPS)
    with pytest.raises(NftRejected):
        proxier.sync()
    # dns would be the first user of vip-endpoints-udp: declared in the
    # refused transaction, it is not there either
    assert listing(backend) == before_kernel
    assert proxier.table_state(IPFamily.IPV4).fragments == before_state
    repair = proxier.sync()
    assert repair.full
    assert listing(backend) == full_table_of(WEB, WEB_EPS, DNS, DNS_EPS)


def test_ebusy_defers_chain_deletes_to_a_later_transaction(clock: Clock) -> None:
    with started(OldKernel()) as backend:
        assert isinstance(backend, OldKernel)
        proxier = Proxier(CONFIG, backend, clock=clock)
        # ClientIP affinity: its KUBE-SVC and KUBE-EXT chains (rules/dispatch.py:
        # a port without affinity goes through shared choosers, no chain of its own)
        web = service("web", "10.96.0.10", type="NodePort", node_ports=[30080],
                      affinity_timeout=600)
        events = listed(proxier, web, WEB_EPS, DNS, DNS_EPS)
        proxier.sync()
        events.on_service(web, None)  # its chains go
        with pytest.raises(NftBusy):
            proxier.sync()
        retry = proxier.sync()  # full, with the chain deletes deferred
        assert retry.full
        stale = proxier.table_state(IPFamily.IPV4).stale_chains
        assert stale and all(kernel_name(name).startswith("KUBE-") for name in stale)
        chains = _chains(backend)
        assert stale <= chains, "left flushed in the kernel"
        gc_before = len(backend.sent)
        proxier.sync()  # no change: only the deferred deletes go out
        deletes = backend.sent[gc_before]
        assert {next(iter(command_json(c))) for c in deletes} == {"delete"}
        assert not proxier.table_state(IPFamily.IPV4).stale_chains
        assert not stale & _chains(backend)
        assert listing(backend) == full_table_of(DNS, DNS_EPS, WEB_EPS)


def _chains(backend: FakeBackend) -> set[str]:
    """The chains of our tables, as the planner names them."""
    listed = list_family_objects(backend.list_table_objects, "ip", CONFIG.table_name)
    return set(listed.chains) if listed is not None else set()


# --- when a sync is full ----------------------------------------------------------


def test_the_periodic_full_sync(backend: Recording, clock: Clock) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    listed(proxier, WEB, WEB_EPS)
    assert proxier.sync().full
    clock.now += CONFIG.full_sync_period - 1
    assert not proxier.sync().full
    clock.now += 1
    assert proxier.sync().full
    assert not proxier.sync().full


def test_a_node_change_makes_the_next_sync_full(backend: Recording, clock: Clock) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    events = listed(proxier, WEB, WEB_EPS)
    proxier.sync()
    events.on_node(node(NODE, ["192.168.50.1"], pod_cidrs=["10.244.0.0/24"]))
    assert not proxier.sync().full, "the same node is no change"
    events.on_node(node(NODE, ["192.168.50.1", "192.168.50.7"], pod_cidrs=["10.244.0.0/24"]))
    assert proxier.sync().full
    assert proxier.node().ipv4 == ("192.168.50.1", "192.168.50.7")


def test_a_service_cidr_change_makes_the_next_sync_full(
    backend: Recording, clock: Clock
) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    events = listed(proxier, WEB, WEB_EPS)
    proxier.sync()
    cidr = {"kind": "ServiceCIDR", "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": ["10.96.0.0/16"]}}
    events.on_service_cidrs([cidr])
    assert proxier.sync().full
    events.on_service_cidrs([cidr])
    assert not proxier.sync().full


# --- invalid input --------------------------------------------------------------


def test_an_invalid_field_is_reported_once_when_its_event_arrives(
    backend: Recording, clock: Clock
) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    problems: list[InvalidField] = []
    events = feed(proxier, problems)
    bad = service("bad", "10.96.0.66", ports=[("http", 70000, "TCP")])
    bad["metadata"]["uid"] = "u-1"
    events.on_service(None, bad)
    assert [(p.problem.kind, p.problem.obj, p.problem.field) for p in problems] == [
        ("Service", "ns/bad", "spec.ports[0].port")
    ]
    assert (problems[0].namespace, problems[0].name, problems[0].uid) == ("ns", "bad", "u-1")
    events.on_service(bad, bad)  # a resync: not again
    assert len(problems) == 1
    listed(proxier, WEB, WEB_EPS)
    proxier.sync()
    assert len(problems) == 1, "nothing is reported at sync time"
    assert listing(backend) == full_table_of(WEB, WEB_EPS)
    assert "10.96.0.66" not in listing(backend)


def test_slice_node_and_cidr_problems_go_into_the_same_stream(backend: Recording) -> None:
    proxier = Proxier(CONFIG, backend)
    problems: list[InvalidField] = []
    events = feed(proxier, problems)
    events.on_endpoint_slice(None, endpoint_slice("web", ["10.244.0.11", "10.244.0.999"]))
    bad_node = node(NODE, ["192.168.50.1"], pod_cidrs=["10.244.0.0/99"])
    events.on_node(bad_node)
    events.on_node(bad_node)
    events.on_service_cidrs([{"kind": "ServiceCIDR", "metadata": {"name": "c"},
                              "spec": {"cidrs": ["nonsense"]}}])
    assert [(p.problem.kind, p.problem.field) for p in problems] == [
        ("EndpointSlice", "endpoints[1].addresses[0]"),
        ("Node", "spec.podCIDRs[0]"),
        ("ServiceCIDR", "spec.cidrs[0]"),
    ]
    assert proxier.node().name == NODE, "the valid part of the Node is kept"


def test_a_problem_that_goes_and_comes_back_is_reported_again(backend: Recording) -> None:
    proxier = Proxier(CONFIG, backend)
    problems: list[InvalidField] = []
    events = feed(proxier, problems)
    bad = service("web", "10.96.0.10", ports=[("http", 70000, "TCP")])
    events.on_service(None, bad)
    events.on_service(bad, WEB)
    events.on_service(WEB, bad)
    events.on_service(bad, None)
    events.on_service(None, bad)
    assert len(problems) == 3


# --- what the report is -----------------------------------------------------------


def test_the_report_is_values_later_syncs_do_not_change(
    backend: Recording, clock: Clock
) -> None:
    proxier = Proxier(CONFIG, backend, clock=clock)
    events = listed(proxier, WEB, WEB_EPS)
    first = proxier.sync()
    v4 = first.families[0]
    services_then = dict(v4.state.services)
    endpoints_then = dict(v4.state.endpoints)
    events.on_service(None, DNS)
    events.on_endpoint_slice(WEB_EPS, None)
    proxier.sync()
    assert dict(v4.state.services) == services_then
    assert dict(v4.state.endpoints) == endpoints_then
    assert v4.table.chains > 0 and v4.table.elements > 0
    assert first.health_check_ports == {}


def test_hooks_get_the_report_and_a_failing_hook_breaks_nothing(
    backend: Recording, clock: Clock
) -> None:
    seen: list[SyncReport] = []

    def broken(report: SyncReport) -> None:
        raise RuntimeError("hook bug")

    proxier = Proxier(CONFIG, backend, hooks=[broken, seen.append], clock=clock)
    listed(proxier, WEB, WEB_EPS)
    report = proxier.sync()
    assert seen == [report]


def test_changes_call_on_change_and_are_counted_as_pending(backend: Recording) -> None:
    kicks: list[None] = []
    proxier = Proxier(CONFIG, backend, on_change=lambda: kicks.append(None))
    events = feed(proxier)
    events.on_service(None, WEB)
    events.on_endpoint_slice(None, WEB_EPS)
    assert len(kicks) == 2
    assert proxier.pending_changes() == (1, 1)
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)
    proxier.sync()
    assert proxier.pending_changes() == (0, 0)


class RecordingHeap:
    """Records its calls, and how many commits the backend had seen when
    a build ended (the commit is inside the bracket)."""

    def __init__(self, backend: Recording) -> None:
        self.backend = backend
        self.calls: list[tuple[str, bool | int]] = []

    @contextlib.contextmanager
    def building(self, full: bool) -> Iterator[None]:
        self.calls.append(("building", full))
        sent = len(self.backend.sent)
        try:
            yield
        finally:
            self.calls.append(("built, commits", len(self.backend.sent) - sent))

    def settled(self, full: bool) -> None:
        self.calls.append(("settled", full))


def test_the_heap_policy_brackets_build_and_commit_and_settles_after_the_hooks(
    backend: Recording, clock: Clock
) -> None:
    heap = RecordingHeap(backend)
    proxier = Proxier(
        CONFIG, backend, heap=heap, clock=clock,
        hooks=[lambda report: heap.calls.append(("hook", report.full))],
    )
    events = listed(proxier, WEB, WEB_EPS)
    proxier.sync()
    events.on_service(None, DNS)
    proxier.sync()
    backend.refuse_next = NftRejected("Could not process rule: Invalid argument")
    events.on_service(DNS, None)
    with pytest.raises(NftRejected):
        proxier.sync()
    assert heap.calls == [
        # a full sync of one chunk is one transaction
        ("building", True), ("built, commits", 1), ("hook", True), ("settled", True),
        ("building", False), ("built, commits", 1), ("hook", False), ("settled", False),
        ("building", False), ("built, commits", 1),  # sent, refused: nothing settles
    ]


def test_a_chunked_full_syncs_records_are_made_beside_its_render(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's owners are compacted (chains digested, elements packed) in
    the render-ahead thread, not by the staging that holds the GIL while
    the kernel takes the chunk before; first start and resync alike."""
    made: list[str] = []

    def compact_noting(fragment: Fragment) -> CompactFragment:
        made.append(threading.current_thread().name)
        return compact(fragment)

    monkeypatch.setattr(chunked, "compact", compact_noting)
    objects = []
    for i in range(6):
        objects += [service(f"s{i}", f"10.96.1.{i + 1}"),
                    endpoint_slice(f"s{i}", [(f"10.244.0.{i + 1}", NODE)])]
    with started(Snapshots()) as backend:
        proxier = Proxier(CONFIG, backend, clock=clock, fresh_chunk=2)
        listed(proxier, *objects)
        proxier.sync()
        assert len(made) == 6 and all(n.startswith("render-ahead") for n in made)
        records = dict(proxier.table_state(IPFamily.IPV4).fragments)
        made.clear()
        proxier.request_full_sync()
        proxier.sync()
        assert len(made) == 6 and all(n.startswith("render-ahead") for n in made)
        assert proxier.table_state(IPFamily.IPV4).fragments.keys() == records.keys()


def test_plan_full_never_touches_the_kernel(backend: Recording) -> None:
    proxier = Proxier(CONFIG, backend)
    listed(proxier, WEB, WEB_EPS)
    planned = proxier.plan_full()
    assert planned.commands and backend.sent == []
    assert planned.input.full and planned.input.node.ipv4 == ("192.168.50.1",)
    assert listing(backend) == json.dumps([None, None])


# --- the first full sync onto absent tables ---------------------------------------------


class Snapshots(Recording):
    """Recording that also keeps, after each commit, what traffic reaches:
    the ip table of the pair that has base chains (None: neither)."""

    def __init__(self) -> None:
        super().__init__()
        self.after: list[str | None] = []

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        super().commit(commands, fresh=fresh)
        if commands:
            self.after.append(self.hooked())

    def hooked(self) -> str | None:
        for name in table_pair(CONFIG.table_name):
            objects = list_family_objects(self.list_table_objects, "ip", name)
            if objects is not None and objects.hooked:
                doc = list_family(self.list_table, "ip", name)
                return json.dumps(canonical(doc), sort_keys=True)
        return None


def test_a_full_sync_in_steps_is_reached_by_traffic_only_once_complete(clock: Clock) -> None:
    """A full sync of more than one chunk is built in a table no hook
    reaches, then switched to in one transaction that adds its base chains
    and deletes the live tables: after every commit traffic reaches nothing,
    the whole old table or the whole new one. Onto absent tables, and over
    existing ones (a restart, the periodic full sync), whose name alternates."""
    objects = []
    for i in range(6):
        objects += [service(f"s{i}", f"10.96.1.{i + 1}"),
                    endpoint_slice(f"s{i}", [(f"10.244.0.{i + 1}", NODE),
                                             (f"10.244.1.{i + 1}", "node-b")])]
    whole = Recording()
    with started(whole):
        one = Proxier(CONFIG, whole, clock=clock)
        listed(one, *objects)
        one.sync()
        assert len(whole.sent) == 1  # one chunk: one transaction
        want = json.dumps(canonical(list_family(whole.list_table, "ip", "nftproxy")),
                          sort_keys=True)
    with started(Snapshots()) as backend:
        assert isinstance(backend, Snapshots)
        proxier = Proxier(CONFIG, backend, clock=clock, fresh_chunk=3)
        listed(proxier, *objects)
        report = proxier.sync()
        assert report.full and report.ops == sum(map(len, backend.sent))
        # leftovers deleted, the skeleton, 3 chunks of 2 services (4 endpoints
        # >= 3 each), the switch
        assert len(backend.sent) == 6
        assert backend.after == [None] * 5 + [want]
        backend.sent.clear()
        backend.after.clear()
        proxier.request_full_sync()
        assert proxier.sync().full
        assert len(backend.sent) == 6
        assert backend.after == [want] * 6
        assert backend.list_table("ip", "nftproxy") is None
        assert backend.list_table("ip", "nftproxy-b") is not None
        proxier.request_full_sync()
        assert proxier.sync().full and backend.list_table("ip", "nftproxy-b") is None
        assert backend.after[-1] == want


def _six_services() -> list[dict[str, Any]]:
    objects = []
    for i in range(6):
        objects += [service(f"s{i}", f"10.96.1.{i + 1}"),
                    endpoint_slice(f"s{i}", [(f"10.244.0.{i + 1}", NODE)])]
    return objects


class Overlapping(Recording):
    """Recording whose commit of the first chunk waits (10 s at most) until
    the step after it has been encoded."""

    def __init__(self) -> None:
        super().__init__()
        self.encodes = 0
        self.next_encoded = threading.Event()
        self.overlapped: bool | None = None

    def encoded(self, commands: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
        self.encodes += 1
        if self.encodes == 4:  # leftovers, the skeleton, the first chunk, the second
            self.next_encoded.set()
        return super().encoded(commands)

    def commit(self, commands: Sequence[Mapping[str, Any]], *, fresh: bool = False) -> None:
        if len(self.sent) == 2:  # the first chunk
            self.overlapped = self.next_encoded.wait(10)
        super().commit(commands, fresh=fresh)


def test_a_step_commits_while_the_next_is_staged(clock: Clock) -> None:
    """libnftables takes one chunk while the agent stages and encodes the
    next: the steps are recorded as taken, committed in a thread of their own."""
    with started(Overlapping()) as backend:
        assert isinstance(backend, Overlapping)
        proxier = Proxier(CONFIG, backend, clock=clock, fresh_chunk=2)
        listed(proxier, *_six_services())
        assert proxier.sync().full
        assert backend.overlapped is True
        assert len(backend.sent) == 6
        table = listing(backend)
        proxier.request_full_sync()
        assert proxier.sync().full and listing(backend) == table


def test_a_refused_first_sync_of_one_transaction_leaves_no_table(
    backend: Recording, clock: Clock
) -> None:
    """libnftables 1.0.6 declares some maps in a text transaction of their
    own before the commands: when the commands are refused, the tables
    those declarations created are deleted too."""
    proxier = Proxier(CONFIG, backend, clock=clock)
    listed(proxier, WEB, WEB_EPS)
    backend.refuse_next = NftRejected("Could not process rule: Invalid argument")
    with pytest.raises(NftRejected):
        proxier.sync()
    assert not backend.run_json({"list": {"tables": {}}})["nftables"][1:]
    assert proxier.sync().full and listing(backend) != json.dumps([None, None])


def test_a_refused_chunk_leaves_no_table_and_the_next_sync_converges(
    backend: Recording, clock: Clock
) -> None:
    """The record runs ahead of the kernel by one step: after a refused chunk
    nothing after it is committed, what the build committed is deleted (a
    first start that fails leaves no table), and the next (full) sync builds
    what one transaction would."""
    objects = _six_services()
    whole = Recording()
    with started(whole):
        one = Proxier(CONFIG, whole, clock=clock)
        listed(one, *objects)
        one.sync()
        want = listing(whole)
    original = backend.commit

    def refuse_the_second_chunk(
        commands: Sequence[Mapping[str, Any]], *, fresh: bool = False
    ) -> None:
        if len(backend.sent) == 3:
            backend.refuse_next = NftRejected("Could not process rule: Invalid argument")
        original(commands, fresh=fresh)

    backend.commit = refuse_the_second_chunk  # type: ignore[method-assign]
    proxier = Proxier(CONFIG, backend, clock=clock, fresh_chunk=2)
    listed(proxier, *objects)
    with pytest.raises(NftRejected):
        proxier.sync()
    # leftovers, the skeleton, the first chunk, the refused one, the build deleted
    assert len(backend.sent) == 5
    assert not [t for t in threading.enumerate() if t.name.startswith(("render-ahead", "commit"))]
    assert not backend.run_json({"list": {"tables": {}}})["nftables"][1:]
    report = proxier.sync()
    assert report.full and len(backend.sent) > 6
    assert listing(backend) == want
