"""Dataplane acceptance, bridge variant: detectLocalMode=BridgeInterface.

Its own sandbox: pods br1 and br2 on bridge cbr0 in the node namespace
(10.244.2.0/24, fd00:244:2::/64, gateway 10.244.2.1 / fd00:244:2::1; ports
in hairpin mode and bridge-nf-call-ip(6)tables on, as on a kubelet node) and
remote1 ("on node-b", veth + host routes as in test_dataplane). The local
traffic detector is `iifname cbr0`, so "from a pod" means "came in through
the bridge", whatever the source address.

Aspects (IPv4 and IPv6):
- a bridged pod reaching a ClusterIP keeps its source; the external client is
  masqueraded; a bridged pod reaching its own service (hairpin across the
  bridge) is masqueraded and answered;
- externalTrafficPolicy=Local without a local endpoint: the client is
  dropped, a bridged pod still reaches the LB IP (pod short-circuit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from test_dataplane import (
    DROP_TIMEOUT,
    NODE_PORTS,
    OK_TIMEOUT,
    Cluster,
    Net,
    all_ok,
    build_or_fail,
    peers,
    slices,
    svc,
)

from nftproxy.core.config import DetectLocalMode, ProxyConfig
from nftproxy.kernel.conntrack import Conntrack
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.sandbox.probe import errors
from nftproxy.tools.sandbox.topology import (
    BRIDGE,
    CLUSTER_CIDRS,
    NODE_NAME,
    Spec,
    Topology,
    default_pods,
)

pytestmark = pytest.mark.kernel

FAMILIES = [pytest.param(4, id="ipv4"), pytest.param(6, id="ipv6")]

CONFIG = ProxyConfig(
    node_name=NODE_NAME,
    cluster_cidrs=CLUSTER_CIDRS,
    detect_local_mode=DetectLocalMode.BRIDGE_INTERFACE,
    bridge_interface=BRIDGE,
    table_name="nftproxy",
)


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    with contextlib.ExitStack() as stack:
        yield build_or_fail(Spec(default_pods(local=0, remote=1, bridged=2)), stack)


@pytest.fixture(scope="module")
def backend(topo: Topology) -> Iterator[NftBackend]:
    with NftBackend(netns=topo.node) as b:
        yield b


@pytest.fixture(scope="module")
def conntrack(topo: Topology) -> Iterator[Conntrack]:
    with Conntrack(netns=topo.node) as ct:
        yield ct


@pytest.fixture
def cluster(topo: Topology, backend: NftBackend, conntrack: Conntrack) -> Iterator[Cluster]:
    backend.delete_tables(CONFIG.table_name)
    topo.flush_conntrack()
    yield Cluster(backend, CONFIG, conntrack)
    backend.delete_tables(CONFIG.table_name)


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_detection_masquerades_only_off_bridge_sources(
    topo: Topology, cluster: Cluster, family: int
) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(svc("web", 10), slices("web", [pods["br2"], pods["remote1"]])).sync()

    from_client = topo.probe("client", "tcp", net.vip(10), 80, count=30, timeout=OK_TIMEOUT)
    assert set(all_ok(from_client)) == {"br2", "remote1"}
    for name in ("br2", "remote1"):
        assert peers(from_client, name) == {pods[name].gateway(family)}, f"{name}: not masqueraded"

    from_pod = topo.probe("br1", "tcp", net.vip(10), 80, count=30, timeout=OK_TIMEOUT)
    assert set(all_ok(from_pod)) == {"br2", "remote1"}
    assert peers(from_pod) == {pods["br1"].ip(family)}, "bridged pod source must be kept"


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_hairpin(topo: Topology, cluster: Cluster, family: int) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(svc("web", 11), slices("web", [pods["br1"], pods["br2"]])).sync()
    for proto, port in (("tcp", 80), ("udp", 53)):
        attempts = topo.probe("br1", proto, net.vip(11), port, count=40, timeout=OK_TIMEOUT)
        assert set(all_ok(attempts)) == {"br1", "br2"}, proto
        assert peers(attempts, "br1") == {pods["br1"].gateway(family)}, f"{proto}: hairpin"
        assert peers(attempts, "br2") == {pods["br1"].ip(family)}, proto


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_pod_short_circuits_local_policy(
    topo: Topology, cluster: Cluster, family: int
) -> None:
    net, pods = Net(family), topo.pods
    cluster.apply(
        svc(
            "lb",
            12,
            type="LoadBalancer",
            node_ports=[NODE_PORTS["tcp"], NODE_PORTS["udp"]],
            lb_ips=[Net(4).lb(12), Net(6).lb(12)],
            etp="Local",
            health_check_node_port=30500,
        ),
        slices("lb", [pods["remote1"]]),
    ).sync()
    dropped = topo.probe("client", "tcp", net.lb(12), 80, count=2, timeout=DROP_TIMEOUT)
    assert errors(dropped) == {"timeout": 2}, "no local endpoint: external client dropped"
    attempts = topo.probe("br1", "tcp", net.lb(12), 80, count=20, timeout=OK_TIMEOUT)
    assert all_ok(attempts) == {"remote1": 20}, "pods reach external VIPs through the cluster chain"
    assert peers(attempts) == {pods["br1"].ip(family)}
