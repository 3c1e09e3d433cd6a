"""Localhost node ports (issue 37; kube-proxy's KEP-6032), without the kernel.

Aspects:
- configuration: the nodePortAddresses keywords `primary`, `localhost` and
  `all` in any combination, in the file (v1alpha1 and v1alpha2) and on
  --nodeport-addresses; the feature gate KubeProxyNFTablesLocalhostNodePorts
  in featureGates and on --feature-gates; off by default; `localhost` without
  the gate is one warning and serves nothing (kube-proxy's nftables mode
  serves no loopback address then either), as is the gate without a
  loopback address; iptables.localhostNodePorts stays ignored;
- rules: with the feature off (by default, or with only one half of it) the
  skeleton is the same value as today's, in both families; with it on,
  exactly four IPv4 rules more, in the chains and places kube-proxy's
  KUBE-* roles give them, and IPv6 is unchanged;
- route_localnet: set by the agent at start only when the feature is on,
  never read or written otherwise, and a failure to set it stops the start;
- trace: the interpreter follows the new rules (the node's own connection
  to 127.0.0.1 reaches the service, masqueraded, for eTP=Cluster and Local;
  a packet for 127.0.0.1 from the network is dropped by KUBE-FIREWALL).
The real packets are in test_dataplane_localhost.py.
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from k8s import endpoint_slice, node, service
from test_trace_flows import HOST, PODS, Answer, answer_of, answered

from nftproxy.agent.agent import Agent
from nftproxy.cluster.events import ClusterEvents
from nftproxy.cluster.file import FileSource, WatchedFiles
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, NodeInfo
from nftproxy.core.nft.listing import list_family
from nftproxy.core.rules.fragment import Fragment
from nftproxy.core.rules.skeleton import render_skeleton
from nftproxy.core.trace import Packet, Ruleset, trace
from nftproxy.core.trace.packet import Origin
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.sysctl import ROUTE_LOCALNET, enable_route_localnet
from nftproxy.tools import cli
from nftproxy.tools.config_load import build_config, config_notes, load_config_file
from nftproxy.tools.config_values import ConfigError

GATE = "KubeProxyNFTablesLocalhostNodePorts"
V1 = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
V2 = "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n"
V4, V6 = IPFamily.IPV4, IPFamily.IPV6
NODE = NodeInfo("node-a", ipv4=("192.168.0.2",), ipv6=("fd00:192::2",))
OFF = ProxyConfig()
ON = ProxyConfig(nodeport_addresses=("primary", "localhost"), nftables_localhost_nodeports=True)


def load(tmp_path: Path, body: str, header: str = V1) -> tuple[ProxyConfig, list[str]]:
    path = tmp_path / "config.yaml"
    path.write_text(header + textwrap.dedent(body))
    overrides, warnings = load_config_file(path)
    config = build_config(overrides, {})
    return config, [*warnings, *config_notes(config)]


def from_flags(*argv: str) -> ProxyConfig:
    args = cli.build_parser().parse_args(["sync", "--source", "x.yaml", *argv])
    return cli._load_config(args)


# --- configuration ---------------------------------------------------------------------


def test_off_by_default() -> None:
    for config in (ProxyConfig(), build_config({}, {}), from_flags()):
        assert config.nftables_localhost_nodeports is False
        assert config.localhost_nodeports == ()
        assert config_notes(config) == []


@pytest.mark.parametrize("header", [V1, V2], ids=["v1alpha1", "v1alpha2"])
def test_the_keyword_and_the_gate_in_the_file(tmp_path: Path, header: str) -> None:
    body = f"nodePortAddresses: [primary, localhost]\nfeatureGates: {{{GATE}: true}}\n"
    config, warnings = load(tmp_path, body, header)
    assert warnings == []
    assert config.nodeport_addresses == ("primary", "localhost")
    assert config.nftables_localhost_nodeports is True
    assert config.localhost_nodeports == ("127.0.0.0/8",)
    assert config.nodeport_primary


def test_the_keyword_and_the_gate_as_flags() -> None:
    config = from_flags("--nodeport-addresses", "primary,localhost",
                        "--feature-gates", f"{GATE}=true")
    assert config.localhost_nodeports == ("127.0.0.0/8",)
    off = from_flags("--nodeport-addresses", "primary,localhost",
                     "--feature-gates", f"{GATE}=false")
    assert (off.nftables_localhost_nodeports, off.localhost_nodeports) == (False, ())


def test_flags_override_the_files_gate(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(V1 + f"nodePortAddresses: [localhost]\nfeatureGates: {{{GATE}: true}}\n")
    config = from_flags("--config", str(path), "--feature-gates", f"{GATE}=false")
    assert config.localhost_nodeports == ()


def test_the_keyword_without_the_gate_is_one_warning_and_serves_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config, warnings = load(tmp_path, "nodePortAddresses: [primary, localhost]\n")
    assert config.localhost_nodeports == ()
    assert warnings == [
        "nodePortAddresses: 127.0.0.0/8 (loopback) not served: localhost node ports need "
        f"featureGates {GATE}=true"
    ]
    caplog.set_level(logging.WARNING, logger="nftproxy.tools.cli")
    from_flags("--nodeport-addresses", "localhost")
    assert [r.getMessage() for r in caplog.records] == warnings


def test_the_gate_without_a_loopback_address_is_one_warning(tmp_path: Path) -> None:
    config, warnings = load(tmp_path, f"featureGates: {{{GATE}: true}}\n")
    assert config.localhost_nodeports == ()
    assert len(warnings) == 1
    assert warnings[0].startswith(f"featureGates {GATE} is on, but nodePortAddresses names no")


@pytest.mark.parametrize(
    ("addresses", "served", "matches_all"),
    [
        pytest.param(("localhost",), ("127.0.0.0/8",), False, id="localhost alone"),
        pytest.param(("all", "localhost"), ("127.0.0.0/8",), True, id="all,localhost"),
        pytest.param(("127.0.0.1/32", "10.0.0.0/8"), ("127.0.0.1/32",), False,
                     id="a loopback CIDR names only its addresses"),
        pytest.param(("0.0.0.0/1",), ("127.0.0.0/8",), False,
                     id="a CIDR overlapping 127.0.0.0/8 (kube-proxy's check)"),
        pytest.param(("all",), (), True, id="all names no loopback address explicitly"),
        pytest.param(("0.0.0.0/0",), (), True, id="nor does a /0"),
        pytest.param(("::1/128", "primary"), (), False, id="::1 is never served"),
        pytest.param((), (), True, id="unset"),
    ],
)
def test_which_loopback_addresses_are_served(
    addresses: tuple[str, ...], served: tuple[str, ...], matches_all: bool
) -> None:
    config = build_config({"nodeport_addresses": list(addresses),
                           "nftables_localhost_nodeports": True}, {})
    assert config.localhost_nodeports == served
    assert config.nodeport_matches_all(V4) is matches_all


def test_keywords_combine_with_each_other_and_cidrs() -> None:
    config = from_flags("--nodeport-addresses", "primary,all,localhost,10.0.0.0/8")
    assert config.nodeport_addresses == ("primary", "all", "localhost", "10.0.0.0/8")
    assert config.nodeport_cidrs_of(V4) == ("0.0.0.0/0", "127.0.0.0/8", "10.0.0.0/8")
    assert config.nodeport_cidrs_of(V6) == ("::/0", "::1/128")
    assert config.nodeport_matches_all(V4) and config.nodeport_matches_all(V6)
    primary = from_flags("--nodeport-addresses", "primary,10.0.0.0/8")
    assert not primary.nodeport_matches_all(V6), "primary restricts IPv6 too"


def test_iptables_localhost_nodeports_stays_ignored(tmp_path: Path) -> None:
    config, warnings = load(tmp_path, "iptables: {localhostNodePorts: true}\n")
    assert warnings == []
    assert config == ProxyConfig()


def test_feature_gates_flag_reads_known_gates_and_warns_about_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="nftproxy.tools.cli")
    gates = "AllowServiceExternalIPs=false, PreferSameTrafficDistribution=false,Foo=true"
    config = from_flags("--feature-gates", gates)
    assert (config.allow_service_external_ips, config.prefer_same_node) == (False, False)
    assert [r.getMessage() for r in caplog.records] == [
        "--feature-gates: Foo=true ignored by nftproxy"]
    # a gate's own flag wins over --feature-gates
    both = from_flags("--feature-gates", "AllowServiceExternalIPs=false",
                      "--allow-service-external-ips=true")
    assert both.allow_service_external_ips is True
    for bad in (GATE, f"{GATE}=yes", "=true"):
        with pytest.raises(ConfigError, match=r"--feature-gates: .* is not Gate=true"):
            from_flags("--feature-gates", bad)


# --- rules ---------------------------------------------------------------------------


HALF_ON = [
    pytest.param(replace(OFF, nodeport_addresses=("primary", "localhost")), id="keyword only"),
    pytest.param(replace(OFF, nftables_localhost_nodeports=True), id="gate only"),
    pytest.param(replace(ON, nodeport_addresses=("primary", "all")), id="gate, no loopback"),
]


@pytest.mark.parametrize("config", HALF_ON)
@pytest.mark.parametrize("family", [V4, V6])
def test_off_the_skeleton_is_todays(config: ProxyConfig, family: IPFamily) -> None:
    today = replace(config, nftables_localhost_nodeports=False,
                    nodeport_addresses=tuple(a for a in config.nodeport_addresses
                                             if a != "localhost"))
    assert render_skeleton(family, config, NODE) == render_skeleton(family, today, NODE)


def test_ipv6_never_changes() -> None:
    today = replace(ON, nftables_localhost_nodeports=False)
    assert render_skeleton(V6, ON, NODE) == render_skeleton(V6, today, NODE)


def _rules(fragment: Fragment) -> dict[str, list[tuple[list[Any], str | None]]]:
    return {c.name: [(list(r.expr), r.comment) for r in c.rules] for c in fragment.chains}


LOOPBACK = {"prefix": {"addr": "127.0.0.0", "len": 8}}
DADDR = {"payload": {"protocol": "ip", "field": "daddr"}}
SADDR = {"payload": {"protocol": "ip", "field": "saddr"}}
TO_LOOPBACK = {"match": {"op": "==", "left": DADDR, "right": LOOPBACK}}
PROTO_PORT = {"concat": [{"meta": {"key": "l4proto"}},
                         {"payload": {"protocol": "th", "field": "dport"}}]}


def test_on_four_ipv4_rules_more_in_kube_proxys_places() -> None:
    today = replace(ON, nftables_localhost_nodeports=False)
    on, off = _rules(render_skeleton(V4, ON, NODE)), _rules(render_skeleton(V4, today, NODE))
    added = {name: [r for r in rules if r not in off[name]] for name, rules in on.items()}
    assert {n: r for n, r in added.items() if r} == {
        "nat-output": [([TO_LOOPBACK, {"goto": {"target": "KUBE-NODEPORTS"}}],
                        "localhost NodePorts (route_localnet): KUBE-NODEPORTS")],
        "affinity:nat-output": [
            ([TO_LOOPBACK, {"vmap": {"key": PROTO_PORT, "data": "@service-nodeports"}}],
             "localhost NodePorts (route_localnet), ClientIP affinity")],
        "KUBE-EXTERNAL-SERVICES": [
            ([TO_LOOPBACK, {"vmap": {"key": PROTO_PORT, "data": "@no-endpoint-nodeports"}}],
             "localhost node ports with no (local) endpoints")],
        "filter-input": [([
            TO_LOOPBACK,
            {"match": {"op": "!=", "left": SADDR, "right": LOOPBACK}},
            {"match": {"op": "!=", "left": {"ct": {"key": "state"}},
                       "right": {"set": ["established", "related"]}}},
            {"match": {"op": "!=", "left": {"ct": {"key": "status"}}, "right": "dnat"}},
            {"drop": None},
        ], "KUBE-FIREWALL: block incoming localnet connections (CVE-2020-8558)")],
    }
    # places: the drop before anything else in input; the DNAT after KUBE-SERVICES
    # (kube-proxy's "must be last"); the rest appended; nothing else moves
    assert on["filter-input"][1:] == off["filter-input"]
    assert on["nat-output"][:-1] == off["nat-output"]
    assert on["affinity:nat-output"][:-1] == off["affinity:nat-output"]
    assert on["KUBE-EXTERNAL-SERVICES"][:-1] == off["KUBE-EXTERNAL-SERVICES"]
    assert [set(c) for c in (on, off)] == [set(off)] * 2, "no chain added"


def test_only_the_listed_loopback_addresses() -> None:
    config = replace(ON, nodeport_addresses=("127.0.0.1/32",))
    output = _rules(render_skeleton(V4, config, NODE))["nat-output"][-1][0]
    assert output[0] == {"match": {"op": "==", "left": DADDR, "right": "127.0.0.1"}}


# --- route_localnet ------------------------------------------------------------------


class FakeFS:
    """/proc/sys as a dict, recording every path read or written."""

    def __init__(self, values: Mapping[str, str], *, read_only: bool = False) -> None:
        self.values = dict(values)
        self.read_only = read_only
        self.touched: list[str] = []

    def read(self, path: str) -> str:
        self.touched.append(path)
        if path not in self.values:
            raise FileNotFoundError(2, "No such file or directory", path)
        return self.values[path] + "\n"

    def write(self, path: str, value: str) -> None:
        self.touched.append(path)
        if self.read_only:
            raise OSError(30, "Read-only file system", path)
        self.values[path] = value


def _agent(tmp_path: Path, config: ProxyConfig, fs: FakeFS) -> Agent:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"kind": "List", "items": [node("node-a", ["192.168.50.1"])]}))
    config = replace(config, node_name="node-a", healthz_bind_address="",
                     metrics_bind_address="")

    def source_factory(handler: ClusterEvents) -> WatchedFiles:
        return WatchedFiles(FileSource([path], handler, node_name="node-a", poll_interval=0.01))

    return Agent(config, backend=FakeBackend(), source_factory=source_factory, sysctl_fs=fs)


@pytest.mark.parametrize("config", [pytest.param(OFF, id="default"), *HALF_ON])
def test_the_agent_never_touches_route_localnet_when_off(
    tmp_path: Path, config: ProxyConfig
) -> None:
    fs = FakeFS({ROUTE_LOCALNET: "0"})
    agent = _agent(tmp_path, config, fs)
    try:
        agent.start()
    finally:
        agent.stop()
    assert ROUTE_LOCALNET not in fs.touched
    assert fs.values[ROUTE_LOCALNET] == "0"


def test_the_agent_sets_route_localnet_when_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fs = FakeFS({ROUTE_LOCALNET: "0"})
    agent = _agent(tmp_path, ON, fs)
    try:
        agent.start()
    finally:
        agent.stop()
    assert fs.values[ROUTE_LOCALNET] == "1"
    said = [r.getMessage() for r in caplog.records if "route_localnet" in r.getMessage()]
    assert len(said) == 1 and "CVE-2020-8558" in said[0], said


def test_route_localnet_that_cannot_be_set_stops_the_start(tmp_path: Path) -> None:
    fs = FakeFS({ROUTE_LOCALNET: "0"}, read_only=True)
    agent = _agent(tmp_path, ON, fs)
    try:
        with pytest.raises(OSError, match="Read-only"):
            agent.start()
    finally:
        agent.stop()
    assert enable_route_localnet(FakeFS({ROUTE_LOCALNET: "1"})) is False  # already set


# --- trace ---------------------------------------------------------------------------


def _scenario() -> list[dict[str, Any]]:
    local1, remote1 = PODS["local1"], PODS["remote1"]
    eps = [(local1.ipv4, "node-a"), (remote1.ipv4, "node-b")]
    return [
        service("np", "10.96.0.20", type="NodePort", node_ports=[30080],
                ports=(("tcp", 80, "TCP"),)),
        endpoint_slice("np", eps, ports=(("tcp", 8080, "TCP"),)),
        service("npl", "10.96.0.21", type="NodePort", node_ports=[30081], etp="Local",
                ports=(("udp", 53, "UDP"),)),
        endpoint_slice("npl", eps, ports=(("udp", 5353, "UDP"),)),
        service("nps", "10.96.0.22", type="NodePort", node_ports=[30082], affinity_timeout=60,
                ports=(("tcp", 80, "TCP"),)),
        endpoint_slice("nps", eps, ports=(("tcp", 8080, "TCP"),)),
        service("npe", "10.96.0.23", type="NodePort", node_ports=[30083],
                ports=(("tcp", 80, "TCP"),)),
    ]


def _listing(config: ProxyConfig) -> Ruleset:
    from test_dataplane import Cluster

    backend = FakeBackend()
    backend.start()
    config = replace(config, node_name="node-a", cluster_cidrs=("10.244.0.0/16",),
                     table_name="nftproxy")
    cluster = Cluster(backend, config)  # type: ignore[arg-type]  # any Backend will do
    cluster.apply(_scenario()).sync()
    doc = list_family(backend.list_table, "ip", "nftproxy")
    assert doc is not None
    return Ruleset.from_listing(doc, "ip", "nftproxy")


def _traced(rs: Ruleset, src: str, dst: str, port: int, proto: str, origin: Origin) -> Answer:
    packet = Packet(src, dst, port, proto, origin=origin,
                    iifname="" if origin is Origin.NODE else "eth0")
    names = {p.ipv4: name for name, p in PODS.items()}
    return answer_of(trace(rs, packet, HOST), names)


@pytest.mark.parametrize(
    ("port", "proto", "expect"),
    [
        pytest.param(30080, "tcp", answered(local1=True, remote1=True), id="eTP=Cluster"),
        pytest.param(30081, "udp", answered(local1=True, remote1=True),
                     id="eTP=Local: any endpoint, as the node's own traffic"),
        pytest.param(30082, "tcp", answered(local1=True, remote1=True, sticky=True),
                     id="ClientIP affinity"),
        pytest.param(30083, "tcp", Answer("reject"), id="no endpoints"),
    ],
)
def test_trace_follows_the_node_to_localhost(port: int, proto: str, expect: Answer) -> None:
    assert _traced(_listing(ON), "127.0.0.1", "127.0.0.1", port, proto, Origin.NODE) == expect
    off = _traced(_listing(OFF), "127.0.0.1", "127.0.0.1", port, proto, Origin.NODE)
    assert off == answered(**{"(not translated)": False})


def test_trace_drops_a_packet_for_localhost_from_the_network() -> None:
    rs = _listing(ON)
    packet = Packet("192.168.50.2", "127.0.0.1", 10248, "tcp", origin=Origin.EXTERNAL,
                    iifname="eth0")
    (path,) = trace(rs, packet, HOST).paths
    assert path.verdict == "drop"
    assert path.reasons == (
        "127.0.0.1 is a loopback address and 192.168.50.2 is not: KUBE-FIREWALL drops it "
        "(route_localnet, CVE-2020-8558)",)
    # nor is a node port DNATed for it: only the node's own connections are served
    assert _traced(rs, "192.168.50.2", "127.0.0.1", 30080, "tcp", Origin.EXTERNAL) == Answer(
        "drop")
