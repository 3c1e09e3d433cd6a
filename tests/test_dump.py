"""`nftproxy dump` reads what is programmed, with no nftproxy process running.

Aspects: per service port its VIPs, node port, policies, affinity, source
ranges (from the shared firewall-vips / firewall-allow sets, grouped per
port, with its KUBE-FW-<h>) and endpoints with their KUBE-SEP-<h> (from the
DNAT rule's comment; ruleset v2 has no KUBE-SEP chains) and cascade
probability (a cluster-IP-only port through its shared chooser, ruleset
v7, named by its KUBE-SVC-<h>); --service filters; --json is machine-readable; a missing table
is a clear message; `cleanup` deletes only nftproxy's tables;
- addresses: the text brackets IPv6 wherever a port follows (VIPs,
  endpoints, no-endpoint entries); the JSON keeps address and port as
  separate fields for all three, in both families.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kernel
from feed import intake
from k8s import endpoint_slice, service

from nftproxy.agent.proxier import Proxier
from nftproxy.cluster.events import KIND_ENDPOINT_SLICES, KIND_SERVICES
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import Endpoint, IPFamily, L4Protocol, ServicePortName
from nftproxy.core.nft.listing import list_family
from nftproxy.core.rules import expr, names
from nftproxy.core.rules import skeleton as sk
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
    assert all(e["identity"].startswith("KUBE-SEP-") for e in web["endpoints"])
    # cluster IP only: the shared chooser stands in for its KUBE-SVC (ruleset v7)
    assert (web["chains"], web["chooser"]) == (["KUBE-SVC-XRY76EGRC3BSCIIJ"], "dispatch-tcp-2")

    sticky = services["demo/sticky:http"]
    assert sticky["affinity_timeout"] == 600
    assert [e["probability"] for e in sticky["endpoints"]] == [0.3333] * 3

    local = services["demo/web-local:http"]
    assert local["policies"]["externalTrafficPolicy"] == "Local"
    assert local["node_port"] == 30081
    assert local["source_ranges"] == ["192.168.50.2"]
    assert local["firewall"] == "KUBE-FW-EPQ2GAXAICHDUGFX"
    assert local["chains"] == ["KUBE-SVC-EPQ2GAXAICHDUGFX", "KUBE-SVL-EPQ2GAXAICHDUGFX",
                               "KUBE-EXT-EPQ2GAXAICHDUGFX"]
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
    assert proc.stdout.count("KUBE-SEP-") == 3  # one per endpoint (affinity rules not counted)


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
    doc = list_family(backend.list_table, family, proxier.config.table_name)
    assert doc is not None
    return doc


def test_a_port_with_affinity_is_read_through_the_affinity_table() -> None:
    """Ruleset v9: its destinations are `accept` in the main table's maps and
    gotos into its chains in the affinity table's; dump shows it as before
    (internalTrafficPolicy from the KUBE-SVL the goto names, the node port,
    the chains, the cascade's endpoints, the timeout)."""
    backend = FakeBackend()
    backend.start()
    proxier = Proxier(ProxyConfig(node_name="node-a"), backend)
    events = intake(proxier)
    events.on_service(None, service("sticky", "10.96.0.7", type="NodePort", node_ports=(30077,),
                                    itp="Local", affinity_timeout=300))
    events.on_endpoint_slice(None, endpoint_slice(
        "sticky", [("10.244.0.5", "node-a"), ("10.244.0.6", "node-a"), ("10.244.1.7", "b")]))
    events.on_synced(KIND_SERVICES)
    events.on_synced(KIND_ENDPOINT_SLICES)
    proxier.sync()
    doc = list_family(backend.list_table, "ip", "nftproxy")
    assert doc is not None
    main = backend.list_table("ip", "nftproxy")
    assert main is not None and "KUBE-SVL-" not in json.dumps(
        [o for o in main["nftables"] if "chain" in o or "rule" in o])
    (view,) = parse_table(doc, family="ip", table="nftproxy").to_json()["services"]
    spn = ServicePortName("ns", "sticky", "http", L4Protocol.TCP)
    assert view["policies"]["internalTrafficPolicy"] == "Local"
    assert (view["vips"], view["node_port"]) == ([{"address": "10.96.0.7", "port": 80}], 30077)
    assert view["chains"] == [names.service_chain(spn), names.local_chain(spn),
                              names.external_chain(spn)]
    assert sorted(e["address"] for e in view["local_endpoints"]) == ["10.244.0.5", "10.244.0.6"]
    assert view["affinity_timeout"] == 300


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


# --- ruleset v2 shapes, hand-written -------------------------------------------------------

WEB = ServicePortName("ns", "web", "http", L4Protocol.TCP)
LB = ServicePortName("ns", "lb", "https", L4Protocol.TCP)


def _v2_listing() -> dict[str, Any]:
    """Two LoadBalancer ports sharing firewall-vips / firewall-allow; web
    has ClientIP affinity (lookup rules, then a cascade with updates): in
    the shared set, each element with its timeout."""
    eps = [Endpoint(f"10.1.0.{n}", 8080) for n in (1, 2, 3)]
    seps = [names.endpoint_chain(WEB, ep) for ep in eps]

    def update(i: int) -> dict[str, Any]:
        return expr.affinity_update(IPFamily.IPV4, names.affinity_key(WEB, eps[i]),
                                    sk.AFFINITY, 900)

    def dnat(i: int, *head: Any, what: str = "") -> dict[str, Any]:
        return {"chain": names.service_chain(WEB),
                "comment": f"ns/web:http -> 10.1.0.{i + 1}:8080{what} {seps[i]}",
                "expr": [*head, update(i), {"match": {"op": "==", "left": {"meta": {
                    "key": "l4proto"}}, "right": "tcp"}},
                    {"dnat": {"family": "ip", "addr": f"10.1.0.{i + 1}", "port": 8080}}]}

    def numgen(mod: int) -> dict[str, Any]:
        return {"match": {"op": "==", "left": {"numgen": {"mode": "random", "mod": mod}},
                          "right": 0}}

    def lookup(i: int) -> dict[str, Any]:
        return expr.affinity_lookup(IPFamily.IPV4, names.affinity_key(WEB, eps[i]), sk.AFFINITY)

    rules = [*(dnat(i, lookup(i), what=" affinity") for i in range(3)),
             dnat(0, numgen(3)), dnat(1, numgen(2)), dnat(2)]

    def vip(ip: str, port: int, spn: ServicePortName) -> dict[str, Any]:
        fw = names.firewall_chain(spn)
        return {"elem": {"val": {"concat": [ip, "tcp", port]}, "comment": f"{fw} {spn}"}}

    def allow(ip: str, port: int, src: Any) -> dict[str, Any]:
        return {"concat": [ip, "tcp", port, src]}

    prefix = {"prefix": {"addr": "192.168.0.0", "len": 16}}
    service_ips = [
        [{"elem": {"val": {"concat": [ip, "tcp", port]}, "comment": str(spn)}},
         {"goto": {"target": names.service_chain(spn)}}]
        for ip, port, spn in (("10.96.0.10", 80, WEB), ("192.168.60.10", 80, WEB),
                              ("192.168.60.11", 443, LB), ("192.168.60.12", 443, LB))]
    return {"nftables": [
        {"map": {"name": sk.SERVICE_IPS, "elem": service_ips}},
        {"set": {"name": sk.FIREWALL_VIPS, "elem": [
            vip("192.168.60.10", 80, WEB), vip("192.168.60.11", 443, LB),
            vip("192.168.60.12", 443, LB)]}},
        {"set": {"name": sk.FIREWALL_ALLOW, "flags": ["interval"], "elem": [
            allow("192.168.60.10", 80, prefix), allow("192.168.60.11", 443, "172.16.0.9"),
            allow("192.168.60.12", 443, "172.16.0.9"),
            allow("192.168.60.12", 443, {"range": ["172.17.0.1", "172.17.0.9"]})]}},
        {"set": {"name": sk.AFFINITY, "flags": ["timeout", "dynamic"]}},
        {"chain": {"name": names.service_chain(WEB)}},
        *({"rule": r} for r in rules),
        {"chain": {"name": names.service_chain(LB)}},
    ]}


def test_v2_cascade_identities_affinity_and_grouped_source_ranges() -> None:
    view = parse_table(_v2_listing(), family="ip", table="nftproxy")
    data = {s["service"]: s for s in view.to_json()["services"]}
    web, lb = data["ns/web:http"], data["ns/lb:https"]
    eps = [Endpoint(f"10.1.0.{n}", 8080) for n in (1, 2, 3)]
    assert [(e["address"], e["identity"], e["probability"]) for e in web["endpoints"]] == [
        (ep.address.split(":")[0], names.endpoint_chain(WEB, ep), 0.3333) for ep in eps]
    assert web["affinity_timeout"] == 900
    assert (web["source_ranges"], web["firewall"]) == (
        ["192.168.0.0/16"], names.firewall_chain(WEB))
    assert (lb["source_ranges"], lb["firewall"]) == (
        ["172.16.0.9", "172.17.0.1-172.17.0.9"], names.firewall_chain(LB))
    text = render_text(view)
    assert f"sourceRanges: 192.168.0.0/16  ({names.firewall_chain(WEB)})" in text
    assert f"10.1.0.2:8080                 33.33%  {names.endpoint_chain(WEB, eps[1])}" in text
    assert "sessionAffinity: ClientIP, timeout 900s" in text
