"""`nftproxy trace` through the shared choosers, in kube-proxy's words.

A service port without ClientIP affinity, whatever its endpoint count N,
has no chain of its own: its cluster IP's `service-ips` element goes to
`dispatch-<proto>-<N>` (comment "ns/svc:port KUBE-SVC-<h>"), which DNATs by
`ip daddr . tcp dport . numgen random mod N map @vip-endpoints-<proto>`;
its external IPs and LB VIPs (eTP=Cluster) go to the same chooser (comment
"... KUBE-EXT-<h>"), its node port to `dispatch-nodeport-<proto>-<N>` (`tcp
dport . numgen random mod N map @nodeport-endpoints-<proto>`), each
external destination marked for masquerade by KUBE-SERVICES' /
KUBE-NODEPORTS' lookup in `masquerade-vips` / `masquerade-nodeports`; an
eTP=Local external destination through external-local / nodeport-local.
Aspects, on tables a full sync renders (FakeBackend):
- the path names the service port, the KUBE-SVC-<h> the element stands for
  (KUBE-SVL-<h> for internalTrafficPolicy=Local), the shared chooser
  (`chooser`, and the DNATing chain), each endpoint by its KUBE-SEP-<h>
  with probability 1/N; in both families; the text's service line and
  summary lines read as kube-proxy's (and the JSON carries `chooser`);
- masquerade through the shared chooser is attributed as kube-proxy's
  KUBE-SVC rule's: an off-cluster source, masqueradeAll, a pod's traffic
  kept;
- a node-port service that keeps its chains (ClientIP affinity:
  KUBE-SVC/KUBE-EXT/KUBE-SVL) and a cluster-IP-only one coexist: each is
  traced through its own way, with no chooser named for the first;
- an LB VIP, an external IP (dispatch-tcp-N) and a node port
  (dispatch-nodeport-tcp-N) of an eTP=Cluster port: the path names the
  service port, KUBE-EXT-<h> and the shared chooser, each endpoint's
  KUBE-SEP-<h> with 1/N, in both families; the masquerade is KUBE-EXT's
  (every source, a pod's too), attributed to the KUBE-SERVICES /
  KUBE-NODEPORTS rule that looked the destination up, once (the
  chooser's own cluster-IP rule adds no reason); its cluster IP is still
  traced as KUBE-SVC-<h>;
- a partial sync writes what a full sync writes: the table a partial sync
  adds the services in lists and traces as the one a full sync builds.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest
from k8s import endpoint_slice, service
from kernel import canonical
from test_proxier import NODE, listed

from nftproxy.agent.proxier import Proxier
from nftproxy.core.address import format_address
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import Endpoint, L4Protocol, ServicePortName
from nftproxy.core.nft.listing import list_family
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


def listings(
    objects: list[dict[str, Any]], config: ProxyConfig = CONFIG, *, partial: bool = False
) -> dict[str, Any]:
    """The tables one full sync of `objects` programs (fake kernel), per
    family; `partial`: the full sync of none, then a partial sync adding them."""
    backend = FakeBackend()
    backend.start()
    proxier = Proxier(config, backend)
    events = listed(proxier, *([] if partial else objects))
    assert proxier.sync().full
    if partial:
        for obj in objects:
            if obj["kind"] == "Service":
                events.on_service(None, obj)
            else:
                events.on_endpoint_slice(None, obj)
        assert not proxier.sync().full
    return {f: list_family(backend.list_table, f, config.table_name) for f in ("ip", "ip6")}


def cluster(*, itp: str | None = None, node_port: bool = False,
            etp: str | None = "Local", affinity: bool = False) -> list[dict[str, Any]]:
    """web: cluster IP only, three endpoints in each family (two on this
    node); with `node_port`, np too: a NodePort service, same endpoints,
    externalTrafficPolicy `etp`, with ClientIP `affinity` (then it keeps its
    chains)."""
    objs = [service("web", [VIPS["ip"], VIPS["ip6"]], itp=itp)]
    objs += [_slices("web", f, EPS[f]) for f in ("ip", "ip6")]
    if node_port:
        objs.append(service("np", [NP_VIPS["ip"], NP_VIPS["ip6"]], type="NodePort",
                            node_ports=(30080,), etp=etp,
                            affinity_timeout=600 if affinity else None))
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
    assert {p.chooser for p in result.paths} == {"dispatch-tcp-3"}
    assert {p.endpoint.chain for p in result.paths if p.endpoint} == {"dispatch-tcp-3"}
    assert {p.endpoint.identity for p in result.paths if p.endpoint} == _seps(WEB, EPS[family])

    lines = render_text(result).splitlines()
    assert lines[1] == (f"  service ns/web:http: {names.service_chain(WEB)} "
                        "(shared chooser dispatch-tcp-3)")
    assert {tuple(line.split()[:3]) for line in lines[2:5]} == {
        ("33.33%", format_address(ip, 80), names.endpoint_chain(WEB, Endpoint(ip, 80)))
        for ip in EPS[family]}
    assert result.to_json()["paths"][0]["chooser"] == "dispatch-tcp-3"


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
    assert {p.chooser for p in every.paths} == {"dispatch-tcp-3"}


def test_internal_traffic_policy_local_names_kube_svl() -> None:
    tables = listings(cluster(itp="Local"))
    result = run(tables, "10.244.0.12", VIPS["ip"], Origin.POD)
    local = EPS["ip"][:2]  # the endpoints on this node
    assert result.endpoints() == {f"{ip}:80": Fraction(1, 2) for ip in local}
    assert {(p.service, p.chains, p.chooser) for p in result.paths} == {
        ("ns/web:http", (names.local_chain(WEB),), "dispatch-tcp-2")}
    assert {p.endpoint.identity for p in result.paths if p.endpoint} == _seps(WEB, local)


def test_a_node_port_service_and_a_cluster_ip_only_one_coexist() -> None:
    tables = listings(cluster(node_port=True, affinity=True))
    web = run(tables, "192.168.1.2", VIPS["ip"], Origin.EXTERNAL)
    assert {(p.chains, p.chooser) for p in web.paths} == {
        ((names.service_chain(WEB),), "dispatch-tcp-3")}
    np = run(tables, "192.168.1.2", NP_VIPS["ip"], Origin.EXTERNAL)
    assert {(p.service, p.chains, p.chooser) for p in np.paths} == {
        ("ns/np:http", (names.service_chain(NP),), "")}
    assert {p.endpoint.chain for p in np.paths if p.endpoint} == {names.service_chain(NP)}
    assert {p.endpoint.identity for p in np.paths if p.endpoint} == _seps(NP, EPS["ip"])
    assert all(p.masquerade and "off-cluster" in p.reasons[0] for p in np.paths)
    assert render_text(np).splitlines()[1] == f"  service ns/np:http: {names.service_chain(NP)}"

    node_port = run(tables, "192.168.1.2", "192.168.1.1", Origin.EXTERNAL, port=30080)
    assert {(p.chains, p.chooser) for p in node_port.paths} == {
        ((names.external_chain(NP), names.local_chain(NP)), "")}
    assert node_port.endpoints() == {f"{ip}:80": Fraction(1, 2) for ip in EPS["ip"][:2]}


# --- external destinations through the shared choosers ------------------------------------

LB = ServicePortName("ns", "lb", "http", L4Protocol.TCP)
LB_VIPS = {"ip": "10.96.0.40", "ip6": "fd00:96::40"}
INGRESS = {"ip": "203.0.113.5", "ip6": "fd00:113::5"}
EXTERNAL_IPS = {"ip": "192.168.7.7", "ip6": "fd00:7::7"}
NODE_IPS = {"ip": "192.168.1.1", "ip6": "fd00:1::1"}
CLIENTS = {"ip": "192.168.1.2", "ip6": "fd00:1::2"}


def shared_lb() -> list[dict[str, Any]]:
    """lb: a dual-stack LoadBalancer (ingress IP, external IP, node port
    30090), externalTrafficPolicy Cluster, web's three endpoints: every
    destination goes to a shared chooser."""
    objs = [service("lb", [LB_VIPS["ip"], LB_VIPS["ip6"]], type="LoadBalancer",
                    node_ports=(30090,), external_ips=list(EXTERNAL_IPS.values()),
                    lb_ips=list(INGRESS.values()), etp="Cluster")]
    return objs + [_slices("lb", f, EPS[f]) for f in ("ip", "ip6")]


def _kube_ext_mark(rule: str, set_name: str) -> str:
    return ("external destination of an externalTrafficPolicy=Cluster service: "
            f"{names.external_chain(LB)}'s mark, set by {rule} (@{set_name})")


VIP_MARK = _kube_ext_mark("KUBE-SERVICES/rule 1", "masquerade-vips")
NODEPORT_MARK = _kube_ext_mark("KUBE-NODEPORTS/rule 1", "masquerade-nodeports")


@pytest.mark.parametrize("family", ["ip", "ip6"])
@pytest.mark.parametrize("kind", ["lb", "external-ip", "node-port"])
def test_an_external_destination_is_traced_through_its_shared_chooser(
    family: str, kind: str
) -> None:
    tables = listings(shared_lb())
    dst, port = {"lb": (INGRESS[family], 80), "external-ip": (EXTERNAL_IPS[family], 80),
                 "node-port": (NODE_IPS[family], 30090)}[kind]
    chooser = "dispatch-nodeport-tcp-3" if kind == "node-port" else "dispatch-tcp-3"
    result = run(tables, CLIENTS[family], dst, Origin.EXTERNAL, port=port)
    assert result.endpoints() == {format_address(ip, 80): Fraction(1, 3) for ip in EPS[family]}
    assert {(p.service, p.chains, p.chooser) for p in result.paths} == {
        ("ns/lb:http", (names.external_chain(LB),), chooser)}
    assert {p.endpoint.chain for p in result.paths if p.endpoint} == {chooser}
    assert {p.endpoint.identity for p in result.paths if p.endpoint} == _seps(LB, EPS[family])
    mark = NODEPORT_MARK if kind == "node-port" else VIP_MARK
    # one reason: the chooser's cluster-IP rule marks an off-cluster source
    # again, but the mark is KUBE-EXT's
    assert {(p.masquerade, p.reasons) for p in result.paths} == {(True, (mark,))}
    lines = render_text(result).splitlines()
    ext = names.external_chain(LB)
    assert lines[1] == f"  service ns/lb:http: {ext} (shared chooser {chooser})"
    assert {line.split()[1] for line in lines[2:5]} == {format_address(ip, 80)
                                                       for ip in EPS[family]}


def test_kube_ext_marks_a_pods_traffic_too_and_the_cluster_ip_stays_kube_svc() -> None:
    tables = listings(shared_lb())
    pod = run(tables, "10.244.0.12", INGRESS["ip"], Origin.POD)
    others = [p for p in pod.paths if p.endpoint and p.endpoint.address != "10.244.0.12"]
    assert len(others) == 2
    assert {(p.masquerade, p.reasons) for p in others} == {(True, (VIP_MARK,))}
    cip = run(tables, "10.244.0.12", LB_VIPS["ip"], Origin.POD)
    others = [p for p in cip.paths if p.endpoint and p.endpoint.address != "10.244.0.12"]
    assert {(p.chains, p.chooser, p.masquerade, p.reasons) for p in others} == {
        ((names.service_chain(LB),), "dispatch-tcp-3", False, ("not marked for masquerade",))}


def test_an_etp_local_port_beside_a_shared_etp_cluster_one() -> None:
    """Both go through shared chains (v8): np's node port through
    nodeport-local to the chooser of its two local endpoints, named as
    kube-proxy's KUBE-EXT -> KUBE-SVL."""
    tables = listings([*shared_lb(), *cluster(node_port=True, etp="Local")])
    local = run(tables, CLIENTS["ip"], NODE_IPS["ip"], Origin.EXTERNAL, port=30080)
    assert {(p.service, p.chains, p.chooser) for p in local.paths} == {
        ("ns/np:http", (names.external_chain(NP), names.local_chain(NP)),
         "dispatch-nodeport-local-tcp-2")}
    assert local.endpoints() == {f"{ip}:80": Fraction(1, 2) for ip in EPS["ip"][:2]}
    assert {(p.masquerade, p.reasons) for p in local.paths} == {
        (False, ("externalTrafficPolicy=Local: the client's address is kept",))}
    shared = run(tables, CLIENTS["ip"], NODE_IPS["ip"], Origin.EXTERNAL, port=30090)
    assert {(p.service, p.chains, p.chooser) for p in shared.paths} == {
        ("ns/lb:http", (names.external_chain(LB),), "dispatch-nodeport-tcp-3")}
    assert {(p.masquerade, p.reasons) for p in shared.paths} == {(True, (NODEPORT_MARK,))}
    json_path = shared.to_json()["paths"][0]
    assert (json_path["chooser"], json_path["chains"]) == (
        "dispatch-nodeport-tcp-3", [names.external_chain(LB)])


