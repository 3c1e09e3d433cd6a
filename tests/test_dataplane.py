"""Dataplane acceptance: kube-proxy's service semantics proven by real packets.

One sandbox (nftproxy.tools.sandbox.topology) per module: a node namespace holding
nftproxy's tables, five pods (local1-3 on this node, remote1-2 "on node-b",
all wired to this node by veth + host routes), and an external client with
the addresses 192.168.50.2/.3 (+ .10-.29 for session affinity) and the same in
fd00:50::/64. Every test starts from empty tables and an empty conntrack
table, feeds a fresh Proxier (whose NftBackend works in the node namespace)
Service / EndpointSlice JSON, syncs, and sends traffic with the sandbox probe.
Backends answer "<pod> peer=<addr>:<port>", so each test checks *who*
answered and *which source* they saw (a masqueraded source is the node's pod
gateway address; an unmasqueraded one is the client's own).

The Proxier is wired as `nftproxy run` wires it: the conntrack cleanup
(nftproxy.kernel.conntrack) runs as its post-commit hook.

Aspects (IPv4 and IPv6 wherever the feature applies):
- ClusterIP spreads over every ready endpoint; removed endpoints get no new
  connections after the next sync, not even a UDP flow that reuses its old
  source port (conntrack cleanup), while flows to endpoints that stay, stay;
- off-cluster sources to a ClusterIP are masqueraded, pods are not, hairpin is;
- NodePort on every allowed node address, from the client, pods and the node
  (not on addresses nodePortAddresses leaves out), masqueraded for
  externalTrafficPolicy=Cluster; nodePortAddresses CIDRs select the host's
  interface addresses (also secondaries the Node object does not list, and
  one added at run time, within one sync);
- externalTrafficPolicy=Local: only local endpoints, client address kept; no
  local endpoint -> dropped, while pods and the node itself still get through;
- internalTrafficPolicy=Local: pods reach only local endpoints; none -> drop;
- externalIPs, LoadBalancer ingress IPs, loadBalancerSourceRanges;
- sessionAffinity ClientIP, including expiry;
- no endpoints -> TCP refused in < 1 s, UDP ICMP port unreachable (ClusterIP,
  NodePort, LB and external IPs; from the client, a pod and the node, whose
  own UDP sees EPERM); undefined port of an active ClusterIP rejected;
- terminating endpoints serve only when no ready endpoint exists (also the
  local ones of externalTrafficPolicy=Local);
- no failed connection while endpoints change and full resyncs happen;
- 1,000 services at once;
- SCTP (reported as SKIPPED "SCTP NOT RUNNABLE" on kernels without SCTP;
  NFTPROXY_REQUIRE_SCTP=1 makes that a failure).
The bridge variant (detectLocalMode=BridgeInterface) is test_dataplane_bridge.py.

Probabilistic thresholds keep wide margins: e.g. 300 connections over 3
endpoints, each must get >= 15% (expected 33%; failure odds ~1e-11).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import kernel
import pytest
from feed import intake
from k8s import endpoint_slice, node, service

from nftproxy.agent.proxier import Proxier
from nftproxy.agent.report import SyncReport
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import HostAddresses
from nftproxy.kernel.addresses import AddressWatch, read_host_addresses
from nftproxy.kernel.conntrack import Conntrack, conntrack_hook
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.sandbox.probe import Attempt, answered_by, errors
from nftproxy.tools.sandbox.topology import (
    CLUSTER_CIDRS,
    NODE_ALT_IPV4,
    NODE_ALT_IPV6,
    NODE_IPV4,
    NODE_IPV6,
    NODE_NAME,
    Pod,
    Spec,
    Topology,
    TopologyError,
    build,
    default_pods,
)

pytestmark = pytest.mark.kernel

LOG = logging.getLogger("test_dataplane")
CONFIG = ProxyConfig(node_name=NODE_NAME, cluster_cidrs=CLUSTER_CIDRS, table_name="nftproxy")

# Service ports (port 80 TCP "tcp", 53 UDP "udp") and what the pods serve.
PORTS = (("tcp", 80, "TCP"), ("udp", 53, "UDP"))
SLICE_PORTS = (("tcp", 8080, "TCP"), ("udp", 5353, "UDP"))
PROTO_PORT = {"tcp": 80, "udp": 53}
NODE_PORTS = {"tcp": 30080, "udp": 30053}

AFFINITY_V4 = tuple(f"192.168.50.{i}" for i in range(10, 30))
AFFINITY_V6 = tuple(f"fd00:50::{i}" for i in range(10, 30))

FAMILIES = [pytest.param(4, id="ipv4"), pytest.param(6, id="ipv6")]
PROTOS = [pytest.param("tcp", id="tcp"), pytest.param("udp", id="udp")]

# Timeouts: generous where an answer is expected, short where a drop is.
OK_TIMEOUT = 2.0
DROP_TIMEOUT = 0.5


@dataclass(frozen=True)
class Net:
    """The sandbox's addresses of one IP family."""

    family: int

    def vip(self, n: int) -> str:
        """ClusterIP number n (10.96.0.n / fd00:96::n)."""
        return f"10.96.0.{n}" if self.family == 4 else f"fd00:96::{n}"

    def lb(self, n: int) -> str:
        """LoadBalancer / external IP number n (192.168.60.n / fd00:60::n)."""
        return f"192.168.60.{n}" if self.family == 4 else f"fd00:60::{n}"

    @property
    def node_ip(self) -> str:
        return NODE_IPV4 if self.family == 4 else NODE_IPV6

    @property
    def node_alt_ip(self) -> str:
        return NODE_ALT_IPV4 if self.family == 4 else NODE_ALT_IPV6

    @property
    def client(self) -> str:
        """The client's primary address (source of its routes)."""
        return "192.168.50.2" if self.family == 4 else "fd00:50::2"

    @property
    def client_other(self) -> str:
        return "192.168.50.3" if self.family == 4 else "fd00:50::3"

    @property
    def affinity_sources(self) -> tuple[str, ...]:
        return AFFINITY_V4 if self.family == 4 else AFFINITY_V6

    def host_prefix(self, ip: str) -> str:
        return f"{ip}/32" if self.family == 4 else f"{ip}/128"


