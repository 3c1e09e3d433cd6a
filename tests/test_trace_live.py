"""`nftproxy trace --live`: the kernel's own trace of real packets, and nothing left behind.

Aspects (kernel tests: a namespace with the sample programmed by `nftproxy
sync` and a route out, so the namespace's own packets reach the output hook;
the two tracing tests also after partial syncs deleted demo/dns and
demo/web-np and added them again -- and with them the shared choosers
and maps only they use, e.g. dispatch-udp-3 and vip-endpoints-udp):
- the node's own UDP datagram to a ClusterIP is reported rule by rule in
  trace's vocabulary (hook, chain #rule, the rule as nft prints it, the
  verdict) with its outcome (DNAT target, masquerade): by the goto to the
  shared chooser, whichever sync wrote it; the command stops after
  --count packets, and the table is exactly as before;
- a TCP SYN of the node's own to the node port of a port with shared
  choosers (demo/web-np, eTP=Cluster) shows the `masquerade-nodeports`
  element KUBE-NODEPORTS #1 matched and the `service-nodeports` element,
  both naming its KUBE-EXT-<h>, and the `nodeport-endpoints` element that
  DNATed it (KUBE-SEP-<h>);
- interrupted with SIGINT (Ctrl-C) or SIGTERM while waiting, it removes its
  chains and exits; also when the agent's full sync removed them first;
- the event lines of `nft -a monitor trace` are read (pure).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from feed import intake

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import L4Protocol, ServicePortName
from nftproxy.core.nft.jsontext import command_json
from nftproxy.core.rules import names
from nftproxy.core.trace import Packet
from nftproxy.kernel import netns as nsutil
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.dry_run import proxier_from_files
from nftproxy.tools.trace_live import parse_event, removal, trace_chains

SAMPLE = str(Path(__file__).resolve().parents[1] / "nftproxy" / "examples" / "cluster.yaml")
NFTPROXY = [sys.executable, "-m", "nftproxy"]
TARGET = ("10.96.0.53", 53)  # demo/dns:dns, UDP, three endpoints
CIDRS = ("10.244.0.0/16", "fd00:244::/48")


def test_monitor_lines_are_read() -> None:
    rule = parse_event('trace id dd605f1f ip nftproxy KUBE-SERVICES rule ip daddr . meta l4proto '
                       '. th dport vmap @service-ips comment "x" # handle 63 (verdict goto '
                       'KUBE-SVC-IXHL676EY46F5RLS)')
    assert rule is not None
    assert (rule.id, rule.table, rule.chain, rule.kind, rule.handle, rule.verdict) == (
        "dd605f1f", "nftproxy", "KUBE-SERVICES", "rule", 63, "goto KUBE-SVC-IXHL676EY46F5RLS")
    policy = parse_event("trace id dd605f1f ip nftproxy filter-output policy accept meta mark "
                         "0x00004000 ")
    assert policy is not None and (policy.kind, policy.verdict) == ("policy", "accept")
    packet = parse_event('trace id 1 ip6 t c packet: iif "eth0" ip6 saddr fd00::1')
    assert packet is not None and packet.text == 'iif "eth0" ip6 saddr fd00::1'
    assert parse_event("something else") is None


def test_a_monitor_line_reaches_the_terminal_with_its_control_characters_escaped() -> None:
    """Another tool's rule comment may hold an ANSI escape: it is shown, not obeyed."""
    rule = parse_event('trace id 1 ip theirs c\x1b[2J rule ip daddr 10.0.0.1 comment '
                       '"\x1b[31mred\x07" # handle 2 (verdict accept)')
    assert rule is not None and rule.chain == "c\\x1b[2J"
    assert rule.text == 'ip daddr 10.0.0.1 comment "\\x1b[31mred\\x07"'
    assert all(c.isprintable() for c in rule.text + rule.chain + rule.table)


