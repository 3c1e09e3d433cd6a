"""The packet-flow table of test_trace_flows.py against the real kernel.

For every case and both families: the scenario is programmed by a Proxier
into the node namespace of the dataplane sandbox (the same sandbox, config
and builders as tests/test_dataplane.py), the interpreter traces the case
on the kernel's own listing of the table, and the sandbox sends the traffic.
The test asserts the interpreter gives the table's answer and the traffic
gives the interpreter's: same endpoints, same masquerade per endpoint, same
reject/drop. For the affinity case the traffic is pinned to one endpoint
the interpreter offered, and the interpreter, on the listing taken after
that traffic (the kernel filled the affinity set), pins the client to that
same endpoint.

How traffic reads: an answer names the pod and the source it saw (the pod
gateway: masqueraded; the sender's own address: not); TCP refused / ICMP
port unreachable (or EPERM for the node's own UDP) is a reject; no answer
within the timeout is a drop.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
from test_dataplane import CONFIG, build_or_fail
from test_demo import SANDBOX
from test_trace_flows import CASES, FAMILIES, PODS, Answer, Case, answer_of, interpret, program

from nftproxy.core.address import format_address
from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.listing import list_family
from nftproxy.core.trace import Origin
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools import demo
from nftproxy.tools.demo_report import Block, Check, plan
from nftproxy.tools.dry_run import proxier_from_files
from nftproxy.tools.sandbox.addresses import (
    CLUSTER_CIDRS,
    NODE_IPV4,
    NODE_IPV6,
    POD_GATEWAY_IPV4,
    POD_GATEWAY_IPV6,
    Spec,
    default_pods,
)
from nftproxy.tools.sandbox.probe import Attempt, errors
from nftproxy.tools.sandbox.topology import Topology
from nftproxy.tools.trace import live_tables, make_packet, run

pytestmark = pytest.mark.kernel

ANSWERED = 40
"""Attempts where an answer is expected: with 3 endpoints, P(one never
chosen) = 3 * (2/3)^40 ~ 3e-7."""


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    with contextlib.ExitStack() as stack:
        yield build_or_fail(Spec(default_pods(local=3, remote=2)), stack)


@pytest.fixture(scope="module")
def node(topo: Topology) -> Iterator[NftBackend]:
    """The node's tables, programmed once with the whole scenario."""
    with NftBackend(netns=topo.node) as backend:
        backend.delete_tables(CONFIG.table_name)
        topo.flush_conntrack()
        program(backend)
        yield backend
        backend.delete_tables(CONFIG.table_name)


def _listing(backend: NftBackend, family: int) -> dict[int, Mapping[str, Any]]:
    doc = list_family(backend.list_table, "ip" if family == 4 else "ip6", CONFIG.table_name)
    assert doc is not None
    return {family: doc}


def _send(topo: Topology, case: Case, family: int) -> list[Attempt]:
    answered = case.expect.verdict == "answered"
    return topo.probe(
        case.who, case.proto, case.dst.address(family), case.dst.port,
        count=ANSWERED if answered else 3,
        src=case.source(family) if case.who == "client" else None,
        timeout=2.0 if case.expect.verdict != "drop" else 0.5,
    )


def observed(attempts: Sequence[Attempt], gateway: str, sender: str | None) -> Answer:
    """The traffic's answer, in the table's terms: a pod that saw `gateway`
    was masqueraded, one that saw `sender` (None: the node, whose source
    address the kernel picks) was not."""
    if all(a.ok for a in attempts):
        seen: dict[str, set[bool]] = {}
        for a in attempts:
            assert a.pod is not None
            masqueraded = a.peer == gateway
            assert masqueraded or sender in (None, a.peer), f"{a}: neither gateway nor sender"
            seen.setdefault(a.pod, set()).add(masqueraded)
        assert all(len(v) == 1 for v in seen.values()), f"mixed masquerade: {seen}"
        return Answer("answered", {pod: v.pop() for pod, v in seen.items()})
    kinds = set(errors(attempts))
    if any(a.ok for a in attempts) or len(kinds) != 1:
        return Answer(f"mixed: {errors(attempts)} and {sum(a.ok for a in attempts)} answers")
    return Answer({"refused": "reject", "EPERM": "reject", "timeout": "drop"}.get(
        kinds.pop(), f"error {kinds}"))


def agree(traffic: Answer, interpreted: Answer, again: Callable[[], Answer]) -> None:
    """Assert the traffic did what the interpreter said. With affinity, one
    client sticks to one of the endpoints offered, and `again` (the
    interpreter on a listing taken after the traffic) pins it there."""
    if not interpreted.sticky:
        assert traffic == interpreted, f"kernel: {traffic}; interpreter: {interpreted}"
        return
    (pod, masq), = traffic.endpoints.items()  # one client: one endpoint
    assert interpreted.endpoints.get(pod) == masq, (traffic, interpreted)
    pinned = again()
    assert pinned == Answer("answered", {pod: masq}, sticky=True), (
        f"after the traffic the kernel pins the client to {pod}; the interpreter says {pinned}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.says)
def test_kernel_and_interpreter_give_the_tables_answer(
    topo: Topology, node: NftBackend, case: Case, family: int
) -> None:
    interpreted = interpret(_listing(node, family), case, family)
    sender = None if case.who == "node" else case.source(family)
    traffic = observed(_send(topo, case, family), PODS["local1"].gateway(family), sender)
    assert interpreted == case.expect, f"interpreter: {interpreted}; table: {case.expect}"
    agree(traffic, interpreted, lambda: interpret(_listing(node, family), case, family))


# --- the demo's own paths -------------------------------------------------------------------


def test_trace_agrees_with_the_demos_traffic_on_the_sample() -> None:
    """Every path the demo reports for the embedded sample (demo_report.plan,
    sent by demo.run_checks, as `nftproxy demo` does), traced on the live
    table: same endpoints, masquerade, reject or drop."""
    config = ProxyConfig(cluster_cidrs=CLUSTER_CIDRS)  # the demo's default
    host = [NODE_IPV4, NODE_IPV6, *SANDBOX.gateways]
    with contextlib.ExitStack() as stack:
        topo = build_or_fail(Spec(demo.PODS), stack)
        backend = stack.enter_context(NftBackend(netns=topo.node))
        proxier_from_files([str(demo.SAMPLE)], config, backend).sync()
        checks = [c for b in plan(demo.load_cluster(demo.SAMPLE), SANDBOX) for c in b.checks]
        assert len(checks) >= 10

        def traced(check: Check) -> Answer:
            tables = live_tables(backend, config.table_name, host)
            assert tables is not None
            target = f"{format_address(check.addr, check.port)}/{check.proto}"
            packet = make_packet(check.src, target, Origin.EXTERNAL, config)
            return answer_of(run(tables, packet), SANDBOX.pods)

        interpreted = {c: traced(c) for c in checks}  # before any traffic (affinity)
        block = Block("every path", "", (), (), tuple(checks))
        results, _ = demo.run_checks(topo, [block], threading.Event())
        for check in checks:
            gateway = POD_GATEWAY_IPV6 if ":" in check.addr else POD_GATEWAY_IPV4
            traffic = observed(results[check].attempts, gateway, check.src)
            agree(traffic, interpreted[check], functools.partial(traced, check))