# --- the harness: a Proxier fed like the agent feeds it --------------------------


class Cluster:
    """A fresh Proxier on the node namespace's tables, wired as `nftproxy run`
    wires it (conntrack cleanup as post-commit hook), plus the objects it was
    given (so apply() sends proper update events)."""

    def __init__(
        self,
        backend: NftBackend,
        config: ProxyConfig = CONFIG,
        conntrack: Conntrack | None = None,
    ) -> None:
        hooks = [conntrack_hook(conntrack, log=LOG)] if conntrack is not None else []
        self.proxier = Proxier(config, backend, hooks=hooks)
        intake(self.proxier).on_node(
            node(
                NODE_NAME,
                [NODE_IPV4, NODE_ALT_IPV4, NODE_IPV6, NODE_ALT_IPV6],
                pod_cidrs=["10.244.0.0/24", "fd00:244::/64"],
            )
        )
        intake(self.proxier).on_synced(KIND_SERVICES)
        intake(self.proxier).on_synced(KIND_ENDPOINT_SLICES)
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}

    @staticmethod
    def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
        meta = obj["metadata"]
        return obj["kind"], meta["namespace"], meta["name"]

    def _send(self, kind: str, previous: Any, current: Any) -> None:
        if kind == "Service":
            intake(self.proxier).on_service(previous, current)
        else:
            intake(self.proxier).on_endpoint_slice(previous, current)

    def apply(self, *objects: dict[str, Any] | Iterable[dict[str, Any]]) -> Cluster:
        """Add or update Services / EndpointSlices (or lists of them)."""
        for obj in _flatten(objects):
            key = self._key(obj)
            self._send(key[0], self._objects.get(key), obj)
            self._objects[key] = obj
        return self

    def delete(self, *objects: dict[str, Any] | Iterable[dict[str, Any]]) -> Cluster:
        for obj in _flatten(objects):
            key = self._key(obj)
            self._send(key[0], self._objects.pop(key), None)
        return self

    def sync(self) -> SyncReport:
        return self.proxier.sync()


def _flatten(
    objects: Sequence[dict[str, Any] | Iterable[dict[str, Any]]],
) -> Iterator[dict[str, Any]]:
    for item in objects:
        if isinstance(item, dict):
            yield item
        else:
            yield from item


def svc(name: str, n: int, *, families: Sequence[int] = (4, 6), **kw: Any) -> dict[str, Any]:
    """A dual-stack (by default) Service with ClusterIPs number n and PORTS."""
    kw.setdefault("ports", PORTS)
    return service(name, [Net(f).vip(n) for f in families], **kw)


def slices(
    name: str,
    endpoints: Sequence[Pod | tuple[Pod, dict[str, Any]]],
    *,
    families: Sequence[int] = (4, 6),
    ports: Sequence[tuple[str, int, str]] = SLICE_PORTS,
) -> list[dict[str, Any]]:
    """One EndpointSlice per family for `endpoints` (pods, or (pod,
    conditions) pairs); nodeName is the pod's."""
    out = []
    for family in families:
        eps = []
        for entry in endpoints:
            pod, conditions = entry if isinstance(entry, tuple) else (entry, {})
            eps.append({"ip": pod.ip(family), "nodeName": pod.node_name, **conditions})
        out.append(
            endpoint_slice(
                name,
                eps,
                ports=ports,
                family="IPv4" if family == 4 else "IPv6",
                name=f"{name}-v{family}",
            )
        )
    return out


TERMINATING = {"ready": False, "serving": True, "terminating": True}
GONE = {"ready": False, "serving": False, "terminating": True}


@dataclass
class Timeline:
    """What a test did when (`time.monotonic()`, the clock of `Attempt.at`),
    so a failed attempt can be placed among the syncs around it."""

    events: list[tuple[str, float, float]]

    def sync(self, cluster: Cluster, what: str) -> SyncReport:
        start = time.monotonic()
        report = cluster.sync()
        self.events.append((what, start, time.monotonic()))
        return report

    def around(self, a: Attempt, margin: float = 0.05) -> str:
        """The events within `margin` s of the attempt, times relative to its start."""
        end = a.at + a.seconds
        near = [
            f"{what} {t0 - a.at:+.4f}..{t1 - a.at:+.4f}s"
            for what, t0, t1 in self.events
            if t0 - margin < end and t1 + margin > a.at
        ]
        return "; ".join(near) or "no event nearby"


