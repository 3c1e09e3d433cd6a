"""One service port -> its fragment (nftproxy.core.rules.service): the endpoints.

Aspects, each in kube-proxy's words (docs/kube-proxy-semantics.md,
upstream-nftables-notes.md §1.5-§1.15):
- the endpoints a shared chooser picks from: the port owns one element
  per endpoint in the chooser's map (vip-[local-]endpoints-<proto>,
  nodeport-[local-]endpoints-<proto>), in endpoint order, each naming its
  endpoint by kube-proxy's KUBE-SEP-<h> in its comment (within nft's 128
  bytes), DNATed with the service's protocol; a changed endpoint is
  elements only;
- hairpin: an (endpoint . endpoint) element per reachable endpoint;
- IPv6 ports: ip6 matches, bracketed endpoint addresses, ipv6_addr keys;
- session affinity (the only ports with a chooser of their own, KUBE-SVC /
  KUBE-SVL in the affinity table): lookup, refresh, DNAT per endpoint before
  the numgen cascade, which DNATs inline; the one affinity set, a shared
  object of the ports that use it.
test_rules_dispatch*.py test the shared choosers themselves (their rules,
counts, probabilities). Rules are read through builders.text() (nft
syntax; fails on unknown shapes); dispatch, masquerade and the renderer
meta-test live in test_rules_service.py.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest
from builders import (
    AFFINITY,
    CIP,
    CONFIG,
    EP1,
    EP2,
    EP3,
    ETP_LOCAL,
    ITP_LOCAL,
    LOCAL,
    LOCAL_AND_REMOTE,
    MASQ,
    NODE,
    REMOTE,
    SVC,
    SVC1,
    SVL,
    chain_of,
    client_key,
    dispatch,
    dnat_to,
    elements_of,
    endpoint,
    hairpin,
    labels,
    nodeport_dnat,
    render,
    rules_of,
    sep,
    service_port,
    shared_chains,
    shared_dnat,
    shared_rules,
    shared_sets,
    text,
    to,
)

from nftproxy.core.model import Endpoint, IPFamily, L4Protocol, SessionAffinity
from nftproxy.core.rules import names
from nftproxy.core.rules import skeleton as sk
from nftproxy.core.rules.dispatch import is_indexed_map
from nftproxy.core.rules.fragment import (
    NUMGEN_KEY,
    Element,
    Fragment,
    Rule,
    Target,
    compact_chain,
)

# --- the endpoints a shared chooser picks from ----------------------------------


def _map_elements(fragment: Fragment) -> list[Element]:
    """The port's elements of the choosers' maps (index -> endpoint)."""
    return [e for e in fragment.elements if is_indexed_map(e.set_name)]


@pytest.mark.parametrize(
    "protocol", [L4Protocol.TCP, L4Protocol.UDP, L4Protocol.SCTP], ids=lambda p: p.name)
def test_endpoint_rule_dnats_with_the_service_protocol(protocol: L4Protocol) -> None:
    """The DNAT is in the shared chooser the destination goes to (its map
    pick of the protocol's map, whose element holds the endpoint's address
    and port) or, with affinity, in KUBE-SVC's cascade; no rule marks hairpin
    traffic (KUBE-POSTROUTING does, from hairpin-endpoints) and no KUBE-SEP
    chain exists."""
    port = service_port(protocol=protocol, node_port=3001, external_traffic_policy=LOCAL)
    proto = protocol.nft
    fragment = render(port, (endpoint(EP1, 8080, local=True),)).fragment
    assert fragment.chains == ()
    assert shared_rules(fragment, f"dispatch-{proto}-1")[-1] == shared_dnat(1, proto)
    assert shared_rules(fragment, f"dispatch-nodeport-local-{proto}-1") == [
        nodeport_dnat(1, proto).replace("nodeport-endpoints", "nodeport-local-endpoints")]
    sep1 = names.endpoint_chain(port.name, endpoint(EP1, 8080))
    comment = f"ns1/svc1:p80 -> {EP1}:8080 {sep1}"
    assert _map_elements(fragment) == [
        Element(f"vip-endpoints-{proto}", (CIP, 80, 0), Target(EP1, 8080), comment),
        Element(f"nodeport-endpoints-{proto}", (3001, 0), Target(EP1, 8080), comment),
        Element(f"nodeport-local-endpoints-{proto}", (3001, 0), Target(EP1, 8080), comment),
    ]
    assert {e.set_name for e in _map_elements(fragment)} <= set(shared_sets(fragment))
    assert elements_of(fragment, "hairpin-endpoints") == {(EP1, EP1): None}
    affinity = replace(port, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(affinity, (endpoint(EP1, 8080),)).fragment
    chain = names.service_chain(port.name)
    assert rules_of(fragment, chain)[-1].endswith(to(EP1, 8080, proto))
    assert _map_elements(fragment) == []


def test_a_changed_endpoint_changes_elements_only() -> None:
    """Same count, another endpoint: the port still has no chain, uses the
    same shared objects (equal chains, so none is rewritten), and the
    endpoints maps keep their keys; only their values (and the hairpin
    pairs) change. The second endpoint has no node, so it is a hairpin pair."""
    here = endpoint(EP1, local=True)
    before = render(ETP_LOCAL, (here, endpoint(EP2, nodeless=True))).fragment
    moved = (endpoint(EP1, 8080, local=True), endpoint(EP3, nodeless=True))
    after = render(ETP_LOCAL, moved).fragment
    assert before.chains == after.chains == ()
    assert before.shared == after.shared
    assert [compact_chain(c) for c in shared_chains(before).values()] == [
        compact_chain(c) for c in shared_chains(after).values()]
    assert before.sets == after.sets == ()
    assert [e.key for e in _map_elements(before)] == [e.key for e in _map_elements(after)]
    changed = set(before.elements) ^ set(after.elements)
    assert {e.set_name for e in changed} == {
        "vip-endpoints-tcp", "vip-local-endpoints-tcp", "nodeport-endpoints-tcp",
        "nodeport-local-endpoints-tcp", "hairpin-endpoints"}
    assert [str(e.value) for e in _map_elements(after)
            if e.key[0] == CIP] == [f"{EP1}:8080", f"{EP3}:80"]
    assert [str(e.value) for e in _map_elements(after)
            if e.set_name == "nodeport-local-endpoints-tcp"] == [f"{EP1}:8080"]


def test_endpoint_comments_name_the_endpoint_by_its_kube_sep_identity() -> None:
    eps = (endpoint(EP1), endpoint(EP2, 8080))
    fragment = render(AFFINITY, eps).fragment
    spn, (sep1, sep2) = AFFINITY.name, (sep(EP1, AFFINITY), sep(EP2, AFFINITY, 8080))
    assert [r.comment for r in chain_of(fragment, SVC).rules[1:]] == [
        f"{spn} -> {EP1}:80 affinity {sep1}",
        f"{spn} -> {EP2}:8080 affinity {sep2}",
        f"{spn} -> {EP1}:80 {sep1}",
        f"{spn} -> {EP2}:8080 {sep2}",
    ]


def test_endpoint_comments_of_a_maximal_service_keep_the_kube_sep_tag_within_128_bytes() -> None:
    port = service_port("s" * 63, ns="n" * 63, port_name="p" * 15, family=IPFamily.IPV6,
                        session_affinity=SessionAffinity.CLIENT_IP)
    eps = (endpoint("fd00:10:180::ffff:ffff", 65535), endpoint("fd00:10:180::2"))
    fragment = render(port, eps).fragment
    rules = chain_of(fragment, names.service_chain(port.name)).rules[1:]
    comments = [str(r.comment) for r in rules]
    tags = [names.endpoint_chain(port.name, Endpoint(*_split(dnat_to(r)))) for r in rules]
    assert tags[:2] == tags[2:]  # the affinity rules, then the cascade, in one order
    assert set(tags) == {names.endpoint_chain(port.name, ep) for ep in eps}
    assert all(len(c.encode()) <= names.COMMENT_MAX_BYTES for c in comments)
    assert all(c.endswith(" " + tag) for c, tag in zip(comments, tags, strict=True))
    assert all(c.startswith(str(port.name)[:60]) for c in comments)  # still readable
    assert len(set(comments)) == len(comments)  # affinity and cascade rules stay distinct


def test_map_element_comments_of_a_maximal_service_keep_the_kube_sep_tag() -> None:
    """In every map the port fills: its cluster IP's, its node port's, and
    the local endpoints' of its eTP=Local node port."""
    port = service_port("s" * 63, ns="n" * 63, port_name="p" * 15, family=IPFamily.IPV6,
                        node_port=3001, external_traffic_policy=LOCAL)
    eps = (endpoint("fd00:10:180::ffff:ffff", 65535, local=True), endpoint("fd00:10:180::2"))
    fragment = render(port, eps).fragment
    elements = _map_elements(fragment)
    assert {e.set_name for e in elements} == {
        "vip-endpoints-tcp", "nodeport-endpoints-tcp", "nodeport-local-endpoints-tcp"}
    assert len(elements) == 5
    for e in elements:
        assert isinstance(e.value, Target)
        tag = names.endpoint_chain(port.name, Endpoint(e.value.ip, e.value.port))
        comment = str(e.comment)
        assert len(comment.encode()) <= names.COMMENT_MAX_BYTES
        assert comment.endswith(" " + tag) and comment.startswith(str(port.name)[:60])


