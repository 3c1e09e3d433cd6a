"""Packet-flow tables: what the dataplane suite proves with traffic, stated once.

Each case says, in the domain's words, who sends what where and what
happens: which endpoints answer and whether each sees a masqueraded source,
or that the packet is rejected or dropped. The cases run twice:
- here, against the interpreter (nftproxy/core/trace) on the table a
  Proxier programs into a FakeBackend: no root, milliseconds per case;
- in test_trace_dataplane.py, against the real kernel in the sandbox of
  tests/test_dataplane.py (same address plan, same Service/EndpointSlice
  builders, same config), where a test asserts that the traffic and the
  interpreter (run on the kernel's own listing) give the same answer as the
  table, for every case and both families.
So the interpreter cannot drift from the kernel, and the fast suite covers
the packet paths the slow one proves.

Scenario: one node (node-a) with pods local1-3 and remote pods remote1-2
(on node-b), ClusterIP, hairpin, NodePort, LoadBalancer with
externalTrafficPolicy=Local (with and without a local endpoint),
internalTrafficPolicy=Local, loadBalancerSourceRanges, ClientIP affinity,
a service without endpoints, and the ServiceCIDRs 10.96.0.0/16, fd00:96::/64.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_dataplane import CONFIG, TERMINATING, Cluster, Net, nodeport_service, slices, svc

from nftproxy.core.nft.listing import list_family
from nftproxy.core.nft.seam import Backend
from nftproxy.core.trace import Host, Origin, Packet, Ruleset, Trace, trace
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools.sandbox.addresses import (
    NODE_ALT_IPV4,
    NODE_ALT_IPV6,
    NODE_IPV4,
    NODE_IPV6,
    POD_GATEWAY_IPV4,
    POD_GATEWAY_IPV6,
    SERVICE_RANGES,
    Pod,
    default_pods,
)

PODS = {
    s.name: Pod(s.name, "", s.ipv4, s.ipv6, s.node_name, "", POD_GATEWAY_IPV4, POD_GATEWAY_IPV6)
    for s in default_pods(local=3, remote=2)
}
"""The sandbox's pods by name (addresses and nodes as the sandbox builds them)."""
HOST = Host.of([NODE_IPV4, NODE_ALT_IPV4, NODE_IPV6, NODE_ALT_IPV6,
                POD_GATEWAY_IPV4, POD_GATEWAY_IPV6])
"""The sandbox node's own addresses (node, alternate, pod gateways)."""
FAMILIES = [pytest.param(4, id="ipv4"), pytest.param(6, id="ipv6")]


def pod_ip(name: str, family: int) -> str:
    return PODS[name].ip(family)


def _scenario() -> list[dict[str, Any]]:
    p = [PODS[n] for n in ("local1", "local2", "local3", "remote1", "remote2")]
    local1, local2, _, remote1, remote2 = p
    v4, v6 = Net(4), Net(6)

    def lb(n: int) -> list[str]:
        return [v4.lb(n), v6.lb(n)]

    return [
        svc("web", 10), *slices("web", [local1, local2, remote1]),
        svc("hair", 12), *slices("hair", [local1, local2]),
        nodeport_service("np", 20), *slices("np", [local1, remote1]),
        svc("lbl", 30, type="LoadBalancer", node_ports=[30081, 30054], lb_ips=lb(30),
            etp="Local"),
        *slices("lbl", [local1, remote1]),
        svc("lbnone", 31, type="LoadBalancer", node_ports=[30082, 30055], lb_ips=lb(31),
            etp="Local"),
        *slices("lbnone", [remote1, remote2]),
        svc("itp", 32, itp="Local"), *slices("itp", [local1, remote1]),
        svc("fw", 42, type="LoadBalancer", node_ports=[30083, 30056], lb_ips=lb(42),
            source_ranges=[v4.host_prefix(v4.client), v6.host_prefix(v6.client)]),
        *slices("fw", [local1, remote1]),
        svc("sticky", 50, affinity_timeout=600),
        *slices("sticky", [local1, local2, remote1]),
        svc("empty", 60),
        nodeport_service("npempty", 61, type="LoadBalancer", node_ports=[30084, 30057],
                         lb_ips=lb(61), external_ips=lb(62)),
        svc("ext", 40, external_ips=lb(40)), *slices("ext", [local1, remote1]),
        svc("term", 70), *slices("term", [local1, (local2, TERMINATING)]),
        nodeport_service("lterm", 71, etp="Local", node_ports=[30085, 30058]),
        *slices("lterm", [(local1, TERMINATING), remote1]),
    ]


