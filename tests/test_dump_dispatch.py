"""`nftproxy dump` of ports without a chain of their own (ruleset v7's shared choosers).

A cluster-IP-only port's `service-ips` element goes to the shared chooser
`dispatch-<proto>-<g>-<N>` (comment "ns/svc:port KUBE-SVC-<h>"), whose
endpoints are the N elements of `clusterip-endpoints-<proto>-<g>` keyed
(cluster IP, port, i). Aspects, on tables a full sync renders (FakeBackend,
tests/test_trace_dispatch.py's cluster):
- the view shows such a port as before: its VIP, its endpoints with their
  KUBE-SEP-<h> and 1/N each, its KUBE-SVC-<h> (`chains`) and the chooser
  (`chooser`), in text and JSON, in both families; KUBE-SVL-<h> and
  `local endpoints` for internalTrafficPolicy=Local;
- two ports of the same endpoint count share the chooser but each shows
  only its own elements (keyed by its cluster IP); a node-port service
  (own KUBE-SVC/KUBE-EXT chains, no chooser) shows as before beside them;
- a name too long for the comment (cut by `names.tagged`) still finds the
  endpoints and the KUBE-SVC-<h>; missing elements show no endpoint, no crash.
"""

from __future__ import annotations

from typing import Any

from k8s import endpoint_slice, service
from test_trace_dispatch import EPS, NODES, NP, VIPS, WEB, cluster, listings

from nftproxy.core.address import format_address
from nftproxy.core.model import Endpoint, L4Protocol, ServicePortName
from nftproxy.core.rules import names
from nftproxy.tools.dump import parse_table, render_text


def _services(doc: Any, family: str) -> dict[str, dict[str, Any]]:
    view = parse_table(doc, family=family, table="nftproxy").to_json()
    return {s["service"]: s for s in view["services"]}


Shown = set[tuple[str, int, str, float]]
"""Endpoints as (address, port, KUBE-SEP-<h>, probability)."""


def _endpoints(view: dict[str, Any], key: str = "endpoints") -> Shown:
    return {(e["address"], e["port"], e["identity"], e["probability"]) for e in view[key]}


def _expected(spn: ServicePortName, ips: list[str], share: float) -> Shown:
    return {(ip, 80, names.endpoint_chain(spn, Endpoint(ip, 80)), share) for ip in ips}


def test_a_dispatched_ports_endpoints_are_shown_in_both_families() -> None:
    tables = listings(cluster())
    for family in ("ip", "ip6"):
        web = _services(tables[family], family)["ns/web:http"]
        assert web["vips"] == [{"address": VIPS[family], "port": 80}]
        assert _endpoints(web) == _expected(WEB, EPS[family], 0.3333)
        assert (web["chains"], web["chooser"]) == ([names.service_chain(WEB)], "dispatch-tcp-a-3")
        assert web["local_endpoints"] == [] and "internalTrafficPolicy" not in web["policies"]
        text = render_text(parse_table(tables[family], family=family, table="nftproxy"))
        assert (f"    chains: {names.service_chain(WEB)} (shared chooser dispatch-tcp-a-3)"
                in text.splitlines())
        for ip in EPS[family]:
            sep = names.endpoint_chain(WEB, Endpoint(ip, 80))
            assert f"      {format_address(ip, 80):<28}  33.33%  {sep}" in text


def test_internal_traffic_policy_local_shows_kube_svl_and_local_endpoints() -> None:
    web = _services(listings(cluster(itp="Local"))["ip"], "ip")["ns/web:http"]
    assert web["policies"] == {"internalTrafficPolicy": "Local"}
    assert (web["chains"], web["chooser"]) == ([names.local_chain(WEB)], "dispatch-tcp-a-2")
    assert _endpoints(web, "local_endpoints") == _expected(WEB, EPS["ip"][:2], 0.5)
    assert web["endpoints"] == []


def test_ports_sharing_a_chooser_and_a_node_port_service_each_show_their_own() -> None:
    other = ServicePortName("ns", "other", "http", L4Protocol.TCP)
    other_ips = ["10.244.0.21", "10.244.0.22", "10.244.1.23"]
    objs = [*cluster(node_port=True), service("other", "10.96.0.30"),
            endpoint_slice("other", list(zip(other_ips, NODES, strict=True)))]
    views = _services(listings(objs)["ip"], "ip")
    web, mine = views["ns/web:http"], views["ns/other:http"]
    assert web["chooser"] == mine["chooser"] == "dispatch-tcp-a-3"
    assert _endpoints(web) == _expected(WEB, EPS["ip"], 0.3333)
    assert _endpoints(mine) == _expected(other, other_ips, 0.3333)
    np = views["ns/np:http"]
    assert np["chooser"] == "" and np["node_port"] == 30080
    assert np["chains"] == [names.service_chain(NP), names.external_chain(NP)]
    assert np["policies"] == {"externalTrafficPolicy": "Cluster"}
    assert _endpoints(np) == _expected(NP, EPS["ip"], 0.3333)


def test_a_name_cut_in_the_comment_still_finds_endpoints_and_kube_svc() -> None:
    long_ns, long_name = "n" * 60, "s" * 60
    spn = ServicePortName(long_ns, long_name, "http", L4Protocol.TCP)
    objs = [service(long_name, "10.96.0.50", ns=long_ns),
            endpoint_slice(long_name, ["10.244.0.31"], ns=long_ns)]
    (view,) = _services(listings(objs)["ip"], "ip").values()
    assert len(str(spn)) + len(names.service_chain(spn)) >= names.COMMENT_MAX_BYTES
    assert view["service"].startswith(f"{long_ns}/{long_name[:20]}")
    assert (view["chains"], view["chooser"]) == ([names.service_chain(spn)], "dispatch-tcp-a-1")
    assert _endpoints(view) == _expected(spn, ["10.244.0.31"], 1.0)


def test_missing_elements_show_no_endpoint() -> None:
    doc = listings(cluster())["ip"]
    kept = [i for i in doc["nftables"]
            if not ("map" in i and i["map"]["name"].startswith("clusterip-endpoints-"))]
    web = _services({"nftables": kept}, "ip")["ns/web:http"]
    assert (web["endpoints"], web["chooser"]) == ([], "dispatch-tcp-a-3")
