"""KUBE-* names and comments (nftproxy.core.rules.names).

Aspects:
- chain names are kube-proxy's iptables-mode names, pinned from upstream's
  own test vectors (pkg/proxy/iptables/proxier_test.go), so `nftproxy dump`
  lines up with `iptables-save` from a kube-proxy node;
- the hash input is spelled exactly: "ns/name[:port]" + lower-case protocol
  [+ "ip:port" or "[ip]:port"];
- comments always fit the kernel's 128-byte budget, stay readable and
  distinguishable, and never split a UTF-8 character;
- ruleset v2 has no KUBE-SEP/KUBE-FW chains: their names tag comments (the
  DNAT rule's, the firewall-vips element's), and `tagged` keeps the tag
  whole within the budget however long the service's name is.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from typing import Any

import pytest
from builders import endpoint, render, service_port
from hypothesis import given
from hypothesis import strategies as st

from nftproxy.core.model import (
    Endpoint,
    IPFamily,
    L4Protocol,
    LoadBalancerIngress,
    ServicePortName,
    SessionAffinity,
    TrafficPolicy,
)
from nftproxy.core.nft.jsontext import command_json
from nftproxy.core.nft.ops import Table
from nftproxy.core.nft.plan import TableState, stage_full
from nftproxy.core.rules import names

SVC1 = ServicePortName("ns1", "svc1", "p80", L4Protocol.TCP)

_DNS = "abcdefghijklmnopqrstuvwxyz0123456789-"


def _label(longest: int) -> st.SearchStrategy[str]:
    """A DNS label, often of the maximal length kube-apiserver allows."""
    return st.one_of(
        st.text(alphabet=_DNS, min_size=longest, max_size=longest),
        st.text(alphabet=_DNS, min_size=1, max_size=longest),
    )



def _b32_sha256(text: str) -> str:
    """The hash kube-proxy's iptables mode uses, computed independently."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]


@pytest.mark.parametrize(
    ("chain", "expected"),
    [
        pytest.param(names.service_chain, "KUBE-SVC-XPGD46QRK7WJZT7O", id="service chain"),
        pytest.param(names.external_chain, "KUBE-EXT-XPGD46QRK7WJZT7O", id="external chain"),
        pytest.param(names.local_chain, "KUBE-SVL-XPGD46QRK7WJZT7O", id="local chain"),
        pytest.param(names.firewall_chain, "KUBE-FW-XPGD46QRK7WJZT7O", id="firewall chain"),
    ],
)
def test_ns1_svc1_p80_chains_carry_upstream_hash(
    chain: Callable[[ServicePortName], str], expected: str
) -> None:
    assert chain(SVC1) == expected


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        pytest.param(("ns2", "svc2"), "KUBE-SVC-GNZBNJ2PO5MGZ6GT", id="ns2/svc2:p80"),
        pytest.param(("ns4", "svc4"), "KUBE-SVC-4SW47YFZTEDKD3PK", id="ns4/svc4:p80"),
    ],
)
def test_other_upstream_service_chain_vectors(service: tuple[str, str], expected: str) -> None:
    ns, name = service
    assert names.service_chain(ServicePortName(ns, name, "p80", L4Protocol.TCP)) == expected


def test_endpoint_chain_of_10_180_0_1_port_80_matches_upstream() -> None:
    assert names.endpoint_chain(SVC1, Endpoint("10.180.0.1", 80)) == "KUBE-SEP-SXIVWICOYRO3J4NJ"


def test_unnamed_port_hashes_namespace_slash_name_only() -> None:
    unnamed = ServicePortName("ns1", "svc1", "", L4Protocol.TCP)
    assert str(unnamed) == "ns1/svc1"
    assert _b32_sha256("ns1/svc1tcp") == "AQI2S6QIMU7PVVRP"
    assert names.service_chain(unnamed) == "KUBE-SVC-AQI2S6QIMU7PVVRP"


def test_ipv6_endpoint_hashes_bracketed_address() -> None:
    ep = Endpoint("fd00::1", 80)
    assert ep.address == "[fd00::1]:80"
    assert _b32_sha256("ns1/svc1:p80tcp[fd00::1]:80") == "T5UNFIPVCZXM3U7X"
    assert names.endpoint_chain(SVC1, ep) == "KUBE-SEP-T5UNFIPVCZXM3U7X"


def test_protocol_is_part_of_the_hash_in_lower_case() -> None:
    udp = ServicePortName("ns1", "svc1", "p80", L4Protocol.UDP)
    assert names.service_hash(udp) == _b32_sha256("ns1/svc1:p80udp")
    assert names.service_hash(udp) != names.service_hash(SVC1)


