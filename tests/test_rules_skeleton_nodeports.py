"""Which addresses accept node ports (nftproxy.core.rules.skeleton):
nodePortAddresses -- all local addresses, "primary", CIDR lists, loopback
never served; selecting from the host's interface addresses when they were
read, else from the Node's. test_rules_skeleton.py pins the rest of the
skeleton.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from skeleton_golden import FIB_DADDR_LOCAL, NOT_LOOPBACK_V4, NOT_LOOPBACK_V6, goto, in_set
from test_rules_skeleton import DEFAULT, NODE, V4, V6, chain_rules, sets

from nftproxy.core.model import HostAddresses, IPFamily, NodeInfo
from nftproxy.core.rules.fragment import Fragment
from nftproxy.core.rules.skeleton import nodeport_ips, render_skeleton

# --- nodePortAddresses -----------------------------------------------------------


def _nodeport_match(fragment: Fragment) -> list[dict[str, Any]]:
    """The destination matches before `goto KUBE-NODEPORTS` (KUBE-SERVICES) --
    the same ones must guard the no-endpoint-nodeports check."""
    services = chain_rules(fragment, "KUBE-SERVICES")[-1][0]
    external = chain_rules(fragment, "KUBE-EXTERNAL-SERVICES")[1][0]
    assert services[-1] == goto("KUBE-NODEPORTS")
    assert external[:-1] == services[:-1]
    return services[:-1]


@pytest.mark.parametrize(
    "addresses",
    [
        pytest.param((), id="empty nodePortAddresses"),
        pytest.param(("0.0.0.0/0",), id="0.0.0.0/0"),
        pytest.param(("10.0.0.0/8", "0.0.0.0/0"), id="a /0 among other CIDRs"),
    ],
)
def test_node_ports_on_every_local_non_loopback_address(addresses: tuple[str, ...]) -> None:
    fragment = render_skeleton(V4, replace(DEFAULT, nodeport_addresses=addresses), NODE)
    assert _nodeport_match(fragment) == [FIB_DADDR_LOCAL, NOT_LOOPBACK_V4]
    assert sets(fragment)["nodeport-ips"].elements == ()


def test_node_ports_on_every_local_ipv6_address_exclude_ipv6_loopback() -> None:
    config = replace(DEFAULT, nodeport_addresses=("::/0",))
    fragment = render_skeleton(V6, config, NODE)
    assert _nodeport_match(fragment) == [FIB_DADDR_LOCAL, NOT_LOOPBACK_V6]


@pytest.mark.parametrize(
    ("family", "ip", "expected"),
    [
        pytest.param(V4, "ip", ("192.168.0.2",), id="IPv4 primary"),
        pytest.param(V6, "ip6", ("fd00:192::2",), id="IPv6 primary"),
    ],
)
def test_primary_serves_node_ports_on_the_primary_ip_only(
    family: IPFamily, ip: str, expected: tuple[str, ...]
) -> None:
    fragment = render_skeleton(family, replace(DEFAULT, nodeport_addresses=("primary",)), NODE)
    assert _nodeport_match(fragment) == [in_set(ip, "nodeport-ips")]
    assert sets(fragment)["nodeport-ips"].elements == expected


NODE_MANY = NodeInfo(
    "node-a",
    ipv4=("192.168.0.2", "10.1.2.3", "172.16.0.1", "127.0.0.1"),
    ipv6=("fd00:192::2", "2001:db8::5", "::1"),
)


@pytest.mark.parametrize(
    ("family", "addresses", "expected"),
    [
        pytest.param(V4, ("10.0.0.0/8",), ("10.1.2.3",), id="one CIDR picks the node IP inside it"),
        pytest.param(V4, ("172.16.0.0/12", "192.168.0.0/16"), ("192.168.0.2", "172.16.0.1"),
                     id="several CIDRs keep the node's address order"),
        pytest.param(V4, ("127.0.0.0/8", "10.0.0.0/8"), ("10.1.2.3",),
                     id="loopback in the list is never served"),
        pytest.param(V4, ("203.0.113.0/24",), (), id="a CIDR matching no node IP serves nothing"),
        pytest.param(V6, ("2001:db8::/32", "::1/128"), ("2001:db8::5",),
                     id="IPv6 CIDRs, loopback never served"),
    ],
)
def test_cidr_lists_select_node_ips(
    family: IPFamily, addresses: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    config = replace(DEFAULT, nodeport_addresses=addresses)
    fragment = render_skeleton(family, config, NODE_MANY)
    assert sets(fragment)["nodeport-ips"].elements == expected
    assert nodeport_ips(family, config, NODE_MANY) == expected
    assert _nodeport_match(fragment) == [in_set(family.nft_family, "nodeport-ips")]


def test_primary_never_serves_a_loopback_primary() -> None:
    node = NodeInfo("node-a", ipv4=("127.0.0.1", "192.168.0.2"))
    config = replace(DEFAULT, nodeport_addresses=("primary",))
    assert nodeport_ips(V4, config, node) == ()


def test_family_without_any_listed_cidr_serves_node_ports_on_every_address() -> None:
    config = replace(DEFAULT, nodeport_addresses=("192.168.0.0/16",))
    fragment = render_skeleton(V6, config, NODE)
    assert _nodeport_match(fragment) == [FIB_DADDR_LOCAL, NOT_LOOPBACK_V6]


# Host interface addresses: a secondary address the Node object does not list,
# a Node address on no interface (192.168.0.2 is the Node's primary), loopback.
HOST = HostAddresses(
    ipv4=("10.1.2.3", "10.9.9.9", "127.0.0.1", "172.16.0.1"),
    ipv6=("::1", "2001:db8::5", "2001:db8::7", "fd00:192::2"),
)
NODE_ON_HOST = replace(NODE_MANY, host_addresses=HOST)


@pytest.mark.parametrize(
    ("family", "addresses", "expected"),
    [
        pytest.param(V4, ("10.0.0.0/8",), ("10.1.2.3", "10.9.9.9"),
                     id="a CIDR selects the host's addresses, secondaries too"),
        pytest.param(V4, ("192.168.0.0/16",), (),
                     id="a Node address on no interface is not served"),
        pytest.param(V4, ("127.0.0.0/8", "172.16.0.0/12"), ("172.16.0.1",),
                     id="a loopback interface address is never served"),
        pytest.param(V6, ("2001:db8::/32",), ("2001:db8::5", "2001:db8::7"),
                     id="IPv6 CIDRs select the host's IPv6 addresses"),
        pytest.param(V6, ("primary",), ("fd00:192::2",),
                     id="primary: the Node's primary IP, found on an interface"),
        pytest.param(V4, ("primary",), (),
                     id="primary: not served when on no interface (as kube-proxy)"),
        pytest.param(V4, ("primary", "172.16.0.0/12"), ("172.16.0.1",),
                     id="primary with CIDRs"),
    ],
)
def test_cidrs_select_the_host_interface_addresses_when_read(
    family: IPFamily, addresses: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    config = replace(DEFAULT, nodeport_addresses=addresses)
    fragment = render_skeleton(family, config, NODE_ON_HOST)
    assert sets(fragment)["nodeport-ips"].elements == expected
    assert _nodeport_match(fragment) == [in_set(family.nft_family, "nodeport-ips")]


@pytest.mark.parametrize("family", [V4, V6])
def test_without_node_port_addresses_host_addresses_change_nothing(family: IPFamily) -> None:
    assert render_skeleton(family, DEFAULT, NODE_ON_HOST) == render_skeleton(
        family, DEFAULT, NODE_MANY
    )