def program(backend: Backend) -> Cluster:
    """The scenario, synced into `backend` by a Proxier as the agent feeds it."""
    cluster = Cluster(backend, CONFIG)  # type: ignore[arg-type]  # any Backend will do
    cluster.proxier.on_service_cidrs(SERVICE_RANGES)
    cluster.apply(_scenario()).sync()
    return cluster


# --- answers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What happens: "answered" by `endpoints` (pod -> masqueraded?), or
    "reject" / "drop". `sticky`: every connection of one client goes to
    the same one of them (ClientIP affinity)."""

    verdict: str
    endpoints: Mapping[str, bool] = field(default_factory=dict)
    sticky: bool = False

    def __str__(self) -> str:
        eps = ", ".join(f"{p}{' (masqueraded)' if m else ''}" for p, m in
                        sorted(self.endpoints.items()))
        return f"{self.verdict} {eps}{' sticky' if self.sticky else ''}".strip()


def answered(*, sticky: bool = False, **endpoints: bool) -> Answer:
    return Answer("answered", endpoints, sticky)


REJECT = Answer("reject")
DROP = Answer("drop")


@dataclass(frozen=True)
class Dst:
    """A destination: ClusterIP / LB IP number `n`, or the node's address."""

    kind: str
    n: int
    port: int

    def address(self, family: int) -> str:
        net = Net(family)
        return {"vip": net.vip, "lb": net.lb}[self.kind](self.n) if self.kind != "node" else (
            net.node_ip
        )

    def __str__(self) -> str:
        return f"{self.kind}{self.n or ''}:{self.port}"


def vip(n: int, port: int = 80) -> Dst:
    return Dst("vip", n, port)


def lb(n: int, port: int = 80) -> Dst:
    return Dst("lb", n, port)


def node_port(port: int) -> Dst:
    return Dst("node", 0, port)


@dataclass(frozen=True)
class Case:
    says: str
    who: str
    """"client", "node" or a pod's name."""
    dst: Dst
    expect: Answer
    proto: str = "tcp"
    other_client: bool = False
    """From the client's second address (outside loadBalancerSourceRanges)."""

    def source(self, family: int) -> str:
        net = Net(family)
        if self.who == "client":
            return net.client_other if self.other_client else net.client
        return net.node_ip if self.who == "node" else pod_ip(self.who, family)

    def origin(self) -> Origin:
        return {"client": Origin.EXTERNAL, "node": Origin.NODE}.get(self.who, Origin.POD)

    def packet(self, family: int) -> Packet:
        iif = "" if self.who == "node" else None
        return Packet(self.source(family), self.dst.address(family), self.dst.port, self.proto,
                      origin=self.origin(), iifname=iif)