# --- eTP=Local external destinations through external-local (ruleset v8) ---------------


def local_lb() -> list[dict[str, Any]]:
    """lb as in `shared_lb`, externalTrafficPolicy Local: two of its three
    endpoints are on this node."""
    objs = [service("lb", [LB_VIPS["ip"], LB_VIPS["ip6"]], type="LoadBalancer",
                    node_ports=(30090,), external_ips=list(EXTERNAL_IPS.values()),
                    lb_ips=list(INGRESS.values()), etp="Local")]
    return objs + [_slices("lb", f, EPS[f]) for f in ("ip", "ip6")]


@pytest.mark.parametrize("family", ["ip", "ip6"])
def test_an_etp_local_vip_keeps_the_clients_address_and_picks_a_local_endpoint(
    family: str,
) -> None:
    tables = listings(local_lb())
    for vip in (INGRESS[family], EXTERNAL_IPS[family]):
        result = run(tables, CLIENTS[family], vip, Origin.EXTERNAL)
        assert {(p.chains, p.chooser, p.masquerade) for p in result.paths} == {
            ((names.external_chain(LB), names.local_chain(LB)), "dispatch-local-tcp-2", False)}
        assert result.endpoints() == {
            format_address(ip, 80): Fraction(1, 2) for ip in EPS[family][:2]}


