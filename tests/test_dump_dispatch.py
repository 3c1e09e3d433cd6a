"""`nftproxy dump` of ports without a chain of their own (the shared choosers).

A port's cluster IP `service-ips` element goes to the shared chooser
`dispatch-<proto>-<N>` (comment "ns/svc:port KUBE-SVC-<h>"), whose
endpoints are the N elements of `vip-endpoints-<proto>` keyed (cluster
IP, port, i); with externalTrafficPolicy Cluster its external IPs and LB
VIPs go to the same chooser (comment "... KUBE-EXT-<h>", elements keyed by
the VIP) and its node port to `dispatch-nodeport-<proto>-<N>`
(`nodeport-endpoints-<proto>` keyed (node port, i)). Aspects, on tables
a full sync renders (FakeBackend, tests/test_trace_dispatch.py's cluster
and shared_lb):
- the view shows such a port as before: its VIP, its endpoints with their
  KUBE-SEP-<h> and 1/N each, its KUBE-SVC-<h> (`chains`) and the chooser
  (`chooser`), in text and JSON, in both families; KUBE-SVL-<h> and
  `local endpoints` for internalTrafficPolicy=Local;
- two ports of the same endpoint count share the chooser but each shows
  only its own elements (keyed by its cluster IP); an eTP=Local node-port
  service (through nodeport-local and its choosers) shows its KUBE-SVC,
  KUBE-SVL and KUBE-EXT beside them;
- a port with shared external destinations shows as a port with KUBE-EXT
  does (VIPs, node port, externalTrafficPolicy Cluster, KUBE-SVC-<h> and
  KUBE-EXT-<h>, the endpoints), and per destination (cluster IP, external
  IP, LB VIP, node port) its chooser, KUBE-SVC/EXT-<h> and endpoints, in
  text and JSON, in both families;
- a name too long for the comment (cut by `names.tagged`) still finds the
  endpoints and the KUBE-SVC-<h>; missing elements show no endpoint, no
  crash (a node port without its elements: its own "no endpoints" line);
- a partial sync writes what a full sync writes: the table a partial sync
  adds the services in shows the same, line for line.
"""

from __future__ import annotations

from typing import Any

from k8s import endpoint_slice, service
from test_trace_dispatch import (
    EPS,
    EXTERNAL_IPS,
    INGRESS,
    LB,
    LB_VIPS,
    NODES,
    NP,
    VIPS,
    WEB,
    cluster,
    listings,
    shared_lb,
)

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
        assert (web["chains"], web["chooser"]) == ([names.service_chain(WEB)], "dispatch-tcp-3")
        assert web["local_endpoints"] == [] and "internalTrafficPolicy" not in web["policies"]
        text = render_text(parse_table(tables[family], family=family, table="nftproxy"))
        assert (f"    chains: {names.service_chain(WEB)} (shared chooser dispatch-tcp-3)"
                in text.splitlines())
        for ip in EPS[family]:
            sep = names.endpoint_chain(WEB, Endpoint(ip, 80))
            assert f"      {format_address(ip, 80):<28}  33.33%  {sep}" in text


def test_internal_traffic_policy_local_shows_kube_svl_and_local_endpoints() -> None:
    web = _services(listings(cluster(itp="Local"))["ip"], "ip")["ns/web:http"]
    assert web["policies"] == {"internalTrafficPolicy": "Local"}
    assert (web["chains"], web["chooser"]) == ([names.local_chain(WEB)], "dispatch-tcp-2")
    assert _endpoints(web, "local_endpoints") == _expected(WEB, EPS["ip"][:2], 0.5)
    assert web["endpoints"] == []


def test_ports_sharing_a_chooser_and_a_node_port_service_each_show_their_own() -> None:
    other = ServicePortName("ns", "other", "http", L4Protocol.TCP)
    other_ips = ["10.244.0.21", "10.244.0.22", "10.244.1.23"]
    objs = [*cluster(node_port=True), service("other", "10.96.0.30"),
            endpoint_slice("other", list(zip(other_ips, NODES, strict=True)))]
    views = _services(listings(objs)["ip"], "ip")
    web, mine = views["ns/web:http"], views["ns/other:http"]
    assert web["chooser"] == mine["chooser"] == "dispatch-tcp-3"
    assert _endpoints(web) == _expected(WEB, EPS["ip"], 0.3333)
    assert _endpoints(mine) == _expected(other, other_ips, 0.3333)
    np = views["ns/np:http"]  # eTP=Local: the external-local chains and choosers (v8)
    assert np["chooser"] == "dispatch-tcp-3" and np["node_port"] == 30080
    assert [(d["port"], d["chooser"], d["identity"]) for d in np["dispatched"]] == [
        (80, "dispatch-tcp-3", names.service_chain(NP)),
        (30080, "dispatch-nodeport-tcp-3", names.service_chain(NP)),
        (30080, "dispatch-nodeport-local-tcp-2", names.local_chain(NP)),
        (30080, "nodeport-local", names.external_chain(NP)),
    ]
    assert np["chains"] == [names.service_chain(NP), names.local_chain(NP),
                            names.external_chain(NP)]
    assert np["policies"] == {"externalTrafficPolicy": "Local"}
    assert _endpoints(np) == _expected(NP, EPS["ip"], 0.3333)
    assert _endpoints(np, "local_endpoints") == _expected(NP, EPS["ip"][:2], 0.5)