def _split(address: str) -> tuple[str, int]:
    """"ip:port" / "[ip6]:port" -> (ip, port)."""
    ip, _, port = address.rpartition(":")
    return ip.strip("[]"), int(port)


# --- hairpin ---------------------------------------------------------------------


def test_hairpin_elements_pair_each_reachable_endpoint_with_itself() -> None:
    """kube-proxy masquerades a connection whose client is the endpoint it was
    sent to: every endpoint a chooser can DNAT to and that can be its own
    client here is an (ep . ep) element, which the skeleton's first
    KUBE-POSTROUTING rule matches after DNAT."""
    eps = (endpoint(EP3, local=True), endpoint(EP1, local=True),
           endpoint(EP2, ready=False, terminating=True, serving=True, local=True))  # unused
    fragment = render(ETP_LOCAL, eps).fragment
    assert elements_of(fragment, "hairpin-endpoints") == {(EP1, EP1): None, (EP3, EP3): None}
    everything = [r for c in fragment.chains for r in (text(x) for x in c.rules)]
    assert not any(ip in r and r.endswith(MASQ) for r in everything for ip in (EP1, EP2, EP3))
    skeleton = sk.render_skeleton(IPFamily.IPV4, CONFIG, NODE)
    (decl,) = [s for s in skeleton.sets if s.name == "hairpin-endpoints"]
    assert decl.key == ("ip saddr", "ip daddr")
    assert rules_of(skeleton, "KUBE-POSTROUTING")[0] == (
        "ct status dnat ip saddr . ip daddr @hairpin-endpoints meta mark set meta mark | 0x4000")


