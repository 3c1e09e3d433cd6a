"""Conntrack cleanup against the real kernel, proven by UDP traffic.

Aspects:
- a UDP client that keeps one source port reaches the new endpoint in the
  first datagram after its endpoint was replaced (IPv4 and IPv6) -- and,
  with the cleanup hook left out, keeps reaching the old one: the cleanup is
  what makes the difference;
- 0 -> 1 endpoints: datagrams to a service without endpoints go unanswered
  and, rejected before conntrack confirms them, leave no entry; after the
  endpoint appears the same source port is answered (a regression guard:
  this one would pass without cleanup too);
- 0 -> 1 where cleanup decides: a flow the node forwarded before the
  service existed (no DNAT in its entry) is answered once the service
  appears, and stays lost without the cleanup;
- SCTP and IPv6 entries are deleted; an IPv6 entry to another address with
  the same port is left alone (the kernel's IPv6 CTA_FILTER address match
  is inverted, so that check is ours);
- a cleanup of more ports than are dumped one by one (a full sync) shares
  one dump per family and protocol and deletes what one dump per port
  would (FakeConntrack);
- Conntrack.start() never creates a missing namespace;
- the cost of a cleanup with 10,000 unrelated entries in the table
  (recorded, not asserted).

Topology (built here, torn down after each test): client (192.168.50.2,
fd00:50::2) == veth == node (nftproxy's tables and conntrack; forwarding;
default route back towards the client) == veth == pods (two endpoint
addresses, A and B, each with its own UDP responder that keeps answering
after it left the EndpointSlice).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import kernel
import pytest
from feed import intake
from k8s import endpoint_slice, node, service

from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.core.conntrack import CleanupResult, Flow, FlowFilter
from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.kernel import netns as _netns
from nftproxy.kernel.conntrack import Conntrack, ConntrackUnavailable, conntrack_hook
from nftproxy.kernel.fake_conntrack import FakeConntrack
from nftproxy.kernel.libnftables import NftBackend

pytestmark = pytest.mark.kernel

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
NODE = "node-a"
CONFIG = ProxyConfig(
    node_name=NODE, cluster_cidrs=("10.244.0.0/16", "fd00:244::/48"), table_name="nftproxy"
)
CLIENT_PORT = 40053
TARGET_PORT = 5353


@dataclass(frozen=True)
class Plan:
    """The address plan of one family."""

    client: str
    node: str
    pod_gw: str
    a: str
    b: str
    vip: str
    any: str
    prefix: int


PLANS = {
    V4: Plan(
        "192.168.50.2", "192.168.50.1", "10.244.1.1", "10.244.1.2", "10.244.1.3",
        "10.96.0.10", "0.0.0.0", 24,
    ),
    V6: Plan(
        "fd00:50::2", "fd00:50::1", "fd00:244:1::1", "fd00:244:1::2", "fd00:244:1::3",
        "fd00:96::10", "::", 64,
    ),
}  # fmt: skip
AF = {V4: socket.AF_INET, V6: socket.AF_INET6}


# ---- topology --------------------------------------------------------------------------


MAC = {
    "client": "02:00:00:00:01:02",
    "ext0": "02:00:00:00:01:01",
    "pod0": "02:00:00:00:02:01",
    "pods": "02:00:00:00:02:02",
}


def _ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, text=True)


def _veth(ns: str, name: str, mac: str, peer_ns: str, peer_mac: str) -> None:
    """`name` in `ns`, its peer `eth0` in `peer_ns`, both with fixed MACs."""
    peer = ("peer", "name", "eth0", "address", peer_mac, "netns", peer_ns)
    _ip(ns, "link", "add", name, "address", mac, "type", "veth", *peer)


@dataclass(frozen=True)
class Topology:
    client: str
    node: str
    pods: str


@contextlib.contextmanager
def topology() -> Iterator[Topology]:
    with (
        kernel.fresh_netns() as client,
        kernel.fresh_netns() as node_ns,
        kernel.fresh_netns() as pods,
    ):
        _veth(node_ns, "ext0", MAC["ext0"], client, MAC["client"])
        _veth(node_ns, "pod0", MAC["pod0"], pods, MAC["pods"])
        for family, p in PLANS.items():
            nodad = ["nodad"] if family is V6 else []
            _ip(client, "addr", "add", f"{p.client}/{p.prefix}", "dev", "eth0", *nodad)
            _ip(node_ns, "addr", "add", f"{p.node}/{p.prefix}", "dev", "ext0", *nodad)
            _ip(node_ns, "addr", "add", f"{p.pod_gw}/{p.prefix}", "dev", "pod0", *nodad)
            for ip in (p.a, p.b):
                _ip(pods, "addr", "add", f"{ip}/{p.prefix}", "dev", "eth0", *nodad)
            # Static neighbours: IPv6 neighbour discovery right after the
            # links come up lost the first datagram for ~1 s on 6.18.
            for ns, ip, dev, mac in (
                (client, p.node, "eth0", MAC["ext0"]),
                (node_ns, p.client, "ext0", MAC["client"]),
                (node_ns, p.a, "pod0", MAC["pods"]),
                (node_ns, p.b, "pod0", MAC["pods"]),
                (pods, p.pod_gw, "eth0", MAC["pod0"]),
            ):
                _ip(ns, "neigh", "replace", ip, "lladdr", mac, "dev", dev, "nud", "permanent")
        for ns, dev in ((client, "eth0"), (node_ns, "ext0"), (node_ns, "pod0"), (pods, "eth0")):
            _ip(ns, "link", "set", dev, "up")
        for family, p in PLANS.items():
            flag = "-4" if family is V4 else "-6"
            services = "10.96.0.0/16" if family is V4 else "fd00:96::/64"
            _ip(client, flag, "route", "add", services, "via", p.node)
            _ip(pods, flag, "route", "add", "default", "via", p.pod_gw)
            # Packets to a VIP nftproxy does not know yet leave towards the
            # client (which drops them): the node confirms an un-NATed entry.
            _ip(node_ns, flag, "route", "add", "default", "via", p.client)
        _netns.sysctl(node_ns, "net.ipv4.ip_forward", 1)
        _netns.sysctl(node_ns, "net.ipv6.conf.all.forwarding", 1)
        yield Topology(client, node_ns, pods)


class Responder:
    """A UDP server on one endpoint address: answers `<name> <payload>`."""

    def __init__(self, ns: str, family: IPFamily, ip: str, name: str) -> None:
        self.sock: socket.socket = _netns.run_in(ns, socket.socket, AF[family], socket.SOCK_DGRAM)
        self.sock.bind((ip, TARGET_PORT))
        self.sock.settimeout(0.05)
        self.name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(512)
            except TimeoutError:
                continue
            self.sock.sendto(f"{self.name} ".encode() + data, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


class Client:
    """A UDP client that always sends from the same source port."""

    def __init__(self, ns: str, family: IPFamily) -> None:
        self.sock: socket.socket = _netns.run_in(ns, socket.socket, AF[family], socket.SOCK_DGRAM)
        self.sock.bind((PLANS[family].any, CLIENT_PORT))
        self._seq = 0

    def ask(self, ip: str, port: int, timeout: float = 0.5) -> str | None:
        """The name of the endpoint that answered, or None (no answer)."""
        self._seq += 1
        token = f"ping-{self._seq}"
        self.sock.sendto(token.encode(), (ip, port))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(512)
            except (TimeoutError, ConnectionRefusedError):
                return None
            name, _, echoed = data.decode().partition(" ")
            if echoed == token:  # not a late answer to an earlier ping
                return name
        return None

    def close(self) -> None:
        self.sock.close()


def dump_flows(ns: str) -> list[str]:
    """Every conntrack entry of the namespace as `proto src:sport > dst:dport
    reply-from ip`, for assertions and failure messages."""

    def body() -> list[str]:
        from pyroute2.conntrack import Conntrack as PyConntrack

        out: list[str] = []
        for af, v in ((socket.AF_INET, "V4"), (socket.AF_INET6, "V6")):
            with PyConntrack(nfgen_family=af) as ct:
                for msg in ct.dump():
                    orig, reply = msg.get_attr("CTA_TUPLE_ORIG"), msg.get_attr("CTA_TUPLE_REPLY")
                    ip, l4 = orig.get_attr("CTA_TUPLE_IP"), orig.get_attr("CTA_TUPLE_PROTO")
                    rip = reply.get_attr("CTA_TUPLE_IP")
                    out.append(
                        f"{l4.get_attr('CTA_PROTO_NUM')} "
                        f"{ip.get_attr(f'CTA_IP_{v}_SRC')}:{l4.get_attr('CTA_PROTO_SRC_PORT')} > "
                        f"{ip.get_attr(f'CTA_IP_{v}_DST')}:{l4.get_attr('CTA_PROTO_DST_PORT')} "
                        f"reply-from {rip.get_attr(f'CTA_IP_{v}_SRC')}"
                    )
        return sorted(out)

    return _netns.run_in(ns, body)


@dataclass
class Cluster:
    """nftproxy on the node of a fresh topology, with or without cleanup."""

    topo: Topology
    family: IPFamily
    proxier: Proxier
    client: Client
    results: list[CleanupResult]

    @property
    def plan(self) -> Plan:
        return PLANS[self.family]

    def ask(self) -> str | None:
        return self.client.ask(self.plan.vip, 53)

    def flows(self) -> list[str]:
        return dump_flows(self.topo.node)


def dns_service(family: IPFamily) -> dict[str, Any]:
    return service("dns", PLANS[family].vip, ports=[("dns", 53, "UDP")])


def dns_slice(family: IPFamily, *ips: str) -> dict[str, Any]:
    return endpoint_slice(
        "dns",
        [(ip, NODE) for ip in ips],
        ports=[("dns", TARGET_PORT, "UDP")],
        family=family.value,
    )


@contextlib.contextmanager
def cluster(family: IPFamily, *, cleanup: bool) -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        topo = stack.enter_context(topology())
        for ip, name in ((PLANS[family].a, "A"), (PLANS[family].b, "B")):
            stack.callback(Responder(topo.pods, family, ip, name).close)
        backend = stack.enter_context(NftBackend(netns=topo.node))
        results: list[CleanupResult] = []
        hooks = []
        if cleanup:
            ct = stack.enter_context(Conntrack(netns=topo.node))
            log = logging.getLogger("test.conntrack")
            hooks.append(conntrack_hook(ct, log=log, on_result=results.append))
        proxier = Proxier(CONFIG, backend, hooks=hooks)
        intake(proxier).on_node(node(NODE, [PLANS[V4].node, PLANS[V6].node]))
        proxier.on_synced(KIND_SERVICES)
        proxier.on_synced(KIND_ENDPOINT_SLICES)
        client = Client(topo.client, family)
        stack.callback(client.close)
        yield Cluster(topo, family, proxier, client, results)


# ---- traffic ---------------------------------------------------------------------------

FAMILIES = pytest.mark.parametrize("family", [V4, V6], ids=["IPv4", "IPv6"])
WITH_AND_WITHOUT = pytest.mark.parametrize(
    "cleanup", [True, False], ids=["with cleanup", "without cleanup"]
)


@FAMILIES
@WITH_AND_WITHOUT
def test_endpoint_replaced_next_datagram_reaches_the_new_one(
    family: IPFamily, cleanup: bool
) -> None:
    with cluster(family, cleanup=cleanup) as c:
        p = c.plan
        intake(c.proxier).on_service(None, dns_service(family))
        intake(c.proxier).on_endpoint_slice(None, dns_slice(family, p.a))
        c.proxier.sync()
        assert c.ask() == "A"
        assert c.ask() == "A", "same source port, same flow"

        intake(c.proxier).on_endpoint_slice(dns_slice(family, p.a), dns_slice(family, p.b))
        c.proxier.sync()
        answer = c.ask()
        if cleanup:
            assert answer == "B", c.flows()
            assert [(r.deleted, r.errors) for r in c.results][-1] == (1, 0)
        else:
            # The old entry keeps its DNAT to A (still running, no longer an
            # endpoint): without cleanup the client never reaches B.
            assert answer == "A", c.flows()
            assert c.ask() == "A"


@FAMILIES
def test_zero_to_one_endpoints_the_same_source_port_is_answered(family: IPFamily) -> None:
    with cluster(family, cleanup=True) as c:
        intake(c.proxier).on_service(None, dns_service(family))
        c.proxier.sync()
        assert c.ask() is None, "no endpoints: rejected"
        assert c.flows() == [], "a rejected datagram confirms no entry"
        intake(c.proxier).on_endpoint_slice(None, dns_slice(family, c.plan.a))
        c.proxier.sync()
        assert c.ask() == "A", c.flows()


@WITH_AND_WITHOUT
def test_flow_cached_before_the_service_existed(cleanup: bool) -> None:
    with cluster(V4, cleanup=cleanup) as c:
        c.proxier.sync()
        assert c.ask() is None, "unknown VIP: routed towards the client and dropped there"
        intake(c.proxier).on_service(None, dns_service(V4))
        intake(c.proxier).on_endpoint_slice(None, dns_slice(V4, c.plan.a))
        c.proxier.sync()
        if cleanup:
            assert c.ask() == "A", c.flows()
        else:
            assert c.ask() is None, "the un-NATed entry still routes past the service"


# ---- entries made by hand ----------------------------------------------------------------

_NLA_F_NESTED = 0x8000
_NFNL_SUBSYS_CTNETLINK = 1
_IPCTNL_MSG_CT_NEW = 0
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_EXCL, _NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
_NLMSG_ERROR = 2
_NETLINK_NETFILTER = 12
_SOL_NETLINK, _NETLINK_CAP_ACK = 270, 10


def _nla(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def _tuple(kind: int, af: int, src: str, dst: str, proto: int, sport: int, dport: int) -> bytes:
    ip = _nla(1, socket.inet_pton(af, src)) + _nla(2, socket.inet_pton(af, dst))
    if af == socket.AF_INET6:
        ip = _nla(3, socket.inet_pton(af, src)) + _nla(4, socket.inet_pton(af, dst))
    ports = _nla(2, struct.pack("!H", sport)) + _nla(3, struct.pack("!H", dport))
    l4 = _nla(1, bytes([proto])) + ports
    return _nla(kind | _NLA_F_NESTED, _nla(1 | _NLA_F_NESTED, ip) + _nla(2 | _NLA_F_NESTED, l4))


def _ct_new(seq: int, flow: Flow) -> bytes:
    """IPCTNL_MSG_CT_NEW for `flow`, its reply coming from reply_src:5353."""
    af = AF[flow.family]
    proto = {L4Protocol.UDP: 17, L4Protocol.SCTP: 132, L4Protocol.TCP: 6}[flow.protocol]
    body = (
        _tuple(1, af, flow.src, flow.dst, proto, flow.sport, flow.dport)
        + _tuple(2, af, flow.reply_src, flow.src, proto, TARGET_PORT, flow.sport)
        + _nla(7, struct.pack("!I", 600))  # CTA_TIMEOUT
    )
    head = struct.pack("=BBH", af, 0, 0)
    kind = (_NFNL_SUBSYS_CTNETLINK << 8) | _IPCTNL_MSG_CT_NEW
    flags = _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_EXCL | _NLM_F_CREATE
    return struct.pack("=IHHII", 16 + len(head) + len(body), kind, flags, seq, 0) + head + body


def add_flows(ns: str, flows: Sequence[Flow], *, batch: int = 200) -> int:
    """Create entries (reply = the flow's reply source answering the client,
    as after DNAT) with raw ctnetlink messages: ~25x faster than pyroute2's
    `entry('add')`. Returns how many the kernel accepted."""

    def body() -> int:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
        sock.setsockopt(_SOL_NETLINK, _NETLINK_CAP_ACK, 1)  # acks without the request
        sock.bind((0, 0))
        failed = 0
        with sock:
            for start in range(0, len(flows), batch):
                chunk = flows[start : start + batch]
                sock.send(b"".join(_ct_new(start + i + 1, f) for i, f in enumerate(chunk)))
                acks = 0
                while acks < len(chunk):
                    data = sock.recv(1 << 16)
                    offset = 0
                    while offset < len(data):
                        size, kind = struct.unpack_from("=IH", data, offset)
                        if kind == _NLMSG_ERROR:
                            acks += 1
                            failed += struct.unpack_from("=i", data, offset + 16)[0] != 0
                        offset += (size + 3) & ~3
        return len(flows) - failed

    return _netns.run_in(ns, body)


def unrelated_flows(count: int) -> list[Flow]:
    """UDP flows between 10.1.0.0/16 and 10.2.0.0/16, port 9999: nothing a
    service filter names."""
    out = []
    for i in range(count):
        hi, lo = divmod(i, 250)
        out.append(
            Flow(V4, L4Protocol.UDP, f"10.1.{hi}.{lo + 1}", f"10.2.{hi}.{lo + 1}",
                 10000 + i % 50000, 9999, f"10.2.{hi}.{lo + 1}")
        )  # fmt: skip
    return out


def test_sctp_and_ipv6_entries_are_deleted_and_neighbours_kept(netns: str) -> None:
    sctp_old = Flow(V4, L4Protocol.SCTP, "192.168.50.2", "10.96.0.30", 4001, 3868, "10.244.1.2")
    sctp_new = Flow(V4, L4Protocol.SCTP, "192.168.50.2", "10.96.0.30", 4002, 3868, "10.244.1.3")
    v6_old = Flow(V6, L4Protocol.UDP, "fd00:50::2", "fd00:96::10", 4000, 53, "fd00:244::2")
    v6_other_ip = Flow(V6, L4Protocol.UDP, "fd00:50::2", "fd00:96::11", 4001, 53, "fd00:244::2")
    v4_same_port = Flow(V4, L4Protocol.UDP, "192.168.50.2", "10.96.0.10", 4000, 53, "10.244.1.2")
    flows = [sctp_old, sctp_new, v6_old, v6_other_ip, v4_same_port]
    assert add_flows(netns, flows) == len(flows)
    filters = [
        FlowFilter(V4, L4Protocol.SCTP, 3868, "10.96.0.30", frozenset({"10.244.1.3"})),
        FlowFilter(V6, L4Protocol.UDP, 53, "fd00:96::10", frozenset({"fd00:244::3"})),
    ]
    with Conntrack(netns=netns) as ct:
        first = ct.apply(filters)
        second = ct.apply(filters)
    assert (first.deleted, first.errors) == (2, 0)
    assert (second.matched, second.deleted, second.errors) == (1, 0, 0)
    assert dump_flows(netns) == [
        "132 192.168.50.2:4002 > 10.96.0.30:3868 reply-from 10.244.1.3",
        "17 192.168.50.2:4000 > 10.96.0.10:53 reply-from 10.244.1.2",
        "17 fd00:50::2:4001 > fd00:96::11:53 reply-from fd00:244::2",
    ]


def _flow_line(flow: Flow) -> str:
    """`flow` as dump_flows shows it."""
    proto = {L4Protocol.UDP: 17, L4Protocol.SCTP: 132, L4Protocol.TCP: 6}[flow.protocol]
    return (
        f"{proto} {flow.src}:{flow.sport} > {flow.dst}:{flow.dport} reply-from {flow.reply_src}"
    )


def test_a_cleanup_of_many_ports_deletes_what_one_dump_per_port_would(netns: str) -> None:
    """More ports of one family and protocol than are dumped one by one (a
    full sync): they share one dump, and the same flows go as with one dump
    per port (FakeConntrack) -- neighbours on other ports, on other addresses
    of a filtered port and of another protocol stay."""
    flows: list[Flow] = []
    filters: list[FlowFilter] = []
    for family, p in PLANS.items():
        for i in range(8):
            vip = p.vip[:-2] + str(20 + i)  # 10.96.0.2i, fd00:96::2i
            keep = frozenset({p.b})
            filters += [
                FlowFilter(family, L4Protocol.UDP, 1000 + i, vip, keep),
                FlowFilter(family, L4Protocol.UDP, 30000 + i, None, keep),
            ]
            flows += [
                Flow(family, L4Protocol.UDP, p.client, vip, 4000 + i, 1000 + i, p.a),  # stale
                Flow(family, L4Protocol.UDP, p.client, vip, 5000 + i, 1000 + i, p.b),
                Flow(family, L4Protocol.UDP, p.client, p.node, 4100 + i, 30000 + i, p.a),  # stale
                Flow(family, L4Protocol.UDP, p.client, p.vip, 6000 + i, 1000 + i, p.a),
                Flow(family, L4Protocol.UDP, p.client, vip, 7000 + i, 9999, p.a),
                Flow(family, L4Protocol.SCTP, p.client, vip, 4000 + i, 1000 + i, p.a),
            ]
    assert add_flows(netns, flows) == len(flows)
    expected = FakeConntrack(flows)
    expected.start()
    want = expected.apply(filters)
    with Conntrack(netns=netns) as ct:
        got = ct.apply(filters)
    assert (got.matched, got.deleted, got.errors) == (want.matched, want.deleted, 0) == (48, 32, 0)
    assert dump_flows(netns) == sorted(_flow_line(f) for f in expected.flows)


def test_start_never_creates_a_missing_namespace() -> None:
    kernel.require_root()
    name = kernel.unique_name("nftpx-t-missing-")
    ct = Conntrack(netns=name)
    with pytest.raises(ConntrackUnavailable):
        ct.start()
    assert not _netns.exists(name)
    ct.close()


# ---- cost ---------------------------------------------------------------------------------------


def test_cleanup_cost_with_10k_unrelated_entries(
    netns: str, record_property: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Recorded, not asserted: cleanup time with 10,000 unrelated entries."""
    t0 = time.perf_counter()
    assert add_flows(netns, unrelated_flows(10_000)) == 10_000
    fill = time.perf_counter() - t0
    keep = frozenset({"10.244.1.2"})
    one_port = [
        FlowFilter(V4, L4Protocol.UDP, 30053, None, keep),
        FlowFilter(V4, L4Protocol.UDP, 53, "10.96.0.10", keep),
    ]
    ports = 250
    full = [
        flt
        for i in range(ports)
        for flt in (
            FlowFilter(V4, L4Protocol.UDP, 30000 + i, None, keep),
            FlowFilter(V4, L4Protocol.UDP, 53, f"10.96.1.{i}", keep),
        )
    ]
    stale = [
        Flow(V4, L4Protocol.UDP, "192.168.50.2", "10.96.0.10", 20000 + i, 53, "10.244.9.9")
        for i in range(100)
    ]
    with Conntrack(netns=netns) as ct:
        ct.apply(one_port)  # warm-up
        runs = [ct.apply(one_port) for _ in range(5)]
        nothing = sorted(runs, key=lambda r: r.seconds)[2]  # the median
        assert add_flows(netns, stale) == 100
        hundred = ct.apply(one_port)
        everything = ct.apply(full)

    assert (nothing.deleted, hundred.deleted, hundred.errors, everything.errors) == (0, 100, 0, 0)
    numbers = {
        "fill_10k_seconds": round(fill, 3),
        "one_port_2_filters_nothing_stale_ms_median": round(nothing.seconds * 1e3, 1),
        "one_port_2_filters_100_stale_ms": round(hundred.seconds * 1e3, 1),
        "per_delete_ms": round((hundred.seconds - nothing.seconds) * 10, 2),
        # one dump of every UDP entry, the 10,000 unrelated ones dropped while parsing
        f"full_sync_{ports}_ports_{len(full)}_filters_ms": round(everything.seconds * 1e3, 1),
    }
    for key, value in numbers.items():
        record_property(key, value)
    with capsys.disabled():
        print(f"\nconntrack cleanup cost: {numbers}")
