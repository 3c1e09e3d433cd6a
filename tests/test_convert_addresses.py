"""convert/fields.py: addresses parsed as kube-proxy parses them, and the
fast dotted-quad path agreeing with ipaddress's parser on every input; and
model.Endpoint.at_port agreeing with dataclasses.replace."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nftproxy.core.convert import fields
from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    IPMode,
    L4Protocol,
    LoadBalancerIngress,
    ServicePort,
    ServicePortName,
    SessionAffinity,
    TrafficPolicy,
)


def slow_parse(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """What parse_ip did before its fast path: unpad, then ipaddress."""
    if "%" in value:
        return None
    try:
        addr = ipaddress.ip_address(fields._unpad_ipv4(value))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("203.0.113.000", "203.0.113.0"),  # Go's ParseIPSloppy: decimal, leading zeros dropped
        ("010.001.002.003", "10.1.2.3"),
        ("0255.1.1.1", "255.1.1.1"),  # four digits: not the fast path, same answer
        ("256.1.1.1", None),
        ("1.2.3", None),
        ("1.2.3.4.5", None),
        ("1..3.4", None),
        ("1.2.3.4 ", None),
        ("+1.2.3.4", None),
        ("\u0661.2.3.4", None),  # an Arabic-Indic digit one
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("fd00::1", "fd00::1"),
        ("fe80::1%eth0", None),
    ],
)
def test_addresses_parse_as_kube_proxy_parses_them(text: str, parsed: str | None) -> None:
    got = fields.parse_ip(text)
    assert (str(got) if got is not None else None) == parsed


octet = st.one_of(
    st.integers(0, 999).map(str),
    st.integers(0, 255).map(lambda n: f"{n:03}"),
    st.text(alphabet="0123456789 +-x", min_size=0, max_size=4),
)


@given(st.lists(octet, min_size=3, max_size=5).map(".".join))
def test_the_fast_path_agrees_with_ipaddress(text: str) -> None:
    assert fields.parse_ip(text) == slow_parse(text)


def test_at_port_is_replace_for_every_field() -> None:
    endpoint = Endpoint(
        "10.1.2.3", 0, ready=False, serving=True, terminating=True, node_name="n",
        zone="z", zone_hints=frozenset({"z"}), node_hints=frozenset({"n"}), is_local=True,
    )
    assert endpoint.at_port(8080) == dataclasses.replace(endpoint, port=8080)
    # a field added to Endpoint must be added to at_port too
    assert [f.name for f in dataclasses.fields(Endpoint)] == [
        "ip", "port", "ready", "serving", "terminating", "node_name", "zone",
        "zone_hints", "node_hints", "is_local",
    ]


def test_service_port_at_port_is_replace_for_every_field() -> None:
    template = ServicePort(
        ServicePortName("", "", "", L4Protocol.TCP), IPFamily.IPV6, "fd00::1", 0,
        L4Protocol.TCP, 0, ("fd00::2",), (LoadBalancerIngress("fd00::3", IPMode.PROXY),),
        ("fd00::/8",), TrafficPolicy.LOCAL, TrafficPolicy.LOCAL, SessionAffinity.CLIENT_IP,
        77, 30001, "PreferClose",
    )  # fmt: skip
    name = ServicePortName("ns", "web", "http", L4Protocol.UDP)
    assert template.at_port(name, 53, L4Protocol.UDP, 30053) == dataclasses.replace(
        template, name=name, port=53, protocol=L4Protocol.UDP, node_port=30053
    )
    # a field added to ServicePort must be added to at_port too
    assert len(dataclasses.fields(ServicePort)) == 15