def test_only_an_endpoint_that_can_be_its_own_client_here_is_a_hairpin_pair() -> None:
    """A pod on another node reaches a service through its own node's proxy,
    so it is never DNATed to itself here: its endpoint has no pair (as
    kube-proxy's IPVS mode keeps only local endpoints in KUBE-LOOP-BACK).
    An endpoint without a node (a hand-written EndpointSlice, an address
    outside the cluster) might come through this node: it keeps its pair,
    and so does every endpoint while this node's name is unknown."""
    eps = (endpoint(EP1, local=True), endpoint(EP2), endpoint(EP3, nodeless=True))
    pairs = elements_of(render(SVC1, eps).fragment, "hairpin-endpoints")
    assert pairs == {(EP1, EP1): None, (EP3, EP3): None}
    unnamed = replace(NODE, name="")
    pairs = elements_of(render(SVC1, eps, node=unnamed).fragment, "hairpin-endpoints")
    assert pairs == {(ip, ip): None for ip in (EP1, EP2, EP3)}


def test_one_element_per_endpoint_ip_however_many_of_its_ports_serve() -> None:
    eps = (endpoint(EP1, 8080, local=True), endpoint(EP1, 9090, local=True),
           endpoint(EP2, local=True))
    fragment = render(SVC1, eps).fragment
    assert [e.key for e in fragment.elements if e.set_name == "hairpin-endpoints"] == [
        (EP1, EP1), (EP2, EP2)]


# --- IPv6 ------------------------------------------------------------------------


