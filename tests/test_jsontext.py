"""The JSON printer (core/nft/jsontext.py): each command as the libnftables
JSON objects it stands for -- elements with their comments cut to the
kernel's budget, CIDRs as prefixes, declarations by typeof -- sent as one
document behind the metainfo, and shown by a refusal that names it.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from nftproxy.core.nft.errors import rejection
from nftproxy.core.nft.jsontext import (
    METAINFO,
    command_json,
    command_text,
    element_json,
    transaction_text,
)
from nftproxy.core.nft.ops import Table
from nftproxy.core.rules import expr, names
from nftproxy.core.rules.fragment import Element, Rule, SetDecl, Target, Verdict


def dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


_TEXT = st.text(min_size=1, max_size=140)  # non-ASCII, quotes, controls; over the comment budget
_PARTS = st.one_of(
    st.integers(min_value=0, max_value=2**32 - 1),
    st.sampled_from(["10.96.0.1", "fd00::1", "tcp", "10.0.0.0/8", "fd00::/64", "192.0.2.7/32"]),
)
_VALUES = st.one_of(
    st.none(),
    st.builds(Target, st.sampled_from(["10.128.0.5", "fd00:10::5"]), st.integers(1, 65535)),
    st.builds(Verdict, st.sampled_from(["goto", "jump"]), st.sampled_from(["dispatch-2", "K-X"])),
    st.builds(Verdict, st.sampled_from(["drop", "accept"])),
)
_ELEMENTS = st.builds(
    Element,
    st.sampled_from(["service-ips", "vip-endpoints-tcp"]),
    st.lists(_PARTS, min_size=1, max_size=4).map(tuple),
    _VALUES,
    st.one_of(st.none(), _TEXT),
)


@settings(max_examples=200)
@given(elements=st.lists(_ELEMENTS, min_size=1, max_size=6))
def test_an_add_elements_command_sends_each_element_as_its_objects(
    elements: list[Element],
) -> None:
    (command,) = Table("ip", "nftproxy").add_elements("service-ips", elements)
    sent = json.loads(transaction_text([command]))["nftables"]
    assert sent[0] == METAINFO
    assert sent[1]["add"]["element"]["elem"] == [
        element_json(e, with_comment=True) for e in elements]
    for item, e in zip(sent[1]["add"]["element"]["elem"], elements, strict=True):
        key = item[0] if e.value is not None else item
        if e.comment:
            assert key["elem"]["comment"] == names.comment(e.comment)


def test_an_element_reads_as_libnftables_json() -> None:
    a = Element("vip-endpoints-tcp", ("10.96.0.1", 80, 0), Target("10.128.0.5", 8080),
                "ns/web:http")
    assert element_json(a, with_comment=True) == [
        {"elem": {"val": {"concat": ["10.96.0.1", 80, 0]}, "comment": "ns/web:http"}},
        {"concat": ["10.128.0.5", 8080]},
    ]
    assert element_json(a, with_comment=False)[0] == {"concat": ["10.96.0.1", 80, 0]}
    cidr = Element("firewall-allow", ("10.96.0.1", "tcp", 80, "10.0.0.0/8"))
    assert element_json(cidr, with_comment=False) == {"concat": [
        "10.96.0.1", "tcp", 80, {"prefix": {"addr": "10.0.0.0", "len": 8}}]}


def test_a_long_comment_is_cut_in_the_objects() -> None:
    long = "ns/" + "x" * 200 + ":http"
    e = Element("service-ips", ("10.96.0.1", "tcp", 80), None, long)
    (comment,) = [element_json(e, with_comment=True)["elem"]["comment"]]
    assert comment == names.comment(long) and len(comment.encode()) <= names.COMMENT_MAX_BYTES


def test_other_commands_are_dumped_as_their_objects() -> None:
    t = Table("ip", "t")
    rule = t.add_rule("c", Rule((expr.accept(),), comment="why"))
    assert command_text(rule) == dumps(
        {"add": {"rule": {"family": "ip", "table": "t", "chain": "c",
                          "expr": [{"accept": None}], "comment": "why"}}})
    (static,) = t.add_set_elements(SetDecl.keyed("s", ("ip daddr",), elements=("10.0.0.1",)))
    assert command_text(static) == dumps(
        {"add": {"element": {"family": "ip", "table": "t", "name": "s", "elem": ["10.0.0.1"]}}})
    declared = command_json(t.add_set(SetDecl.keyed("m", ("meta l4proto", "th dport"),
                                                    map="verdict", comment="c")))
    assert declared == {"add": {"map": {
        "family": "ip", "table": "t", "name": "m", "comment": "c",
        "map": {"typeof": {"accept": None}},
        "type": {"typeof": {"concat": [{"meta": {"key": "l4proto"}},
                                       {"payload": {"protocol": "th", "field": "dport"}}]}}}}}


def test_a_refusal_shows_the_refused_element_command() -> None:
    e = Element("service-ips", ("10.96.0.1", "tcp", 80), Verdict("goto", "nowhere"), "ns/web:http")
    commands = Table("ip", "nftproxy").add_elements("service-ips", [e])
    message = "Error: Could not process rule: No such file or directory at index 1"
    error = rejection(message, commands, first_index=1)  # after the metainfo
    assert error.command is commands[0]
    assert '"elem":[[{"elem":{"val":{"concat":["10.96.0.1","tcp",80]}' in str(error)
