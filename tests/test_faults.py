"""Faults, each proven in a real network namespace (issue 13, "Faults" b-e;
(a), SIGKILL during a commit, is tests/test_faults_kill.py; the harness is
tests/faults.py).

Aspects:
(b) another process deletes nftproxy's table or flushes one of its chains
    under a running agent: the drift check (agent/drift.py) sees it and a
    full sync repairs it within syncPeriod, counted in
    nftproxy_drift_repairs_total{reason};
(c) the kernel refuses a commit -- another tool's rule jumps into a chain
    nftproxy deletes (EBUSY), or another tool's table owns our table's name
    (EPERM, persistent): the previous rules keep answering, the failure is
    counted and handed to on_sync_failure (the CLI posts a Node Event),
    retries back off, and a full sync repairs;
(d) netlink errors during conntrack cleanup (EPERM: the cleanup thread
    without CAP_NET_ADMIN): counted, logged once, the agent keeps syncing;
(e) a UDP flow with a fixed source port, sending all along, to a service
    whose endpoints drop to zero and come back elsewhere: the client reaches
    the new endpoint within a couple of syncs (k/k #139628).

Each test prints the recovery time it measured (pytest -s shows them).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import kernel
import pytest
from fakeapi import FakeApiServer
from faults import (
    NODE,
    NODE_IP,
    TABLE,
    Failures,
    UdpFlow,
    config,
    drop_tables,
    net_admin,
    repairs,
    running_agent,
    sample,
    squatter,
    tables,
    wait_until,
    write_cluster,
)
from feed import intake
from k8s import endpoint_slice, node, service

from nftproxy.agent.drift import DriftWatch, next_generation
from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.model import L4Protocol, ServicePortName
from nftproxy.core.nft.commands import (
    AddChain,
    AddTable,
    DeleteChain,
    DeleteTable,
    FlushChain,
    Where,
)
from nftproxy.core.nft.errors import NftBusy, NftNotFound
from nftproxy.core.rules.names import service_chain
from nftproxy.kernel.conntrack import Conntrack
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools import cli
from nftproxy.tools.sandbox.topology import (
    NODE_IPV4,
    NODE_IPV6,
    Pod,
    Spec,
    Topology,
    build,
    default_pods,
)

# --- (b) drift: the watch itself, and the proxier over FakeBackend ---------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_b_drift_watch_sees_only_other_commits_at_most_once_per_period() -> None:
    generation = [7]
    clock = Clock()
    watch = DriftWatch(lambda: generation[0], period=10.0, clock=clock)
    with watch.committing(["cmd"]):
        generation[0] += 1  # our commit
    clock.now += 10
    assert not watch.changed(), "our own commit is not drift"
    with watch.committing([]):
        pass  # an empty commit sends nothing
    generation[0] += 1  # someone else's
    assert not watch.changed(), "checked at most once per period"
    clock.now += 10
    assert watch.changed()
    with contextlib.suppress(RuntimeError), watch.committing(["cmd"]):
        raise RuntimeError("refused")  # a refused commit moves nothing
    assert watch.changed(), "still unrepaired, whatever the period"
    with watch.committing(["cmd"]):
        generation[0] += 1
    watch.repaired()
    clock.now += 10
    assert not watch.changed()
    assert next_generation(0xFFFFFFFF) == 1


def test_b_drift_watch_off_never_reads() -> None:
    def read() -> int:
        raise AssertionError("read")

    watch = DriftWatch(read, period=None)
    with watch.committing(["cmd"]):
        pass
    assert not watch.changed()


def test_b_drift_watch_reads_a_full_sync_in_steps_once_after_its_commits() -> None:
    generation = [7]
    reads: list[int] = []

    def read() -> int:
        reads.append(generation[0])
        return generation[0]

    clock = Clock()
    watch = DriftWatch(read, period=10.0, clock=clock)
    with watch.committing_steps():
        for _ in range(3):
            with watch.committing(["cmd"]):
                generation[0] += 1  # our steps
        assert reads == [], "no reading before each step"
    assert reads == [10]
    clock.now += 10
    assert not watch.changed(), "our own steps are not drift"
    generation[0] += 1  # someone else's
    clock.now += 10
    assert watch.changed()
    with contextlib.suppress(RuntimeError), watch.committing_steps():
        with watch.committing(["cmd"]):
            generation[0] += 1
        raise RuntimeError("the second step refused")
    assert reads[-1] == 12, "read after a refused step too"


def test_b_a_first_sync_in_steps_reads_the_generation_once() -> None:
    backend = FakeBackend()
    backend.start()
    reads: list[int] = []
    generation = backend.generation

    def counted() -> int:
        reads.append(generation())
        return reads[-1]

    backend.generation = counted  # type: ignore[method-assign]
    proxier = Proxier(config(), backend, clock=Clock(), drift_check_period=5.0, fresh_chunk=1)
    feed = intake(proxier)
    for i in range(4):
        feed.on_service(None, service(f"web{i}", f"10.96.0.{10 + i}"))
        feed.on_endpoint_slice(None, endpoint_slice(f"web{i}", [(f"10.244.0.{11 + i}", NODE)]))
    feed.on_synced(KIND_SERVICES)
    feed.on_synced(KIND_ENDPOINT_SLICES)
    before = generation()
    assert proxier.sync().full
    assert generation() - before >= 5, "the skeleton and four chunks, each its own commit"
    assert reads == [generation()]


def fake_proxier(backend: FakeBackend, reasons: list[str], clock: Clock) -> Proxier:
    proxier = Proxier(
        config(), backend, clock=clock, drift_check_period=5.0, on_drift=reasons.append
    )
    feed = intake(proxier)
    feed.on_service(None, service("web", "10.96.0.10"))
    feed.on_endpoint_slice(None, endpoint_slice("web", [("10.244.0.11", NODE)]))
    feed.on_synced(KIND_SERVICES)
    feed.on_synced(KIND_ENDPOINT_SLICES)
    return proxier


@pytest.mark.parametrize(
    ("vandalism", "reason"),
    [
        pytest.param([DeleteTable(Where("ip", TABLE))], "table", id="table"),
        pytest.param(
            [DeleteChain(Where("ip", TABLE), "nat-postrouting")],
            "chains", id="chain",
        ),
        pytest.param(
            [FlushChain(Where("ip", TABLE), "nat-prerouting")],
            "foreign_commit", id="flush",
        ),
    ],
)
def test_b_proxier_repairs_what_another_process_changed(
    vandalism: list[dict[str, Any]], reason: str
) -> None:
    backend = FakeBackend()
    backend.start()
    reasons: list[str] = []
    clock = Clock()
    proxier = fake_proxier(backend, reasons, clock)
    proxier.sync()

    def listing() -> Any:
        return kernel.canonical(backend.list_table("ip", TABLE))

    want = listing()
    clock.now += 5
    assert proxier.sync().ops == 0, "nobody else committed: nothing to do"
    backend.commit(vandalism)
    assert listing() != want
    clock.now += 1
    assert not proxier.sync().full, "not checked again before the period"
    clock.now += 5
    report = proxier.sync()
    assert report.full
    assert listing() == want
    assert reasons == [reason]
    clock.now += 5
    assert not proxier.sync().full
    assert reasons == [reason]


# --- (b) drift under a running agent, real kernel ---------------------------------------------


def test_b_the_generation_moves_by_one_per_commit_of_any_process(netns: str) -> None:
    """What the drift check stands on: one commit (both families), one step;
    listings and refused commits none; another process's commit one."""
    with NftBackend(netns=netns) as backend:
        start = backend.generation()
        backend.commit([AddTable(Where(f, TABLE)) for f in ("ip", "ip6")])
        assert backend.generation() == start + 1
        backend.list_table("ip", TABLE)
        with pytest.raises(NftNotFound):
            backend.commit([AddChain(Where("ip", "nope"), "x")])
        assert backend.generation() == start + 1
        kernel.nft(netns, "add", "table", "inet", "other-tool")
        assert backend.generation() == start + 2