def all_ok(attempts: Sequence[Attempt], timeline: Timeline | None = None) -> Counter[str]:
    """Assert every attempt was answered; who answered how often."""
    failed = [a for a in attempts if not a.ok]
    where = "".join(f"\n  {a} amid: {timeline.around(a)}" for a in failed[:5]) if timeline else ""
    assert not failed, (
        f"{len(failed)}/{len(attempts)} failed: {errors(attempts)}; e.g. {failed[0]}{where}"
    )
    return answered_by(attempts)


def peers(attempts: Iterable[Attempt], pod: str | None = None) -> set[str | None]:
    return {a.peer for a in attempts if pod is None or a.pod == pod}


# --- fixtures ------------------------------------------------------------------


def build_or_fail(spec: Spec, stack: contextlib.ExitStack) -> Topology:
    """The sandbox, or a loud failure (never a skip) when it cannot be built."""
    kernel.require_root()
    try:
        return stack.enter_context(build(spec))
    except (TopologyError, OSError, subprocess.SubprocessError) as exc:
        pytest.fail(f"cannot build the dataplane sandbox: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    spec = Spec(
        default_pods(local=3, remote=2),
        client_ipv4=("192.168.50.2", "192.168.50.3", *AFFINITY_V4),
        client_ipv6=("fd00:50::2", "fd00:50::3", *AFFINITY_V6),
    )
    with contextlib.ExitStack() as stack:
        yield build_or_fail(spec, stack)


@pytest.fixture(scope="module")
def backend(topo: Topology) -> Iterator[NftBackend]:
    with NftBackend(netns=topo.node) as b:
        yield b


@pytest.fixture(scope="module")
def conntrack(topo: Topology) -> Iterator[Conntrack]:
    with Conntrack(netns=topo.node) as ct:
        yield ct


@pytest.fixture
def make_cluster(
    topo: Topology, backend: NftBackend, conntrack: Conntrack
) -> Iterator[Callable[..., Cluster]]:
    """Empty tables and conntrack, then Cluster(config) on demand."""
    backend.delete_tables(CONFIG.table_name)
    topo.flush_conntrack()
    yield lambda config=CONFIG: Cluster(backend, config, conntrack)
    backend.delete_tables(CONFIG.table_name)


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()


# --- ClusterIP -------------------------------------------------------------------


