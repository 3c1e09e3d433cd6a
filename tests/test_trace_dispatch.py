"""`nftproxy trace` through ruleset v7's shared choosers, in kube-proxy's words.

A service port reached only at its cluster IP (no node port, external IP or
LB VIP), without affinity, with 1..64 endpoints has no KUBE-SVC/SVL chain:
its `service-ips` element goes to `dispatch-<proto>-<g>-<N>` (comment
"ns/svc:port KUBE-SVC-<h>"), which DNATs by `ip daddr . tcp dport . numgen
random mod N map @clusterip-endpoints-<proto>-<g>`. Aspects, on tables a
full sync renders (FakeBackend):
- the path names the service port, the KUBE-SVC-<h> the element stands for
  (KUBE-SVL-<h> for internalTrafficPolicy=Local), the shared chooser
  (`chooser`, and the DNATing chain), each endpoint by its KUBE-SEP-<h>
  with probability 1/N; in both families; the text's service line and
  summary lines read as kube-proxy's (and the JSON carries `chooser`);
- masquerade through the shared chooser is attributed as kube-proxy's
  KUBE-SVC rule's: an off-cluster source, masqueradeAll, a pod's traffic
  kept;
- a node-port service (its own KUBE-SVC/KUBE-EXT chains) and a
  cluster-IP-only one coexist: each is traced through its own way, with
  no chooser named for the first.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest
from k8s import endpoint_slice, service
from test_proxier import NODE, listed

from nftproxy.agent.proxier import Proxier
from nftproxy.core.address import format_address
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import Endpoint, L4Protocol, ServicePortName
from nftproxy.core.rules import names
from nftproxy.core.trace import Host, Origin, Packet, Ruleset, Trace, trace
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools.trace import render_text

CONFIG = ProxyConfig(
    node_name=NODE, table_name="nftproxy", cluster_cidrs=("10.244.0.0/16", "fd00:244::/48")
)
HOST = Host.of(["192.168.1.1", "fd00:1::1"])
WEB = ServicePortName("ns", "web", "http", L4Protocol.TCP)
NP = ServicePortName("ns", "np", "http", L4Protocol.TCP)
EPS = {"ip": ["10.244.0.11", "10.244.0.12", "10.244.1.13"],
       "ip6": ["fd00:244::11", "fd00:244::12", "fd00:244:1::13"]}
VIPS = {"ip": "10.96.0.10", "ip6": "fd00:96::10"}
NP_VIPS = {"ip": "10.96.0.20", "ip6": "fd00:96::20"}
NODES = ("node-a", "node-a", "node-b")


def _slices(name: str, family: str, ips: list[str]) -> dict[str, Any]:
    return endpoint_slice(name, list(zip(ips, NODES, strict=True)),
                          family="IPv4" if family == "ip" else "IPv6")


def listings(objects: list[dict[str, Any]], config: ProxyConfig = CONFIG) -> dict[str, Any]:
    """The tables one full sync of `objects` programs (fake kernel), per family."""
    backend = FakeBackend()
    backend.start()
    proxier = Proxier(config, backend)
    listed(proxier, *objects)
    proxier.sync()
    return {f: backend.list_table(f, config.table_name) for f in ("ip", "ip6")}


def cluster(*, itp: str | None = None, node_port: bool = False) -> list[dict[str, Any]]:
    """web: cluster IP only, three endpoints in each family (two on this
    node); with `node_port`, np too: a NodePort service, same endpoints."""
    objs = [service("web", [VIPS["ip"], VIPS["ip6"]], itp=itp)]
    objs += [_slices("web", f, EPS[f]) for f in ("ip", "ip6")]
    if node_port:
        objs.append(service("np", [NP_VIPS["ip"], NP_VIPS["ip6"]], type="NodePort",
                            node_ports=(30080,)))
        objs += [_slices("np", f, EPS[f]) for f in ("ip", "ip6")]
    return objs


def run(tables: dict[str, Any], src: str, dst: str, origin: Origin, port: int = 80) -> Trace:
    family = "ip" if ":" not in dst else "ip6"
    rs = Ruleset.from_listing(tables[family], family, "nftproxy")
    assert rs.problems() == []
    iif = "" if origin is Origin.NODE else None
    return trace(rs, Packet(src, dst, port, "tcp", origin=origin, iifname=iif), HOST)


def _seps(spn: ServicePortName, ips: list[str]) -> set[str]:
    return {names.endpoint_chain(spn, Endpoint(ip, 80)) for ip in ips}


@pytest.mark.parametrize("family", ["ip", "ip6"])
def test_a_cluster_ip_only_port_is_traced_through_its_shared_chooser(family: str) -> None:
    tables = listings(cluster())
    src = "192.168.1.2" if family == "ip" else "fd00:1::2"
    result = run(tables, src, VIPS[family], Origin.EXTERNAL)
    assert result.endpoints() == {format_address(ip, 80): Fraction(1, 3) for ip in EPS[family]}
    assert {p.service for p in result.paths} == {"ns/web:http"}
    assert {p.chains for p in result.paths} == {(names.service_chain(WEB),)}
    assert {p.chooser for p in result.paths} == {"dispatch-tcp-a-3"}
    assert {p.endpoint.chain for p in result.paths if p.endpoint} == {"dispatch-tcp-a-3"}
    assert {p.endpoint.identity for p in result.paths if p.endpoint} == _seps(WEB, EPS[family])

    lines = render_text(result).splitlines()
    assert lines[1] == (f"  service ns/web:http: {names.service_chain(WEB)} "
                        "(shared chooser dispatch-tcp-a-3)")
    assert {tuple(line.split()[:3]) for line in lines[2:5]} == {
        ("33.33%", format_address(ip, 80), names.endpoint_chain(WEB, Endpoint(ip, 80)))
        for ip in EPS[family]}
    assert result.to_json()["paths"][0]["chooser"] == "dispatch-tcp-a-3"


def test_masquerade_through_the_shared_chooser_is_attributed() -> None:
    tables = listings(cluster())
    outside = run(tables, "192.168.1.2", VIPS["ip"], Origin.EXTERNAL)
    assert {(p.masquerade, p.reasons) for p in outside.paths} == {
        (True, ("off-cluster source to a cluster IP (not from a pod on this node)",))}
    pod = run(tables, "10.244.0.12", VIPS["ip"], Origin.POD)
    kept = [p for p in pod.paths if p.endpoint and p.endpoint.address != "10.244.0.12"]
    assert {(p.masquerade, p.reasons) for p in kept} == {
        (False, ("not marked for masquerade",))}

    config = replace(CONFIG, masquerade_all=True)
    every = run(listings(cluster(), config), "10.244.0.12", VIPS["ip"], Origin.POD)
    assert {(p.masquerade, p.reasons) for p in every.paths} == {
        (True, ("masqueradeAll: all traffic to the cluster IP is masqueraded",))}
    assert {p.chooser for p in every.paths} == {"dispatch-tcp-a-3"}


def test_internal_traffic_policy_local_names_kube_svl() -> None:
    tables = listings(cluster(itp="Local"))
    result = run(tables, "10.244.0.12", VIPS["ip"], Origin.POD)
    local = EPS["ip"][:2]  # the endpoints on this node
    assert result.endpoints() == {f"{ip}:80": Fraction(1, 2) for ip in local}
    assert {(p.service, p.chains, p.chooser) for p in result.paths} == {
        ("ns/web:http", (names.local_chain(WEB),), "dispatch-tcp-a-2")}
    assert {p.endpoint.identity for p in result.paths if p.endpoint} == _seps(WEB, local)


def test_a_node_port_service_and_a_cluster_ip_only_one_coexist() -> None:
    tables = listings(cluster(node_port=True))
    web = run(tables, "192.168.1.2", VIPS["ip"], Origin.EXTERNAL)
    assert {(p.chains, p.chooser) for p in web.paths} == {
        ((names.service_chain(WEB),), "dispatch-tcp-a-3")}
    np = run(tables, "192.168.1.2", NP_VIPS["ip"], Origin.EXTERNAL)
    assert {(p.service, p.chains, p.chooser) for p in np.paths} == {
        ("ns/np:http", (names.service_chain(NP),), "")}
    assert {p.endpoint.chain for p in np.paths if p.endpoint} == {names.service_chain(NP)}
    assert {p.endpoint.identity for p in np.paths if p.endpoint} == _seps(NP, EPS["ip"])
    assert all(p.masquerade and "off-cluster" in p.reasons[0] for p in np.paths)
    assert render_text(np).splitlines()[1] == f"  service ns/np:http: {names.service_chain(NP)}"

    node_port = run(tables, "192.168.1.2", "192.168.1.1", Origin.EXTERNAL, port=30080)
    assert {(p.chains, p.chooser) for p in node_port.paths} == {
        ((names.external_chain(NP), names.service_chain(NP)), "")}
    assert node_port.endpoints() == {f"{ip}:80": Fraction(1, 3) for ip in EPS["ip"]}
