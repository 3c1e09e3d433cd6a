"""Localhost node ports proven by real packets (issue 37; kube-proxy's KEP-6032).

The sandbox of tests/test_dataplane.py (its own, per module: node, client,
pods local1-2 on this node and remote1 on node-b), with
nodePortAddresses [primary, localhost]. Every test starts from empty tables,
an empty conntrack table and route_localnet=0 in the node namespace, and
leaves it at 0 again; the namespaces are removed however the module ends.

Aspects:
- feature on (the gate KubeProxyNFTablesLocalhostNodePorts, route_localnet
  set by nftproxy's own `enable_route_localnet` in the node namespace): a
  process on the node reaches 127.0.0.1:nodePort over TCP and UDP, for
  externalTrafficPolicy=Cluster and Local (with a local endpoint); as
  kube-proxy's iptables mode treats the node's own traffic, Local sends it
  to any endpoint, and the connection is masqueraded (the pods see their
  gateway, never 127.0.0.1); `nftproxy trace` on the kernel's listing says
  the same; a port with ClientIP affinity (the affinity table) too;
- feature off (the keyword without the gate), even with route_localnet=1
  left set: the same connections fail, while the node's primary address
  still serves the node port;
- CVE-2020-8558: with the feature on, a packet for 127.0.0.1 that arrives
  from another namespace on the node's interface (written raw onto the
  client's veth: no socket sends to 127.0.0.1 off loopback) never reaches a
  process listening on 127.0.0.1 in the node, nor a node port; without the
  KUBE-FIREWALL rule (feature off, route_localnet=1) the same packet does,
  which shows the probe can see it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_dataplane import (
    CONFIG,
    NODE_PORTS,
    OK_TIMEOUT,
    Cluster,
    Net,
    all_ok,
    build_or_fail,
    nodeport_service,
    peers,
    slices,
)
from test_trace_flows import HOST, Answer, answer_of, answered

from nftproxy.core.config import ProxyConfig
from nftproxy.core.nft.listing import list_family
from nftproxy.core.trace import Packet, Ruleset, trace
from nftproxy.core.trace.packet import Origin
from nftproxy.kernel import netns
from nftproxy.kernel.conntrack import Conntrack
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.kernel.sysctl import ROUTE_LOCALNET, HostFS, enable_route_localnet
from nftproxy.tools.sandbox.addresses import NODE_IPV4, Spec, default_pods
from nftproxy.tools.sandbox.probe import errors
from nftproxy.tools.sandbox.topology import Topology, sysctls

pytestmark = pytest.mark.kernel

ON = replace(CONFIG, nodeport_addresses=("primary", "localhost"), nftables_localhost_nodeports=True)
OFF = replace(ON, nftables_localhost_nodeports=False)
LOCALHOST = "127.0.0.1"
ANSWERED = 40
"""Attempts where an answer is expected: with 2 endpoints, P(one never
chosen) = 2 * (1/2)^40 ~ 2e-12."""
REFUSED = 3
ETPS = [pytest.param("Cluster", id="eTP=Cluster"), pytest.param("Local", id="eTP=Local")]
PROTOS = [pytest.param("tcp", id="tcp"), pytest.param("udp", id="udp")]


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    with contextlib.ExitStack() as stack:
        yield build_or_fail(Spec(default_pods(local=2, remote=1)), stack)


@pytest.fixture(scope="module")
def backend(topo: Topology) -> Iterator[NftBackend]:
    with NftBackend(netns=topo.node) as b:
        yield b


@pytest.fixture(scope="module")
def conntrack(topo: Topology) -> Iterator[Conntrack]:
    with Conntrack(netns=topo.node) as ct:
        yield ct


def route_localnet(topo: Topology) -> int:
    return netns.run_in(topo.node, lambda: int(Path(ROUTE_LOCALNET).read_text()))


@pytest.fixture
def make_cluster(
    topo: Topology, backend: NftBackend, conntrack: Conntrack
) -> Iterator[Callable[[ProxyConfig], Cluster]]:
    """Empty tables and conntrack, route_localnet 0; then Cluster(config)
    on demand; and the same state again afterwards."""

    def reset() -> None:
        backend.delete_tables(CONFIG.table_name)
        topo.flush_conntrack()
        sysctls(topo.node, {"net.ipv4.conf.all.route_localnet": 0})

    reset()
    yield lambda config: Cluster(backend, config, conntrack)
    reset()


def feature_on(topo: Topology) -> None:
    """What `nftproxy run` does at start with the feature on, in the node."""
    assert route_localnet(topo) == 0
    assert netns.run_in(topo.node, lambda: enable_route_localnet(HostFS())) is True
    assert route_localnet(topo) == 1


def localhost_services(cluster: Cluster, topo: Topology, etp: str) -> None:
    pods = topo.pods
    cluster.apply(
        nodeport_service("np", 20, etp=etp),
        slices("np", [pods["local1"], pods["remote1"]]),
    ).sync()


def interpreted(backend: NftBackend, src: str, dst: str, port: int, proto: str,
                origin: Origin) -> Answer:
    """`nftproxy trace`'s answer on the kernel's own listing of the IPv4 table."""
    doc = list_family(backend.list_table, "ip", CONFIG.table_name)
    assert doc is not None
    rs = Ruleset.from_listing(doc, "ip", CONFIG.table_name)
    packet = Packet(src, dst, port, proto, origin=origin,
                    iifname="" if origin is Origin.NODE else "eth0")
    names = {p.ipv4: name for name, p in HOST_PODS.items()}
    return answer_of(trace(rs, packet, HOST), names)


HOST_PODS = {s.name: s for s in default_pods(local=2, remote=1)}
"""The sandbox's pods by name, for naming the interpreter's endpoints."""


# --- the node reaches 127.0.0.1:nodePort ----------------------------------------------------


@pytest.mark.parametrize("proto", PROTOS)
@pytest.mark.parametrize("etp", ETPS)
def test_the_node_reaches_a_node_port_on_localhost(
    topo: Topology, backend: NftBackend, make_cluster: Callable[[ProxyConfig], Cluster],
    etp: str, proto: str,
) -> None:
    feature_on(topo)
    localhost_services(make_cluster(ON), topo, etp)
    gateway = topo.pods["local1"].gateway(4)

    attempts = topo.probe("node", proto, LOCALHOST, NODE_PORTS[proto], count=ANSWERED,
                          timeout=OK_TIMEOUT)
    counts = all_ok(attempts)
    # eTP=Local too: the node's own traffic may use any endpoint (kube-proxy's
    # "route LOCAL traffic ... to the Cluster chain")
    assert set(counts) == {"local1", "remote1"}, counts
    assert peers(attempts) == {gateway}, "localhost traffic must be masqueraded"

    traced = interpreted(backend, LOCALHOST, LOCALHOST, NODE_PORTS[proto], proto, Origin.NODE)
    assert traced == answered(local1=True, remote1=True), traced

    if etp == "Local":  # while an external client still gets the local endpoint only
        client = topo.probe("client", proto, NODE_IPV4, NODE_PORTS[proto], count=10,
                            timeout=OK_TIMEOUT)
        assert all_ok(client) == {"local1": 10}
        assert peers(client) == {Net(4).client}


def test_a_client_ip_affinity_node_port_on_localhost(
    topo: Topology, backend: NftBackend, make_cluster: Callable[[ProxyConfig], Cluster]
) -> None:
    """The affinity table's nat-output serves it: one endpoint for the node,
    masqueraded."""
    feature_on(topo)
    pods = topo.pods
    make_cluster(ON).apply(
        nodeport_service("sticky", 21, affinity_timeout=600),
        slices("sticky", [pods["local1"], pods["remote1"]]),
    ).sync()
    attempts = topo.probe("node", "tcp", LOCALHOST, NODE_PORTS["tcp"], count=20,
                          timeout=OK_TIMEOUT)
    assert len(all_ok(attempts)) == 1, "ClientIP affinity: one endpoint"
    assert peers(attempts) == {pods["local1"].gateway(4)}
    traced = interpreted(backend, LOCALHOST, LOCALHOST, NODE_PORTS["tcp"], "tcp", Origin.NODE)
    assert traced.sticky and set(traced.endpoints) <= {"local1", "remote1"}, traced


@pytest.mark.parametrize("proto", PROTOS)
def test_without_the_gate_localhost_node_ports_fail(
    topo: Topology, make_cluster: Callable[[ProxyConfig], Cluster], proto: str
) -> None:
    # route_localnet left at 1 by someone else: the rules are what serves
    sysctls(topo.node, {"net.ipv4.conf.all.route_localnet": 1})
    localhost_services(make_cluster(OFF), topo, "Cluster")

    failed = topo.probe("node", proto, LOCALHOST, NODE_PORTS[proto], count=REFUSED,
                        timeout=0.5)
    assert not any(a.ok for a in failed), failed
    assert sum(errors(failed).values()) == REFUSED
    # the service itself is served on the node's primary address
    all_ok(topo.probe("node", proto, NODE_IPV4, NODE_PORTS[proto], count=5,
                      timeout=OK_TIMEOUT))


# --- CVE-2020-8558: 127.0.0.1 from the network ------------------------------------------------


def _mac(ns: str, ifname: str) -> bytes:
    (link,) = json.loads(netns.exec_in(ns, ["ip", "-j", "link", "show", ifname]).stdout)
    return bytes.fromhex(link["address"].replace(":", ""))


def _checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _udp_frame(src_mac: bytes, dst_mac: bytes, src: str, dst: str, port: int,
               payload: bytes) -> bytes:
    """An Ethernet frame with one IPv4 UDP datagram (UDP checksum 0: none)."""
    udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0x4000, 64,
                     socket.IPPROTO_UDP, 0, ipaddress.IPv4Address(src).packed,
                     ipaddress.IPv4Address(dst).packed)
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    return dst_mac + src_mac + struct.pack("!H", 0x0800) + ip + udp


def sent_from_the_network(topo: Topology, port: int) -> bytes | None:
    """Write a UDP datagram for 127.0.0.1:`port` onto the client's veth,
    addressed to the node's interface; what a socket bound to 127.0.0.1:port
    in the node received within a second (None: nothing)."""
    payload = b"from the network to 127.0.0.1"
    frame = _udp_frame(_mac(topo.client, "eth0"), _mac(topo.node, "ext0"), Net(4).client,
                       LOCALHOST, port, payload)

    def listen() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((LOCALHOST, port))
        sock.settimeout(1.0)
        return sock

    def send() -> None:
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as raw:
            raw.bind(("eth0", 0))
            raw.send(frame)

    with netns.run_in(topo.node, listen) as sock:
        netns.run_in(topo.client, send)
        try:
            data = sock.recv(1024)
        except TimeoutError:
            return None
    assert data == payload
    return data


def test_a_packet_for_localhost_from_the_network_is_dropped(
    topo: Topology, backend: NftBackend, make_cluster: Callable[[ProxyConfig], Cluster]
) -> None:
    feature_on(topo)
    localhost_services(make_cluster(ON), topo, "Cluster")

    assert sent_from_the_network(topo, 10248) is None, "KUBE-FIREWALL let 127.0.0.1 in"
    # nor does the network get a node port through 127.0.0.1 (only the node's own
    # connections are DNATed there): the drop comes first
    assert sent_from_the_network(topo, NODE_PORTS["udp"]) is None
    traced = interpreted(backend, Net(4).client, LOCALHOST, 10248, "udp", Origin.EXTERNAL)
    assert traced == Answer("drop"), traced

    # the same packet, with route_localnet still 1 but no KUBE-FIREWALL rule, arrives
    backend.delete_tables(CONFIG.table_name)
    make_cluster(OFF).sync()
    assert route_localnet(topo) == 1
    assert sent_from_the_network(topo, 10248) is not None, "the probe cannot see the packet"