def test_the_tracing_chains_match_the_5_tuple_and_are_removed_one_by_one() -> None:
    cmds = [command_json(c) for c in
            trace_chains(Packet("fd00::2", "fd00::10", 80, "tcp", sport=4000), "nftproxy", 7)]
    chains = [c["add"]["chain"] for c in cmds if "chain" in c["add"]]
    assert [(c["family"], c["name"], c["hook"], c["prio"]) for c in chains] == [
        ("ip6", "trace-7-prerouting", "prerouting", -350),
        ("ip6", "trace-7-output", "output", -350),
    ]
    rule = next(c["add"]["rule"] for c in cmds if "rule" in c["add"])
    assert rule["expr"][-1] == {"mangle": {"key": {"meta": {"key": "nftrace"}}, "value": 1}}
    assert [e["match"]["right"] for e in rule["expr"][:-1]] == [
        "fd00::2", "fd00::10", "tcp", 80, 4000]
    assert [len(t) for t in removal("ip6", "nftproxy", ["a", "b"])] == [2, 2]


# --- kernel -----------------------------------------------------------------------------------


@pytest.fixture
def node(netns: str) -> Iterator[str]:
    """`netns` with the sample programmed and a route out (a veth pair)."""
    for argv in (["ip", "link", "set", "lo", "up"],
                 ["ip", "link", "add", "out0", "type", "veth", "peer", "name", "out1"],
                 ["ip", "addr", "add", "192.168.50.1/24", "dev", "out0"],
                 ["ip", "link", "set", "out0", "up"], ["ip", "link", "set", "out1", "up"],
                 ["ip", "route", "add", "default", "dev", "out0"]):
        nsutil.exec_in(netns, argv, check=True)
    synced = nsutil.exec_in(netns, [*NFTPROXY, "sync", "--source", SAMPLE, "--cluster-cidr",
                                    ",".join(CIDRS)], check=False)
    assert synced.returncode == 0, synced.stderr
    yield netns


def _readd_by_partial_syncs(ns: str, services: tuple[str, ...]) -> None:
    """A Proxier of the sample over `ns`'s table: its full sync, then a
    partial sync deleting the demo `services` and one adding them again."""
    with open(SAMPLE) as f:
        items = yaml.safe_load(f)["items"]
    chosen = [o for o in items
              if o["kind"] == "Service" and o["metadata"]["name"] in services]
    assert len(chosen) == len(services)
    with NftBackend(netns=ns) as backend:
        proxier = proxier_from_files([SAMPLE], ProxyConfig(cluster_cidrs=CIDRS), backend)
        assert proxier.sync().full
        events = intake(proxier)
        for obj in chosen:
            events.on_service(obj, None)
        assert not proxier.sync().full
        for obj in chosen:
            events.on_service(None, obj)
        assert not proxier.sync().full


@pytest.fixture(params=["full", "partial"])
def synced_by(node: str, request: pytest.FixtureRequest) -> tuple[str, str]:
    """(`node`, how demo/dns and demo/web-np were last written): by the
    full sync, or by partial syncs (which write the same)."""
    how: str = request.param
    if how == "partial":
        _readd_by_partial_syncs(node, ("dns", "web-np"))
    return node, how


def _table(ns: str) -> list[Any]:
    with NftBackend(netns=ns) as backend:
        doc = backend.list_table("ip", "nftproxy")
    assert doc is not None
    return [item for item in doc["nftables"] if "chain" in item or "rule" in item]


def _without_handles(items: list[Any]) -> str:
    return json.dumps([{k: {f: v for f, v in o.items() if f != "handle"} for k, o in i.items()}
                       for i in items], sort_keys=True)


def _tracer(
    ns: str, *extra: str, target: str = f"{TARGET[0]}:{TARGET[1]}/udp"
) -> subprocess.Popen[str]:
    argv = ["ip", "netns", "exec", ns, *NFTPROXY, "trace", "--live", *extra,
            "192.168.50.1", target]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_chains(ns: str, proc: subprocess.Popen[str], present: bool = True) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        names = {i["chain"]["name"] for i in _table(ns) if "chain" in i}
        if any(n.startswith("trace-") for n in names) == present:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the tracing chains did not appear")


def _send_udp(ns: str) -> None:
    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"x", TARGET)

    nsutil.run_in(ns, send)


