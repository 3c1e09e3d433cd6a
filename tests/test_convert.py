"""Kubernetes JSON -> model values, and what happens to bad input.

Aspects covered:
- Services: ports, families, node ports, external IPs, load balancers and
  their source ranges, traffic policies, affinity, health-check node port;
  the services that produce nothing (headless, ExternalName, labelled);
- every kind of invalid Service field: the exact field path reported, and
  the rest of the Service still converting;
- EndpointSlices: conditions and their defaults, hints, locality, families,
  invalid addresses, de-duplication, order, ports, trigger times;
- Nodes, ServiceCIDRs and object names;
- a property test: arbitrary JSON-like input never raises out of convert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nftproxy.core.convert import (
    HEADLESS_LABEL,
    SERVICE_NAME_LABEL,
    SERVICE_PROXY_NAME_LABEL,
    EndpointSliceInfo,
    Problem,
    node_info,
    service_cidrs,
    service_name,
    service_ports,
    slice_info,
)
from nftproxy.core.convert.endpointslice import _plain_endpoint, _slice_endpoint
from nftproxy.core.convert.problems import Report
from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    IPMode,
    L4Protocol,
    LoadBalancerIngress,
    NamespacedName,
    NodeInfo,
    ServicePort,
    ServicePortName,
    SessionAffinity,
    TrafficPolicy,
)

V4 = IPFamily.IPV4
V6 = IPFamily.IPV6
TCP = L4Protocol.TCP
UDP = L4Protocol.UDP
SCTP = L4Protocol.SCTP
NODE = "node-a"
TRIGGER = "endpoints.kubernetes.io/last-change-trigger-time"


# --- builders -----------------------------------------------------------------


def service(
    *, labels: dict[str, str] | None = None, status: Any = None, **spec: Any
) -> dict[str, Any]:
    """A Service ns/web; spec fields default to one TCP port 80 "http" on 10.96.0.10."""
    full_spec: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
    }
    full_spec.update(spec)
    obj: dict[str, Any] = {"metadata": {"namespace": "ns", "name": "web"}, "spec": full_spec}
    if labels is not None:
        obj["metadata"]["labels"] = labels
    if status is not None:
        obj["status"] = status
    return obj


def lb_status(*ingress: Any) -> dict[str, Any]:
    return {"loadBalancer": {"ingress": list(ingress)}}


def sp(
    port_name: str = "http",
    port: int = 80,
    *,
    protocol: L4Protocol = TCP,
    family: IPFamily = V4,
    cluster_ip: str = "10.96.0.10",
    **fields: Any,
) -> ServicePort:
    """The expected ServicePort of ns/web."""
    return ServicePort(
        name=ServicePortName("ns", "web", port_name, protocol),
        family=family,
        cluster_ip=cluster_ip,
        port=port,
        protocol=protocol,
        **fields,
    )


def port(name: str, number: Any, **fields: Any) -> dict[str, Any]:
    return {"name": name, "port": number, **fields}


HTTP = port("http", 80)
DNS = port("dns", 53, protocol="UDP")


def as_map(*ports: ServicePort) -> dict[ServicePortName, ServicePort]:
    return {p.name: p for p in ports}


def endpoint_slice(
    *endpoints: Any,
    ports: Any = None,
    address_type: Any = "IPv4",
    service_label: Any = "web",
    annotations: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """EndpointSlice ns/web-abc of service ns/web; one port "http" 8080 by default."""
    meta: dict[str, Any] = {"namespace": "ns", "name": "web-abc", "labels": {}}
    if service_label is not None:
        meta["labels"][SERVICE_NAME_LABEL] = service_label
    if annotations is not None:
        meta["annotations"] = annotations
    obj: dict[str, Any] = {
        "metadata": meta,
        "addressType": address_type,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}] if ports is None else ports,
        "endpoints": list(endpoints),
    }
    obj.update(extra)
    return obj


def ep(ip: Any, **fields: Any) -> dict[str, Any]:
    return {"addresses": [ip], **fields}


HTTP_NAME = ServicePortName("ns", "web", "http", TCP)


def endpoints_of(info: EndpointSliceInfo | None, name: ServicePortName = HTTP_NAME) -> Any:
    assert info is not None
    return info.ports[name]


def fields(problems: list[Problem]) -> list[str]:
    return [p.field for p in problems]


# --- Services: valid input ----------------------------------------------------

VALID_SERVICES = [
    pytest.param(service(), V4, [sp()], id="cluster IP with one named port"),
    pytest.param(service(ports=[port("", 80)]), V4, [sp("")], id="the only port may be unnamed"),
    pytest.param(
        service(ports=[{"port": 80}]),
        V4,
        [sp("")],
        id="a port without name and protocol is the unnamed TCP port",
    ),
    pytest.param(
        service(ports=[HTTP, DNS, port("sig", 9000, protocol="SCTP")]),
        V4,
        [sp(), sp("dns", 53, protocol=UDP), sp("sig", 9000, protocol=SCTP)],
        id="several ports with TCP, UDP and SCTP",
    ),
    pytest.param(
        service(ports=[port("dns", 53, protocol="TCP"), DNS]),
        V4,
        [sp("dns", 53), sp("dns", 53, protocol=UDP)],
        id="one name with two protocols is two service ports",
    ),
    pytest.param(
        service(clusterIPs=["10.96.0.10", "fd00::10"], ipFamilies=["IPv4", "IPv6"]),
        V4,
        [sp()],
        id="dual-stack service seen by the IPv4 proxier",
    ),
    pytest.param(
        service(clusterIPs=["10.96.0.10", "fd00::10"], ipFamilies=["IPv4", "IPv6"]),
        V6,
        [sp(family=V6, cluster_ip="fd00::10")],
        id="dual-stack service seen by the IPv6 proxier",
    ),
    pytest.param(
        service(clusterIP="fd00::10", clusterIPs=["fd00::10", "10.96.0.10"]),
        V4,
        [sp()],
        id="IPv6-primary dual-stack service seen by the IPv4 proxier",
    ),
    pytest.param(
        service(clusterIP="fd00:0::0010"),
        V6,
        [sp(family=V6, cluster_ip="fd00::10")],
        id="IPv6 cluster IP is normalised",
    ),
    pytest.param(
        service(clusterIP="010.096.000.010"),
        V4,
        [sp()],
        id="IPv4 cluster IP with leading zeros is read as decimal like ParseIPSloppy",
    ),
    pytest.param(service(), V6, [], id="single-stack IPv4 service has no IPv6 ports"),
    pytest.param(
        service(type="NodePort", ports=[port("http", 80, nodePort=30080)]),
        V4,
        [sp(node_port=30080)],
        id="NodePort service keeps its node port",
    ),
    pytest.param(
        service(type="ClusterIP", ports=[port("http", 80, nodePort=30080)]),
        V4,
        [sp()],
        id="ClusterIP service ignores a node port",
    ),
    pytest.param(
        service(type="NodePort", ports=[port("http", 80, nodePort=0)]),
        V4,
        [sp()],
        id="node port 0 means none",
    ),
    pytest.param(
        service(
            type="LoadBalancer",
            ports=[port("http", 80, nodePort=30080)],
            status=lb_status({"ip": "1.2.3.4"}),
        ),
        V4,
        [sp(node_port=30080, load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),))],
        id="load balancer ingress IP defaults to ipMode VIP",
    ),
    pytest.param(
        service(
            type="LoadBalancer",
            status=lb_status(
                {"ip": "1.2.3.4", "ipMode": "VIP"},
                {"ip": "5.6.7.8", "ipMode": "Proxy"},
                {"hostname": "lb.example.com"},
                {"ip": "2001:db8::5"},
                {"ip": "1.2.3.4"},
            ),
        ),
        V4,
        [
            sp(
                load_balancer_ingress=(
                    LoadBalancerIngress("1.2.3.4", IPMode.VIP),
                    LoadBalancerIngress("5.6.7.8", IPMode.PROXY),
                )
            )
        ],
        id="load balancer keeps VIP and Proxy IPs, drops hostnames, other family, duplicates",
    ),
    pytest.param(
        service(
            type="LoadBalancer",
            clusterIPs=["10.96.0.10", "fd00::10"],
            status=lb_status({"ip": "1.2.3.4"}, {"ip": "2001:db8::5"}),
        ),
        V6,
        [
            sp(
                family=V6,
                cluster_ip="fd00::10",
                load_balancer_ingress=(LoadBalancerIngress("2001:db8::5"),),
            )
        ],
        id="IPv6 view of a dual-stack load balancer",
    ),
    pytest.param(
        service(type="NodePort", status=lb_status({"ip": "1.2.3.4"})),
        V4,
        [sp()],
        id="ingress IPs of a service that is not a LoadBalancer are ignored",
    ),
    pytest.param(
        service(
            type="LoadBalancer",
            loadBalancerSourceRanges=[" 203.0.113.0/25", "203.0.113.000/025", "10.0.0.1/8 "],
            status=lb_status({"ip": "1.2.3.4"}),
        ),
        V4,
        [
            sp(
                load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),),
                load_balancer_source_ranges=("203.0.113.0/25", "10.0.0.0/8"),
            )
        ],
        id="source ranges are trimmed, unpadded, masked and de-duplicated",
    ),
    pytest.param(
        service(
            type="LoadBalancer",
            loadBalancerSourceRanges=["2001:db8::/48", ""],
            status=lb_status({"ip": "1.2.3.4"}),
        ),
        V4,
        [sp(load_balancer_ingress=(LoadBalancerIngress("1.2.3.4"),))],
        id="source ranges all of the other family leave this family unfiltered",
    ),
    pytest.param(
        service(
            type="LoadBalancer",
            clusterIPs=["10.96.0.10", "fd00::10"],
            loadBalancerSourceRanges=["203.0.113.0/25", "2001:DB8:0::/48"],
        ),
        V6,
        [sp(family=V6, cluster_ip="fd00::10", load_balancer_source_ranges=("2001:db8::/48",))],
        id="IPv6 view keeps the IPv6 source ranges",
    ),
    pytest.param(
        service(type="NodePort", loadBalancerSourceRanges=["203.0.113.0/25"]),
        V4,
        [sp()],
        id="source ranges of a service that is not a LoadBalancer are ignored",
    ),
    pytest.param(
        service(externalIPs=["192.168.99.11", "192.168.099.011", "2001:db8::1", "", "  "]),
        V4,
        [sp(external_ips=("192.168.99.11",))],
        id="external IPs: other family dropped, duplicates and blanks skipped silently",
    ),
    pytest.param(
        service(clusterIPs=["10.96.0.10", "fd00::10"], externalIPs=["192.168.99.11", "::0001"]),
        V6,
        [sp(family=V6, cluster_ip="fd00::10", external_ips=("::1",))],
        id="IPv6 external IP is normalised",
    ),
    pytest.param(
        service(externalIPs=["::ffff:192.168.99.11"]),
        V4,
        [sp(external_ips=("192.168.99.11",))],
        id="IPv4-mapped IPv6 external IP is IPv4, as Go parses it",
    ),
    pytest.param(
        service(type="NodePort", externalTrafficPolicy="Local"),
        V4,
        [sp(external_traffic_policy=TrafficPolicy.LOCAL)],
        id="externalTrafficPolicy Local",
    ),
    pytest.param(
        service(type="NodePort", externalTrafficPolicy="Global"),
        V4,
        [sp()],
        id="legacy externalTrafficPolicy Global means Cluster",
    ),
    pytest.param(
        service(externalTrafficPolicy="Local"),
        V4,
        [sp(external_traffic_policy=TrafficPolicy.LOCAL)],
        id="externalTrafficPolicy is kept as given on a ClusterIP service",
    ),
    pytest.param(
        service(internalTrafficPolicy="Local"),
        V4,
        [sp(internal_traffic_policy=TrafficPolicy.LOCAL)],
        id="internalTrafficPolicy Local",
    ),
    pytest.param(
        service(sessionAffinity="ClientIP"),
        V4,
        [sp(session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=10800)],
        id="ClientIP affinity without a timeout gets 3 hours",
    ),
    pytest.param(
        service(
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        V4,
        [sp(session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=60)],
        id="ClientIP affinity with an explicit timeout",
    ),
    pytest.param(
        service(sessionAffinity="None", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}}),
        V4,
        [sp()],
        id="affinity None ignores the affinity config",
    ),
    pytest.param(
        service(type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=32000),
        V4,
        [sp(external_traffic_policy=TrafficPolicy.LOCAL, health_check_node_port=32000)],
        id="health check node port of a LoadBalancer with eTP Local",
    ),
    pytest.param(
        service(type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=0),
        V4,
        [sp(external_traffic_policy=TrafficPolicy.LOCAL)],
        id="health check node port 0 means none",
    ),
    pytest.param(
        service(type="LoadBalancer", healthCheckNodePort=32000),
        V4,
        [sp()],
        id="health check node port is not served with eTP Cluster",
    ),
    pytest.param(
        service(type="NodePort", externalTrafficPolicy="Local", healthCheckNodePort=32000),
        V4,
        [sp(external_traffic_policy=TrafficPolicy.LOCAL)],
        id="health check node port is not served for a NodePort service",
    ),
    pytest.param(
        service(trafficDistribution="PreferClose"),
        V4,
        [sp(traffic_distribution="PreferClose")],
        id="trafficDistribution is kept as given",
    ),
]


@pytest.mark.parametrize(("svc", "family", "expected"), VALID_SERVICES)
def test_valid_service(svc: dict[str, Any], family: IPFamily, expected: list[ServicePort]) -> None:
    ports, problems = service_ports(svc, family)
    assert problems == []
    assert ports == as_map(*expected)


NOTHING_PRODUCED = [
    pytest.param(service(clusterIP="None"), id="headless service"),
    pytest.param(service(clusterIP=None, clusterIPs=["None"]), id="headless by clusterIPs"),
    pytest.param(service(clusterIP=None), id="no cluster IP at all"),
    pytest.param(service(clusterIP="", clusterIPs=[]), id="empty cluster IP"),
    pytest.param(service(type="ExternalName", externalName="example.com"), id="ExternalName"),
    pytest.param(
        service(labels={SERVICE_PROXY_NAME_LABEL: "other-proxy"}), id="served by another proxy"
    ),
    pytest.param(service(labels={SERVICE_PROXY_NAME_LABEL: ""}), id="proxy-name label empty"),
    pytest.param(service(labels={HEADLESS_LABEL: ""}), id="headless label"),
    pytest.param(
        service(clusterIP="None", ports=[port("x", 0)]),
        id="headless service with invalid ports reports nothing",
    ),
]


@pytest.mark.parametrize("svc", NOTHING_PRODUCED)
@pytest.mark.parametrize("family", [V4, V6])
def test_service_that_produces_nothing(svc: dict[str, Any], family: IPFamily) -> None:
    assert service_ports(svc, family) == ({}, [])


# --- Services: invalid input --------------------------------------------------

LB_1234 = lb_status({"ip": "1.2.3.4"})
INGRESS_1234 = (LoadBalancerIngress("1.2.3.4"),)

BAD_SERVICES = [
    pytest.param(service(clusterIP="10.96.0.300"), ["spec.clusterIP"], [], id="invalid cluster IP"),
    pytest.param(
        service(clusterIP=10), ["spec.clusterIP"], [], id="cluster IP that is not a string"
    ),
    pytest.param(
        service(clusterIPs=["10.96.0.10", "fd00::zz"]),
        ["spec.clusterIPs[1]"],
        [sp()],
        id="invalid second cluster IP; the valid one still converts",
    ),
    pytest.param(
        service(clusterIPs=["fe80::1%eth0", "10.96.0.10"]),
        ["spec.clusterIPs[0]"],
        [sp()],
        id="cluster IP with an IPv6 zone is invalid",
    ),
    pytest.param(
        service(clusterIPs="10.96.0.10"),
        ["spec.clusterIPs"],
        [sp()],
        id="clusterIPs not a list falls back to clusterIP",
    ),
    pytest.param(
        service(ports=[port("zero", 0), HTTP]),
        ["spec.ports[0].port"],
        [sp()],
        id="port 0",
    ),
    pytest.param(
        service(ports=[HTTP, port("big", 70000)]),
        ["spec.ports[1].port"],
        [sp()],
        id="port 70000",
    ),
    pytest.param(
        service(ports=[port("str", "80"), HTTP]),
        ["spec.ports[0].port"],
        [sp()],
        id="port given as a string",
    ),
    pytest.param(
        service(ports=[port("bool", True), HTTP]),
        ["spec.ports[0].port"],
        [sp()],
        id="port given as a boolean",
    ),
    pytest.param(
        service(ports=[port("float", 80.0), HTTP]),
        ["spec.ports[0].port"],
        [sp()],
        id="port given as a float",
    ),
    pytest.param(
        service(ports=[{"name": "none"}, HTTP]),
        ["spec.ports[0].port"],
        [sp()],
        id="port missing",
    ),
    pytest.param(
        service(ports=[port("icmp", 7, protocol="ICMP"), HTTP]),
        ["spec.ports[0].protocol"],
        [sp()],
        id="unknown protocol",
    ),
    pytest.param(
        service(ports=[port("lower", 8, protocol="tcp"), HTTP]),
        ["spec.ports[0].protocol"],
        [sp()],
        id="protocol in lower case is unknown",
    ),
    pytest.param(
        service(ports=[port("list", 8, protocol=["TCP"]), HTTP]),
        ["spec.ports[0].protocol"],
        [sp()],
        id="protocol that is a list",
    ),
    pytest.param(
        service(ports=[{"name": 5, "port": 8}, HTTP]),
        ["spec.ports[0].name"],
        [sp()],
        id="port name that is not a string",
    ),
    pytest.param(
        service(ports=[HTTP, port("http", 81)]),
        ["spec.ports[1].name"],
        [sp()],
        id="duplicate port name and protocol; the first wins",
    ),
    pytest.param(
        service(ports=[port("zero", 0, protocol="ICMP"), HTTP]),
        ["spec.ports[0].protocol", "spec.ports[0].port"],
        [sp()],
        id="every invalid field of a port is reported",
    ),
    pytest.param(
        service(type="NodePort", ports=[port("http", 80, nodePort=70000), port("dns", 53)]),
        ["spec.ports[0].nodePort"],
        [sp(), sp("dns", 53)],
        id="node port out of range becomes no node port",
    ),
    pytest.param(
        service(type="NodePort", ports=[port("http", 80, nodePort="30080")]),
        ["spec.ports[0].nodePort"],
        [sp()],
        id="node port given as a string",
    ),
    pytest.param(
        service(ports=[port("http", 80, nodePort="junk")]),
        [],
        [sp()],
        id="node port of a ClusterIP service is not even looked at",
    ),
    pytest.param(service() | {"spec": "x"}, ["spec"], [], id="spec a string"),
    pytest.param(service() | {"spec": ["x"]}, ["spec"], [], id="spec a list"),
    pytest.param(service(ports={"http": 80}), ["spec.ports"], [], id="ports not a list"),
    pytest.param(
        service(ports=["http:80", HTTP]),
        ["spec.ports[0]"],
        [sp()],
        id="port entry that is a string",
    ),
    pytest.param(
        service(ports=[None, HTTP]), ["spec.ports[0]"], [sp()], id="port entry that is null"
    ),
    pytest.param(service(type="Magic"), ["spec.type"], [sp()], id="unknown type is ClusterIP"),
    pytest.param(
        service(externalIPs=["192.168.99.11", "192.168.99.300", 7]),
        ["spec.externalIPs[1]", "spec.externalIPs[2]"],
        [sp(external_ips=("192.168.99.11",))],
        id="invalid external IPs skipped, valid one kept",
    ),
    pytest.param(
        service(externalIPs="192.168.99.11"),
        ["spec.externalIPs"],
        [sp()],
        id="externalIPs not a list",
    ),
    pytest.param(
        service(
            type="LoadBalancer",
            loadBalancerSourceRanges=[
                "203.0.113.0/33",
                "203.0.113.0",
                "203.0.113.0/255.255.255.0",
                "nonsense",
                None,
                "10.0.0.0/1000",
                "10.0.0.0/8",
            ],
            status=LB_1234,
        ),
        [f"spec.loadBalancerSourceRanges[{i}]" for i in range(6)],
        [sp(load_balancer_ingress=INGRESS_1234, load_balancer_source_ranges=("10.0.0.0/8",))],
        id="malformed source ranges skipped, valid one kept",
    ),
    pytest.param(
        service(
            type="LoadBalancer",
            status=lb_status({"ip": "1.2.3.999"}, "1.2.3.5", {"ip": "1.2.3.4"}),
        ),
        ["status.loadBalancer.ingress[0].ip", "status.loadBalancer.ingress[1]"],
        [sp(load_balancer_ingress=INGRESS_1234)],
        id="invalid load balancer ingress entries skipped",
    ),
    pytest.param(
        service(type="LoadBalancer", status=lb_status({"ip": "1.2.3.4", "ipMode": "Tunnel"})),
        ["status.loadBalancer.ingress[0].ipMode"],
        [sp(load_balancer_ingress=INGRESS_1234)],
        id="unknown ipMode is VIP",
    ),
    pytest.param(
        service(type="LoadBalancer", status={"loadBalancer": []}),
        ["status.loadBalancer"],
        [sp()],
        id="status.loadBalancer not an object",
    ),
    pytest.param(
        service(type="NodePort", externalTrafficPolicy="Sideways"),
        ["spec.externalTrafficPolicy"],
        [sp()],
        id="unknown externalTrafficPolicy is Cluster",
    ),
    pytest.param(
        service(internalTrafficPolicy="Global"),
        ["spec.internalTrafficPolicy"],
        [sp()],
        id="Global is not an internalTrafficPolicy",
    ),
    pytest.param(
        service(sessionAffinity="Cookie"),
        ["spec.sessionAffinity"],
        [sp()],
        id="unknown session affinity is None",
    ),
    *[
        pytest.param(
            service(
                sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": timeout}},
            ),
            ["spec.sessionAffinityConfig.clientIP.timeoutSeconds"],
            [sp(session_affinity=SessionAffinity.CLIENT_IP, affinity_timeout=10800)],
            id=f"affinity timeout {timeout!r} is replaced by the default",
        )
        for timeout in (0, -1, 86401, "3600")
    ],
    pytest.param(
        service(sessionAffinity="ClientIP", sessionAffinityConfig="3600"),
        ["spec.sessionAffinityConfig"],
        [sp(session_affinity=SessionAffinity.CLIENT_IP)],
        id="affinity config not an object",
    ),
    pytest.param(
        service(type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=70000),
        ["spec.healthCheckNodePort"],
        [sp(external_traffic_policy=TrafficPolicy.LOCAL)],
        id="health check node port out of range",
    ),
    pytest.param(
        service(trafficDistribution=1),
        ["spec.trafficDistribution"],
        [sp()],
        id="trafficDistribution not a string",
    ),
]


@pytest.mark.parametrize(("svc", "expected_fields", "expected"), BAD_SERVICES)
def test_invalid_service_field(
    svc: dict[str, Any], expected_fields: list[str], expected: list[ServicePort]
) -> None:
    ports, problems = service_ports(svc, V4)
    assert fields(problems) == expected_fields
    assert all(p.kind == "Service" and p.obj == "ns/web" and p.message for p in problems)
    assert ports == as_map(*expected)


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        pytest.param(None, "metadata", id="no metadata"),
        pytest.param("ns/web", "metadata", id="metadata a string"),
        pytest.param({"namespace": "ns"}, "metadata.name", id="no name"),
        pytest.param({"namespace": "ns", "name": ""}, "metadata.name", id="empty name"),
        pytest.param({"name": "web"}, "metadata.namespace", id="no namespace"),
        pytest.param({"name": "web", "namespace": 3}, "metadata.name", id="namespace not a string"),
    ],
)
def test_service_with_unusable_metadata(metadata: Any, field: str) -> None:
    svc = service() | {"metadata": metadata}
    ports, problems = service_ports(svc, V4)
    assert ports == {}
    assert problems == [Problem("Service", "<unknown>", field, problems[0].message)]


def test_problem_message_names_the_value() -> None:
    _, problems = service_ports(service(ports=[port("big", 70000)]), V4)
    assert str(problems[0]) == "Service ns/web: spec.ports[0].port: 70000 is out of range 1..65535"


# --- EndpointSlices -----------------------------------------------------------


def E(ip: str, port: int = 8080, **fields: Any) -> Endpoint:
    return Endpoint(ip=ip, port=port, **fields)


CONDITIONS = [
    pytest.param(None, (True, True, False), id="no conditions: ready and serving"),
    pytest.param({}, (True, True, False), id="ready missing counts as ready"),
    pytest.param({"ready": False}, (False, False, False), id="serving defaults to ready"),
    pytest.param({"ready": True, "serving": True}, (True, True, False), id="ready and serving"),
    pytest.param(
        {"ready": False, "serving": True, "terminating": True},
        (False, True, True),
        id="serving and terminating",
    ),
    pytest.param(
        {"ready": False, "serving": False, "terminating": True},
        (False, False, True),
        id="terminating, not serving",
    ),
    pytest.param({"ready": None}, (True, True, False), id="null ready counts as missing"),
]


@pytest.mark.parametrize(("conditions", "expected"), CONDITIONS)
def test_endpoint_conditions(conditions: Any, expected: tuple[bool, bool, bool]) -> None:
    endpoint = ep("10.0.0.1") if conditions is None else ep("10.0.0.1", conditions=conditions)
    info, problems = slice_info(endpoint_slice(endpoint), NODE)
    assert problems == []
    (only,) = endpoints_of(info)
    assert (only.ready, only.serving, only.terminating) == expected


def test_condition_that_is_not_a_boolean_is_reported_and_defaulted() -> None:
    endpoint = ep("10.0.0.1", conditions={"ready": "yes", "terminating": 1})
    info, problems = slice_info(endpoint_slice(endpoint), NODE)
    assert fields(problems) == [
        "endpoints[0].conditions.ready",
        "endpoints[0].conditions.terminating",
    ]
    assert endpoints_of(info) == (E("10.0.0.1"),)


def test_hints_zone_and_locality() -> None:
    eps = endpoint_slice(
        ep(
            "10.0.0.1",
            nodeName=NODE,
            zone="zone-a",
            hints={
                "forZones": [{"name": "zone-a"}, {"name": "zone-b"}],
                "forNodes": [{"name": NODE}],
            },
        ),
        ep("10.0.0.2", nodeName="node-b", zone="zone-b"),
        ep("10.0.0.3"),
    )
    info, problems = slice_info(eps, NODE)
    assert problems == []
    assert endpoints_of(info) == (
        E(
            "10.0.0.1",
            node_name=NODE,
            zone="zone-a",
            zone_hints=frozenset({"zone-a", "zone-b"}),
            node_hints=frozenset({NODE}),
            is_local=True,
        ),
        E("10.0.0.2", node_name="node-b", zone="zone-b"),
        E("10.0.0.3"),
    )


def test_no_endpoint_is_local_when_the_node_name_is_unknown() -> None:
    info, _ = slice_info(endpoint_slice(ep("10.0.0.1", nodeName="")), "")
    assert endpoints_of(info) == (E("10.0.0.1"),)


def test_invalid_hints_are_reported_and_skipped() -> None:
    eps = endpoint_slice(
        ep("10.0.0.1", hints={"forZones": [{"name": "zone-a"}, "zone-b", {}], "forNodes": "x"})
    )
    info, problems = slice_info(eps, NODE)
    assert fields(problems) == [
        "endpoints[0].hints.forZones[1]",
        "endpoints[0].hints.forZones[2]",
        "endpoints[0].hints.forNodes",
    ]
    assert endpoints_of(info) == (E("10.0.0.1", zone_hints=frozenset({"zone-a"})),)


_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-1, 2), st.text(max_size=3),
    st.lists(st.none(), max_size=1),
)
_IPS = st.one_of(
    st.sampled_from(["10.0.0.1", "10.244.3.25", "0.0.0.0", "255.255.255.255", "192.168.1.10"]),
    st.sampled_from(["010.0.0.1", "10.0.0.01", "256.1.1.1", "10.0.0", "10.0.0.1.2", "1e.0.0.1"]),
    st.sampled_from(["fd00::1", "::ffff:10.0.0.1", "10.0.0.1%eth0", " 10.0.0.1"]),
    st.just("\u0661\u0660.0.0.1"),  # Arabic-Indic digits: str.isdigit() says yes
    _ANY_VALUE,
)
_ENTRIES = st.fixed_dictionaries(
    {},
    optional={
        "addresses": st.one_of(st.lists(_IPS, max_size=2), _ANY_VALUE),
        "conditions": st.one_of(
            st.fixed_dictionaries(
                {}, optional={k: _ANY_VALUE for k in ("ready", "serving", "terminating")}
            ),
            _ANY_VALUE,
        ),
        "nodeName": st.one_of(st.sampled_from([NODE, "node-b", ""]), _ANY_VALUE),
        "zone": st.one_of(st.sampled_from(["zone-a", ""]), _ANY_VALUE),
        "hints": st.one_of(st.none(), st.just({"forZones": [{"name": "zone-a"}]}), _ANY_VALUE),
    },
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(entry=st.one_of(_ENTRIES, _ANY_VALUE), family=st.sampled_from([V4, V6]))
def test_the_plain_reading_of_an_endpoint_is_the_full_one(entry: Any, family: IPFamily) -> None:
    """The initial list's fast reading (`_plain_endpoint`) gives what the
    full one gives without a problem, or leaves the entry to it."""
    plain = _plain_endpoint(entry, family, NODE)
    report = Report("EndpointSlice", "ns/web-abc")
    full = _slice_endpoint(entry, "endpoints[0]", family, NODE, report)
    if plain is not None:
        assert (plain, report.problems) == (full, [])


def test_the_plain_reading_takes_the_common_entries() -> None:
    """Entries as the API serves them take the fast reading: with or without
    conditions, node and zone."""
    entries = [
        {"addresses": ["10.244.1.7"]},
        {"addresses": ["10.244.1.7"], "conditions": {"ready": True}, "nodeName": NODE},
        {"addresses": ["10.244.1.7"], "conditions": {"ready": False, "serving": True,
                                                     "terminating": True},
         "nodeName": "node-b", "zone": "zone-a"},
    ]
    for entry in entries:
        assert _plain_endpoint(entry, V4, NODE) is not None, entry
    local = _plain_endpoint(entries[1], V4, NODE)
    assert local == E("10.244.1.7", port=0, is_local=True, node_name=NODE)


def test_slice_identity_and_family() -> None:
    info, problems = slice_info(endpoint_slice(ep("10.0.0.1")), NODE)
    assert problems == []
    assert info == EndpointSliceInfo(
        service=NamespacedName("ns", "web"),
        slice_name="web-abc",
        family=V4,
        ports={HTTP_NAME: (E("10.0.0.1"),)},
    )


def test_ipv6_slice_normalises_addresses() -> None:
    info, problems = slice_info(
        endpoint_slice(ep("fd00:10::0001"), ep("FD00:10::2"), address_type="IPv6"), NODE
    )
    assert problems == []
    assert info is not None and info.family is V6
    assert endpoints_of(info) == (E("fd00:10::1"), E("fd00:10::2"))


IGNORED_SLICES = [
    pytest.param(endpoint_slice(ep("example.com"), address_type="FQDN"), id="FQDN slice"),
    pytest.param(endpoint_slice(ep("10.0.0.1"), service_label=None), id="no service-name label"),
    pytest.param(endpoint_slice(ep("10.0.0.1"), service_label=""), id="empty service-name label"),
    pytest.param(endpoint_slice(ep("10.0.0.1"), service_label=7), id="label not a string"),
]


@pytest.mark.parametrize("eps", IGNORED_SLICES)
def test_slice_ignored_silently(eps: dict[str, Any]) -> None:
    assert slice_info(eps, NODE) == (None, [])


@pytest.mark.parametrize(
    ("eps", "field"),
    [
        pytest.param(endpoint_slice(ep("10.0.0.1"), address_type="IPv5"), "addressType", id="IPv5"),
        pytest.param(
            endpoint_slice(ep("10.0.0.1"), address_type=None), "addressType", id="no addressType"
        ),
        pytest.param(
            endpoint_slice(ep("10.0.0.1"))
            | {"metadata": {"name": "web-abc", "labels": {SERVICE_NAME_LABEL: "web"}}},
            "metadata.namespace",
            id="no namespace",
        ),
    ],
)
def test_unusable_slice_is_reported(eps: dict[str, Any], field: str) -> None:
    info, problems = slice_info(eps, NODE)
    assert info is None
    assert fields(problems) == [field]


BAD_ENDPOINTS = [
    pytest.param(ep("10.0.0.256"), "endpoints[1].addresses[0]", id="invalid IPv4 address"),
    pytest.param(ep("fd00::1"), "endpoints[1].addresses[0]", id="IPv6 address in IPv4 slice"),
    pytest.param(ep(None), "endpoints[1].addresses[0]", id="null address"),
    pytest.param({"addresses": []}, "endpoints[1].addresses[0]", id="no address"),
    pytest.param({"addresses": "10.0.0.9"}, "endpoints[1].addresses", id="addresses not a list"),
    pytest.param("10.0.0.9", "endpoints[1]", id="endpoint that is a string"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_ENDPOINTS)
def test_invalid_endpoint_is_skipped(bad: Any, field: str) -> None:
    info, problems = slice_info(endpoint_slice(ep("10.0.0.1"), bad, ep("10.0.0.2")), NODE)
    assert field in fields(problems)
    assert all(p.kind == "EndpointSlice" and p.obj == "ns/web-abc" for p in problems)
    assert endpoints_of(info) == (E("10.0.0.1"), E("10.0.0.2"))


def test_endpoint_only_the_first_address_counts() -> None:
    info, _ = slice_info(endpoint_slice({"addresses": ["10.0.0.1", "bogus"]}), NODE)
    assert endpoints_of(info) == (E("10.0.0.1"),)


def test_duplicate_endpoints_are_merged_and_a_local_duplicate_wins() -> None:
    eps = endpoint_slice(
        ep("10.0.0.1", nodeName="node-b"),
        ep("10.0.0.1", nodeName=NODE),
        ep("10.0.0.1", nodeName="node-c"),
        ep("10.0.0.2", zone="first"),
        ep("10.0.0.2", zone="second"),
    )
    info, problems = slice_info(eps, NODE)
    assert problems == []
    assert endpoints_of(info) == (
        E("10.0.0.1", node_name=NODE, is_local=True),
        E("10.0.0.2", zone="first"),
    )


def test_endpoints_are_sorted() -> None:
    info, _ = slice_info(endpoint_slice(ep("10.0.0.3"), ep("10.0.0.1"), ep("10.0.0.2")), NODE)
    assert [e.ip for e in endpoints_of(info)] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def test_every_port_gets_every_endpoint() -> None:
    eps = endpoint_slice(
        ep("10.0.0.1"),
        ep("10.0.0.2"),
        ports=[
            {"name": "http", "port": 8080, "protocol": "TCP"},
            {"name": "dns", "port": 5353, "protocol": "UDP"},
        ],
    )
    info, problems = slice_info(eps, NODE)
    assert problems == []
    assert info is not None
    assert info.ports == {
        HTTP_NAME: (E("10.0.0.1"), E("10.0.0.2")),
        ServicePortName("ns", "web", "dns", UDP): (E("10.0.0.1", 5353), E("10.0.0.2", 5353)),
    }


def test_slice_port_defaults_to_unnamed_tcp() -> None:
    info, problems = slice_info(endpoint_slice(ep("10.0.0.1"), ports=[{"port": 8080}]), NODE)
    assert problems == []
    assert info is not None
    assert info.ports == {ServicePortName("ns", "web", "", TCP): (E("10.0.0.1"),)}


BAD_SLICE_PORTS = [
    pytest.param({"name": "nil", "port": None}, "ports[0].port", id="nil port"),
    pytest.param({"name": "none"}, "ports[0].port", id="port missing"),
    pytest.param({"name": "zero", "port": 0}, "ports[0].port", id="port 0"),
    pytest.param({"name": "big", "port": 65536}, "ports[0].port", id="port 65536"),
    pytest.param({"name": "str", "port": "80"}, "ports[0].port", id="port a string"),
    pytest.param({"name": "x", "port": 1, "protocol": "ICMP"}, "ports[0].protocol", id="ICMP"),
    pytest.param({"name": 1, "port": 1}, "ports[0].name", id="name not a string"),
    pytest.param("http", "ports[0]", id="port entry that is a string"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_SLICE_PORTS)
def test_invalid_slice_port_is_skipped(bad: Any, field: str) -> None:
    eps = endpoint_slice(ep("10.0.0.1"), ports=[bad, {"name": "http", "port": 8080}])
    info, problems = slice_info(eps, NODE)
    assert fields(problems) == [field]
    assert info is not None
    assert info.ports == {HTTP_NAME: (E("10.0.0.1"),)}


def test_slice_without_valid_endpoints_maps_its_ports_to_nothing() -> None:
    info, problems = slice_info(endpoint_slice(endpoints="x"), NODE)
    assert fields(problems) == ["endpoints"]
    assert info is not None
    assert info.ports == {HTTP_NAME: ()}


TRIGGER_TIMES = [
    pytest.param("2024-01-02T03:04:05Z", 1704164645.0, id="UTC"),
    pytest.param("2024-01-02T03:04:05.25Z", 1704164645.25, id="fractional seconds"),
    pytest.param("2024-01-02T03:04:05.123456789Z", 1704164645.123456, id="nanoseconds"),
    pytest.param("2024-01-02T04:04:05+01:00", 1704164645.0, id="offset"),
]


@pytest.mark.parametrize(("text", "expected"), TRIGGER_TIMES)
def test_trigger_time(text: str, expected: float) -> None:
    info, problems = slice_info(endpoint_slice(ep("10.0.0.1"), annotations={TRIGGER: text}), NODE)
    assert problems == []
    assert info is not None and info.trigger_time == pytest.approx(expected)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("yesterday", id="words"),
        pytest.param("2024-01-02", id="date only"),
        pytest.param("2024-01-02T03:04:05", id="no time zone"),
        pytest.param("2024-13-02T03:04:05Z", id="month 13"),
        pytest.param("2024-01-02 03:04:05Z", id="space separator"),
        pytest.param(1704164645, id="a number"),
    ],
)
def test_malformed_trigger_time(text: Any) -> None:
    info, problems = slice_info(endpoint_slice(ep("10.0.0.1"), annotations={TRIGGER: text}), NODE)
    assert fields(problems) == [f"metadata.annotations[{TRIGGER}]"]
    assert info is not None and info.trigger_time is None
    assert endpoints_of(info) == (E("10.0.0.1"),)


def test_no_trigger_time() -> None:
    info, problems = slice_info(endpoint_slice(ep("10.0.0.1"), annotations={}), NODE)
    assert problems == [] and info is not None and info.trigger_time is None


# --- Nodes --------------------------------------------------------------------


def node(**fields: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": NODE}, "spec": {}, "status": {}}
    for key, value in fields.items():
        section, _, name = key.partition("__")
        obj[section][name] = value
    return obj


def test_node_addresses_internal_first_then_external() -> None:
    addresses = [
        {"type": "Hostname", "address": "node-a"},
        {"type": "ExternalIP", "address": "203.0.113.5"},
        {"type": "InternalIP", "address": "192.168.0.2"},
        {"type": "InternalIP", "address": "fd00::0002"},
        {"type": "ExternalIP", "address": "192.168.0.2"},
        {"type": "InternalIP", "address": "192.168.0.3"},
        {"type": "ExternalIP", "address": "2001:db8::5"},
    ]
    info, problems = node_info(node(status__addresses=addresses))
    assert problems == []
    assert info is not None
    assert info.ipv4 == ("192.168.0.2", "192.168.0.3", "203.0.113.5")
    assert info.ipv6 == ("fd00::2", "2001:db8::5")
    assert info.primary_ip(V4) == "192.168.0.2"


def test_node_invalid_addresses_are_reported() -> None:
    addresses = [
        {"type": "InternalIP", "address": "192.168.0.300"},
        "192.168.0.4",
        {"type": "InternalIP", "address": "192.168.0.2"},
    ]
    info, problems = node_info(node(status__addresses=addresses))
    assert fields(problems) == ["status.addresses[0].address", "status.addresses[1]"]
    assert all(p.kind == "Node" and p.obj == NODE for p in problems)
    assert info is not None and info.ipv4 == ("192.168.0.2",)


def test_node_labels_zone_and_pod_cidrs() -> None:
    obj = node(spec__podCIDRs=["10.244.1.0/24", "fd00:10:244:1::/64"])
    obj["metadata"]["labels"] = {
        "topology.kubernetes.io/zone": "zone-a",
        "kubernetes.io/hostname": NODE,
    }
    info, problems = node_info(obj)
    assert problems == []
    assert info == NodeInfo(
        name=NODE,
        labels=(("kubernetes.io/hostname", NODE), ("topology.kubernetes.io/zone", "zone-a")),
        pod_cidrs=("10.244.1.0/24", "fd00:10:244:1::/64"),
    )
    assert info.zone == "zone-a"


def test_node_single_pod_cidr_and_invalid_entries() -> None:
    info, problems = node_info(node(spec__podCIDR="10.244.1.7/24"))
    assert problems == [] and info is not None and info.pod_cidrs == ("10.244.1.0/24",)
    info, problems = node_info(node(spec__podCIDRs=["10.244.1.0/33", "10.244.2.0/24"]))
    assert fields(problems) == ["spec.podCIDRs[0]"]
    assert info is not None and info.pod_cidrs == ("10.244.2.0/24",)
    info, problems = node_info(node(spec__podCIDR="10.244.1.0"))
    assert fields(problems) == ["spec.podCIDR"]
    assert info is not None and info.pod_cidrs == ()


def test_node_label_that_is_not_a_string_is_skipped() -> None:
    obj = node()
    obj["metadata"]["labels"] = {"a": "1", "b": 2}
    info, problems = node_info(obj)
    assert fields(problems) == ["metadata.labels['b']"]
    assert info is not None and info.labels == (("a", "1"),)


@pytest.mark.parametrize(
    ("obj", "deleting", "to_be_deleted"),
    [
        pytest.param(node(), False, False, id="healthy node"),
        pytest.param(
            node(metadata__deletionTimestamp="2024-01-02T03:04:05Z"), True, False, id="deleting"
        ),
        pytest.param(
            node(spec__taints=[{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]),
            False,
            True,
            id="autoscaler taint",
        ),
        pytest.param(
            node(spec__taints=[{"key": "node.kubernetes.io/unreachable"}, "junk"]),
            False,
            False,
            id="other taints",
        ),
    ],
)
def test_node_deletion(obj: dict[str, Any], deleting: bool, to_be_deleted: bool) -> None:
    info, _ = node_info(obj)
    assert info is not None
    assert (info.deleting, info.to_be_deleted) == (deleting, to_be_deleted)


def test_node_without_name() -> None:
    info, problems = node_info({"metadata": {}})
    assert info is None
    assert problems == [Problem("Node", "<unknown>", "metadata.name", problems[0].message)]


# --- ServiceCIDRs and names ---------------------------------------------------


def test_service_cidrs() -> None:
    obj = {
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": ["10.96.0.1/12", "fd00:0:0::/108", "10.96.0.0/40", "", 5]},
    }
    cidrs, problems = service_cidrs(obj)
    assert cidrs == ("10.96.0.0/12", "fd00::/108")
    assert fields(problems) == ["spec.cidrs[2]", "spec.cidrs[4]"]
    assert all(p.kind == "ServiceCIDR" and p.obj == "kubernetes" for p in problems)


def test_service_cidrs_not_a_list() -> None:
    assert service_cidrs({"spec": {"cidrs": "10.96.0.0/12"}}) == (
        (),
        [Problem("ServiceCIDR", "<unknown>", "spec.cidrs", "expected a list, got '10.96.0.0/12'")],
    )


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param(
            {"metadata": {"namespace": "ns", "name": "web"}},
            NamespacedName("ns", "web"),
            id="namespaced",
        ),
        pytest.param({"metadata": {"name": "n1"}}, NamespacedName("", "n1"), id="cluster-scoped"),
        pytest.param({"metadata": {"namespace": "ns"}}, None, id="no name"),
        pytest.param({"metadata": {"namespace": "ns", "name": ""}}, None, id="empty name"),
        pytest.param({"metadata": {"namespace": 1, "name": "web"}}, None, id="bad namespace"),
        pytest.param({"metadata": []}, None, id="metadata a list"),
        pytest.param({}, None, id="no metadata"),
        pytest.param(None, None, id="not even an object"),
    ],
)
def test_service_name(obj: Any, expected: NamespacedName | None) -> None:
    assert service_name(obj) == expected


# --- nothing raises -----------------------------------------------------------

INTERESTING_STRINGS = [
    "",
    "None",
    "10.96.0.10",
    "fd00::10",
    "010.001.002.003",
    "203.0.113.000/025",
    "10.0.0.0/8",
    "::ffff:1.2.3.4",
    "fe80::1%eth0",
    "TCP",
    "UDP",
    "SCTP",
    "ClusterIP",
    "NodePort",
    "LoadBalancer",
    "ExternalName",
    "Local",
    "Cluster",
    "ClientIP",
    "IPv4",
    "IPv6",
    "FQDN",
    "Proxy",
    "VIP",
    "InternalIP",
    "2024-01-02T03:04:05Z",
    NODE,
]
KEYS = [
    "metadata",
    "spec",
    "status",
    "name",
    "namespace",
    "labels",
    "annotations",
    "ports",
    "port",
    "protocol",
    "nodePort",
    "clusterIP",
    "clusterIPs",
    "endpoints",
    "addresses",
    "conditions",
    "addressType",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(INTERESTING_STRINGS)
)
json_like = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything at all."""
    return strategy | json_like