def test_ipv6_port_renders_ip6_matches_and_ipv6_addresses() -> None:
    port = service_port(family=IPFamily.IPV6, node_port=3001)
    ep = endpoint("fd00:10:180::1", local=True)
    fragment = render(port, (ep,)).fragment
    cip = "fd00:172:30::41"
    tag = f"ns1/svc1:p80 -> [fd00:10:180::1]:80 {names.endpoint_chain(port.name, ep)}"
    assert dispatch(fragment, labels(port)) == {
        "cluster-ips": {(cip,): None},
        "service-ips": {(cip, "tcp", 80): "goto dispatch-tcp-1"},
        "vip-endpoints-tcp": {(cip, 80, 0): "[fd00:10:180::1]:80"},
        "service-nodeports": {("tcp", 3001): "goto dispatch-nodeport-tcp-1"},
        "nodeport-endpoints-tcp": {(3001, 0): "[fd00:10:180::1]:80"},
        "masquerade-nodeports": {("tcp", 3001): None},
        **hairpin("fd00:10:180::1"),
    }
    assert [e.comment for e in _map_elements(fragment)] == [tag, tag]
    assert shared_rules(fragment, "dispatch-tcp-1") == [
        f"ip6 daddr @cluster-ips ip6 saddr != fd00:10::/48 {MASQ}", shared_dnat(1, ip="ip6")]
    assert shared_rules(fragment, "dispatch-nodeport-tcp-1") == [nodeport_dnat(1, ip="ip6")]
    assert {d.name: d.type[0] for d in shared_sets(fragment).values()} == {
        "vip-endpoints-tcp": "ipv6_addr", "nodeport-endpoints-tcp": "inet_service"}
    assert {d.map for d in shared_sets(fragment).values()} == {"ipv6_addr . inet_service"}
    assert fragment.family is IPFamily.IPV6


def test_ipv6_affinity_keys_the_ipv6_client() -> None:
    port = service_port(family=IPFamily.IPV6, session_affinity=SessionAffinity.CLIENT_IP)
    ep = endpoint("fd00:10:180::1")
    fragment = render(port, (ep,)).fragment
    assert fragment.sets == ()
    key = client_key(port, "fd00:10:180::1", family="ip6")
    assert rules_of(fragment, names.service_chain(port.name))[1:] == [
        f"{key} @affinity update @affinity {{ {key} timeout 10800s }} "
        "meta l4proto tcp dnat to [fd00:10:180::1]:80",
        f"update @affinity {{ {key} timeout 10800s }} meta l4proto tcp dnat to [fd00:10:180::1]:80",
    ]


# --- session affinity: the cascade -----------------------------------------------


def _probabilities(rules: list[Rule]) -> dict[str, Fraction]:
    """Chance of being DNATed to each endpoint by the affinity cascade, reading
    each rule's numgen match: `numgen random mod m == 0` matches with
    probability 1/m, no match means 1."""
    reach, out = Fraction(1), dict[str, Fraction]()
    for rule in rules:
        p = Fraction(1)
        for s in rule.expr:
            if "match" in s and "numgen" in s["match"]["left"]:
                assert s["match"]["right"] == 0 and s["match"]["op"] == "=="
                p = Fraction(1, s["match"]["left"]["numgen"]["mod"])
        target = dnat_to(rule)
        out[target] = out.get(target, Fraction(0)) + reach * p
        reach *= 1 - p
    assert reach == 0, "the last rule of the cascade must always match"
    return out


def test_affinity_declares_no_set_of_its_own() -> None:
    """Ruleset v4: every endpoint's clients live in one `affinity` set (a
    named set per endpoint slowed every commit), which the ports with
    ClientIP affinity share: it is their one shared object."""
    eps = (endpoint(EP1), endpoint(EP2))
    fragment = render(AFFINITY, eps).fragment
    assert fragment.sets == ()
    assert list(shared_sets(fragment)) == ["affinity:affinity"] and shared_chains(fragment) == {}
    other = render(replace(AFFINITY, name=replace(AFFINITY.name, name="other")), eps).fragment
    assert other.shared == fragment.shared


def test_the_shared_affinity_set_is_dynamic_with_timeouts_per_element() -> None:
    (decl,) = sk.choosers(IPFamily.IPV4, CONFIG, NODE).affinity().sets
    assert decl.name == "affinity:affinity"
    assert decl.key == ("ip saddr", NUMGEN_KEY, NUMGEN_KEY)
    assert decl.type == ("ipv4_addr", "integer", "integer")
    assert decl.map is None
    assert set(decl.flags) == {"dynamic", "timeout"}
    assert decl.dynamic
    assert decl.timeout is None, "each port's rules give their own timeout"
    assert decl.size == sk.AFFINITY_SIZE and decl.size > 65535
    (decl6,) = sk.choosers(IPFamily.IPV6, CONFIG, NODE).affinity().sets
    assert decl6.key == ("ip6 saddr", NUMGEN_KEY, NUMGEN_KEY)