def test_b_deleted_table_and_flushed_chain_are_repaired_within_sync_period(
    netns: str, tmp_path: Path
) -> None:
    path = tmp_path / "cluster.yaml"
    write_cluster(path, [
        node(NODE, [NODE_IP]),
        service("web", ["10.96.0.10", "fd00:96::10"]),
        endpoint_slice("web", [("10.244.0.11", NODE)]),
        endpoint_slice("web", [("fd00:244::11", NODE)]),
    ])
    period = 2.0
    with running_agent(netns, path, config(sync_period=period)) as agent:
        want = tables(netns)
        assert want["ip"] is not None and want["ip6"] is not None
        full_syncs = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"

        kernel.nft(netns, "delete", "table", "ip", TABLE)
        table_took = wait_until(lambda: tables(netns) == want, 3 * period + 10, "table back")
        # the count follows the commit in the sync thread: wait for it too
        wait_until(lambda: repairs(agent, "table") == 1, 5, "repair counted")

        # the shared chooser of web's one endpoint (rules/dispatch.py)
        chain = next(c for c in want["ip"]["chains"] if re.fullmatch(r"dispatch-tcp-1", c))
        kernel.nft(netns, "flush", "chain", "ip", TABLE, chain)
        assert tables(netns) != want
        chain_took = wait_until(lambda: tables(netns) == want, 3 * period + 10, "rules back")
        wait_until(lambda: repairs(agent, "foreign_commit") == 1, 5, "repair counted")

        before = sample(agent, full_syncs)
        time.sleep(2 * period + 0.5)
        assert sample(agent, full_syncs) == before, "nobody touched nftables: no full sync"
        assert repairs(agent, "table") + repairs(agent, "foreign_commit") == 2
    print(f"\n(b) syncPeriod {period}s: deleted table back after {table_took:.2f}s, "
          f"flushed chain after {chain_took:.2f}s")
    # within syncPeriod of the change, plus one full sync (generous under load)
    assert max(table_took, chain_took) < period + 5


