"""`trace` and `dump` on ruleset v4's ClientIP affinity: one shared set.

A port with ClientIP affinity chooses in its KUBE-SVC/KUBE-SVL chain: per
endpoint a lookup rule `ip saddr . K1 . K2 @affinity update @affinity { ip
saddr . K1 . K2 timeout T } ... dnat to EP` (K1, K2 = names.affinity_key: the
endpoint's KUBE-SEP-<h>, as constant numgens), then the numgen cascade
updating the same set; the set itself (skeleton.AFFINITY) has no timeout.
These chains and the set are the affinity table's (nftproxy-affinity,
ruleset v9): `trace` and `dump` read both tables, the main table's
`accept` for the port's destination leading to the affinity table's nat
chain. The tables here are what a Proxier programs for two affinity Services --
sticky (3 endpoints, 77 s) and other (600 s; its one endpoint is sticky's
second address and port, under another KUBE-SEP, so another key) -- into a
FakeBackend listing as libnftables 1.0.6 or 1.1.3 does, both families; the
kernel tests program a namespace (whichever libnftables runs them: 1.0.6 on
the host, 1.1.3 inside the trixie userspace) and fill its affinity set with
`nft add element`, as traffic does. Aspects:
- an unpinned client: 1/3 per endpoint, each path "would pin ... for 77s
  (@affinity)" -- the rule's element timeout -- and the rule shows it;
- a pinned client (an element for its source and the endpoint's key): that
  endpoint only, via its lookup rule, "pins ... (@affinity, Ns left)";
- an element for another client, or for the client and another endpoint's
  key (the same address and port behind the other Service) pins nothing
  here, while the latter pins the client for the other Service;
- dump: "sessionAffinity: ClientIP, timeout Ts" per port, its own T, and
  the endpoints 1/3 each (lookup rules not counted);
- the kernel's listing, with elements the kernel holds, traces and dumps
  the same.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from fractions import Fraction
from typing import Any

import kernel
import pytest
from k8s import endpoint_slice, service
from test_proxier import listed

from nftproxy.agent.proxier import Proxier
from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import Endpoint, L4Protocol, ServicePortName
from nftproxy.core.nft.listing import list_family
from nftproxy.core.nft.seam import Backend
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.trace import Host, Packet, Ruleset, Trace, trace
from nftproxy.kernel.fake import FakeBackend
from nftproxy.kernel.libnftables import NftBackend
from nftproxy.tools.dump import parse_table, render_text

TABLE = "nftproxy"
CONFIG = ProxyConfig(table_name=TABLE)
STICKY = ServicePortName("ns", "sticky", "http", L4Protocol.TCP)
OTHER = ServicePortName("ns", "other", "http", L4Protocol.TCP)
FAMILIES = ("ip", "ip6")
VERSIONS = ("1.0.6", "1.1")
HOST = Host.of(["192.168.1.1", "fd00:1::1"])


def _net(family: str) -> dict[str, Any]:
    v4 = family == "ip"
    return {
        "sticky": "10.96.0.50" if v4 else "fd00:96::50",
        "other": "10.96.0.51" if v4 else "fd00:96::51",
        "eps": [f"10.244.0.1{n}" if v4 else f"fd00:244::1{n}" for n in (1, 2, 3)],
        "client": "192.168.50.2" if v4 else "fd00:50::2",
        "stranger": "192.168.50.3" if v4 else "fd00:50::3",
    }


def _objects() -> list[dict[str, Any]]:
    v4, v6 = _net("ip"), _net("ip6")
    port = (("http", 8080, "TCP"),)
    out = [
        service("sticky", [v4["sticky"], v6["sticky"]], affinity_timeout=77),
        service("other", [v4["other"], v6["other"]], affinity_timeout=600),
    ]
    for net, fam in ((v4, "IPv4"), (v6, "IPv6")):
        out += [
            endpoint_slice("sticky", net["eps"], ports=port, family=fam,
                           name=f"sticky-{fam.lower()}"),
            endpoint_slice("other", net["eps"][1:2], ports=port, family=fam,
                           name=f"other-{fam.lower()}"),
        ]
    return out


def _program(backend: Backend) -> None:
    proxier = Proxier(CONFIG, backend)
    listed(proxier, *_objects())
    report = proxier.sync()
    assert report.ops > 0 and not report.skipped, report


@pytest.fixture(scope="module", params=VERSIONS)
def planned(request: pytest.FixtureRequest) -> Iterator[dict[str, Mapping[str, Any]]]:
    """The listings per family, as libnftables `request.param` lists them."""
    backend = FakeBackend(version=request.param)
    backend.start()
    try:
        _program(backend)
        docs = {f: list_family(backend.list_table, f, TABLE) for f in FAMILIES}
    finally:
        backend.close()
    yield {f: doc for f, doc in docs.items() if doc is not None}


def _key(spn: ServicePortName, ip: str) -> tuple[int, int]:
    return names.affinity_key(spn, Endpoint(ip, 8080))


def _sep(spn: ServicePortName, ip: str) -> str:
    return names.endpoint_chain(spn, Endpoint(ip, 8080))


def _remembered(doc: Mapping[str, Any], *entries: tuple[str, tuple[int, int], int]
                ) -> dict[str, Any]:
    """`doc` with the affinity set holding (client, key, seconds left)
    elements, as the kernel lists them after traffic."""
    out = copy.deepcopy(dict(doc))
    (found,) = [o["set"] for o in out["nftables"] if o.get("set", {}).get("name") == sk.AFFINITY]
    assert "timeout" not in found  # the timeout is each element's, from the rule
    found["elem"] = [{"elem": {"val": {"concat": [client, *key]}, "timeout": 77, "expires": left}}
                     for client, key, left in entries]
    return out


def _trace(doc: Mapping[str, Any], family: str, src: str, vip: str) -> Trace:
    rs = Ruleset.from_listing(doc, family, TABLE)
    assert rs.problems() == []
    return trace(rs, Packet(src, vip, 80), HOST)


def _paths(result: Trace) -> list[tuple[str, str, Fraction, str]]:
    return sorted((p.endpoint.address if p.endpoint else "", p.endpoint.identity
                   if p.endpoint else "", p.probability, p.affinity) for p in result.paths)


def _unpinned(family: str, client: str) -> list[tuple[str, str, Fraction, str]]:
    note = f"affinity would pin {client} to this endpoint for 77s (@affinity)"
    return sorted((ip, _sep(STICKY, ip), Fraction(1, 3), note) for ip in _net(family)["eps"])


# --- trace -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unpinned_client_gets_each_endpoint_with_the_rules_timeout(
    planned: dict[str, Mapping[str, Any]], family: str
) -> None:
    net = _net(family)
    result = _trace(planned[family], family, net["client"], net["sticky"])
    assert _paths(result) == _unpinned(family, net["client"])
    ip = "ip" if family == "ip" else "ip6"
    for path in result.paths:
        assert path.endpoint is not None
        k1, k2 = _key(STICKY, path.endpoint.address)
        update = (f"update @affinity {{ {ip} saddr . numgen random mod 1 offset {k1} . "
                  f"numgen random mod 1 offset {k2} timeout 77s }}")
        assert any(update in s.text for s in path.steps), [s.text for s in path.steps]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pinned_client_goes_to_its_endpoint_only(
    planned: dict[str, Mapping[str, Any]], family: str
) -> None:
    net = _net(family)
    second = net["eps"][1]
    doc = _remembered(planned[family], (net["client"], _key(STICKY, second), 42))
    (path,) = _trace(doc, family, net["client"], net["sticky"]).paths
    assert path.endpoint is not None
    assert (path.endpoint.address, path.endpoint.identity, path.probability) == (
        second, _sep(STICKY, second), Fraction(1))
    assert path.endpoint.comment.endswith(f" affinity {_sep(STICKY, second)}")  # the lookup rule
    assert path.affinity == f"affinity pins {net['client']} to this endpoint (@affinity, 42s left)"


@pytest.mark.parametrize("family", FAMILIES)
def test_another_clients_or_another_endpoints_element_does_not_pin(
    planned: dict[str, Mapping[str, Any]], family: str
) -> None:
    net = _net(family)
    shared = net["eps"][1]  # sticky's second endpoint, and other's only one
    assert _key(OTHER, shared) != _key(STICKY, shared)
    doc = _remembered(planned[family], (net["stranger"], _key(STICKY, shared), 42),
                      (net["client"], _key(OTHER, shared), 41))
    result = _trace(doc, family, net["client"], net["sticky"])
    assert _paths(result) == _unpinned(family, net["client"])
    (other,) = _trace(doc, family, net["client"], net["other"]).paths
    assert other.affinity == f"affinity pins {net['client']} to this endpoint (@affinity, 41s left)"
    assert other.endpoint is not None and other.endpoint.identity == _sep(OTHER, shared)


# --- dump ------------------------------------------------------------------------------------


def _dump_says(doc: Mapping[str, Any], family: str) -> None:
    view = parse_table(doc, family=family, table=TABLE)
    ports = {s.service: s for s in view.services}
    sticky, other = ports[str(STICKY)], ports[str(OTHER)]
    assert (sticky.affinity_timeout, other.affinity_timeout) == (77, 600)
    assert [(e.address, e.identity, e.probability) for e in sticky.endpoints] == [
        (ip, _sep(STICKY, ip), 0.3333) for ip in _net(family)["eps"]]
    text = render_text(view)
    blocks = text.split(f"  {OTHER}")
    assert "sessionAffinity: ClientIP, timeout 77s" in text
    assert "sessionAffinity: ClientIP, timeout 600s" in blocks[1], text


@pytest.mark.parametrize("family", FAMILIES)
def test_dump_shows_each_ports_affinity_timeout(
    planned: dict[str, Mapping[str, Any]], family: str
) -> None:
    _dump_says(planned[family], family)


# --- the kernel's listing ----------------------------------------------------------------------


def test_the_kernels_listing_with_its_elements_traces_and_dumps_the_same(netns: str) -> None:
    with NftBackend(netns=netns) as backend:
        _program(backend)
        for family in FAMILIES:
            net = _net(family)
            k1, k2 = _key(STICKY, net["eps"][2])
            kernel.nft(netns, "add", "element", family, names.affinity_table(TABLE), sk.AFFINITY,
                       f"{{ {net['client']} . {k1} . {k2} timeout 77s }}")
        docs = {f: list_family(backend.list_table, f, TABLE) for f in FAMILIES}
    for family, doc in docs.items():
        assert doc is not None
        net = _net(family)
        (path,) = _trace(doc, family, net["client"], net["sticky"]).paths
        assert path.endpoint is not None and path.endpoint.address == net["eps"][2]
        left = re.fullmatch(rf"affinity pins {net['client']} to this endpoint "
                            r"\(@affinity, (\d+)s left\)", path.affinity)
        assert left is not None and 0 < int(left[1]) <= 77, path.affinity
        stranger = _trace(doc, family, net["stranger"], net["sticky"])
        assert _paths(stranger) == _unpinned(family, net["stranger"])
        _dump_says(doc, family)