def test_pods_and_the_node_reach_every_endpoint_of_an_etp_local_vip() -> None:
    """kube-proxy's KUBE-EXT: pod traffic goes to KUBE-SVC unmarked (but
    for hairpin), the node's own traffic to KUBE-SVC marked."""
    tables = listings(local_lb())
    every = {f"{ip}:80": Fraction(1, 3) for ip in EPS["ip"]}
    pod = run(tables, "10.244.0.12", INGRESS["ip"], Origin.POD)
    assert pod.endpoints() == every
    assert {(p.chains, p.chooser) for p in pod.paths} == {
        ((names.external_chain(LB), names.service_chain(LB)), "dispatch-tcp-3")}
    assert all(not p.masquerade for p in pod.paths if p.endpoint.address != "10.244.0.12")
    node = run(tables, NODE_IPS["ip"], INGRESS["ip"], Origin.NODE)
    assert node.endpoints() == every
    assert {(p.masquerade, p.reasons) for p in node.paths} == {(True, (
        "the node's own traffic to an externalTrafficPolicy=Local destination (Local policy)",))}


def test_with_masquerade_all_pod_traffic_to_an_etp_local_vip_is_not_marked() -> None:
    """kube-proxy's KUBE-SVC marks every packet to the cluster IP with
    masqueradeAll, not the pod traffic KUBE-EXT sends it for an external
    destination: the shared chooser's rule matches @cluster-ips."""
    tables = listings(local_lb(), replace(CONFIG, masquerade_all=True))
    pod = run(tables, "10.244.0.12", INGRESS["ip"], Origin.POD)
    others = [p for p in pod.paths if p.endpoint and p.endpoint.address != "10.244.0.12"]
    assert len(others) == 2 and not any(p.masquerade for p in others)
    cip = run(tables, "10.244.0.12", LB_VIPS["ip"], Origin.POD)
    assert all(p.masquerade for p in cip.paths)