# --- the sandbox: client -> node (the agent's tables) -> pods ---------------------------------


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    kernel.require_root()
    with build(Spec(default_pods(local=3, remote=0))) as t:
        yield t


@pytest.fixture
def node_ns(topo: Topology) -> Iterator[str]:
    """The node namespace with no tables and no flows left by another test."""
    topo.flush_conntrack()
    yield topo.node
    drop_tables(topo.node)


def web(
    name: str, ips: Sequence[str], pods: Sequence[Pod], *, udp: bool = False, **service_kw: Any
) -> list[Any]:
    """A Service (TCP 80 -> 8080, or UDP 8125 -> 5353; `service_kw` for
    k8s.service) and its slices."""
    port, target = (("statsd", 8125, "UDP"), ("statsd", 5353, "UDP")) if udp else (
        ("http", 80, "TCP"), ("http", 8080, "TCP"))
    slices = [
        endpoint_slice(name, [(p.ip(f), NODE) for p in pods], ports=[target],
                       family=f"IPv{f}", name=f"{name}-v{f}")
        for f in ((4, 6) if len(ips) == 2 else (4,))
    ]
    return [service(name, list(ips), ports=[port], **service_kw), *slices]


def the_node() -> dict[str, Any]:
    return node(NODE, [NODE_IPV4, NODE_IPV6], pod_cidrs=["10.244.0.0/24", "fd00:244::/64"])


def answered(topo: Topology, ip: str, port: int = 80) -> str | None:
    """Which pod answered one TCP connection from the client (None: none)."""
    (attempt,) = topo.probe("client", "tcp", ip, port, timeout=1.0)
    return attempt.pod