def test_a_name_cut_in_the_comment_still_finds_endpoints_and_kube_svc() -> None:
    long_ns, long_name = "n" * 60, "s" * 60
    spn = ServicePortName(long_ns, long_name, "http", L4Protocol.TCP)
    objs = [service(long_name, "10.96.0.50", ns=long_ns),
            endpoint_slice(long_name, ["10.244.0.31"], ns=long_ns)]
    (view,) = _services(listings(objs)["ip"], "ip").values()
    assert len(str(spn)) + len(names.service_chain(spn)) >= names.COMMENT_MAX_BYTES
    assert view["service"].startswith(f"{long_ns}/{long_name[:20]}")
    assert (view["chains"], view["chooser"]) == ([names.service_chain(spn)], "dispatch-tcp-1")
    assert _endpoints(view) == _expected(spn, ["10.244.0.31"], 1.0)


def test_missing_elements_show_no_endpoint() -> None:
    doc = listings(cluster())["ip"]
    kept = [i for i in doc["nftables"]
            if not ("map" in i and i["map"]["name"].startswith("vip-endpoints-"))]
    web = _services({"nftables": kept}, "ip")["ns/web:http"]
    assert (web["endpoints"], web["chooser"]) == ([], "dispatch-tcp-3")


def _dispatched(view: dict[str, Any]) -> list[tuple[str, int, str, str, Shown]]:
    return [(d["address"], d["port"], d["chooser"], d["identity"], _endpoints(d))
            for d in view["dispatched"]]


def test_shared_external_destinations_are_shown_with_their_endpoints() -> None:
    tables = listings(shared_lb())
    svc, ext = names.service_chain(LB), names.external_chain(LB)
    for family in ("ip", "ip6"):
        lb = _services(tables[family], family)["ns/lb:http"]
        eps = _expected(LB, EPS[family], 0.3333)
        assert {(v["address"], v["port"]) for v in lb["vips"]} == {
            (LB_VIPS[family], 80), (EXTERNAL_IPS[family], 80), (INGRESS[family], 80)}
        assert lb["node_port"] == 30090
        assert lb["policies"] == {"externalTrafficPolicy": "Cluster"}
        assert (lb["chains"], lb["chooser"]) == ([svc, ext], "dispatch-tcp-3")
        assert _endpoints(lb) == eps and lb["local_endpoints"] == []
        assert _dispatched(lb)[0] == (LB_VIPS[family], 80, "dispatch-tcp-3", svc, eps)
        assert sorted(_dispatched(lb)[1:3]) == sorted([
            (EXTERNAL_IPS[family], 80, "dispatch-tcp-3", ext, eps),
            (INGRESS[family], 80, "dispatch-tcp-3", ext, eps)])
        assert _dispatched(lb)[3] == ("", 30090, "dispatch-nodeport-tcp-3", ext, eps)

        lines = render_text(parse_table(tables[family], family=family, table="nftproxy"))
        text = lines.splitlines()
        assert (f"    chains: {svc}, {ext} (shared choosers dispatch-tcp-3, "
                "dispatch-nodeport-tcp-3)") in text
        assert f"      {'nodePort 30090':<28} -> dispatch-nodeport-tcp-3  {ext}" in text
        assert (f"      {format_address(INGRESS[family], 80):<28} -> dispatch-tcp-3  {ext}"
                in text)
        assert sum("KUBE-SEP-" in line for line in text) == 3  # the same endpoints: shown once


def test_a_node_port_without_its_elements_shows_no_endpoints() -> None:
    doc = listings(shared_lb())["ip"]
    kept = [i for i in doc["nftables"]
            if not ("map" in i and i["map"]["name"].startswith("nodeport-endpoints-"))]
    view = parse_table({"nftables": kept}, family="ip", table="nftproxy")
    lb = {s["service"]: s for s in view.to_json()["services"]}["ns/lb:http"]
    assert _endpoints(lb) == _expected(LB, EPS["ip"], 0.3333)
    assert _dispatched(lb)[3] == ("", 30090, "dispatch-nodeport-tcp-3",
                                  names.external_chain(LB), set())
    text = render_text(view).splitlines()
    at = text.index(f"      {'nodePort 30090':<28} -> dispatch-nodeport-tcp-3  "
                    f"{names.external_chain(LB)}")
    assert text[at + 1] == "        no endpoints"


def test_an_etp_local_port_beside_a_shared_etp_cluster_one() -> None:
    views = _services(listings([*shared_lb(), *cluster(node_port=True, etp="Local")])["ip"], "ip")
    np, lb = views["ns/np:http"], views["ns/lb:http"]
    assert (np["chooser"], np["policies"]) == (
        "dispatch-tcp-3", {"externalTrafficPolicy": "Local"})
    assert "dispatch-nodeport-local-tcp-2" in {d["chooser"] for d in np["dispatched"]}
    assert _endpoints(np, "local_endpoints") == _expected(NP, EPS["ip"][:2], 0.5)
    assert (lb["chooser"], lb["policies"]) == (
        "dispatch-tcp-3", {"externalTrafficPolicy": "Cluster"})
    assert [d["port"] for d in lb["dispatched"]] == [80, 80, 80, 30090]


def test_a_partial_syncs_table_shows_as_a_full_syncs() -> None:
    """A partial sync writes each shared destination as a full sync does (a
    goto to its chooser, added with its first user): dump shows every port
    the same (VIPs, choosers, KUBE-* identities, endpoints and their
    chances), and the same table summary, in both families."""
    objects = [*cluster(node_port=True, etp="Cluster"), *shared_lb()]
    full, partial = listings(objects), listings(objects, partial=True)
    for family in ("ip", "ip6"):
        by_full = parse_table(full[family], family=family, table="nftproxy")
        by_partial = parse_table(partial[family], family=family, table="nftproxy")
        assert len(by_full.to_json()["services"]) == 3
        assert by_partial.to_json() == by_full.to_json()
        assert render_text(by_partial) == render_text(by_full)