def test_affinity_keys_come_from_kube_proxys_endpoint_chain() -> None:
    ep = Endpoint("10.180.0.1", 80)
    assert names.affinity_key(SVC1, ep) == names.endpoints_key("KUBE-SEP-SXIVWICOYRO3J4NJ")


_ADDRESSES = st.one_of(
    st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(lambda a: f"[{a}]")
)


@given(
    ns=_label(63),
    name=_label(63),
    port=st.one_of(st.just(""), _label(15)),
    protocol=st.sampled_from(L4Protocol),
    address=_ADDRESSES,
    number=st.integers(1, 65535),
)
def test_hashes_are_base32_of_sha256_for_any_service_and_endpoint(
    ns: str, name: str, port: str, protocol: L4Protocol, address: str, number: int
) -> None:
    """The hash (rewritten for speed) equals kube-proxy's, computed here with
    base64.b32encode: for any service port name and endpoint address."""
    spn = ServicePortName(ns, name, port, protocol)
    ip = address.strip("[]")
    assert names.service_hash(spn) == _b32_sha256(f"{spn}{protocol.nft}")
    assert names.endpoint_chain(spn, Endpoint(ip, number)) == "KUBE-SEP-" + _b32_sha256(
        f"{spn}{protocol.nft}{address}:{number}")


# --- comments -------------------------------------------------------------


def test_short_comment_is_unchanged() -> None:
    assert names.comment("ns1/svc1:p80 -> 10.180.0.1:80") == "ns1/svc1:p80 -> 10.180.0.1:80"


def test_comment_of_exactly_128_bytes_is_unchanged() -> None:
    text = "x" * names.COMMENT_MAX_BYTES
    assert names.comment(text) == text


def test_long_comment_is_cut_to_128_bytes_deterministically() -> None:
    text = "a" * 300
    cut = names.comment(text)
    assert len(cut.encode()) <= names.COMMENT_MAX_BYTES
    assert cut == names.comment(text)
    assert cut.startswith("a" * 100)


def test_long_comments_differing_only_at_the_end_stay_distinct() -> None:
    base = "n" * 63 + "/" + "s" * 63 + ":" + "p" * 14
    assert names.comment(base + "a") != names.comment(base + "b")


def test_comment_never_splits_a_multibyte_character() -> None:
    text = "é" * 100  # 200 bytes; the cut falls mid-character for an odd budget
    cut = names.comment(text)
    assert len(cut.encode()) <= names.COMMENT_MAX_BYTES
    assert cut.encode().decode() == cut
    head = cut.split("...")[0]
    assert set(head) == {"é"}


service_labels = given(
    ns=_label(63),
    name=_label(63),
    port=st.one_of(st.just(""), _label(15)),
    extra=st.text(max_size=80),
)
"""Any namespace/name:port kube-apiserver accepts, and any text after it."""


def _assert_fits(cut: str) -> None:
    raw = cut.encode()
    assert len(raw) <= names.COMMENT_MAX_BYTES
    assert raw.decode() == cut  # valid UTF-8, no split character


@service_labels
def test_comment_of_any_service_label_fits_and_round_trips(
    ns: str, name: str, port: str, extra: str
) -> None:
    text = f"{ServicePortName(ns, name, port, L4Protocol.TCP)} -> [fd00::1]:80 {extra}"
    cut = names.comment(text)
    _assert_fits(cut)
    assert cut == names.comment(text) == names.check_comment(cut)
    # what nft's syntax cannot quote becomes "?"; the rest is kept
    sayable = "".join(c if c.isprintable() and c not in '"\\' else "?" for c in text)
    if len(text.encode()) <= names.COMMENT_MAX_BYTES:
        assert cut == sayable
    else:
        # the kept head is a prefix of the sayable text
        assert sayable.startswith(cut[: cut.rfind("...")])


def test_comment_of_maximal_service_port_name_fits() -> None:
    text = str(ServicePortName("n" * 63, "s" * 63, "p" * 15, L4Protocol.SCTP))
    assert len(text.encode()) == 143
    assert len(names.comment(text).encode()) <= names.COMMENT_MAX_BYTES


@given(st.text(min_size=1, max_size=400))
def test_comment_of_random_unicode_fits_and_is_valid_utf8(text: str) -> None:
    cut = names.comment(text)
    assert len(cut.encode()) <= names.COMMENT_MAX_BYTES
    assert cut.encode().decode() == cut


# --- tagged: a comment that ends in a KUBE-* identity -------------------------

SEP = "KUBE-SEP-SXIVWICOYRO3J4NJ"


def test_tagged_short_text_is_text_space_tag() -> None:
    assert names.tagged("ns1/svc1:p80 -> 10.180.0.1:80", SEP) == (
        "ns1/svc1:p80 -> 10.180.0.1:80 KUBE-SEP-SXIVWICOYRO3J4NJ")


