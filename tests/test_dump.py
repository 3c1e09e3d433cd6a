"""`nftproxy dump` reads what is programmed, with no nftproxy process running.

Aspects: per service port its VIPs, node port, policies, affinity, source
ranges and endpoints with their KUBE-SEP chain and cascade probability;
--service filters; --json is machine-readable; a missing table is a clear
message; `cleanup` deletes only nftproxy's tables;
- addresses: the text brackets IPv6 wherever a port follows (VIPs,
  endpoints, no-endpoint entries); the JSON keeps address and port as
  separate fields for all three, in both families.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kernel
from feed import intake
from k8s import service

from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.kernel import netns as nsutil
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools.demo import load_cluster
from nftproxy.tools.dump import parse_table, render_text

SAMPLE = str(Path(__file__).resolve().parent.parent / "nftproxy" / "examples" / "cluster.yaml")
NFTPROXY = [sys.executable, "-m", "nftproxy"]


def _run(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return nsutil.exec_in(ns, [*NFTPROXY, *args], check=False)


def _programmed(ns: str) -> None:
    proc = _run(ns, "sync", "--once", "--source", SAMPLE)
    assert proc.returncode == 0, proc.stderr


def test_dump_shows_each_service_port(netns: str) -> None:
    _programmed(netns)
    proc = _run(netns, "dump", "--json")
    assert proc.returncode == 0, proc.stderr
    views = {v["family"]: v for v in json.loads(proc.stdout)}
    services = {s["service"]: s for s in views["ip"]["services"]}

    web = services["demo/web:http"]
    assert web["vips"] == [{"address": "10.96.0.10", "port": 80}]
    # one endpoint of web is serving+terminating: only the two ready ones serve
    assert sorted((e["address"], e["port"]) for e in web["endpoints"]) == [
        ("10.244.0.11", 8080),
        ("10.244.1.13", 8080),
    ]
    assert [e["probability"] for e in web["endpoints"]] == [0.5, 0.5]
    assert all(e["chain"].startswith("KUBE-SEP-") for e in web["endpoints"])

    sticky = services["demo/sticky:http"]
    assert sticky["affinity_timeout"] == 600
    assert [e["probability"] for e in sticky["endpoints"]] == [0.3333] * 3

    local = services["demo/web-local:http"]
    assert local["policies"]["externalTrafficPolicy"] == "Local"
    assert local["node_port"] == 30081
    assert local["source_ranges"] == ["192.168.50.2"]
    assert [(e["address"], e["port"]) for e in local["local_endpoints"]] == [
        ("10.244.0.11", 8080)
    ]

    empty = services["demo/empty:http"]
    assert empty["no_endpoints"] == [
        {"address": "10.96.0.99", "port": 80, "verdict": "goto KUBE-REJECT"}
    ]
    assert empty["endpoints"] == []

    web6 = {s["service"]: s for s in views["ip6"]["services"]}["demo/web:http"]
    assert web6["vips"] == [{"address": "fd00:96::10", "port": 80}]
    assert sorted((e["address"], e["port"]) for e in web6["endpoints"]) == [
        ("fd00:244:1::13", 8080),
        ("fd00:244::11", 8080),
    ]


def test_dump_text_brackets_ipv6_wherever_a_port_follows(netns: str) -> None:
    _programmed(netns)
    proc = _run(netns, "dump", "--service", "demo/web-np")
    assert proc.returncode == 0, proc.stderr
    ip6 = proc.stdout.split("table ip6 ")[1]
    assert "VIPs:        [fd00:96::20]:80" in ip6
    assert "[fd00:244::11]:8080" in ip6
    assert "fd00:96::20:80" not in proc.stdout


def test_dump_filters_by_service_and_prints_text(netns: str) -> None:
    _programmed(netns)
    proc = _run(netns, "dump", "--service", "demo/sticky")
    assert proc.returncode == 0, proc.stderr
    assert "demo/sticky:http" in proc.stdout
    assert "demo/web:http" not in proc.stdout
    assert "sessionAffinity: ClientIP, timeout 600s" in proc.stdout
    assert "33.33%" in proc.stdout


def test_dump_without_a_table_says_so(netns: str) -> None:
    proc = _run(netns, "dump")
    assert proc.returncode == 1
    assert "no table named 'nftproxy'" in proc.stderr


def test_cleanup_deletes_only_our_tables(netns: str) -> None:
    kernel.nft(netns, "add", "table", "ip", "other")
    _programmed(netns)
    proc = _run(netns, "cleanup")
    assert proc.returncode == 0, proc.stderr
    tables = kernel.nft(netns, "list", "tables")
    assert tables.split() == ["table", "ip", "other"]


def test_render_text_of_a_listing_without_services() -> None:
    doc = {
        "nftables": [
            {"table": {"family": "ip", "name": "t"}},
            {"chain": {"family": "ip", "table": "t", "name": "KUBE-SERVICES"}},
        ]
    }
    view = parse_table(doc, family="ip", table="t")
    assert view.services == [] and view.chains == 1
    assert render_text(view).startswith("table ip t: 1 chains, 0 rules")


def _sample_listing(family: str) -> dict[str, object]:
    """The table one full sync of the sample cluster builds (fake kernel),
    plus an IPv6 service port without endpoints (rejected at VIP and node port)."""
    cluster = load_cluster(Path(SAMPLE))
    backend = FakeBackend()
    backend.start()
    proxier = Proxier(ProxyConfig(node_name=cluster.node_name), backend)
    events = intake(proxier)
    empty6 = service("empty6", "fd00:96::99", ns="demo", type="NodePort", node_ports=(30099,))
    for obj in (*cluster.services.values(), empty6):
        events.on_service(None, obj)
    for obj in cluster.slices.values():
        events.on_endpoint_slice(None, obj)
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)
    proxier.sync()
    doc = backend.list_table(family, proxier.config.table_name)
    assert doc is not None
    return doc


def test_ipv6_text_is_bracketed_and_json_keeps_address_and_port_apart() -> None:
    view = parse_table(_sample_listing("ip6"), family="ip6", table="nftproxy")
    text = render_text(view)
    assert "VIPs:        [fd00:96::20]:80" in text
    assert "no endpoints: [fd00:96::99]:80 -> goto KUBE-REJECT" in text
    assert "no endpoints: nodePort 30099 -> goto KUBE-REJECT" in text
    assert "      [fd00:244::11]:8080 " in text
    assert "fd00:96::20:80" not in text and "fd00:96::99:80" not in text

    data = {s["service"]: s for s in view.to_json()["services"]}
    assert data["demo/web-np:http"]["vips"] == [{"address": "fd00:96::20", "port": 80}]
    assert {(e["address"], e["port"]) for e in data["demo/web-np:http"]["endpoints"]} == {
        ("fd00:244::11", 8080), ("fd00:244::12", 8080), ("fd00:244:1::13", 8080)}
    assert data["demo/empty6:http"]["no_endpoints"] == [
        {"address": "fd00:96::99", "port": 80, "verdict": "goto KUBE-REJECT"},
        {"address": "", "port": 30099, "verdict": "goto KUBE-REJECT"},
    ]


def test_ipv4_text_and_json_have_the_same_shape() -> None:
    view = parse_table(_sample_listing("ip"), family="ip", table="nftproxy")
    text = render_text(view)
    assert "VIPs:        10.96.0.20:80" in text
    assert "no endpoints: 10.96.0.99:80 -> goto KUBE-REJECT" in text
    data = {s["service"]: s for s in view.to_json()["services"]}
    assert data["demo/web-np:http"]["vips"] == [{"address": "10.96.0.20", "port": 80}]
    assert data["demo/empty:http"]["endpoints"] == []