@pytest.mark.parametrize("family", ["ip", "ip6"])
def test_a_partial_syncs_table_traces_as_a_full_syncs(family: str) -> None:
    """A partial sync writes each shared destination as a full sync does, a
    goto to its chooser, adding the choosers with their first user: the
    tables list the same content, and every destination traces the same
    (paths, steps, endpoints, chances, KUBE-* identities, masquerade and
    its reasons), from outside and from the node."""
    objects = [*cluster(node_port=True, etp="Cluster"), *shared_lb()]
    full, partial = listings(objects), listings(objects, partial=True)
    assert canonical(partial[family]) == canonical(full[family])
    destinations = [(VIPS[family], 80), (NP_VIPS[family], 80), (LB_VIPS[family], 80),
                    (INGRESS[family], 80), (EXTERNAL_IPS[family], 80),
                    (NODE_IPS[family], 30080), (NODE_IPS[family], 30090)]
    for origin, src in ((Origin.EXTERNAL, CLIENTS[family]), (Origin.NODE, NODE_IPS[family])):
        for dst, port in destinations:
            by_full = run(full, src, dst, origin, port=port)
            by_partial = run(partial, src, dst, origin, port=port)
            assert by_full.endpoints() and len(by_full.paths) == 3, (origin, dst, port)
            assert by_partial.paths == by_full.paths, (origin, dst, port)
