"""Transactions in nft's own syntax (core/nft/nfttext.py).

Aspects: every statement core/rules/expr.py spells reads as nft writes it;
elements with any comment at all are written with their comments quoted
as the JSON printer says them; what no printer may write (a bad family,
name, key part, verdict or target) is refused when the value is built, and
a comment nft cannot quote is made sayable; and a planned full sync of the
example cluster has a line for every command, declarations included.
tests/test_nfttext_kernel.py shows that the kernel holds the same objects
from either printer.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nftproxy.core.config import ProxyConfig
from nftproxy.core.model import IPFamily, L4Protocol
from nftproxy.core.nft import jsontext
from nftproxy.core.nft.commands import AddChain, AddElements, AddRule, Where
from nftproxy.core.nft.nfttext import NoText, command_text, transaction_text
from nftproxy.core.nft.ops import Table
from nftproxy.core.rules import expr
from nftproxy.core.rules.fragment import (
    BadValue,
    BaseHook,
    Chain,
    Element,
    Rule,
    Target,
    Verdict,
)
from nftproxy.kernel.fake import FakeBackend
from nftproxy.tools.dry_run import proxier_from_files

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
TCP, UDP = L4Protocol.TCP, L4Protocol.UDP
T = Table("ip", "nftproxy")

STATEMENTS: list[tuple[Any, str]] = [
    (expr.addr_match(V4, "saddr", ["10.0.0.0/8"]), "ip saddr == 10.0.0.0/8"),
    (expr.addr_match(V6, "daddr", ["fd00::1", "fd00::/64"], negate=True),
     "ip6 daddr != { fd00::1, fd00::/64 }"),
    (expr.set_lookup(V4, "daddr", "cluster-ips"), "ip daddr @cluster-ips"),
    (expr.set_lookup(V4, "saddr", "x", negate=True), "ip saddr != @x"),
    (expr.l4proto(TCP), "meta l4proto == tcp"),
    (expr.port_match(UDP, 53), "udp dport == 53"),
    (expr.iifname("cbr0"), 'meta iifname == "cbr0"'),
    (expr.iifname("veth*", negate=True), 'meta iifname != "veth*"'),
    (expr.fib_local("daddr"), "fib daddr type == local"),
    (expr.ct_state("new"), "ct state new"),
    (expr.ct_state("established", "related"), "ct state established,related"),
    (expr.mark_set(0x4000), "meta mark set meta mark | 16384"),
    (expr.mark_clear(0x4000), "meta mark set meta mark ^ 16384"),
    (expr.mark_is_clear(0x4000), "meta mark & 16384 == 0"),
    (expr.mark_is_set(0x4000), "meta mark & 16384 == 16384"),
    (expr.match(expr.concat_daddr_proto_dport(V4), "@firewall-vips"),
     "ip daddr . meta l4proto . th dport @firewall-vips"),
    (expr.vmap(expr.concat_proto_dport(), "service-nodeports"),
     "meta l4proto . th dport vmap @service-nodeports"),
    (expr.numgen_zero(3), "numgen random mod 3 == 0"),
    (expr.affinity_lookup(V4, (7, 9), "affinity"),
     "ip saddr . numgen random mod 1 offset 7 . numgen random mod 1 offset 9 @affinity"),
    (expr.affinity_update(V6, (7, 9), "affinity", 10800),
     "update @affinity { ip6 saddr . numgen random mod 1 offset 7 . numgen random mod 1 "
     "offset 9 timeout 10800s }"),
    (expr.dnat("10.128.0.5", 8080), "dnat to 10.128.0.5:8080"),
    (expr.dnat("fd00::5", 8080), "dnat to [fd00::5]:8080"),
    (expr.dnat_by_destination(V6, TCP, 2, "vip-local-endpoints-tcp"),
     "dnat ip6 to ip6 daddr . tcp dport . numgen random mod 2 map @vip-local-endpoints-tcp"),
    (expr.dnat_by_port(V4, UDP, 1, "nodeport-endpoints-udp"),
     "dnat ip to udp dport . numgen random mod 1 map @nodeport-endpoints-udp"),
    (expr.masquerade(), "masquerade fully-random"),
    (expr.reject_tcp_reset(), "reject with tcp reset"),
    (expr.reject_icmp(V4), "reject with icmp port-unreachable"),
    (expr.reject_icmp(V6), "reject with icmpv6 port-unreachable"),
    (expr.jump("KUBE-MARK-MASQ"), "jump KUBE-MARK-MASQ"),
    (expr.goto("dispatch-tcp-2"), "goto dispatch-tcp-2"),
    (expr.drop(), "drop"),
    (expr.accept(), "accept"),
    (expr.ret(), "return"),
]  # fmt: skip


@pytest.mark.parametrize(("statement", "text"), STATEMENTS, ids=[t for _, t in STATEMENTS])
def test_a_statement_reads_as_nft_writes_it(statement: Any, text: str) -> None:
    rule = T.add_rule("KUBE-SVC-X", Rule((statement,), comment="ns/web:http"))
    assert command_text(rule) == f'add rule ip nftproxy KUBE-SVC-X {text} comment "ns/web:http"'


def test_objects_read_as_nft_writes_them() -> None:
    base = Chain("nat-output", (), hook=BaseHook("nat", "output", -100))
    assert transaction_text([*T.add_tables(), T.add_chain(base), T.flush_chain("c"),
                             T.delete_chain("c"), T.delete_set("s"),
                             T.flush_set("m", is_map=True)]) == (
        'add table ip nftproxy { comment "managed by nftproxy"; }\n'
        'add table ip nftproxy-affinity { comment "managed by nftproxy"; }\n'
        "add chain ip nftproxy nat-output { type nat hook output priority -100; policy accept; }\n"
        "flush chain ip nftproxy c\ndelete chain ip nftproxy c\n"
        "delete set ip nftproxy s\nflush map ip nftproxy m\n"
    )  # fmt: skip
    delete = T.delete_elements("service-ips", [Element("service-ips", ("10.96.0.1", "tcp", 80))])
    assert command_text(delete[0]) == (
        "delete element ip nftproxy service-ips { 10.96.0.1 . tcp . 80 }"
    )


_PARTS = st.one_of(
    st.integers(min_value=0, max_value=2**32 - 1),
    st.sampled_from(["10.96.0.1", "fd00::1", "tcp", "10.0.0.0/8", "fd00::/64", "192.0.2.7/32"]),
)
_VALUES = st.one_of(
    st.none(),
    st.builds(Target, st.sampled_from(["10.128.0.5", "fd00:10::5"]), st.integers(1, 65535)),
    st.builds(Verdict, st.sampled_from(["goto", "jump"]),
              st.sampled_from(["dispatch-tcp-2", "K-X"])),
    st.builds(Verdict, st.sampled_from(["drop", "accept"])),
)
_ELEMENTS = st.builds(
    Element,
    st.just("vip-endpoints-tcp"),
    st.lists(_PARTS, min_size=1, max_size=4).map(tuple),
    _VALUES,
    # any text at all (lone surrogates aside: not UTF-8): quotes, backslashes, newlines, ESC
    st.one_of(st.none(), st.text(st.characters(blacklist_categories=("Cs",)), max_size=140)),
)


@settings(max_examples=300)
@given(elements=st.lists(_ELEMENTS, min_size=1, max_size=5))
def test_elements_with_any_comment_are_written_as_one_line_of_quoted_comments(
    elements: list[Element],
) -> None:
    """Every comment is written between two quotes with nothing nft's syntax
    would read as its end or an escape, and the JSON printer writes the same
    comment text."""
    (command,) = T.add_elements("vip-endpoints-tcp", elements)
    text = command_text(command)
    assert "\n" not in text and "\\" not in text and text.isprintable()
    with_comment = [e for e in elements if e.comment]
    assert text.count('comment "') == len(with_comment)
    assert text.count('"') == 2 * len(with_comment)
    listed = jsontext.command_json(command)["add"]["element"]["elem"]
    said = [item[0] if isinstance(item, list) else item for item in listed]
    comments = [s["elem"]["comment"] for s in said if isinstance(s, dict) and "elem" in s]
    assert [f'comment "{c}"' in text for c in comments] == [True] * len(with_comment)


@pytest.mark.parametrize(
    "part", ["not an address", "10.0.0.1; flush ruleset", "tcp }", '"', "", "10.0.0.0/8 ", -1,
             2**32, 1.5, None],
)
def test_a_key_part_no_printer_may_write_is_refused_when_built(part: Any) -> None:
    with pytest.raises(BadValue):
        Element("service-ips", ("10.96.0.1", part))


def test_a_map_element_reads_key_comment_then_data() -> None:
    e = Element("m", ("10.96.0.10", 80, 0), Target("10.128.0.10", 8080), "ns/svc:http -> x")
    assert command_text(T.add_elements("vip-endpoints-tcp", [e])[0]) == (
        "add element ip nftproxy vip-endpoints-tcp "
        '{ 10.96.0.10 . 80 . 0 comment "ns/svc:http -> x" : 10.128.0.10 . 8080 }'
    )
    goto = Element("service-ips", ("10.96.0.10", "tcp", 80), Verdict("goto", "dispatch-tcp-2"))
    assert command_text(T.add_elements("service-ips", [goto])[0]).endswith(
        "{ 10.96.0.10 . tcp . 80 : goto dispatch-tcp-2 }"
    )


@pytest.mark.parametrize(
    "build",
    [
        lambda: Where("bridge", "t"),
        lambda: Where("ip", "a b"),
        lambda: AddChain(Where("ip", "t"), "c;d"),
        lambda: AddRule(Where("ip", "t"), "c", Rule((expr.accept(),), comment='say "hi"')),
        lambda: AddRule(Where("ip", "t"), "c", Rule((expr.accept(),), comment="two\nlines")),
        lambda: AddElements(Where("ip", "t"), "s", ()),
        lambda: Verdict("goto", "a b"),
        lambda: Verdict("continue"),
        lambda: Target("10.0.0.1", 0),
        lambda: Target("10.0.0.0/8", 80),
    ],
)  # fmt: skip
def test_what_no_printer_may_write_is_refused_when_built(build: Any) -> None:
    with pytest.raises(ValueError):
        build()


def test_a_comment_nft_cannot_quote_is_made_sayable_for_both_printers() -> None:
    rule = T.add_rule("c", Rule((expr.accept(),), comment='say "hi"\\ \x1b[31m\nnow'))
    assert command_text(rule).endswith('accept comment "say ?hi?? ?[31m?now"')
    assert jsontext.command_json(rule)["add"]["rule"]["comment"] == "say ?hi?? ?[31m?now"


def test_a_statement_nft_syntax_does_not_spell_is_a_programming_error() -> None:
    with pytest.raises(NoText):
        command_text(T.add_rule("c", Rule(({"counter": {}},))))


@pytest.mark.parametrize("version", ["1.0.6", "1.1"])
def test_a_planned_full_sync_has_a_line_for_every_command(version: str) -> None:
    config = ProxyConfig(node_name="", table_name="nftproxy")
    backend = FakeBackend(version=version)
    proxier = proxier_from_files(["nftproxy/examples/cluster.yaml"], config, backend)
    commands = proxier.plan_full().commands
    text = transaction_text(commands)
    assert text.count("\n") == len(commands) > 50
    for word in ("add rule", "add element", "add chain", "KUBE-SVC-", "dnat ip", "@affinity",
                 "add map ip nftproxy service-ips { typeof ip daddr . meta l4proto . th dport"
                 " : verdict; comment "):
        assert word in text, word
    assert len(jsontext.transaction_text(commands)) > len(text)