def test_tagged_of_exactly_128_bytes_is_unchanged_and_one_more_is_cut() -> None:
    fits = "x" * (names.COMMENT_MAX_BYTES - len(SEP) - 1)
    assert names.tagged(fits, SEP) == f"{fits} {SEP}"
    cut = names.tagged(fits + "y", SEP)
    assert len(cut.encode()) <= names.COMMENT_MAX_BYTES
    assert cut.endswith(" " + SEP) and cut != f"{fits}y {SEP}"


def test_tagged_long_text_keeps_the_whole_tag_and_a_readable_head() -> None:
    text = str(ServicePortName("n" * 63, "s" * 63, "p" * 15, L4Protocol.SCTP)) + " -> [::1]:80"
    cut = names.tagged(text, SEP)
    assert len(cut.encode()) <= names.COMMENT_MAX_BYTES
    assert cut.endswith(" " + SEP)
    assert cut.startswith("n" * 63 + "/" + "s" * 20)
    assert cut == names.tagged(text, SEP)  # deterministic


def test_tagged_long_texts_differing_only_at_the_end_stay_distinct() -> None:
    base = "n" * 63 + "/" + "s" * 63 + ":" + "p" * 14 + " -> 10.180.0.1:80"
    assert names.tagged(base + " affinity", SEP) != names.tagged(base, SEP)


def test_tagged_never_splits_a_multibyte_character() -> None:
    cut = names.tagged("é" * 100, SEP)
    assert len(cut.encode()) <= names.COMMENT_MAX_BYTES
    assert set(cut.split("...")[0]) == {"é"}
    assert cut.endswith(" " + SEP)


@service_labels
def test_tagged_of_any_service_label_fits_and_ends_in_its_tag(
    ns: str, name: str, port: str, extra: str
) -> None:
    spn = ServicePortName(ns, name, port, L4Protocol.TCP)
    tag = names.endpoint_chain(spn, Endpoint("fd00::1", 80))
    text = f"{spn} -> [fd00::1]:80{extra}"
    cut = names.tagged(text, tag)
    _assert_fits(cut)
    assert cut.endswith(" " + tag)
    head = cut[: -len(tag) - 1]
    if len(f"{text} {tag}".encode()) <= names.COMMENT_MAX_BYTES:
        assert head == text
    else:
        assert text.startswith(head[: head.rfind("...")])


def test_a_maximal_service_port_yields_a_transaction_whose_comments_all_fit() -> None:
    """kubernetes#139515: one over-long comment fails the whole transaction."""
    port = service_port(
        "s" * 63, ns="n" * 63, port_name="p" * 15, family=IPFamily.IPV6, node_port=30001,
        external_ips=("fd00:99::22",), session_affinity=SessionAffinity.CLIENT_IP,
        load_balancer_ingress=(LoadBalancerIngress("fd00:1:2::3"),),
        load_balancer_source_ranges=("fd00:203::/64",),
        external_traffic_policy=TrafficPolicy.LOCAL,
    )
    eps = (endpoint("fd00:10:180::ffff:ffff", 65535, local=True), endpoint("fd00:10:180::2"))
    fragment = render(port, eps).fragment
    state = TableState(IPFamily.IPV6, Table("ip6", "nftproxy"))
    commands = [command_json(c) for c in stage_full(state, None, {port.name: fragment}).commands]
    comments = [str(v["comment"]) for c in commands for v in _dicts(c) if "comment" in v]
    assert len(str(port.name).encode()) > names.COMMENT_MAX_BYTES
    assert comments and all(len(c.encode()) <= names.COMMENT_MAX_BYTES for c in comments)
    # the identities survive the cut: KUBE-SEP-<h> ends each DNAT rule's comment ...
    rules: list[Any] = [r for c in commands for r in _dicts(c) if "expr" in r]
    dnats = [(r["comment"], d["dnat"]) for r in rules for d in r["expr"] if "dnat" in d]
    assert len(dnats) == 6  # KUBE-SVC: 2 affinity + 2 cascade; KUBE-SVL: 1 + 1 (the local one)
    for comment, dnat in dnats:
        tag = names.endpoint_chain(port.name, Endpoint(str(dnat["addr"]), int(dnat["port"])))
        assert str(comment).endswith(" " + tag)
    # ... and KUBE-FW-<h> starts the firewall-vips element's
    adds: list[Any] = [a for c in commands for a in _dicts(c) if a.get("name") == "firewall-vips"]
    (vip,) = [e["elem"] for a in adds for e in a.get("elem", ())]
    assert str(vip["comment"]).startswith(names.firewall_chain(port.name) + " ")


def _dicts(value: object) -> list[dict[str, object]]:
    if isinstance(value, dict):
        return [value, *(d for v in value.values() for d in _dicts(v))]
    if isinstance(value, list):
        return [d for v in value for d in _dicts(v)]
    return []