def shaped(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict with any subset of these keys, each plausible or arbitrary."""
    return st.fixed_dictionaries({}, optional={k: maybe(v) for k, v in fields.items()})


ips = st.sampled_from(["10.96.0.10", "fd00::10", "1.2.3.4", "2001:db8::5", "None", "x", ""])
cidrs = st.sampled_from(["203.0.113.0/25", " 10.0.0.0/8", "2001:db8::/48", "bad", "1.2.3.4"])
numbers = st.integers(min_value=-1, max_value=70000)
metadata = st.fixed_dictionaries(
    {"namespace": st.just("ns"), "name": st.just("web")},
    optional={
        "labels": maybe(
            st.dictionaries(st.sampled_from([SERVICE_NAME_LABEL, HEADLESS_LABEL]), st.just("web"))
        ),
        "annotations": maybe(st.fixed_dictionaries({TRIGGER: maybe(st.just("2024"))})),
    },
)
services = st.fixed_dictionaries(
    {"metadata": maybe(metadata)},
    optional={
        "spec": maybe(
            shaped(
                type=st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]),
                clusterIP=ips,
                clusterIPs=st.lists(ips, max_size=3),
                ports=st.lists(
                    shaped(name=st.text(max_size=3), port=numbers, nodePort=numbers), max_size=3
                ),
                externalIPs=st.lists(ips, max_size=3),
                loadBalancerSourceRanges=st.lists(cidrs, max_size=3),
                externalTrafficPolicy=st.sampled_from(["Local", "Cluster", "Global"]),
                sessionAffinity=st.just("ClientIP"),
                sessionAffinityConfig=shaped(clientIP=shaped(timeoutSeconds=numbers)),
                healthCheckNodePort=numbers,
            )
        ),
        "status": maybe(
            shaped(
                loadBalancer=shaped(
                    ingress=st.lists(shaped(ip=ips, ipMode=st.just("Proxy")), max_size=3)
                )
            )
        ),
    },
)
slices = st.fixed_dictionaries(
    {"metadata": maybe(metadata)},
    optional={
        "addressType": maybe(st.sampled_from(["IPv4", "IPv6", "FQDN"])),
        "ports": st.lists(shaped(name=st.text(max_size=3), port=numbers), max_size=3),
        "endpoints": st.lists(
            shaped(
                addresses=st.lists(ips, max_size=2),
                conditions=shaped(ready=st.booleans(), serving=st.booleans()),
                nodeName=st.just(NODE),
                hints=shaped(forZones=st.lists(shaped(name=st.text(max_size=3)))),
            ),
            max_size=4,
        ),
    },
)


def assert_clean(problems: list[Problem]) -> None:
    assert isinstance(problems, list)
    for problem in problems:
        assert isinstance(problem, Problem)
        assert all(isinstance(v, str) for v in (problem.kind, problem.obj, problem.field))
        assert not problem.message.startswith("internal error"), problem


def check_service_ports(obj: Any) -> None:
    for family in IPFamily:
        ports, problems = service_ports(obj, family)
        assert_clean(problems)
        assert isinstance(ports, dict)
        for key, value in ports.items():
            assert isinstance(value, ServicePort) and value.name == key
            assert value.family is family and 1 <= value.port <= 65535
            assert 0 <= value.node_port <= 65535
            addresses = (value.cluster_ip, *value.external_ips)
            addresses += tuple(i.ip for i in value.load_balancer_ingress)
            assert all((":" in a) == (family is V6) for a in addresses)
            assert all((":" in r) == (family is V6) for r in value.load_balancer_source_ranges)


def check_slice_info(obj: Any) -> None:
    info, problems = slice_info(obj, NODE)
    assert_clean(problems)
    if info is None:
        return
    assert isinstance(info, EndpointSliceInfo)
    for key, endpoints in info.ports.items():
        assert isinstance(key, ServicePortName) and isinstance(endpoints, tuple)
        assert list(endpoints) == sorted(endpoints)
        assert len({e.address for e in endpoints}) == len(endpoints)
        assert all((":" in e.ip) == (info.family is V6) for e in endpoints)


def check_everything(obj: Any) -> None:
    check_service_ports(obj)
    check_slice_info(obj)
    info, problems = node_info(obj)
    assert_clean(problems)
    assert info is None or isinstance(info, NodeInfo)
    cidrs_found, problems = service_cidrs(obj)
    assert_clean(problems)
    assert isinstance(cidrs_found, tuple) and all(isinstance(c, str) for c in cidrs_found)
    name = service_name(obj)
    assert name is None or isinstance(name, NamespacedName)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(json_like)
def test_arbitrary_json_never_raises(obj: Any) -> None:
    check_everything(obj)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(services)
def test_service_shaped_input_never_raises(obj: dict[str, Any]) -> None:
    check_everything(obj)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(slices)
def test_slice_shaped_input_never_raises(obj: dict[str, Any]) -> None:
    check_everything(obj)


class _Hostile(Mapping[str, Any]):
    """A Mapping whose every lookup fails, standing in for a bug-shaped input."""

    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("boom")

    def __iter__(self) -> Any:
        raise RuntimeError("boom")

    def __len__(self) -> int:
        return 1


def test_even_a_failing_mapping_does_not_raise() -> None:
    assert service_ports(_Hostile(), V4)[0] == {}
    assert slice_info(_Hostile(), NODE)[0] is None
    assert node_info(_Hostile())[0] is None
    assert service_cidrs(_Hostile())[0] == ()
    assert service_name(_Hostile()) is None
