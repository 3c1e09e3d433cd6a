"""Conntrack cleanup without the kernel: what a sync decides to clean, and how
the apply loop treats the table.

Aspects:
- plan(): after a sync through the real Proxier (FakeBackend), the filters
  name every original destination of each UDP/SCTP service port the sync
  touched (cluster IP, external IPs, LB VIPs, node port) and keep only
  serving endpoints; TCP is ignored; partial syncs stay O(changed), full
  syncs cover every UDP/SCTP port; deleted services keep nothing unless
  their destination was re-claimed;
- apply() over FakeConntrack: allowed reply sources survive, everything else
  matching goes, other destinations are untouched; ENOENT counts as vanished;
  other failures are counted, never raised;
- the hook: plans, applies, logs, reports, and never raises.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from feed import intake
from k8s import endpoint_slice, node, service

from nftproxy.agent.proxier import Proxier
from nftproxy.agent.report import SyncReport
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.core.conntrack import CleanupResult, Flow, FlowFilter, Query, apply_filters, plan
from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.kernel.conntrack import _PORT_DUMPS, Conntrack, _dumper, conntrack_hook
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.fake_conntrack import FakeConntrack

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
UDP, TCP, SCTP = L4Protocol.UDP, L4Protocol.TCP, L4Protocol.SCTP
NODE = "node-a"
CONFIG = ProxyConfig(node_name=NODE, cluster_cidrs=("10.244.0.0/16", "fd00:244::/48"))
Obj = dict[str, Any]

DNS = (("dns", 53, "UDP"),)
EP_A, EP_B, EP_C = "10.244.1.2", "10.244.1.3", "10.244.2.4"


def F(
    ip: str | None, port: int, *keep: str, proto: L4Protocol = UDP, family: IPFamily = V4
) -> FlowFilter:
    return FlowFilter(family, proto, port, ip, frozenset(keep))


def dns(name: str = "dns", ip: str | Sequence[str] = "10.96.0.10", **kw: Any) -> Obj:
    kw.setdefault("ports", DNS)
    return service(name, ip, **kw)


def eps(svc: str, ips: Sequence[Any], *, ports: Any = DNS, **kw: Any) -> Obj:
    return endpoint_slice(svc, list(ips), ports=ports, **kw)


# ---- plan(): table-driven over real syncs ----------------------------------------------

Change = tuple[str, Obj | None, Obj | None]  # ("svc" | "eps", previous, current)


@dataclass
class Case:
    id: str
    before: list[Obj]
    changes: list[Change]
    expected: list[FlowFilter]
    full: bool = False
    objs: list[Obj] = field(default_factory=list)


def _objs_kind(obj: Obj) -> str:
    return "svc" if obj["kind"] == "Service" else "eps"


def _feed(proxier: Proxier, kind: str, previous: Obj | None, current: Obj | None) -> None:
    if kind == "svc":
        intake(proxier).on_service(previous, current)
    else:
        intake(proxier).on_endpoint_slice(previous, current)


def started_proxier(objects: Sequence[Obj]) -> tuple[Proxier, list[SyncReport]]:
    """A Proxier over FakeBackend that has done its first (full) sync."""
    reports: list[SyncReport] = []
    backend = FakeBackend()
    backend.start()
    proxier = Proxier(CONFIG, backend, hooks=[reports.append])
    intake(proxier).on_node(node(NODE, ["192.168.50.1", "fd00:50::1"]))
    for obj in objects:
        _feed(proxier, _objs_kind(obj), None, obj)
    intake(proxier).on_synced(KIND_SERVICES)
    intake(proxier).on_synced(KIND_ENDPOINT_SLICES)
    proxier.sync()
    return proxier, reports


A_SLICE = eps("dns", [EP_A])
CASES = [
    Case(
        "an endpoint replaced: flows to the cluster IP keep only the new one",
        [dns(), A_SLICE],
        [("eps", A_SLICE, eps("dns", [EP_B]))],
        [F("10.96.0.10", 53, EP_B)],
    ),
    Case(
        "one of two endpoints removed: the other one is kept",
        [dns(), eps("dns", [EP_A, EP_B])],
        [("eps", eps("dns", [EP_A, EP_B]), eps("dns", [EP_B]))],
        [F("10.96.0.10", 53, EP_B)],
    ),
    Case(
        "last endpoint removed (n -> 0): every flow to the service goes",
        [dns(), A_SLICE],
        [("eps", A_SLICE, None)],
        [F("10.96.0.10", 53)],
    ),
    Case(
        "0 -> 1 endpoints: flows cached while the service had none go",
        [dns()],
        [("eps", None, A_SLICE)],
        [F("10.96.0.10", 53, EP_A)],
    ),
    Case(
        "service and endpoints appear in one sync",
        [],
        [("svc", None, dns()), ("eps", None, A_SLICE)],
        [F("10.96.0.10", 53, EP_A)],
    ),
    Case(
        "service deleted: nothing is kept for any of its destinations",
        [dns(type="NodePort", node_ports=[30053]), A_SLICE],
        [("svc", dns(type="NodePort", node_ports=[30053]), None)],
        [F(None, 30053), F("10.96.0.10", 53)],
    ),
    Case(
        "service deleted and its cluster IP re-used by a new service in the same sync",
        [dns("old"), eps("old", [EP_A])],
        [
            ("svc", dns("old"), None),
            ("svc", None, dns("new")),
            ("eps", None, eps("new", [EP_B])),
        ],
        [F("10.96.0.10", 53, EP_B)],
    ),
    Case(
        "a TCP service is ignored",
        [service("web", "10.96.0.20"), endpoint_slice("web", [EP_A])],
        [("eps", endpoint_slice("web", [EP_A]), endpoint_slice("web", [EP_B]))],
        [],
    ),
    Case(
        "node port: flows to the node port on any address",
        [dns(type="NodePort", node_ports=[30053]), A_SLICE],
        [("eps", A_SLICE, eps("dns", [EP_B]))],
        [F(None, 30053, EP_B), F("10.96.0.10", 53, EP_B)],
    ),
    Case(
        "external IPs and load-balancer VIPs are destinations too",
        [
            dns(type="LoadBalancer", external_ips=["192.168.99.1"], lb_ips=["1.2.3.4"]),
            A_SLICE,
        ],
        [("eps", A_SLICE, eps("dns", [EP_B]))],
        [F("1.2.3.4", 53, EP_B), F("10.96.0.10", 53, EP_B), F("192.168.99.1", 53, EP_B)],
    ),
    Case(
        "IPv6: one filter per family, addresses in canonical form",
        [dns(ip=["10.96.0.10", "fd00:96::a"]), A_SLICE, eps("dns", ["fd00:244::2"])],
        [("eps", eps("dns", ["fd00:244::2"]), eps("dns", ["fd00:244:0::3"]))],
        [F("fd00:96::a", 53, "fd00:244::3", family=V6)],
    ),
    Case(
        "SCTP is cleaned like UDP",
        [
            service("sig", "10.96.0.30", ports=[("sig", 3868, "SCTP")]),
            endpoint_slice("sig", [EP_A], ports=[("sig", 3868, "SCTP")]),
        ],
        [
            (
                "eps",
                endpoint_slice("sig", [EP_A], ports=[("sig", 3868, "SCTP")]),
                endpoint_slice("sig", [EP_B], ports=[("sig", 3868, "SCTP")]),
            )
        ],
        [F("10.96.0.30", 3868, EP_B, proto=SCTP)],
    ),
    Case(
        "a serving terminating endpoint is kept, a non-serving one is not",
        [dns(), A_SLICE],
        [
            (
                "eps",
                A_SLICE,
                eps(
                    "dns",
                    [
                        {"ip": EP_A, "ready": False, "serving": True, "terminating": True},
                        {"ip": EP_B, "ready": False, "serving": False, "terminating": True},
                        EP_C,
                    ],
                ),
            )
        ],
        [F("10.96.0.10", 53, EP_A, EP_C)],
    ),
    Case(
        "a partial sync looks only at the ports it changed",
        [dns("one"), eps("one", [EP_A]), dns("two", "10.96.0.11"), eps("two", [EP_A])],
        [("eps", eps("two", [EP_A]), eps("two", [EP_B]))],
        [F("10.96.0.11", 53, EP_B)],
    ),
    Case(
        "a full sync reconciles every UDP and SCTP port, changed or not",
        [
            dns("one"),
            eps("one", [EP_A]),
            dns("two", "10.96.0.11"),
            service("web", "10.96.0.20"),
            service("sig", "10.96.0.30", ports=[("sig", 3868, "SCTP")]),
        ],
        [],
        [
            F("10.96.0.30", 3868, proto=SCTP),
            F("10.96.0.10", 53, EP_A),
            F("10.96.0.11", 53),
        ],
        full=True,
    ),
    Case(
        "a sync that changed nothing plans nothing",
        [dns(), A_SLICE],
        [],
        [],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan(case: Case) -> None:
    proxier, reports = started_proxier(case.before)
    for kind, previous, current in case.changes:
        _feed(proxier, kind, previous, current)
    if case.full:
        proxier.request_full_sync()
    report = proxier.sync()
    assert report.full is case.full
    assert plan(reports[-1]) == case.expected


def test_plan_of_a_skipped_sync_is_empty() -> None:
    backend = FakeBackend()
    backend.start()
    report = Proxier(CONFIG, backend).sync()
    assert report.skipped and plan(report) == []


# ---- apply() against FakeConntrack ----------------------------------------------------


def flow(
    dst: str,
    dport: int,
    reply_src: str,
    *,
    src: str = "192.168.50.2",
    sport: int = 40000,
    proto: L4Protocol = UDP,
    family: IPFamily = V4,
) -> Flow:
    return Flow(family, proto, src, dst, sport, dport, reply_src)


TO_A = flow("10.96.0.10", 53, EP_A, sport=1)
TO_B = flow("10.96.0.10", 53, EP_B, sport=2)
UNNATED = flow("10.96.0.10", 53, "10.96.0.10", sport=3)  # cached before any DNAT
NODEPORT_A = flow("192.168.50.1", 30053, EP_A, sport=4)
OTHER_PORT = flow("10.96.0.10", 54, EP_A, sport=5)
OTHER_IP = flow("10.96.0.99", 53, EP_A, sport=6)
TCP_A = flow("10.96.0.10", 53, EP_A, sport=7, proto=TCP)
V6_A = flow("fd00:96::a", 53, "fd00:244::2", src="fd00:50::2", family=V6)
V6_B = flow("fd00:96:0:0::a", 53, "fd00:244:0::3", src="fd00:50::2", sport=2, family=V6)
TABLE = [TO_A, TO_B, UNNATED, NODEPORT_A, OTHER_PORT, OTHER_IP, TCP_A, V6_A, V6_B]


def fake(flows: Sequence[Flow] = TABLE, **kw: Any) -> FakeConntrack:
    ct = FakeConntrack(flows, **kw)
    ct.start()
    return ct


@dataclass
class ApplyCase:
    id: str
    filters: list[FlowFilter]
    left: list[Flow]
    deleted: int


APPLY_CASES = [
    ApplyCase(
        "flows answered by an allowed endpoint stay, the others go",
        [F("10.96.0.10", 53, EP_B)],
        [TO_B, NODEPORT_A, OTHER_PORT, OTHER_IP, TCP_A, V6_A, V6_B],
        2,
    ),
    ApplyCase(
        "an empty keep set deletes every flow to the destination",
        [F("10.96.0.10", 53)],
        [NODEPORT_A, OTHER_PORT, OTHER_IP, TCP_A, V6_A, V6_B],
        3,
    ),
    ApplyCase(
        "a node port filter matches any destination address",
        [F(None, 30053, EP_B)],
        [f for f in TABLE if f != NODEPORT_A],
        1,
    ),
    ApplyCase(
        "IPv6 addresses compare in canonical form",
        [F("fd00:96::a", 53, "fd00:244::3", family=V6)],
        [f for f in TABLE if f != V6_A],
        1,
    ),
    ApplyCase(
        "no filter, nothing happens",
        [],
        TABLE,
        0,
    ),
]


@pytest.mark.parametrize("case", APPLY_CASES, ids=[c.id for c in APPLY_CASES])
def test_apply(case: ApplyCase) -> None:
    ct = fake()
    result = ct.apply(case.filters)
    assert ct.flows == case.left
    assert (result.deleted, result.errors, result.vanished) == (case.deleted, 0, 0)
    assert result.filters == len(case.filters)


def test_apply_counts_entries_that_vanished_meanwhile_as_vanished_not_errors() -> None:
    ct = fake(vanishing=[TO_A])
    result = ct.apply([F("10.96.0.10", 53, EP_B)])
    assert (result.deleted, result.vanished, result.errors) == (1, 1, 0)
    assert TO_A not in ct.flows and UNNATED not in ct.flows


def test_apply_counts_other_delete_failures_and_carries_on() -> None:
    ct = fake(failing={TO_A: errno.EPERM})
    result = ct.apply([F("10.96.0.10", 53, EP_B), F(None, 30053)])
    assert (result.deleted, result.errors) == (2, 1)
    assert "Operation not permitted" in result.messages[0] or "EPERM" in result.messages[0]
    assert TO_A in ct.flows and NODEPORT_A not in ct.flows


def test_apply_counts_a_failed_dump_and_runs_the_next_query() -> None:
    ct = fake(broken=[Query(V4, UDP, 53, "10.96.0.10")])
    result = ct.apply([F("10.96.0.10", 53, EP_B), F(None, 30053)])
    assert (result.deleted, result.errors) == (1, 1)
    assert result.messages[0].startswith("dump udp 10.96.0.10:53")


def test_apply_dumps_once_per_port_and_filters_by_address_when_alone() -> None:
    ct = fake()
    ct.apply(
        [
            F("10.96.0.10", 53, EP_B),
            F("10.96.0.99", 53),
            F(None, 30053),
            F("fd00:96::a", 53, family=V6),
        ]
    )
    assert ct.dumps == [
        Query(V4, UDP, 53),  # two services on port 53: one dump, addresses checked here
        Query(V4, UDP, 30053),
        Query(V6, UDP, 53, "fd00:96::a"),
    ]
    assert ct.flows == [TO_B, OTHER_PORT, TCP_A]


def test_a_flow_two_filters_match_goes_if_either_calls_it_stale() -> None:
    clash = flow("10.96.0.10", 30053, EP_A)  # a service port equal to a node port
    ct = fake([clash])
    result = ct.apply([F("10.96.0.10", 30053, EP_A), F(None, 30053, EP_B)])
    assert (result.matched, result.deleted, ct.flows) == (1, 1, [])


def test_apply_keeps_only_the_first_error_messages() -> None:
    flows = [flow("10.96.0.10", 53, EP_A, sport=p) for p in range(1, 31)]
    ct = fake(flows, failing={f: errno.EIO for f in flows})
    result = ct.apply([F("10.96.0.10", 53)])
    assert result.errors == 30 and len(result.messages) == 10


def test_apply_reports_its_duration_from_the_clock() -> None:
    ticks = iter([10.0, 10.25])
    ct = fake(clock=lambda: next(ticks))
    assert ct.apply([F("10.96.0.10", 53)]).seconds == 0.25


def test_conntrack_constructor_does_no_io_and_apply_needs_start() -> None:
    ct = Conntrack(netns="nftpx-no-such-namespace")
    with pytest.raises(RuntimeError, match="not started"):
        ct.apply([F("10.96.0.10", 53)])
    ct.close()  # idempotent, nothing to close


class RecordingLink:
    """kernel/conntrack.py's socket as `_dumper` uses it: the flows of the
    protocol and ports asked for (the address is checked by the core), and
    the dumps asked for."""

    def __init__(self, flows: Sequence[Flow]) -> None:
        self.flows = flows
        self.dumps: list[tuple[IPFamily, L4Protocol, list[int], str | None]] = []

    def dump(
        self, family: IPFamily, protocol: L4Protocol, ports: frozenset[int], ip: str | None
    ) -> list[Flow]:
        self.dumps.append((family, protocol, sorted(ports), ip))
        return [f for f in self.flows if (f.family, f.protocol) == (family, protocol)
                and f.dport in ports]


def test_kernel_dumps_a_few_ports_apart_and_more_once_per_family_and_protocol() -> None:
    few = [F("10.96.0.10", 53, EP_B), F(None, 30053, EP_B), F("fd00:96::a", 53, family=V6)]
    link = RecordingLink(TABLE)
    kept = apply_filters(few, _dumper(link, few), lambda f: None, lambda: 0.0)  # type: ignore[arg-type]
    assert link.dumps == [
        (V4, UDP, [53], "10.96.0.10"),
        (V4, UDP, [30053], None),
        (V6, UDP, [53], "fd00:96::a"),
    ]
    many = [*few, *(F(f"10.96.1.{i}", 1000 + i) for i in range(_PORT_DUMPS))]
    link = RecordingLink(TABLE)
    shared = apply_filters(many, _dumper(link, many), lambda f: None, lambda: 0.0)  # type: ignore[arg-type]
    assert link.dumps == [
        (V4, UDP, sorted({53, 30053, *range(1000, 1000 + _PORT_DUMPS)}), None),
        (V6, UDP, [53], "fd00:96::a"),
    ]
    assert (shared.matched, shared.deleted) == (kept.matched, kept.deleted) == (6, 5)


# ---- the hook -------------------------------------------------------------------------------


def hooked(
    ct: Any, objects: Sequence[Obj], *, on_result: Callable[[CleanupResult], None] | None = None
) -> tuple[Proxier, logging.Logger]:
    log = logging.getLogger("test.conntrack")
    backend = FakeBackend()
    backend.start()
    proxier = Proxier(CONFIG, backend, hooks=[conntrack_hook(ct, log=log, on_result=on_result)])
    intake(proxier).on_node(node(NODE, ["192.168.50.1"]))
    for obj in objects:
        _feed(proxier, _objs_kind(obj), None, obj)
    intake(proxier).on_synced(KIND_SERVICES)
    intake(proxier).on_synced(KIND_ENDPOINT_SLICES)
    return proxier, log


def test_hook_cleans_after_each_sync() -> None:
    ct = fake()
    results: list[CleanupResult] = []
    proxier, _ = hooked(ct, [dns(), A_SLICE], on_result=results.append)
    proxier.sync()  # full: A is serving, the un-NATed flow goes
    assert UNNATED not in ct.flows and TO_A in ct.flows and TO_B not in ct.flows
    intake(proxier).on_endpoint_slice(A_SLICE, eps("dns", [EP_B]))
    proxier.sync()
    assert TO_A not in ct.flows
    assert [r.deleted for r in results] == [2, 1]


def test_hook_reports_nothing_when_nothing_is_planned() -> None:
    results: list[CleanupResult] = []
    proxier, _ = hooked(fake(), [service("web", "10.96.0.20")], on_result=results.append)
    proxier.sync()
    assert results == []


def test_hook_never_raises_and_logs_failures(caplog: pytest.LogCaptureFixture) -> None:
    results: list[CleanupResult] = []
    ct = FakeConntrack(TABLE)  # never started: apply raises RuntimeError
    proxier, _ = hooked(ct, [dns(), A_SLICE], on_result=results.append)
    with caplog.at_level(logging.WARNING, logger="test.conntrack"):
        report = proxier.sync()
    assert report.full
    assert [(r.filters, r.errors) for r in results] == [(1, 1)]
    assert "conntrack cleanup failed" in caplog.text


def test_hook_logs_counted_errors(caplog: pytest.LogCaptureFixture) -> None:
    ct = fake(failing={TO_B: errno.EPERM})
    proxier, _ = hooked(ct, [dns(), A_SLICE])
    with caplog.at_level(logging.WARNING, logger="test.conntrack"):
        proxier.sync()
    assert "conntrack cleanup had 1 errors" in caplog.text


def test_hook_survives_a_failing_result_callback(caplog: pytest.LogCaptureFixture) -> None:
    def boom(_: CleanupResult) -> None:
        raise ValueError("metrics down")

    ct = fake()
    proxier, _ = hooked(ct, [dns(), A_SLICE], on_result=boom)
    with caplog.at_level(logging.ERROR, logger="test.conntrack"):
        proxier.sync()
    assert UNNATED not in ct.flows
    assert "result callback failed" in caplog.text