T, F = True, False
CASES = [
    Case("client -> ClusterIP: every ready endpoint, masqueraded (off-cluster source)",
         "client", vip(10), answered(local1=T, local2=T, remote1=T)),
    Case("pod -> ClusterIP (udp): every ready endpoint, pod source kept",
         "local3", vip(10, 53), answered(local1=F, local2=F, remote1=F), "udp"),
    Case("node -> ClusterIP: masqueraded", "node", vip(10),
         answered(local1=T, local2=T, remote1=T)),
    Case("hairpin: a pod reaching itself through its service is masqueraded",
         "local1", vip(12), answered(local1=T, local2=F)),
    Case("client -> NodePort (externalTrafficPolicy=Cluster): masqueraded",
         "client", node_port(30080), answered(local1=T, remote1=T)),
    Case("pod -> NodePort on the node's address (udp): masqueraded",
         "local2", node_port(30053), answered(local1=T, remote1=T), "udp"),
    Case("client -> LB IP, externalTrafficPolicy=Local: the local endpoint, source kept",
         "client", lb(30), answered(local1=F)),
    Case("client -> NodePort, externalTrafficPolicy=Local: the local endpoint, source kept",
         "client", node_port(30081), answered(local1=F)),
    Case("node -> NodePort, externalTrafficPolicy=Local: every endpoint, masqueraded",
         "node", node_port(30081), answered(local1=T, remote1=T)),
    Case("client -> LB IP, externalTrafficPolicy=Local, no local endpoint: dropped",
         "client", lb(31), DROP),
    Case("client -> NodePort (udp), externalTrafficPolicy=Local, no local endpoint: dropped",
         "client", node_port(30055), DROP, "udp"),
    Case("pod -> LB IP, externalTrafficPolicy=Local, no local endpoint: every endpoint, "
         "source kept (pod short-circuit)", "local2", lb(31), answered(remote1=F, remote2=F)),
    Case("pod -> ClusterIP, internalTrafficPolicy=Local: the local endpoint only",
         "local2", vip(32), answered(local1=F)),
    Case("client inside loadBalancerSourceRanges -> LB IP: answered",
         "client", lb(42), answered(local1=T, remote1=T)),
    Case("client outside loadBalancerSourceRanges -> LB IP: dropped",
         "client", lb(42), DROP, other_client=True),
    Case("client outside loadBalancerSourceRanges -> NodePort: not filtered",
         "client", node_port(30083), answered(local1=T, remote1=T), other_client=True),
    Case("client -> ClusterIP with ClientIP affinity: pinned to one endpoint",
         "client", vip(50), answered(local1=T, local2=T, remote1=T, sticky=True)),
    Case("client -> ClusterIP without endpoints: rejected", "client", vip(60), REJECT),
    Case("client -> ClusterIP without endpoints (udp): rejected",
         "client", vip(60, 53), REJECT, "udp"),
    Case("node -> ClusterIP without endpoints (udp): rejected", "node", vip(60, 53), REJECT,
         "udp"),
    Case("client -> undefined port of a ClusterIP: rejected", "client", vip(10, 81), REJECT),
    Case("pod -> undefined port of a ClusterIP (udp): rejected",
         "local2", vip(10, 54), REJECT, "udp"),
    Case("client -> unallocated address in a ServiceCIDR: dropped", "client", vip(99), DROP),
    Case("client -> NodePort without endpoints: rejected", "client", node_port(30084), REJECT),
    Case("node -> NodePort without endpoints (udp): rejected",
         "node", node_port(30057), REJECT, "udp"),
    Case("client -> LB IP without endpoints: rejected", "client", lb(61), REJECT),
    Case("client -> external IP without endpoints (udp): rejected",
         "client", lb(62, 53), REJECT, "udp"),
    Case("client -> external IP: every endpoint, masqueraded",
         "client", lb(40), answered(local1=T, remote1=T)),
    Case("terminating endpoints get no traffic while a ready one exists",
         "client", vip(70), answered(local1=T)),
    Case("externalTrafficPolicy=Local falls back to a local serving-terminating endpoint",
         "client", node_port(30085), answered(local1=F)),
    Case("...while the ClusterIP uses the ready remote endpoint",
         "client", vip(71), answered(remote1=T)),
]


def interpret(listings: Mapping[int, Mapping[str, Any]], case: Case, family: int) -> Answer:
    """The interpreter's answer for `case` on the listing of `family`'s table."""
    nft = "ip" if family == 4 else "ip6"
    rs = Ruleset.from_listing(listings[family], nft, CONFIG.table_name)
    names = {pod_ip(name, family): name for name in PODS}
    return answer_of(trace(rs, case.packet(family), HOST), names)


def answer_of(result: Trace, names: Mapping[str, str]) -> Answer:
    """The interpreter's paths as an Answer; `names`: pod name by address."""
    verdicts = {p.verdict for p in result.paths}
    if verdicts != {"accept"}:
        return Answer("/".join(sorted(verdicts)))
    endpoints = {names.get(p.endpoint.address if p.endpoint else "", "(not translated)"):
                 p.masquerade for p in result.paths}
    return Answer("answered", endpoints, all(p.affinity for p in result.paths))


@pytest.fixture(scope="module")
def planned() -> dict[int, Mapping[str, Any]]:
    backend = FakeBackend()
    backend.start()
    program(backend)
    listings = {
        f: list_family(backend.list_table, nft, CONFIG.table_name)
        for f, nft in ((4, "ip"), (6, "ip6"))
    }
    return {f: doc for f, doc in listings.items() if doc is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.says)
def test_interpreter_answers_as_the_table_says(
    planned: dict[int, Mapping[str, Any]], case: Case, family: int
) -> None:
    got = interpret(planned, case, family)
    assert got == case.expect, f"{got} != {case.expect}"