def test_affinity_default_timeout_is_three_hours() -> None:
    port = service_port(session_affinity=SessionAffinity.CLIENT_IP)
    rules = rules_of(render(port, REMOTE).fragment, SVC)
    assert all("timeout 10800s }" in r for r in rules if "update" in r)
    assert sum("update" in r for r in rules) == 2


def test_every_rule_that_dnats_records_the_client_for_affinity_first() -> None:
    """kube-proxy's KUBE-SEP chain did `update @affinity { ip saddr }` before
    DNAT whichever way it was reached: the affinity hit refreshes the timeout,
    the cascade pick starts it."""
    port = service_port(session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, REMOTE).fragment
    key = client_key(port, EP1)
    assert rules_of(fragment, SVC)[1:] == [
        f"{key} @affinity update @affinity {{ {key} timeout 10800s }} {to(EP1)}",
        f"update @affinity {{ {key} timeout 10800s }} {to(EP1)}",
    ]


def test_affinity_lookups_come_after_masquerade_and_before_the_cascade() -> None:
    eps = (endpoint(EP1), endpoint(EP2))
    fragment = render(AFFINITY, eps).fragment
    key1, key2 = client_key(AFFINITY, EP1), client_key(AFFINITY, EP2)
    assert rules_of(fragment, SVC) == [
        f"ip daddr {CIP} tcp dport 80 ip saddr != 10.0.0.0/8 {MASQ}",
        f"{key1} @affinity update @affinity {{ {key1} timeout 600s }} {to(EP1)}",
        f"{key2} @affinity update @affinity {{ {key2} timeout 600s }} {to(EP2)}",
        f"numgen random mod 2 0 update @affinity {{ {key1} timeout 600s }} {to(EP1)}",
        f"update @affinity {{ {key2} timeout 600s }} {to(EP2)}",
    ]
    cascade = list(chain_of(fragment, SVC).rules[3:])
    assert _probabilities(cascade) == {f"{EP1}:80": Fraction(1, 2), f"{EP2}:80": Fraction(1, 2)}


def test_an_endpoints_affinity_key_is_its_kube_sep_identity() -> None:
    """One key per KUBE-SEP-<h>: two endpoints of a port, or one endpoint
    of two ports, never share clients' entries; the key is the same after a
    restart (a hash, no allocator)."""
    other_port = service_port(name="other", session_affinity=SessionAffinity.CLIENT_IP)
    keys = {
        client_key(AFFINITY, EP1),
        client_key(AFFINITY, EP2),
        client_key(AFFINITY, EP1, number=81),
        client_key(other_port, EP1),
    }
    assert len(keys) == 4
    k1, k2 = names.affinity_key(AFFINITY.name, endpoint(EP1))
    assert (k1, k2) == names.endpoints_key(sep(EP1, AFFINITY))
    assert 0 <= k1 < 2**31 and 0 <= k2 < 2**31


def test_affinity_in_kube_svl_looks_up_local_endpoints_only() -> None:
    """The Cluster and Local choosers share the endpoint's entries, as
    kube-proxy's two chains share the KUBE-SEP chain and its set."""
    port = replace(ITP_LOCAL, session_affinity=SessionAffinity.CLIENT_IP)
    fragment = render(port, LOCAL_AND_REMOTE).fragment
    key1 = client_key(port, EP1)
    assert rules_of(fragment, SVL)[1:] == [
        f"{key1} @affinity update @affinity {{ {key1} timeout 10800s }} {to(EP1)}",
        f"update @affinity {{ {key1} timeout 10800s }} {to(EP1)}",
    ]
    assert fragment.sets == ()


def test_without_affinity_there_are_no_lookups_nor_updates() -> None:
    """A port without affinity has no chain, and the shared chains it uses
    read only their own maps and the cluster IPs (the masquerade rule):
    no affinity lookup, no update."""
    fragment = render(ETP_LOCAL, (endpoint(EP1, local=True), endpoint(EP2))).fragment
    assert fragment.chains == () and fragment.sets == ()
    rules = [text(r) for c in shared_chains(fragment).values() for r in c.rules]
    assert {word for r in rules for word in r.split() if "@" in word} == {
        "@" + name for name in (*shared_sets(fragment), "cluster-ips")}
    assert not any("update" in r or "affinity" in r for r in rules)