# --- (c) the kernel refuses a commit ------------------------------------------------------------


@pytest.mark.kernel
def test_c_a_foreign_jump_into_a_doomed_chain_is_refused_then_repaired(
    topo: Topology, node_ns: str, tmp_path: Path
) -> None:
    """Another tool's chain in our table jumps to the service chain nftproxy
    deletes when the Service goes: the kernel refuses the partial sync
    (EBUSY); the old rules keep answering; a full sync (the Runner's retry,
    after retry_interval) flushes the intruder and the Service's chains. As
    after any EBUSY, the proxier now deletes chains one transaction later
    (docs/architecture.md "EBUSY"): the next sync removes the empty ones."""
    keep, doomed = topo.pods["local1"], topo.pods["local2"]
    path = tmp_path / "cluster.yaml"
    objects = [the_node(), *web("keep", ["10.96.0.20"], [keep])]
    # ClientIP affinity: the Service has chains of its own (others go
    # through the shared choosers, rules/dispatch.py)
    doomed_svc = web("doomed", ["10.96.0.21"], [doomed], type="NodePort", node_ports=[30081],
                     affinity_timeout=600)
    write_cluster(path, [*objects, *doomed_svc])
    failures = Failures(lambda: (tables(node_ns), answered(topo, "10.96.0.21")))
    commits: list[float] = []
    with running_agent(node_ns, path, config(sync_period=60.0), on_sync_failure=failures,
                       hooks=[lambda _: commits.append(time.monotonic())]) as agent:
        assert (answered(topo, "10.96.0.20"), answered(topo, "10.96.0.21")) == (
            "local1", "local2")
        target = service_chain(ServicePortName("ns", "doomed", "http", L4Protocol.TCP))
        aside = f"{TABLE}-affinity"  # ClientIP affinity: the chain is the affinity table's
        kernel.nft(node_ns, "-f", "-", stdin=(
            f"add chain ip {aside} intruder\nadd rule ip {aside} intruder jump {target}\n"))
        before = tables(node_ns)
        with topo.continuous("client", "tcp", [("10.96.0.20", 80)], timeout=1.0,
                             interval=0.02) as traffic:
            write_cluster(path, objects)  # the Service goes: delete its chains
            wait_until(lambda: bool(failures.seen), 10, "the refused commit")

            def flushed() -> bool:
                rules = tables(node_ns)["ip"]["rules"]
                return "intruder" not in rules and target not in rules

            took = wait_until(flushed, 10, "the repair")
            time.sleep(0.3)
            attempts = traffic.stop()

        (failed_at, error, (at_failure, doomed_then)), = failures.seen
        assert isinstance(error, NftBusy), error
        assert at_failure == before, "a refused commit changes nothing"
        assert doomed_then == "local2", "the old rules still answered"
        assert sample(agent, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total") == 1
        retry = min(t for t in commits if t > failed_at) - failed_at
        assert retry >= 0.9, "the retry comes retry_interval (1 s) later, not at once"
        assert all(a.pod == "local1" for a in attempts) and len(attempts) > 10, attempts
        assert answered(topo, "10.96.0.21") is None
        write_cluster(path, [*objects, *web("later", ["10.96.0.22"], [doomed])])
        wait_until(lambda: not {"intruder", target} & set(tables(node_ns)["ip"]["chains"]),
                   10, "the empty chains deleted by the next sync")
    print(f"\n(c) EBUSY: retried after {retry:.2f}s; repaired {took:.2f}s after the refusal")


@pytest.mark.kernel
def test_c_a_persistent_refusal_backs_off_keeps_the_old_rules_and_recovers(
    topo: Topology, node_ns: str, tmp_path: Path
) -> None:
    """Another tool deletes our ip6 table and takes its name as an owner
    table: every full sync is refused (EPERM), retried at 1, 2, 4... s up
    to syncPeriod, while IPv4 keeps answering; once the tool is gone the
    next retry restores the ip6 table."""
    path = tmp_path / "cluster.yaml"
    write_cluster(path, [the_node(), *web("web", ["10.96.0.30", "fd00:96::30"],
                                          [topo.pods["local1"]])])
    failures = Failures()
    period = 6.0
    with running_agent(node_ns, path, config(sync_period=period),
                       on_sync_failure=failures) as agent:
        want = tables(node_ns)
        assert answered(topo, "fd00:96::30") == "local1"
        with topo.continuous("client", "tcp", [("10.96.0.30", 80)], timeout=1.0,
                             interval=0.05) as traffic:
            kernel.nft(node_ns, "delete", "table", "ip6", TABLE)
            with squatter(node_ns, "ip6") as tool:
                wait_until(lambda: len(failures.seen) >= 4, 3 * period + 10, "4 refusals")
                assert tool.stdin is not None
                tool.stdin.close()  # the tool exits: its table goes with it
            took = wait_until(lambda: tables(node_ns) == want, period + 5, "the ip6 table back")
            attempts = traffic.stop()
        times = [t for t, _, _ in failures.seen]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all("Operation not permitted" in str(e) for _, e, _ in failures.seen)
        assert gaps[0] >= 0.9 and gaps[1] >= 1.8 and gaps[2] >= 3.6, gaps
        assert max(gaps) <= period + 2, "the back-off stops at syncPeriod"
        assert sample(agent, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total") == len(
            times)
        wait_until(lambda: repairs(agent, "table") == 1, 5, "repair counted")
        assert len(attempts) > 20 and all(a.pod == "local1" for a in attempts), attempts
        assert answered(topo, "fd00:96::30") == "local1"
    print(f"\n(c) EPERM: retries {', '.join(f'{g:.1f}s' for g in gaps)} apart; "
          f"ip6 table back {took:.2f}s after the other tool left")


def test_c_the_cli_posts_a_node_event_for_a_refused_sync(tmp_path: Path) -> None:
    """`run` with the API source: a failed sync becomes a Warning Event about
    this Node (namespace default), repeats aggregated into its count."""
    server = FakeApiServer()
    server.start()
    try:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        on_sync_failure = cli._kube_source(kubeconfig, NODE)[1].on_sync_failure
        assert on_sync_failure is not None
        busy = NftBusy("internal:0:0-0: Error: Could not process rule: Device or resource busy\n")
        on_sync_failure(busy)
        wait_until(lambda: not any(t.name == "event" for t in threading.enumerate()), 10,
                   "the Event posted")  # real failures are >= 1 s apart (the retry interval)
        on_sync_failure(busy)
        wait_until(lambda: next(iter(server.objects("Event").values()))["count"] == 2, 10,
                   "the repeat counted")
        (event,) = server.objects("Event").values()
    finally:
        server.stop()
    assert event["metadata"]["namespace"] == "default"
    assert event["involvedObject"] == {"kind": "Node", "apiVersion": "v1", "name": NODE,
                                       "uid": NODE}
    assert (event["type"], event["reason"]) == ("Warning", "SyncProxyRulesFailed")
    assert "Could not process rule: Device or resource busy" in event["message"]


# --- (d) netlink errors during conntrack cleanup -----------------------------------------------


def test_d_conntrack_netlink_errors_are_counted_logged_once_and_survived(
    netns: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cluster.yaml"

    def endpoints(last: int) -> list[Any]:
        return [node(NODE, [NODE_IP]),
                service("statsd", "10.96.0.40", ports=[("statsd", 8125, "UDP")]),
                endpoint_slice("statsd", [(f"10.244.0.{last}", NODE)],
                               ports=[("statsd", 5353, "UDP")])]

    def errors() -> float:
        return sample(agent, "nftproxy_conntrack_cleanup_errors_total")

    def logged(level: int, text: str) -> int:
        return sum(1 for r in caplog.records if r.levelno == level and text in r.getMessage())

    write_cluster(path, endpoints(11))
    conntrack = Conntrack(netns=netns)
    caplog.set_level(logging.DEBUG, logger="nftproxy.agent.agent")
    with running_agent(netns, path, config(), conntrack=conntrack) as agent:
        # the cleanup's own thread loses CAP_NET_ADMIN (the worker is private)
        conntrack._worker.call(lambda _sockets: net_admin(False))
        for last in (12, 13, 14):
            seen = errors()
            write_cluster(path, endpoints(last))
            wait_until(lambda seen=seen: errors() > seen, 10, f"cleanup after .{last}")
        assert logged(logging.WARNING, "conntrack cleanup had") == 1, caplog.text
        assert logged(logging.DEBUG, "conntrack cleanup had") == 2
        assert "Operation not permitted" in caplog.text
        assert errors() >= 3
        assert "10.244.0.14" in kernel.nft(netns, "list", "table", "ip", TABLE)
        assert agent.runner.failures == 0, "a failed cleanup never fails the sync"

        conntrack._worker.call(lambda _sockets: net_admin(True))
        failed = errors()
        write_cluster(path, endpoints(15))
        wait_until(lambda: logged(logging.INFO, "conntrack cleanup works again") == 1, 10,
                   "the recovery logged")
        assert errors() == failed


# --- (e) UDP flows to a service that drops to zero endpoints --------------------------------


@pytest.mark.kernel
def test_e_udp_flow_recovers_after_its_service_had_zero_endpoints(
    topo: Topology, node_ns: str, tmp_path: Path
) -> None:
    """k/k #139628: a client keeps sending from one source port; the
    endpoints drop to zero (local1's server keeps running: a stale flow
    would still reach it), then come back as local2. The n -> 0 cleanup
    clears the flow, so the client is refused meanwhile and reaches local2
    within a couple of syncs."""
    vip, sport = "10.96.0.40", 40125
    one, two = topo.pods["local1"], topo.pods["local2"]
    path = tmp_path / "cluster.yaml"
    write_cluster(path, [the_node(), *web("statsd", [vip], [one], udp=True)])
    syncs: list[float] = []
    with (
        running_agent(node_ns, path, config(), conntrack=Conntrack(netns=node_ns),
                      hooks=[lambda _: syncs.append(time.monotonic())]),
        UdpFlow(topo.client, vip, 8125, sport) as flow,
    ):
        wait_until(lambda: flow.since(0)[-1:] == ["local1"], 10, "local1 answers")
        zero = time.monotonic()
        write_cluster(path, [the_node(), *web("statsd", [vip], [], udp=True)])
        wait_until(lambda: flow.since(zero)[-10:] == ["refused"] * 10, 10, "refused")
        last_one = max(at for at, who in flow.seen if who == "local1")
        back = time.monotonic()
        write_cluster(path, [the_node(), *web("statsd", [vip], [two], udp=True)])
        wait_until(lambda: "local2" in flow.since(back), 10, "local2 answers")
        reached = min(at for at, who in flow.seen if at >= back and who == "local2")
        time.sleep(0.3)
        after = flow.since(reached)
    assert "local1" not in flow.since(last_one + 1e-6), "the flow never went back to local1"
    assert set(after) == {"local2"}, after
    # hooks run after the commit (and this one after the conntrack cleanup)
    syncs_between = sum(1 for t in syncs if back <= t <= reached + 0.2)
    assert 1 <= syncs_between <= 2, syncs_between
    print(f"\n(e) n -> 0: last answer from the old endpoint {last_one - zero:.2f}s after the "
          f"edit; 0 -> 1: the new endpoint answered {reached - back:.2f}s after the edit, "
          f"{syncs_between} sync(s) later")