@pytest.mark.parametrize("proto", PROTOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_cluster_ip_spreads_over_all_ready_endpoints_and_drops_removed_ones(
    topo: Topology, cluster: Cluster, family: int, proto: str
) -> None:
    net, pods = Net(family), topo.pods
    three = [pods["local1"], pods["local2"], pods["remote1"]]
    cluster.apply(svc("web", 10), slices("web", three)).sync()

    counts = all_ok(
        topo.probe("client", proto, net.vip(10), PROTO_PORT[proto], count=300, timeout=OK_TIMEOUT)
    )
    assert set(counts) == {"local1", "local2", "remote1"}
    assert min(counts.values()) >= 45, f"uneven spread over 3 endpoints: {counts}"

    cluster.apply(slices("web", [pods["local1"], pods["remote1"]])).sync()
    counts = all_ok(
        topo.probe("client", proto, net.vip(10), PROTO_PORT[proto], count=100, timeout=OK_TIMEOUT)
    )
    assert "local2" not in counts, f"removed endpoint still chosen: {counts}"
    assert min(counts.values()) >= 15, counts


@pytest.mark.parametrize("family", FAMILIES)
def test_cluster_ip_masquerades_off_cluster_sources_only(
    topo: Topology, cluster: Cluster, family: int
) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(svc("web", 11), slices("web", [pods["local2"], pods["remote1"]])).sync()
    gateway = pods["local2"].gateway(family)

    from_client = topo.probe("client", "tcp", net.vip(11), 80, count=20, timeout=OK_TIMEOUT)
    all_ok(from_client)
    assert peers(from_client) == {gateway}, "client traffic to a ClusterIP must be masqueraded"

    from_node = topo.probe("node", "tcp", net.vip(11), 80, count=20, timeout=OK_TIMEOUT)
    all_ok(from_node)
    assert peers(from_node) == {gateway}, "node-originated traffic must be masqueraded"

    pod_ip = pods["local1"].ip(family)
    for proto in ("tcp", "udp"):
        from_pod = topo.probe(
            "local1", proto, net.vip(11), PROTO_PORT[proto], count=20, timeout=OK_TIMEOUT
        )
        all_ok(from_pod)
        assert peers(from_pod) == {pod_ip}, f"pod-to-ClusterIP ({proto}) must keep the pod source"


@pytest.mark.parametrize("proto", PROTOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hairpin_is_masqueraded_and_answered(
    topo: Topology, cluster: Cluster, family: int, proto: str
) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(svc("web", 12), slices("web", [pods["local1"], pods["local2"]])).sync()

    attempts = topo.probe(
        "local1", proto, net.vip(12), PROTO_PORT[proto], count=40, timeout=OK_TIMEOUT
    )
    counts = all_ok(attempts)
    assert set(counts) == {"local1", "local2"}, counts
    assert peers(attempts, "local1") == {pods["local1"].gateway(family)}, "hairpin not masqueraded"
    assert peers(attempts, "local2") == {pods["local1"].ip(family)}


@pytest.mark.parametrize("family", FAMILIES)
def test_udp_flow_to_removed_endpoint_moves_after_sync(
    topo: Topology, cluster: Cluster, family: int
) -> None:
    """The same UDP flow (fixed source port) is DNATed once; after its
    endpoint is removed, the next sync's conntrack cleanup lets it move,
    while a flow to an endpoint that stays is left alone."""
    net, pods = Net(family), topo.pods
    cluster.apply(svc("dns", 13), slices("dns", [pods["local1"]])).sync()

    def flow() -> list[Attempt]:
        return topo.probe("client", "udp", net.vip(13), 53, count=3, sport=40053)

    assert all_ok(flow()) == {"local1": 3}

    cluster.apply(slices("dns", [pods["local1"], pods["local2"], pods["local3"]])).sync()
    assert all_ok(flow()) == {"local1": 3}, "a flow to a still-serving endpoint must stay"

    cluster.apply(slices("dns", [pods["local2"]])).sync()
    assert all_ok(flow()) == {"local2": 3}, "the flow still goes to the removed endpoint"


# --- NodePort ----------------------------------------------------------------------


def nodeport_service(name: str, n: int, **kw: Any) -> dict[str, Any]:
    kw.setdefault("type", "NodePort")
    kw.setdefault("node_ports", [NODE_PORTS["tcp"], NODE_PORTS["udp"]])
    return svc(name, n, **kw)


@pytest.mark.parametrize("proto", PROTOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_node_port_answers_on_every_node_address_masqueraded(
    topo: Topology, cluster: Cluster, family: int, proto: str
) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(nodeport_service("np", 20), slices("np", [pods["local1"], pods["remote1"]]))
    cluster.sync()
    gateway = pods["local1"].gateway(family)
    for who, address in (
        ("client", net.node_ip),
        ("client", net.node_alt_ip),
        ("local2", net.node_ip),  # a pod, to the node's address...
        ("local2", gateway),  # ...and to the node's address on the pod veths
        ("node", net.node_ip),  # the node itself (output path)
    ):
        attempts = topo.probe(who, proto, address, NODE_PORTS[proto], count=20, timeout=OK_TIMEOUT)
        counts = all_ok(attempts)
        assert set(counts) == {"local1", "remote1"}, (who, address, counts)
        assert peers(attempts) == {gateway}, f"{who} -> {address}: not masqueraded"


@pytest.mark.parametrize("proto", PROTOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_node_port_only_on_node_port_addresses(
    topo: Topology, make_cluster: Callable[..., Cluster], family: int, proto: str
) -> None:
    net, pods = Net(family), topo.pods
    config = ProxyConfig(
        node_name=NODE_NAME,
        cluster_cidrs=CLUSTER_CIDRS,
        table_name=CONFIG.table_name,
        nodeport_addresses=("192.168.50.0/24", "fd00:50::/64"),
    )
    cluster = make_cluster(config)
    cluster.apply(nodeport_service("np", 21), slices("np", [pods["local1"]])).sync()

    all_ok(topo.probe("client", proto, net.node_ip, NODE_PORTS[proto], count=5))
    excluded = topo.probe(
        "client", proto, net.node_alt_ip, NODE_PORTS[proto], count=3, timeout=DROP_TIMEOUT
    )
    assert not any(a.ok for a in excluded), f"node port served on {net.node_alt_ip}: {excluded}"
    # nothing listens there on the node itself: the node's own stack refuses
    assert errors(excluded) == {"refused": 3}, excluded


# --- externalTrafficPolicy / internalTrafficPolicy Local -----------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_external_traffic_policy_local(topo: Topology, cluster: Cluster, family: int) -> None:
    net, pods = Net(family), topo.pods
    lb = svc(
        "lb",
        30,
        type="LoadBalancer",
        node_ports=[NODE_PORTS["tcp"], NODE_PORTS["udp"]],
        lb_ips=[Net(4).lb(30), Net(6).lb(30)],
        external_ips=[Net(4).lb(31), Net(6).lb(31)],
        etp="Local",
        health_check_node_port=30500,
    )
    cluster.apply(lb, slices("lb", [pods["local1"], pods["remote1"], pods["remote2"]])).sync()

    # external clients reach only the local endpoint, with their own address
    for proto, address, port in (
        ("tcp", net.node_ip, NODE_PORTS["tcp"]),
        ("udp", net.node_ip, NODE_PORTS["udp"]),
        ("tcp", net.lb(30), 80),
        ("udp", net.lb(30), 53),
        ("tcp", net.lb(31), 80),
    ):
        attempts = topo.probe("client", proto, address, port, count=20, timeout=OK_TIMEOUT)
        assert all_ok(attempts) == {"local1": 20}, (proto, address)
        assert peers(attempts) == {net.client}, f"{proto} {address}: client address not kept"
    # the node itself is served too (masqueraded, "LOCAL traffic")
    all_ok(topo.probe("node", "tcp", net.node_ip, NODE_PORTS["tcp"], count=10))

    # no local endpoint: external traffic is dropped...
    cluster.apply(slices("lb", [pods["remote1"], pods["remote2"]])).sync()
    for proto, address, port in (
        ("tcp", net.node_ip, NODE_PORTS["tcp"]),
        ("udp", net.node_ip, NODE_PORTS["udp"]),
        ("tcp", net.lb(30), 80),
        ("tcp", net.lb(31), 80),
    ):
        dropped = topo.probe("client", proto, address, port, count=2, timeout=DROP_TIMEOUT)
        assert errors(dropped) == {"timeout": 2}, f"{proto} {address} must be dropped: {dropped}"
    # ...while pods on this node still reach the remote endpoints (ClusterIP, the
    # LB IP and the external IP: kube-proxy's pod short-circuit, the corner of
    # kubernetes#131765) and so does the node itself.
    remote = {"remote1", "remote2"}
    for who, address, port in (
        ("local2", net.vip(30), 80),
        ("local2", net.lb(30), 80),
        ("local2", net.lb(31), 80),
        ("local2", net.node_ip, NODE_PORTS["tcp"]),
        ("node", net.node_ip, NODE_PORTS["tcp"]),
        ("node", net.lb(30), 80),
    ):
        counts = all_ok(topo.probe(who, "tcp", address, port, count=20, timeout=OK_TIMEOUT))
        assert set(counts) <= remote, (who, address, counts)


@pytest.mark.parametrize("family", FAMILIES)
def test_internal_traffic_policy_local(topo: Topology, cluster: Cluster, family: int) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(
        svc("itp", 31, itp="Local"),
        slices("itp", [pods["local1"], pods["remote1"], pods["remote2"]]),
    ).sync()
    for proto in ("tcp", "udp"):
        attempts = topo.probe(
            "local2", proto, net.vip(31), PROTO_PORT[proto], count=30, timeout=OK_TIMEOUT
        )
        assert all_ok(attempts) == {"local1": 30}, proto

    cluster.apply(slices("itp", [pods["remote1"], pods["remote2"]])).sync()
    for proto in ("tcp", "udp"):
        dropped = topo.probe(
            "local2", proto, net.vip(31), PROTO_PORT[proto], count=2, timeout=DROP_TIMEOUT
        )
        assert errors(dropped) == {"timeout": 2}, f"{proto}: no local endpoint must drop"


# --- external IPs, load balancers, source ranges -------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_external_ips_and_load_balancer_ips(topo: Topology, cluster: Cluster, family: int) -> None:
    net, pods = Net(family), topo.pods
    endpoints = [pods["local1"], pods["remote1"]]
    cluster.apply(
        svc("ext", 40, external_ips=[Net(4).lb(40), Net(6).lb(40)]),
        slices("ext", endpoints),
        svc(
            "lbc",
            41,
            type="LoadBalancer",
            node_ports=[30081, 30054],
            lb_ips=[Net(4).lb(41), Net(6).lb(41)],
        ),
        slices("lbc", endpoints),
    ).sync()
    for address in (net.lb(40), net.lb(41)):
        for proto in ("tcp", "udp"):
            attempts = topo.probe(
                "client", proto, address, PROTO_PORT[proto], count=20, timeout=OK_TIMEOUT
            )
            assert set(all_ok(attempts)) == {"local1", "remote1"}, (address, proto)
            assert peers(attempts) == {pods["local1"].gateway(family)}, (address, proto)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_balancer_source_ranges(topo: Topology, cluster: Cluster, family: int) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(
        svc(
            "fw",
            42,
            type="LoadBalancer",
            node_ports=[30082, 30055],
            lb_ips=[Net(4).lb(42), Net(6).lb(42)],
            source_ranges=[Net(4).host_prefix(Net(4).client), Net(6).host_prefix(Net(6).client)],
        ),
        slices("fw", [pods["local1"], pods["remote1"]]),
    ).sync()

    all_ok(topo.probe("client", "tcp", net.lb(42), 80, count=10, src=net.client))
    all_ok(topo.probe("client", "udp", net.lb(42), 53, count=10, src=net.client))
    for proto in ("tcp", "udp"):
        denied = topo.probe(
            "client",
            proto,
            net.lb(42),
            PROTO_PORT[proto],
            count=2,
            src=net.client_other,
            timeout=DROP_TIMEOUT,
        )
        assert errors(denied) == {"timeout": 2}, f"{proto} from outside the ranges: {denied}"
    # the ranges filter the LB IP only: node port and ClusterIP stay open
    all_ok(topo.probe("client", "tcp", net.node_ip, 30082, count=10, src=net.client_other))
    all_ok(topo.probe("client", "tcp", net.vip(42), 80, count=10, src=net.client_other))


# --- session affinity ---------------------------------------------------------------------


def _sticky_choice(attempts: Sequence[Attempt]) -> dict[str | None, str]:
    """Per source: the one endpoint that answered it (asserts there was one)."""
    by_src: dict[str | None, Counter[str]] = {}
    for a in attempts:
        by_src.setdefault(a.src, Counter())[a.pod or "?"] += 1
    choice = {}
    for src, counts in by_src.items():
        assert len(counts) == 1, f"source {src} not sticky: {counts}"
        choice[src] = next(iter(counts))
    return choice


def test_session_affinity_sticks_then_expires(topo: Topology, cluster: Cluster) -> None:
    """Both families in one test, so they share the wait for the timeout."""
    pods = topo.pods
    timeout = 2
    cluster.apply(
        svc("sticky", 50, affinity_timeout=timeout),
        slices("sticky", [pods["local1"], pods["local2"], pods["remote1"]]),
    ).sync()

    before: dict[int, dict[str | None, str]] = {}
    for family in (4, 6):
        net = Net(family)
        for proto in ("tcp", "udp"):
            one = topo.probe(
                "client", proto, net.vip(50), PROTO_PORT[proto], count=50, src=net.client
            )
            assert len(all_ok(one)) == 1, f"{proto}: one client's 50 spread: {answered_by(one)}"
        many = topo.probe("client", "tcp", net.vip(50), 80, count=3, src=net.affinity_sources)
        all_ok(many)
        before[family] = _sticky_choice(many)
        # 20 clients on 3 endpoints: all on one would mean no balancing at all
        assert len(set(before[family].values())) >= 2, before[family]

    time.sleep(timeout + 1.2)
    for family in (4, 6):
        net = Net(family)
        again = topo.probe("client", "tcp", net.vip(50), 80, count=3, src=net.affinity_sources)
        all_ok(again)
        after = _sticky_choice(again)
        moved = [s for s in after if after[s] != before[family][s]]
        # expired affinity -> a fresh random pick per client (2/3 move; P(none) = 3^-20)
        assert moved, f"IPv{family}: affinity did not expire after {timeout}s"


# --- no endpoints, unknown ports ----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_service_without_endpoints_rejects_fast(
    topo: Topology, cluster: Cluster, family: int
) -> None:
    net = Net(family)
    cluster.apply(
        svc("empty", 60),
        nodeport_service(
            "lbempty",
            61,
            type="LoadBalancer",
            lb_ips=[Net(4).lb(61), Net(6).lb(61)],
            external_ips=[Net(4).lb(62), Net(6).lb(62)],
        ),
    ).sync()
    for proto in ("tcp", "udp"):
        for who, address, port in (
            ("client", net.vip(60), PROTO_PORT[proto]),
            ("local1", net.vip(60), PROTO_PORT[proto]),
            ("node", net.vip(60), PROTO_PORT[proto]),
            ("client", net.node_ip, NODE_PORTS[proto]),
            ("node", net.node_ip, NODE_PORTS[proto]),
            ("client", net.lb(61), PROTO_PORT[proto]),
            ("client", net.lb(62), PROTO_PORT[proto]),
        ):
            attempts = topo.probe(who, proto, address, port, count=3, timeout=2)
            assert errors(attempts) == {rejected(who, proto): 3}, (who, address, attempts)
            assert max(a.seconds for a in attempts) < 1.0, (who, proto, address, attempts)


def rejected(who: str, proto: str) -> str:
    """How a REJECT shows to the sender: ECONNREFUSED (TCP reset, ICMP port
    unreachable), except for the node's own UDP: that is rejected in the
    output hook, and the kernel fails its send() with EPERM at once (as with
    kube-proxy's REJECT in OUTPUT)."""
    return "EPERM" if (who, proto) == ("node", "udp") else "refused"


@pytest.mark.parametrize("family", FAMILIES)
def test_undefined_port_of_active_cluster_ip_is_rejected(
    topo: Topology, cluster: Cluster, family: int
) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(svc("web", 62), slices("web", [pods["local1"]])).sync()
    all_ok(topo.probe("client", "tcp", net.vip(62), 80, count=3))
    for proto, port in (("tcp", 81), ("udp", 54)):
        for who in ("client", "local2", "node"):
            attempts = topo.probe(who, proto, net.vip(62), port, count=3, timeout=2)
            assert errors(attempts) == {rejected(who, proto): 3}, (who, proto, attempts)
            assert max(a.seconds for a in attempts) < 1.0


# --- terminating endpoints ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_terminating_endpoints_serve_only_without_ready_ones(
    topo: Topology, cluster: Cluster, family: int
) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(
        svc("term", 70),
        slices("term", [pods["local1"], (pods["local2"], TERMINATING), (pods["local3"], GONE)]),
    ).sync()
    assert all_ok(topo.probe("client", "tcp", net.vip(70), 80, count=30)) == {"local1": 30}

    cluster.apply(
        slices("term", [(pods["local2"], TERMINATING), (pods["local3"], GONE)]),
    ).sync()
    assert all_ok(topo.probe("client", "tcp", net.vip(70), 80, count=30)) == {"local2": 30}

    cluster.apply(slices("term", [(pods["local2"], GONE), (pods["local3"], GONE)])).sync()
    refused = topo.probe("client", "tcp", net.vip(70), 80, count=2, timeout=2)
    assert errors(refused) == {"refused": 2}, "no serving endpoint left: reject"


@pytest.mark.parametrize("family", FAMILIES)
def test_local_policy_falls_back_to_local_terminating_endpoints(
    topo: Topology, cluster: Cluster, family: int
) -> None:
    """eTP=Local: with no local ready endpoint, a local serving+terminating
    one serves external traffic, even though remote ready ones exist."""
    net, pods = Net(family), topo.pods
    cluster.apply(
        nodeport_service("lterm", 71, etp="Local"),
        slices("lterm", [(pods["local1"], TERMINATING), pods["remote1"]]),
    ).sync()
    attempts = topo.probe("client", "tcp", net.node_ip, NODE_PORTS["tcp"], count=20)
    assert all_ok(attempts) == {"local1": 20}
    assert peers(attempts) == {net.client}
    # cluster-policy traffic (the ClusterIP) uses the ready remote endpoint only
    assert all_ok(topo.probe("client", "tcp", net.vip(71), 80, count=20)) == {"remote1": 20}


# --- syncing under traffic -------------------------------------------------------------------


def test_no_connection_fails_while_rules_change(topo: Topology, cluster: Cluster) -> None:
    """Endpoints come and go on one service and others are added and removed,
    with partial syncs and forced full resyncs, while a client and a pod keep
    connecting (TCP and UDP, both families) to endpoints that stay ready."""
    pods = topo.pods
    steady = [pods["local1"], pods["remote1"]]
    cluster.apply(svc("live", 80), slices("live", steady)).sync()
    tcp_targets = [(Net(4).vip(80), 80), (Net(6).vip(80), 80)]
    udp_targets = [(Net(4).vip(80), 53), (Net(6).vip(80), 53)]

    with (
        topo.continuous(
            "client", "tcp", tcp_targets, timeout=OK_TIMEOUT, interval=0.001
        ) as client_tcp,
        topo.continuous(
            "local3", "udp", udp_targets, timeout=OK_TIMEOUT, interval=0.001
        ) as pod_udp,
    ):
        syncs = 0
        started = time.monotonic()
        round_ = 0
        timeline = Timeline([])
        # at least 6 s of traffic and 20 syncs, whichever comes last: on a slow
        # machine 6 s held 16 syncs; never more than 60 s
        while (syncs < 20 or time.monotonic() < started + 6.0) and (
            time.monotonic() < started + 60.0
        ):
            round_ += 1
            extra = pods["local2"] if round_ % 2 else pods["remote2"]
            cluster.apply(slices("live", [*steady, extra]))
            cluster.apply(
                svc(f"other{round_}", 100 + round_ % 50), slices(f"other{round_}", steady)
            )
            if round_ > 1:
                cluster.delete(svc(f"other{round_ - 1}", 100 + (round_ - 1) % 50))
                cluster.delete(slices(f"other{round_ - 1}", steady))
            timeline.sync(cluster, f"sync adding {extra.name}")
            cluster.apply(slices("live", steady))
            full = round_ % 3 == 0
            if full:
                cluster.proxier.request_full_sync()
            report = timeline.sync(cluster, f"{'full ' if full else ''}sync removing {extra.name}")
            syncs += 2
            assert report.ops > 0
            time.sleep(0.05)
        tcp = client_tcp.stop()
        udp = pod_udp.stop()

    assert syncs >= 20
    for name, attempts in (("client tcp", tcp), ("pod udp", udp)):
        assert len(attempts) >= 100, f"{name}: too little traffic to mean anything"
        all_ok(attempts, timeline)
        assert set(answered_by(attempts)) <= {"local1", "remote1", "local2", "remote2"}


# --- scale ------------------------------------------------------------------------------


def _many_vip(i: int, family: int) -> str:
    return f"10.96.{10 + i // 200}.{i % 200 + 1}" if family == 4 else f"fd00:96::1:{i:x}"


def _target_ip(a: Attempt) -> str:
    return a.target.rsplit(":", 1)[0].strip("[]")


def test_thousand_services_answer(topo: Topology, cluster: Cluster) -> None:
    """1,000 dual-stack services (2,000 service ports per family table pair)
    in one full sync; a sample of every 41st answers from its own endpoints;
    then a partial sync on the big table moves one and deletes another."""
    pods = list(topo.pods.values())
    endpoints: dict[int, list[Pod]] = {}
    for i in range(1000):
        endpoints[i] = [pods[i % len(pods)], pods[(i + 1) % len(pods)]]
        cluster.apply(
            service(f"s{i}", [_many_vip(i, 4), _many_vip(i, 6)], ports=PORTS),
            slices(f"s{i}", endpoints[i]),
        )
    start = time.monotonic()
    report = cluster.sync()
    took = time.monotonic() - start
    assert report.full and len(report.updated) == 2000, len(report.updated)
    assert took < 60, f"1,000 services took {took:.1f}s to sync"

    sample = range(0, 1000, 41)
    for family in (4, 6):
        targets = [(_many_vip(i, family), 80) for i in sample]
        attempts = topo.probe_many("client", "tcp", targets, count=2, timeout=OK_TIMEOUT)
        all_ok(attempts)
        for i, (vip, _) in zip(sample, targets, strict=True):
            allowed = {p.name for p in endpoints[i]}
            got = {a.pod for a in attempts if _target_ip(a) == vip}
            assert got and got <= allowed, (i, vip, got, allowed)

    cluster.apply(slices("s41", [topo.pods["local3"]]))
    cluster.delete(service("s82", [_many_vip(82, 4), _many_vip(82, 6)], ports=PORTS))
    cluster.delete(slices("s82", endpoints[82]))
    assert not cluster.sync().full
    for family in (4, 6):
        moved = topo.probe("client", "tcp", _many_vip(41, family), 80, count=10)
        assert all_ok(moved) == {"local3": 10}
        # a deleted service's address is no longer a service: nothing answers
        gone = topo.probe("client", "tcp", _many_vip(82, family), 80, count=1, timeout=DROP_TIMEOUT)
        assert not gone[0].ok, gone


# --- SCTP --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_sctp_cluster_ip(topo: Topology, cluster: Cluster, family: int) -> None:
    """SCTP ClusterIP and NodePort: spread and masquerade, like TCP. Where
    the kernel has no SCTP the rules are still committed (checked), then the
    traffic part is reported as SKIPPED "SCTP NOT RUNNABLE" in the summary;
    NFTPROXY_REQUIRE_SCTP=1 turns that into a failure."""
    net, pods = Net(family), topo.pods
    cluster.apply(
        nodeport_service("sctp", 90, ports=[("sctp", 90, "SCTP")], node_ports=[30090]),
        slices("sctp", [pods["local1"], pods["remote1"]], ports=[("sctp", 9090, "SCTP")]),
    )
    assert cluster.sync().ops > 0
    if topo.sctp_unsupported is not None:
        message = f"SCTP NOT RUNNABLE: this kernel has no SCTP ({topo.sctp_unsupported})"
        if os.environ.get("NFTPROXY_REQUIRE_SCTP"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    for address, port in ((net.vip(90), 90), (net.node_ip, 30090)):
        attempts = topo.probe("client", "sctp", address, port, count=30, timeout=OK_TIMEOUT)
        assert set(all_ok(attempts)) == {"local1", "remote1"}, address
        assert peers(attempts) == {pods["local1"].gateway(family)}, address


# --- nodePortAddresses: the host's interface addresses ------------------------------------

# On the node's ext0 during a test, never in the Node object: (inside, outside)
# HOST_CIDRS; the client routes 192.168.51.0/24 and fd00:51::/64 via the node
# and has 192.168.50.0/24 and fd00:50::/64 on its link.
SECONDARY = {4: ("192.168.51.7", "192.168.50.7"), 6: ("fd00:51::7", "fd00:50::7")}
ADDED_AT_RUN_TIME = {4: "192.168.51.8", 6: "fd00:51::8"}
HOST_CIDRS = ("192.168.51.0/24", "fd00:51::/64")


def host_cidrs_config() -> ProxyConfig:
    return ProxyConfig(
        node_name=NODE_NAME,
        cluster_cidrs=CLUSTER_CIDRS,
        table_name=CONFIG.table_name,
        nodeport_addresses=HOST_CIDRS,
    )


@contextlib.contextmanager
def node_addresses(topo: Topology, *ips: str) -> Iterator[None]:
    """Extra addresses on the node's ext0 for the body; removed whatever happens."""
    added: list[str] = []
    try:
        for ip in ips:
            family = 6 if ":" in ip else 4
            extra = ["nodad"] if family == 6 else []
            topo.run("node", ["ip", "addr", "add", Net(family).host_prefix(ip), "dev", "ext0",
                              *extra])
            added.append(ip)
        yield
    finally:
        for ip in added:
            family = 6 if ":" in ip else 4
            topo.run("node", ["ip", "addr", "del", Net(family).host_prefix(ip), "dev", "ext0"])


def nodeport_ips_in_kernel(topo: Topology, family: int) -> str:
    return topo.run("node", ["nft", "list", "set", "ip" if family == 4 else "ip6",
                             CONFIG.table_name, "nodeport-ips"])


@pytest.mark.parametrize("proto", PROTOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_node_port_on_secondary_host_addresses_inside_the_cidrs_only(
    topo: Topology, make_cluster: Callable[..., Cluster], family: int, proto: str
) -> None:
    """kube-proxy serves node ports on the host's interface addresses inside
    nodePortAddresses, not only on the Node object's."""
    pods = topo.pods
    inside, outside = SECONDARY[family]
    with node_addresses(topo, inside, outside):
        cluster = make_cluster(host_cidrs_config())
        cluster.proxier.on_host_addresses(read_host_addresses(topo.node))
        cluster.apply(nodeport_service("np", 22), slices("np", [pods["local1"]])).sync()

        served = topo.probe("client", proto, inside, NODE_PORTS[proto], count=5,
                            timeout=OK_TIMEOUT)
        assert all_ok(served) == {"local1": 5}
        excluded = topo.probe("client", proto, outside, NODE_PORTS[proto], count=3,
                              timeout=DROP_TIMEOUT)
        assert errors(excluded) == {"refused": 3}, f"node port served on {outside}: {excluded}"


@pytest.mark.parametrize("family", FAMILIES)
def test_node_port_on_a_host_address_added_at_run_time(
    topo: Topology, make_cluster: Callable[..., Cluster], family: int
) -> None:
    """The address watch hands the change to the Proxier; the next sync
    (full) serves the new address, and a removal takes it out again."""
    pods, address = topo.pods, ADDED_AT_RUN_TIME[family]
    cluster = make_cluster(host_cidrs_config())
    readings: queue.SimpleQueue[HostAddresses] = queue.SimpleQueue()

    def on_change(addresses: HostAddresses) -> None:
        cluster.proxier.on_host_addresses(addresses)
        readings.put(addresses)

    def has_address() -> bool:
        reading = readings.get(timeout=10)
        return address in reading.ipv4 + reading.ipv6

    watch = AddressWatch(netns=topo.node, log=LOG)
    watch.start(on_change)
    try:
        assert not has_address()
        cluster.apply(nodeport_service("np", 23), slices("np", [pods["local1"]])).sync()
        with node_addresses(topo, address):
            assert has_address(), "the watch did not hand the new address on"
            before = topo.probe("client", "tcp", address, NODE_PORTS["tcp"], count=1,
                                timeout=DROP_TIMEOUT)
            assert errors(before) == {"refused": 1}, "served before the sync?"
            assert cluster.sync().full
            assert all_ok(topo.probe("client", "tcp", address, NODE_PORTS["tcp"], count=5,
                                     timeout=OK_TIMEOUT)) == {"local1": 5}
            assert address in nodeport_ips_in_kernel(topo, family)
        assert not has_address()
        assert cluster.sync().full
        assert address not in nodeport_ips_in_kernel(topo, family)
    finally:
        watch.close()