def test_live_trace_reports_the_kernels_path_and_leaves_the_table_as_it_was(
    synced_by: tuple[str, str],
) -> None:
    node, _ = synced_by
    before = _without_handles(_table(node))
    proc = _tracer(node, "--count", "1", "--timeout", "30")
    _wait_for_chains(node, proc)
    _send_udp(node)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("tracing 192.168.50.1 -> 10.96.0.53:53/udp in table ip nftproxy")
    assert lines[1].startswith("packet 1 (trace id ")
    # demo/dns is reached only at its cluster IP: the shared chooser for three
    # endpoints stands in for its KUBE-SVC, which the service-ips element
    # names; the element is the goto to the chooser, whichever sync wrote it
    # (KUBE-SERVICES #1 marks the external destinations of shared choosers)
    assert any(line.split()[:3] == ["output", "KUBE-SERVICES", "#2"] and
               "@service-ips: 10.96.0.53 . udp . 53 : goto dispatch-udp-3" in line and
               line.endswith("(demo/dns:dns KUBE-SVC-IXHL676EY46F5RLS)") for line in lines), out
    assert any("dnat to 10.244." in line and "=> accept" in line for line in lines), out
    assert any(line.split()[:3] == ["output", "dispatch-udp-3", "#2"] and
               "@vip-endpoints-udp: 10.96.0.53 . 53 . " in line and
               "KUBE-SEP-" in line for line in lines), out
    assert any("masquerade fully-random  => accept" in line for line in lines), out
    summary = next(line for line in lines if line.startswith("  packet 1: "))
    assert summary.startswith("  packet 1: accepted, DNAT to 10.244.") and summary.endswith(
        "masqueraded"), summary
    assert "(KUBE-SEP-" in summary, summary  # the element the shared chooser took
    assert "1 packet(s) traced" in lines
    assert _without_handles(_table(node)) == before


def _connect_tcp(ns: str, addr: str, port: int) -> None:
    """Send one SYN (nobody answers: the endpoints are not there)."""
    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect((addr, port))
            time.sleep(0.2)

    nsutil.run_in(ns, send)


def test_live_trace_names_kube_ext_of_a_node_port_with_a_shared_chooser(
    synced_by: tuple[str, str],
) -> None:
    node, _ = synced_by
    proc = _tracer(node, "--count", "1", "--timeout", "30", target="192.168.50.1:30080/tcp")
    _wait_for_chains(node, proc)
    _connect_tcp(node, "192.168.50.1", 30080)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    # demo/web-np (eTP=Cluster): KUBE-NODEPORTS #1 marks it as its KUBE-EXT
    # would, the service-nodeports element goes to the shared chooser
    ext = names.external_chain(ServicePortName("demo", "web-np", "http", L4Protocol.TCP))
    assert any(line.split()[:3] == ["output", "KUBE-NODEPORTS", "#1"] and
               "@masquerade-nodeports: tcp . 30080" in line and
               line.endswith(f"(demo/web-np:http {ext})") for line in lines), out
    assert any(line.split()[:3] == ["output", "KUBE-NODEPORTS", "#2"] and
               "@service-nodeports: tcp . 30080 : goto dispatch-nodeport-tcp-3" in line and
               line.endswith(f"(demo/web-np:http {ext})") for line in lines), out
    assert any(line.split()[1] == "dispatch-nodeport-tcp-3" and
               "@nodeport-endpoints-tcp: 30080 . " in line and "KUBE-SEP-" in line
               for line in lines), out
    summary = next(line for line in lines if line.startswith("  packet 1: "))
    assert summary.startswith("  packet 1: accepted, DNAT to 10.244.") and summary.endswith(
        "masqueraded") and "(KUBE-SEP-" in summary, summary


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_it_removes_its_chains(node: str, sig: signal.Signals) -> None:
    before = _without_handles(_table(node))
    proc = _tracer(node, "--timeout", "60")
    _wait_for_chains(node, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "interrupted" in out and "removed trace-" in out
    assert _without_handles(_table(node)) == before


def test_chains_already_removed_by_a_full_sync_are_no_error(node: str) -> None:
    proc = _tracer(node, "--timeout", "60")
    _wait_for_chains(node, proc)
    resynced = nsutil.exec_in(node, [*NFTPROXY, "sync", "--source", SAMPLE, "--cluster-cidr",
                                     "10.244.0.0/16,fd00:244::/48"], check=False)
    assert resynced.returncode == 0, resynced.stderr
    _wait_for_chains(node, proc, present=False)  # the agent's full sync deleted them
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "could not remove" not in out, (out, err)
